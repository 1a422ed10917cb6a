"""One call: load a trained (or exported, or the shipped) MBS-Net."""

from __future__ import annotations

from pathlib import Path

from memfit.train.distributed import resolve_device

from mbsnet_speech.model import MBSNet


def load(run: str | Path | None = None, device: str = "cpu", runs_dir: str | Path = "runs") -> MBSNet:
    """The model, in eval mode on `device`: the one shipped in the package (run None or "shipped"), a
    run's (name or folder: best.pt, else its newest checkpoint), a checkpoint file's, or a folder `memfit
    export` wrote. A missing run is a FileNotFoundError, a file that is not an mbsnet-speech model a
    ValueError, each with one line that says what to do."""
    from mbsnet_speech.system import SYSTEM

    return SYSTEM.load_model(run, resolve_device(device), runs_dir=runs_dir)[0]
