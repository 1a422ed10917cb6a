"""mbsnet-speech as memfit sees it: train/eval/enhance commands, the shipped model and the memory budget
entries. Importing it loads no torch (`memfit systems`, `--help`): the steps import it when built."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.system import BudgetEntry, Scaling, System, parse_then_run

from mbsnet_speech.config import LossWeights, MBSNetConfig, default_config, seed_config, tiny_config

if TYPE_CHECKING:
    from memfit.step import TrainStep

HOP = 100
BUDGET_GIB = 4.0


def samples_for_frames(frames: int, hop: int = HOP) -> int:
    """Waveform length whose centred STFT has exactly `frames` frames (frames = T // hop + 1)."""
    return (frames - 1) * hop


def train_step(
    cfg: MBSNetConfig,
    batch: int,
    samples: int,
    amp: Any = "bf16",
    weights: LossWeights | None = None,
) -> TrainStep:
    """A full training step (forward, MP-SENet losses or `weights`', backward, AdamW) on random (noisy,
    clean) audio; amp: a torch dtype, None, or its name ("bf16", "fp16", "none")."""
    import torch
    from memfit.step import AMP_DTYPES, TrainStep

    from mbsnet_speech.losses import enhancement_loss
    from mbsnet_speech.model import MBSNet

    amp = AMP_DTYPES[amp] if isinstance(amp, str) else amp

    def loss(model, b):
        return enhancement_loss(model, b, weights)[0]

    def make_batch(device):
        return (
            0.1 * torch.randn(batch, samples, device=device),
            0.1 * torch.randn(batch, samples, device=device),
        )

    return TrainStep(build_model=lambda: MBSNet(cfg), make_batch=make_batch, loss=loss, amp_dtype=amp)


def calibration_step(baseline: bool = False) -> TrainStep:
    """A small step of the same code path that really runs on CPU in seconds (estimate vs measured)."""
    small = dict(num_layers=1, num_bands=8)
    if baseline:
        cfg = tiny_config(
            temporal_bidirectional=True, crossband_bidirectional=True, scan="materialise", expand=2.0, **small
        )
    else:
        cfg = tiny_config(checkpoint=True, **small)
    return train_step(cfg, batch=2, samples=samples_for_frames(32))


def budget_entries() -> list[BudgetEntry]:
    ours = default_config()
    seed = seed_config()
    desc = (
        f"{ours.num_bands} bands x {ours.channels} ch, {ours.num_layers} layers of uni temporal + cross-band "
        "Mamba "
        f"(expand {ours.expand:g}, d_state {ours.d_state}, chunked scan, layer recompute)"
    )
    return [
        BudgetEntry(
            variant="chunked-200f",
            step=train_step(ours, 6, samples_for_frames(200)),
            batch=6,
            dtype="bf16",
            budget_gib=BUDGET_GIB,
            config=desc + ", 200 frames",
            calibration=calibration_step(),
            make_step=lambda b, ckpt: train_step(replace(ours, checkpoint=ckpt), b, samples_for_frames(200)),
            scaling=Scaling(
                label="STFT frames (batch 6)",
                sizes=[100, 200, 400],
                make_step=lambda n: train_step(ours, 6, samples_for_frames(n)),
            ),
        ),
        BudgetEntry(
            variant="chunked-2s",
            step=train_step(ours, 6, 32000),
            batch=6,
            dtype="bf16",
            budget_gib=BUDGET_GIB,
            config=desc + ", 2 s crops (321 frames)",
            calibration=calibration_step(),
        ),
        BudgetEntry(
            variant="seed-materialise",
            step=train_step(seed, 2, samples_for_frames(200)),
            batch=2,
            dtype="bf16",
            budget_gib=None,
            is_baseline=True,
            config="the seed's MBS-Net: dual branches, bidirectional Mamba everywhere, expand 2, "
            "materialising real_mamba scan, 200 frames",
            calibration=calibration_step(baseline=True),
            scaling=Scaling(
                label="STFT frames (batch 6)",
                sizes=[100, 200, 400],
                make_step=lambda n: train_step(seed, 6, samples_for_frames(n)),
            ),
        ),
    ]


SYSTEM = System(
    name="mbsnet-speech",
    summary="MBS-Net speech enhancement (band-split Mamba, explicit phase; 2.6M params at paper size), "
    "scored by PESQ",
    train="mbsnet_speech.train:main",
    eval=parse_then_run("mbsnet_speech.flags:eval_args", "mbsnet_speech.eval:run"),
    budgets=budget_entries,
    extra_commands={
        "enhance": parse_then_run("mbsnet_speech.flags:enhance_args", "mbsnet_speech.enhance:run")
    },
    config_cls=MBSNetConfig,
    build_model="mbsnet_speech.model:MBSNet",
    shipped=Path(__file__).parent / "pretrained",
    tags=("speech-enhancement", "audio-to-audio", "mamba"),
)

# The package's console aliases (pyproject [project.scripts]): exit 0 on success, 2 on bad input.
train_cli = SYSTEM.command("train")
eval_cli = SYSTEM.command("eval")
