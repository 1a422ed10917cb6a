"""One call: load a trained (or exported) MBS-Net."""

from __future__ import annotations

from pathlib import Path

from memfit.train.distributed import resolve_device

from mbsnet_speech.model import MBSNet


def load(run: str | Path | None, device: str = "cpu", runs_dir: str | Path = "runs") -> tuple[MBSNet, dict]:
    """(model in eval mode, its checkpoint or config.json as a dict) from a run name or folder, a
    checkpoint file, or a folder `memfit export` wrote."""
    from mbsnet_speech.system import SYSTEM

    return SYSTEM.load_model(run, resolve_device(device), runs_dir=runs_dir)
