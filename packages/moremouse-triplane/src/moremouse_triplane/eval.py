"""`mouse-eval`: novel views of held-out scenes -> PSNR, SSIM, a ground truth vs prediction strip, an orbit.

    uv run mouse-eval --run run      (a run name, a run folder or a checkpoint file; writes <run>/eval/)

Held-out scenes are the `test` split of the generator (never seen in training, never used to choose
the checkpoint: training validates on the `val` split), or every scene of --data; held-out views are
views other than the input. The baseline printed beside the model is the best constant colour per
image (its mean), which bounds what "predict the background" can score. SSIM is torchmetrics'
(gaussian window 11, sigma 1.5, data range 1).

Writes to <run>/eval/: eval.json, views.png (per scene: the input, then the held-out views; top row
ground truth, bottom row prediction) and orbit.png / orbit.gif (novel views around the first scenes).
"""

# The docstring above is `mouse-eval --help`: moremouse_triplane.flags reads it without importing this module.
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from memfit.errors import UsageError
from memfit.train.checkpoint import BEST_NAME
from memfit.train.distributed import resolve_device
from memfit.train.export import is_export, model_line
from memfit.train.flags import apply_threads, eval_out_dir
from memfit.train.metrics import psnr_per_image
from memfit.train.outputs import write_file, write_text
from memfit.train.run_dir import resolve_run
from PIL import Image

from moremouse_triplane.data import make_source
from moremouse_triplane.flags import eval_args
from moremouse_triplane.model import TriplaneGenerator
from moremouse_triplane.render import image_rays, look_at, orbit_eye

STRIP_SCENES = 6  # scenes shown in views.png
ORBIT_SCENES = 3  # scenes shown in orbit.png / orbit.gif
ORBIT_FRAMES = 24
ORBIT_ELEVATION = 25.0
PNG_SCALE = 4  # nearest-neighbour upscaling of the (small) images in the PNGs


