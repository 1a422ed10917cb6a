"""One call each: load a trained (or exported) GINR, and reconstruct images with it."""

from __future__ import annotations

from pathlib import Path

import torch
from memfit.train.distributed import resolve_device

from ginr_cifar.model import GINR


def load(run: str | Path | None = None, device: str = "cpu", runs_dir: str | Path = "runs") -> GINR:
    """The model, in eval mode on `device`, from a run name or folder (default: runs/ginr-cifar/run), a
    checkpoint file, or a folder `memfit export` wrote. A missing run is a FileNotFoundError, a file that
    is not a ginr-cifar model a ValueError, each with one line that says what to do."""
    from ginr_cifar.system import SYSTEM

    return SYSTEM.load_model(run, resolve_device(device), runs_dir=runs_dir)[0]


def reconstruct(
    images: torch.Tensor,
    run: str | Path | None = None,
    resolution: int | None = None,
    device: str = "cpu",
    runs_dir: str | Path = "runs",
) -> torch.Tensor:
    """Images (N, 3, 32, 32), uint8 or float in [0, 1] -> their reconstructions (N, 3, R, R) in [0, 1]:
    each image encoded to the model's latent tokens and decoded at R x R pixel centres (R = `resolution`,
    default 32; larger R samples the same continuous function more finely)."""
    from ginr_cifar.eval import reconstruct as decode

    model = load(run, device, runs_dir)
    want = (model.cfg.channels, model.cfg.image_size, model.cfg.image_size)
    if images.ndim != 4 or tuple(images.shape[1:]) != want:
        raise ValueError(f"images must be (N, {', '.join(map(str, want))}), got {tuple(images.shape)}")
    return decode(model, images, resolution=resolution)
