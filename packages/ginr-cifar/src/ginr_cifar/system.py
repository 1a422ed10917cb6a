"""ginr-cifar as memfit sees it: train/eval entry points and the paper-size memory budgets.

Budget config (the seed's OOM): balanced preset (dim 256, 32 LP tokens, depth 4), SCENT-style decoder of
width 512 with 2 scales (5 mixer + 5 feed-forward blocks), batch 64, all 1024 coordinates, bf16 autocast,
AdamW. ``ff`` and ``xattn`` use per-block activation checkpointing (the seed's ~5 GB for an FF decoder holds
only with it: 65,536 decoded tokens x the FF's hidden width per block otherwise).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memfit.system import BudgetEntry, Scaling, System, parse_then_run

from ginr_cifar.config import GINRConfig, get_config

if TYPE_CHECKING:  # torch loads when a step is built: `memfit systems` and `--help` stay fast
    from memfit.step import TrainStep

BATCH = 64
NUM_COORDS = 1024
BUDGETS_GIB = {"ff": 5.0, "xattn": 8.0}


def ginr_step(cfg: GINRConfig, batch: int, num_coords: int, amp: Any = "bf16") -> TrainStep:
    """A training step of GINR(cfg) on random images and `num_coords` random coordinates per image; amp: a
    torch dtype, None, or its name ("bf16", "fp16", "none")."""
    import torch
    import torch.nn.functional as F
    from memfit.step import AMP_DTYPES, TrainStep

    from ginr_cifar.model import GINR

    amp = AMP_DTYPES[amp] if isinstance(amp, str) else amp

    def make_batch(device):
        images = torch.rand(batch, cfg.channels, cfg.image_size, cfg.image_size, device=device)
        coords = torch.rand(batch, num_coords, 2, device=device) * 2 - 1
        target = torch.rand(batch, num_coords, cfg.channels, device=device)
        return images, coords, target

    def loss(model, b):
        images, coords, target = b
        return F.mse_loss(model(images, coords).float(), target)

    return TrainStep(build_model=lambda: GINR(cfg), make_batch=make_batch, loss=loss, amp_dtype=amp)


def paper_config(decoder: str) -> GINRConfig:
    """Balanced preset, decoder width 512; checkpointing for the variants that must fit."""
    return get_config("balanced", decoder=decoder, decoder_width=512, checkpoint=decoder != "attn")


def calibration_config(decoder: str) -> GINRConfig:
    """A small config of the same variant that really runs on CPU in seconds."""
    return get_config("tiny", decoder=decoder, checkpoint=decoder != "attn")


def budget_entries() -> list[BudgetEntry]:
    entries = []
    for decoder in ("ff", "xattn", "attn"):
        cfg = paper_config(decoder)
        ckpt = "activation checkpointing" if cfg.checkpoint else "no checkpointing (naive)"
        entries.append(
            BudgetEntry(
                variant=decoder,
                step=ginr_step(cfg, BATCH, NUM_COORDS),
                batch=BATCH,
                dtype="bf16",
                budget_gib=BUDGETS_GIB.get(decoder),
                is_baseline=decoder == "attn",
                config=(
                    f"balanced (dim {cfg.dim}, {cfg.num_lp} LP, depth {cfg.depth}), decoder {decoder} width "
                    f"{cfg.decoder_width} x {cfg.decoder_depth} scales, {NUM_COORDS} coords, {ckpt}"
                ),
                calibration=ginr_step(calibration_config(decoder), 4, 256),
                make_step=lambda b, ckpt, cfg=cfg: ginr_step(replace(cfg, checkpoint=ckpt), b, NUM_COORDS),
                scaling=Scaling(
                    label="query coordinates per image",
                    sizes=[1024, 2048, 4096],
                    make_step=lambda n, cfg=cfg: ginr_step(cfg, BATCH, n),
                ),
            )
        )
    return entries


SYSTEM = System(
    name="ginr-cifar",
    summary="Mamba-GINR on CIFAR-10; SCENT-style decoder made query-independent (ff / xattn) to fit",
    train="ginr_cifar.train:main",
    eval=parse_then_run("ginr_cifar.flags:eval_args", "ginr_cifar.eval:run"),
    budgets=budget_entries,
    config_cls=GINRConfig,
    build_model="ginr_cifar.model:GINR",
    tags=("implicit-neural-representation", "image", "mamba"),
)

# The package's console aliases (pyproject [project.scripts]): exit 0 on success, 2 on bad input.
train_cli = SYSTEM.command("train")
eval_cli = SYSTEM.command("eval")