def psnr(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """PSNR in dB per image: (N, C, H, W) in [0, 1] -> (N,)."""
    return psnr_per_image(pred, target)


def ssim(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SSIM per image (torchmetrics: gaussian window 11, sigma 1.5, data range 1): (N, C, H, W) -> (N,)."""
    from torchmetrics.functional.image import structural_similarity_index_measure  # slow import: lazy

    return structural_similarity_index_measure(
        pred.float().clamp(0, 1), target.float(), data_range=1.0, reduction="none"
    )


@torch.no_grad()
def render_views(
    model: TriplaneGenerator, scene: dict[str, torch.Tensor], K: torch.Tensor, c2w: torch.Tensor
) -> torch.Tensor:
    """Scene (eval_scene's input image (3, H, W) and its camera), cameras K (V, 3, 3), c2w (V, 4, 4)
    -> rendered views (V, 3, H, W)."""
    H = W = model.cfg.image_size
    dev = K.device
    image = scene["input"].to(dev)
    planes = model(image[None])
    o, d = image_rays(K, c2w, H, W)  # (V, H*W, 3)
    V = len(K)
    view = (
        image[None].expand(V, -1, -1, -1),
        scene["input_K"].to(dev).expand(V, 3, 3),
        scene["input_c2w"].to(dev).expand(V, 4, 4),
    )
    rgb, _ = model.render(planes.expand(V, *planes.shape[1:]), o, d, view=view)
    return rgb.float().clamp(0, 1).transpose(1, 2).reshape(V, 3, H, W)


def orbit_cameras(
    K: torch.Tensor, c2w: torch.Tensor, frames: int = ORBIT_FRAMES
) -> tuple[torch.Tensor, torch.Tensor]:
    """`frames` cameras on a circle around the origin at the distance of camera c2w (4, 4), intrinsics K."""
    radius = float(c2w[:3, 3].norm())
    eyes = [orbit_eye(360.0 * i / frames, ORBIT_ELEVATION, radius) for i in range(frames)]
    return K.expand(frames, 3, 3), torch.stack([look_at(e) for e in eyes])


def load_model(run: str | Path | None, device: torch.device) -> TriplaneGenerator:
    """The generator of a run (name or folder: best.pt, else its newest checkpoint) or a checkpoint file."""
    from moremouse_triplane.system import SYSTEM

    return SYSTEM.load_model(run, device)[0]


def _to_uint8(img: torch.Tensor, scale: int = PNG_SCALE) -> np.ndarray:
    """(3, H, W) in [0, 1] -> (H*scale, W*scale, 3) uint8, nearest-neighbour upscaled."""
    img = F.interpolate(img[None].float().cpu(), scale_factor=scale, mode="nearest")[0]
    return (img.clamp(0, 1).permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)


def _grid(rows: list[list[torch.Tensor]], pad: int = 2) -> np.ndarray:
    """Rows of (3, H, W) images (None: an empty cell) -> one uint8 picture with white gutters."""
    cells = [[_to_uint8(im) if im is not None else None for im in row] for row in rows]
    h, w = next(c for row in cells for c in row if c is not None).shape[:2]
    cols = max(len(r) for r in cells)
    out = np.full(((h + pad) * len(cells) + pad, (w + pad) * cols + pad, 3), 255, np.uint8)
    for i, row in enumerate(cells):
        for j, c in enumerate(row):
            if c is not None:
                out[
                    pad + i * (h + pad) : pad + i * (h + pad) + h,
                    pad + j * (w + pad) : pad + j * (w + pad) + w,
                ] = c
    return out


def score_scenes(
    model: TriplaneGenerator, scenes: list[dict[str, torch.Tensor]], device: torch.device
) -> dict:
    """Mean PSNR / SSIM over all held-out views of `scenes` (eval_scene dicts), model and constant colour."""
    preds, gts = [], []
    for ev in scenes:
        gts.append(ev["images"].to(device).float())
        preds.append(render_views(model, ev, ev["K"].to(device), ev["c2w"].to(device)))
    pred, gt = torch.cat(preds), torch.cat(gts)
    const = gt.mean(dim=(2, 3), keepdim=True).expand_as(gt)
    return {
        "psnr": psnr(pred, gt).mean().item(),
        "ssim": ssim(pred, gt).mean().item(),
        "psnr_constant": psnr(const, gt).mean().item(),
        "ssim_constant": ssim(const, gt).mean().item(),
        "scenes": len(scenes),
        "views": len(gt),
        "_pred": preds,
    }


def _save_image(image: Image.Image, path: Path, **kwargs) -> None:
    """PIL's save through memfit's one output path (whole or not at all; a full disk is one line)."""
    write_file(path, lambda tmp: image.save(tmp, **kwargs), overwrite=True)


def evaluate(
    model: TriplaneGenerator, source, num_scenes: int, device: torch.device, out: Path | None = None
) -> dict:
    """Scores over the first num_scenes held-out scenes; with `out`, writes views.png and the orbit."""
    scenes = [source.eval_scene(i) for i in range(min(num_scenes, len(source)))]
    res = score_scenes(model, scenes, device)
    preds = res.pop("_pred")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        rows: list[list[torch.Tensor]] = []
        for ev, pred in list(zip(scenes, preds))[:STRIP_SCENES]:
            rows.append([ev["input"], *ev["images"]])
            rows.append([None, *pred])
        _save_image(Image.fromarray(_grid(rows)), out / "views.png", format="PNG")
        res["views_png"] = str(out / "views.png")
        orbit_rows = []
        for ev in scenes[:ORBIT_SCENES]:
            K, c2w = orbit_cameras(ev["K"][0], ev["c2w"][0])
            frames = render_views(model, ev, K.to(device), c2w.to(device)).cpu()
            orbit_rows.append([ev["input"], *frames])
        _save_image(Image.fromarray(_grid(orbit_rows)), out / "orbit.png", format="PNG")
        gif = [
            Image.fromarray(_grid([[row[0], row[1 + f]] for row in orbit_rows])) for f in range(ORBIT_FRAMES)
        ]
        frames = {"save_all": True, "append_images": gif[1:], "duration": 120, "loop": 0}
        _save_image(gif[0], out / "orbit.gif", format="GIF", **frames)
        res["orbit_png"], res["orbit_gif"] = str(out / "orbit.png"), str(out / "orbit.gif")
    return res


def no_best(which: str, run_path: Path, loaded: Path) -> None:
    """Say so when `--checkpoint best` of a run folder loads another checkpoint because the run kept no
    best.pt (one that is there but unreadable, load_intact names already)."""
    exported = is_export(run_path)  # an export holds one model: no checkpoints to choose from
    if which == "best" and run_path.is_dir() and not exported and not (run_path / BEST_NAME).exists():
        print(
            f"[mouse-eval] --checkpoint best: {run_path} has no {BEST_NAME} (the run did not validate: "
            f"--val_scenes 0, or a --data too small to hold scenes out); using its latest checkpoint, "
            f"{loaded.name}",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> dict:
    """Evaluate a trained run; prints and returns {psnr, ssim, psnr_constant, ssim_constant, ...}."""
    return run(eval_args(argv))


def run(args: argparse.Namespace) -> dict:
    """main()'s work on the flags moremouse_triplane.flags.eval_args read (it imports torch)."""
    apply_threads(args)
    device = resolve_device(args.device)
    run_path = resolve_run(args.run, "moremouse-triplane", args.runs_dir)
    out = eval_out_dir(args, run_path, (args.data,))
    from moremouse_triplane.system import SYSTEM

    try:
        model, state = SYSTEM.load_model(run_path, device, which=args.checkpoint)
        print(model_line(SYSTEM, state))
        no_best(args.checkpoint, run_path, Path(state["path"]))
        source = make_source(args.data, model.cfg.image_size, seed=args.seed, split=args.split)
    except UsageError:  # already one line (a run or model file that is missing or damaged)
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        res = evaluate(model, source, args.num_scenes, device, out)
    where = args.data or f"generated {args.split} scenes"
    res.update(checkpoint=str(state["path"]), step=state.get("step"), data=where)
    print(
        f"{where}: {res['scenes']} scenes, "
        f"{res['views']} held-out views\n"
        f"  model:           PSNR {res['psnr']:6.2f} dB  SSIM {res['ssim']:.3f}\n"
        f"  constant colour: PSNR {res['psnr_constant']:6.2f} dB  SSIM {res['ssim_constant']:.3f}\n"
        f"wrote {res['views_png']} (per scene: input + views, truth above prediction), {res['orbit_png']}, "
        f"{res['orbit_gif']}"
    )
    write_text(out / "eval.json", json.dumps(res, indent=1), overwrite=True)
    return res


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mouse-eval", main))
