"""`mouse-train`: train the triplane generator on generated mice (default) or a folder of renders.

    uv run mouse-train --max_minutes 20                 (the CPU recipe: --config cpu, the default)
    uv run mouse-train --config tiny --steps 600
    uv run mouse-train --config paper --data path/to/renders --resume

Each step: a batch of scenes -> input images -> triplanes -> render cfg.rays_per_scene random target
rays per scene (input view + random views) -> MSE to the true colours. Every --eval_every steps the
model renders the held-out views of --val_scenes held-out scenes (the generator's `val` split, or a
fixed part of --data's scenes); the best PSNR is kept as best.pt, which `eval` uses. The `test` split
that `eval` scores by default is never seen here.
"""

from __future__ import annotations

from dataclasses import replace

from memfit.errors import UsageError
from memfit.train.settings import TrainParser

from moremouse_triplane.config import SETTINGS

SYSTEM_NAME = "moremouse-triplane"


def build_parser() -> TrainParser:
    p = TrainParser(SYSTEM_NAME, __doc__, SETTINGS, auto=("tiny", "cpu"))
    m = p.group("model")
    p.flag(m, "--checkpointing", path="model.checkpoint", help="activation checkpointing")
    p.flag(
        m, "--attention", path="model.attention", choices=["sdpa", "naive"], help="attention implementation"
    )
    p.flag(m, "--rays_per_scene", path="model.rays_per_scene", help="target rays per scene")
    p.flag(m, "--samples_per_ray", path="model.samples_per_ray", help="samples per ray")
    p.flag(
        m,
        "--pixel_features",
        path="model.pixel_features",
        help="the decoder also reads the input image where points project",
    )
    p.flag(
        m,
        "--view_features",
        path="model.view_features",
        help="channels of a CNN feature map of the input image sampled with its rgb",
    )
    p.flag(
        m,
        "--carve",
        path="model.carve",
        help="points the input view sees as background (within this of white) are empty",
    )
    p.flag(
        m,
        "--hull_probes",
        path="model.hull_probes",
        help="with --carve, probe rays at N points and sample only inside the hull",
    )
    p.flag(
        m,
        "--global_context",
        path="model.global_context",
        help="add the mean image token to every triplane token",
    )
    d = p.group("data, optimizer and validation")
    p.flag(
        d,
        "--data",
        path="train.data",
        file=("synthetic",),
        help="folder of renders (scene_*/cameras.json); none: generated mice",
    )
    p.flag(
        d,
        "--num_scenes",
        path="train.num_scenes",
        help="cycle over this many generated scenes (0: new every time)",
    )
    p.flag(d, "--batch_size", path="train.batch_size", help="scenes per micro-batch")
    p.optimizer_flags(d)
    p.flag(
        d,
        "--schedule_steps",
        path="train.schedule_steps",
        help="length of the LR schedule (none: the run's --steps)",
    )
    p.flag(
        d,
        "--val_scenes",
        path="train.val_scenes",
        help="held-out scenes validated on (0: no validation, no best.pt)",
    )
    p.flag(d, "--eval_every", path="train.eval_every", help="validate every N steps")
    return p


def validation(source, t, seed: int):
    """(training source, Trainer keyword arguments that validate on held-out scenes and keep best.pt,
    what the run's first line says about validation).

    Generated scenes: the first --val_scenes scenes of the `val` split (`eval` scores `test`). A folder:
    --val_scenes of its scenes, chosen by a fixed seed, are held out of training (a quarter of them at
    most, FolderScenes.split; none of fewer than 4).
    """
    from moremouse_triplane.data import FolderScenes, SyntheticScenes
    from moremouse_triplane.eval import score_scenes

    if not t.val_scenes:
        return source, {}, "no validation (--val_scenes 0), so no best.pt"
    if isinstance(source, FolderScenes):
        total = len(source)
        source, held = source.split(t.val_scenes)
        if not len(held):
            few = f"--data has {total} scene{'' if total == 1 else 's'}, too few to hold one out"
            return source, {}, f"no validation: {few} (a quarter at most is; 4 hold out 1), so no best.pt"
        where = f"{len(held)} of --data's {total} scenes, held out of training"
        if len(held) < t.val_scenes:
            where += f" (--val_scenes {t.val_scenes}: a quarter at most)"
    else:
        held = SyntheticScenes(source.image_size, seed=seed, split="val")
        where = f"{t.val_scenes} held-out generated scene{'' if t.val_scenes == 1 else 's'} (the val split)"
    scenes = [held.eval_scene(i) for i in range(min(t.val_scenes, len(held)))]

    def eval_fn(model) -> dict[str, float]:
        res = score_scenes(model, scenes, next(model.parameters()).device)
        return {k: res[k] for k in ("psnr", "ssim")}

    when = f"every {t.eval_every} steps" if t.eval_every else "at the end"
    kw = dict(eval_fn=eval_fn, eval_every=t.eval_every, best_metric="psnr", best_mode="max")
    return source, kw, f"validation on {where}, {when}"


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, train, return the last metrics (see --help)."""
    run = build_parser().parse(argv)
    import torch
    from memfit.step import AMP_DTYPES
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer, WarmupCosine, set_seed, step_generator

    from moremouse_triplane.data import make_source
    from moremouse_triplane.model import build_model, ray_loss
    from moremouse_triplane.system import train_step

    cfg, t, loop, device = run.settings.model, run.settings.train, run.settings.loop, run.device
    try:
        source, eval_kw, validated = validation(
            make_source(t.data, cfg.image_size, seed=loop.seed, split="train"), t, loop.seed
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None

    set_seed(loop.seed)  # the same initial weights for the same seed
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    info = dist_info()
    B, R, S = t.batch_size, cfg.rays_per_scene, cfg.samples_per_ray

    def get_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        g = step_generator(loop.seed, step, micro, info.rank)
        first = ((step * loop.grad_accum + micro) * info.world_size + info.rank) * B
        indices = [first + i for i in range(B)]
        if t.num_scenes:
            indices = [i % t.num_scenes for i in indices]
        batch = source.train_batch(indices, R, cfg.num_targets, g)
        batch["jitter"] = torch.rand(B, R, S, generator=g)
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    trainer = Trainer(
        model,
        opt,
        ray_loss,
        get_batch,
        run,
        lr_schedule=WarmupCosine(t.warmup, total_steps=t.schedule_steps),
        config=cfg,
        meta={"preset": run.preset, "data": t.data or "synthetic"},
        items_per_step=B * R * loop.grad_accum,
        # carving skips the empty points, a number the data decides: estimate without it (an upper bound)
        memory_step=lambda b, ckpt: train_step(
            replace(cfg, checkpoint=ckpt, carve=0.0), b, AMP_DTYPES[loop.amp]
        ),
        batch_size=B,
        **eval_kw,
    )
    if info.is_main:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"[mouse-train] preset {run.preset}: {n / 1e6:.2f}M params, {cfg.num_tokens} triplane tokens, "
            f"{R} rays x {S} samples per scene, batch {B}, lr {t.lr:g}, "
            f"threads {torch.get_num_threads()}; {validated}; runs in {trainer.run_dir}"
        )
    return trainer.fit()


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mouse-train", main))
