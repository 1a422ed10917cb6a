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

import argparse
import sys

import torch
from memfit.config import overrides_from_args
from memfit.flags import fill_from_recipe
from memfit.training import (
    Trainer,
    add_loop_args,
    add_model_args,
    check_numbers,
    dist_info,
    hidden_alias,
    loop_config_from_args,
    resolve_device,
    set_seed,
    step_generator,
    warmup_cosine_lambda,
)

from moremouse_triplane.config import PRESETS, TriplaneConfig, get_config, recipe_for
from moremouse_triplane.data import FolderScenes, SyntheticScenes, make_source
from moremouse_triplane.eval import score_scenes
from moremouse_triplane.model import build_model, ray_loss

SYSTEM_NAME = "moremouse-triplane"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = add_model_args(
        p,
        PRESETS,
        "auto",
        help="model preset; auto: tiny on a GPU, the CPU recipe (cpu) otherwise",
        attention=["sdpa", "naive"],
    )
    hidden_alias(m, "--preset", dest="config", choices=list(PRESETS))  # old spellings
    hidden_alias(m, "--checkpoint", dest="checkpointing", action=argparse.BooleanOptionalAction)
    p.add_argument(
        "--data", default=None, help="folder of renders (scene_*/cameras.json); default: generated mice"
    )
    p.add_argument(
        "--batch_size", type=int, default=None, help="scenes per micro-batch (default: the recipe's)"
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the recipe's)")
    p.add_argument(
        "--schedule_steps", type=int, default=None, help="length of the LR schedule (default: --steps)"
    )
    p.add_argument(
        "--num_scenes", type=int, default=0, help="cycle over this many generated scenes (0: new every time)"
    )
    p.add_argument("--rays_per_scene", type=int, default=None, help="override the preset's rays per scene")
    p.add_argument("--samples_per_ray", type=int, default=None, help="override the preset's samples per ray")
    p.add_argument(
        "--pixel_features",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override the preset: the decoder also reads the input image where points project",
    )
    p.add_argument(
        "--view_features",
        type=int,
        default=None,
        help="override the preset: channels of a CNN feature map of the input image sampled with its rgb",
    )
    p.add_argument(
        "--carve",
        type=float,
        default=None,
        help="override the preset: points the input view sees as background (within this of white) are empty",
    )
    p.add_argument(
        "--hull_probes",
        type=int,
        default=None,
        help="override the preset: with --carve, probe rays at N points and sample only inside the hull",
    )
    p.add_argument(
        "--global_context",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override the preset: add the mean image token to every triplane token",
    )
    p.add_argument(
        "--val_scenes",
        type=int,
        default=8,
        help="held-out scenes validated on (0: no validation, no best.pt)",
    )
    p.add_argument(
        "--eval_every", type=int, default=None, help="validate every N steps (default: the preset's)"
    )
    add_loop_args(p, steps=None, save_every=None, log_every=20, amp=None)
    return p


def apply_recipe(args: argparse.Namespace) -> None:
    """Fill the flags left unset from the recipe of the chosen preset (auto: cpu without a GPU)."""
    if args.config == "auto":
        on_gpu = resolve_device(args.device).type == "cuda"
        args.config = "tiny" if on_gpu else "cpu"
    keys = ("lr", "batch_size", "steps", "warmup", "amp", "threads", "eval_every", "save_every")
    fill_from_recipe(args, recipe_for(args.config), keys)


def validation(source, args: argparse.Namespace):
    """(training source, Trainer keyword arguments that validate on held-out scenes and keep best.pt).

    Generated scenes: the first --val_scenes scenes of the `val` split (`eval` scores `test`). A folder:
    --val_scenes of its scenes, chosen by a fixed seed, are held out of training.
    """
    if not args.val_scenes:
        return source, {}
    if isinstance(source, FolderScenes):
        source, held = source.split(args.val_scenes)
        if not len(held):
            return source, {}
    else:
        held = SyntheticScenes(source.image_size, seed=args.seed, split="val")
    scenes = [held.eval_scene(i) for i in range(min(args.val_scenes, len(held)))]

    def eval_fn(model) -> dict[str, float]:
        res = score_scenes(model, scenes, next(model.parameters()).device)
        return {k: res[k] for k in ("psnr", "ssim")}

    return source, dict(eval_fn=eval_fn, eval_every=args.eval_every, best_metric="psnr", best_mode="max")


def config_from_args(args: argparse.Namespace) -> TriplaneConfig:
    names = (
        "rays_per_scene",
        "samples_per_ray",
        "attention",
        "global_context",
        "pixel_features",
        "view_features",
        "carve",
        "hull_probes",
    )
    fields = {k: k for k in names}
    overrides = overrides_from_args(args, {**fields, "checkpointing": "checkpoint"})
    try:
        return get_config(args.config, **overrides)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, train, return the last metrics (see --help)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    apply_recipe(args)
    check_numbers(args, val_scenes=">=0", eval_every=">=0")
    check_numbers(args, lr=">0", weight_decay=">=0", warmup=">=0", batch_size=">=1", num_scenes=">=0")
    check_numbers(args, schedule_steps=">=1", rays_per_scene=">=1", samples_per_ray=">=1")
    cfg = config_from_args(args)
    loop = loop_config_from_args(args, system=SYSTEM_NAME)
    device = resolve_device(loop.device)
    try:
        source, eval_kw = validation(
            make_source(args.data, cfg.image_size, seed=args.seed, split="train"), args
        )
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None

    set_seed(args.seed)  # the same initial weights for the same seed
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    total = args.schedule_steps or loop.steps
    warmup = min(args.warmup, total // 5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine_lambda(total, warmup, max_minutes=args.max_minutes)
    )
    info = dist_info()
    B, R, S = args.batch_size, cfg.rays_per_scene, cfg.samples_per_ray

    def get_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        g = step_generator(loop.seed, step, micro, info.rank)
        first = ((step * loop.grad_accum + micro) * info.world_size + info.rank) * B
        indices = [first + i for i in range(B)]
        if args.num_scenes:
            indices = [i % args.num_scenes for i in indices]
        batch = source.train_batch(indices, R, cfg.num_targets, g)
        batch["jitter"] = torch.rand(B, R, S, generator=g)
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    trainer = Trainer(
        model,
        opt,
        ray_loss,
        get_batch,
        loop,
        scheduler=sched,
        config=cfg,
        meta={"preset": args.config, "data": args.data or "synthetic"},
        items_per_step=B * R * loop.grad_accum,
        system=SYSTEM_NAME,
        **eval_kw,
    )
    if info.is_main:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"[mouse-train] preset {args.config}: {n / 1e6:.2f}M params, {cfg.num_tokens} triplane tokens, "
            f"{R} rays x {S} samples per scene, batch {B}, lr {args.lr:g}, "
            f"{torch.get_num_threads()} threads; validation on {args.val_scenes} held-out scenes every "
            f"{args.eval_every} steps; runs in {loop.run_dir}"
        )
    return trainer.fit()


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mouse-train", main))
