"""One call each: load a trained (or exported) triplane generator, and render new views of an image."""

from __future__ import annotations

from pathlib import Path

import torch
from memfit.train.distributed import resolve_device

from moremouse_triplane.model import TriplaneGenerator


def load(
    run: str | Path | None = None, device: str = "cpu", runs_dir: str | Path = "runs"
) -> TriplaneGenerator:
    """The model, in eval mode on `device`, from a run name or folder (default:
    runs/moremouse-triplane/run), a checkpoint file, or a folder `memfit export` wrote. A missing run is a
    FileNotFoundError, a file that is not a moremouse-triplane model a ValueError, each with one line that
    says what to do."""
    from moremouse_triplane.system import SYSTEM

    return SYSTEM.load_model(run, resolve_device(device), runs_dir=runs_dir)[0]


def render_views(
    image: torch.Tensor,
    run: str | Path | None = None,
    views: int = 8,
    elevation: float = 25.0,
    device: str = "cpu",
    runs_dir: str | Path = "runs",
) -> torch.Tensor:
    """An input image (3, H, W) in [0, 1], taken as the training data's input camera sees its scene
    (azimuth 45, elevation 25 degrees, 2.3 units from the centre, 40 degree field of view) -> `views`
    renders (views, 3, H, W) in [0, 1] from cameras evenly around the scene at `elevation`."""
    from moremouse_triplane.data import FOV_DEG, INPUT_VIEW, RADIUS
    from moremouse_triplane.eval import render_views as render
    from moremouse_triplane.render import intrinsics, look_at, orbit_eye

    model = load(run, device, runs_dir)
    size = model.cfg.image_size
    if image.ndim != 3 or tuple(image.shape) != (3, size, size):
        raise ValueError(f"image must be (3, {size}, {size}) in [0, 1], got {tuple(image.shape)}")
    if views < 1:
        raise ValueError(f"views must be >= 1, got {views}")
    dev = next(model.parameters()).device
    K = intrinsics(FOV_DEG, size, size).to(dev)
    scene = {"input": image.float(), "input_K": K, "input_c2w": look_at(orbit_eye(*INPUT_VIEW, RADIUS))}
    c2w = torch.stack([look_at(orbit_eye(360.0 * i / views, elevation, RADIUS)) for i in range(views)])
    return render(model, scene, K.expand(views, 3, 3), c2w.to(dev)).cpu()
