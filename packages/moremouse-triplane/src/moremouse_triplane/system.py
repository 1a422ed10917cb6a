"""How memfit sees this package: train/eval entry points and the paper-size budget entries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.system import BudgetEntry, Scaling, System, parse_then_run

from moremouse_triplane.config import TriplaneConfig, get_config

if TYPE_CHECKING:  # torch loads when a step is built: `memfit systems` and `--help` stay fast
    import torch
    from memfit.step import TrainStep

PAPER_BATCH = 4


def random_batch(cfg: TriplaneConfig, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch shaped like training's: input images and cfg.rays_per_scene rays per scene, with jitter."""
    import torch
    import torch.nn.functional as F

    R, S = cfg.rays_per_scene, cfg.samples_per_ray
    eye = F.normalize(torch.randn(batch, R, 3, device=device), dim=-1) * 2.3
    d = F.normalize(-eye + 0.3 * torch.randn(batch, R, 3, device=device), dim=-1)  # towards the box
    out = {
        "images": torch.rand(batch, 3, cfg.image_size, cfg.image_size, device=device),
        "rays_o": eye,
        "rays_d": d,
        "rgb": torch.rand(batch, R, 3, device=device),
        "jitter": torch.rand(batch, R, S, device=device),
    }
    if cfg.pixel_features:  # the input camera, as the generated scenes' (world up +z, looking at the origin)
        from moremouse_triplane.data import FOV_DEG, INPUT_VIEW, RADIUS
        from moremouse_triplane.render import intrinsics, look_at, orbit_eye

        K = intrinsics(FOV_DEG, cfg.image_size, cfg.image_size)
        out["input_K"] = K.to(device).expand(batch, 3, 3)
        out["input_c2w"] = look_at(orbit_eye(*INPUT_VIEW, RADIUS)).to(device).expand(batch, 4, 4)
    return out


def train_step(cfg: TriplaneConfig, batch: int, amp_dtype: Any = "bf16") -> TrainStep:
    """One training step of the whole system: encoder, transformer, upsampler and rendering the rays;
    amp_dtype: a torch dtype, None, or its name ("bf16", "fp16", "none")."""
    from memfit.step import AMP_DTYPES, TrainStep

    from moremouse_triplane.model import build_model

    amp_dtype = AMP_DTYPES[amp_dtype] if isinstance(amp_dtype, str) else amp_dtype

    return TrainStep(
        build_model=lambda: build_model(cfg),
        make_batch=lambda device: random_batch(cfg, batch, device),
        loss=lambda model, b: model.loss(b),
        amp_dtype=amp_dtype,
    )


def _plane_res(tokens: int) -> int:
    return round((tokens // 3) ** 0.5)


TOKEN_SIZES = [3 * 16**2, 3 * 32**2, 3 * 64**2]  # triplane tokens for the scaling plot


def budget_entries() -> list[BudgetEntry]:
    paper = get_config("paper")
    naive = get_config("paper", attention="naive", checkpoint=False, render_checkpoint=False)
    rays = (
        f"{paper.rays_per_scene} rays x {paper.samples_per_ray} samples per scene, "
        f"in chunks of {paper.render_chunk} rays"
    )
    return [
        BudgetEntry(
            variant="sdpa",
            step=train_step(paper, PAPER_BATCH),
            batch=PAPER_BATCH,
            dtype="bf16",
            budget_gib=16.0,
            config=(
                f"3x{paper.plane_res}x{paper.plane_res} tokens, width {paper.width}, "
                f"{paper.heads}x{paper.head_dim} heads, "
                f"{paper.depth} layers, SDPA, block + render checkpointing, upsampler to "
                f"3x{paper.out_channels}x{paper.out_res}x{paper.out_res}, {rays}"
            ),
            calibration=train_step(
                get_config("tiny", checkpoint=True, render_checkpoint=True, render_chunk=64), 2
            ),
            make_step=lambda b, ckpt: train_step(
                get_config("paper", checkpoint=ckpt, render_checkpoint=ckpt), b
            ),
            scaling=Scaling(
                "triplane tokens",
                TOKEN_SIZES,
                lambda n: train_step(get_config("paper", plane_res=_plane_res(n)), PAPER_BATCH),
            ),
        ),
        BudgetEntry(
            variant="naive",
            step=train_step(naive, PAPER_BATCH, amp_dtype=None),
            batch=PAPER_BATCH,
            dtype="fp32",
            budget_gib=None,
            is_baseline=True,
            config="the seed's setup: fp32, materialised (B, 16, 12288, 12288) scores, no checkpointing",
            calibration=train_step(get_config("tiny", attention="naive"), 2, amp_dtype=None),
            scaling=Scaling(
                "triplane tokens",
                TOKEN_SIZES,
                lambda n: train_step(
                    get_config(
                        "paper",
                        attention="naive",
                        checkpoint=False,
                        render_checkpoint=False,
                        plane_res=_plane_res(n),
                    ),
                    PAPER_BATCH,
                    amp_dtype=None,
                ),
            ),
        ),
    ]


SYSTEM = System(
    name="moremouse-triplane",
    summary="MoReMouse triplane generator: 12,288-token transformer + NeRF rendering, image -> novel views",
    train="moremouse_triplane.train:main",
    eval=parse_then_run("moremouse_triplane.flags:eval_args", "moremouse_triplane.eval:run"),
    budgets=budget_entries,
    extra_commands={
        "make-data": parse_then_run(
            "moremouse_triplane.flags:make_data_args", "moremouse_triplane.data:make_data"
        )
    },
    config_cls=TriplaneConfig,
    build_model="moremouse_triplane.model:build_model",
    tags=("image-to-3d", "nerf", "triplane"),
)

# The package's console aliases (pyproject [project.scripts]): exit 0 on success, 2 on bad input.
train_cli = SYSTEM.command("train")
eval_cli = SYSTEM.command("eval")
