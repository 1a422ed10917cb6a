"""Evaluate a trained Mamba-GINR: full-resolution PSNR on a split and a PNG of truth vs reconstruction.

`ginr-eval --run runs/ginr-cifar/run` decodes all 1024 pixels of every image in the split (default: the
images held out of training), prints the mean PSNR (dB, pixels in [0, 1]) beside the mean-colour baseline,
writes ``eval_<split>.json`` and ``recon_<split>.png`` (top row truth, bottom row reconstruction) in
``--out`` (default: the run's ``eval/`` folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from memfit.flags import add_eval_args, apply_threads, check_numbers, eval_out_dir
from memfit.metrics import psnr_per_image
from memfit.run_dir import resolve_run
from memfit.training import resolve_device

from ginr_cifar.data import default_cache_dir, load_split
from ginr_cifar.model import GINR


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    p.add_argument("--split", default="holdout", choices=["holdout", "test", "train"])
    p.add_argument("--holdout", type=int, default=None, help="held-out count (default: the run's)")
    p.add_argument("--num_images", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--grid", type=int, default=16, help="images in the PNG grid")
    p.add_argument("--cache_dir", default=str(default_cache_dir()))
    p.add_argument("--no_cache", action="store_true")
    add_eval_args(p, "ginr-cifar")
    return p


def load_model(run: str | Path | None, device: torch.device) -> tuple[GINR, dict]:
    """The model of a run (name or folder: its best checkpoint) or a checkpoint file; (model, meta)."""
    from ginr_cifar.system import SYSTEM

    model, state = SYSTEM.load_model(run, device)
    return model, state["meta"]


@torch.no_grad()
def reconstruct(model: GINR, images: torch.Tensor, batch_size: int = 100) -> torch.Tensor:
    """uint8 or float images (N, C, H, W) -> reconstructions (N, C, H, W) in [0, 1], all pixels decoded."""
    from ginr_cifar.data import pixel_coords, pixels_to_image

    device = next(model.parameters()).device
    size = model.cfg.image_size
    grid = pixel_coords(size, device=device)
    out = []
    for i in range(0, images.shape[0], batch_size):
        x = images[i : i + batch_size].to(device)
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        rgb = model(x, grid.expand(x.shape[0], -1, -1)).float().clamp(0, 1)
        out.append(pixels_to_image(rgb, size).cpu())
    return torch.cat(out)


def mean_colour_psnr(images: torch.Tensor) -> float:
    """PSNR of predicting each image's mean colour: the floor any reconstruction must clear."""
    x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    return psnr_per_image(x.mean((2, 3), keepdim=True).expand_as(x), x).mean().item()


def evaluate_psnr(model: GINR, images: torch.Tensor, batch_size: int = 100) -> float:
    """Mean full-resolution PSNR (dB, pixels in [0, 1]) over uint8 images (N, C, H, W)."""
    recon = reconstruct(model, images, batch_size)
    return psnr_per_image(recon, images.float() / 255).mean().item()


def save_grid(truth: torch.Tensor, recon: torch.Tensor, path: str | Path, upscale: int = 4) -> None:
    """truth, recon (N, 3, H, W) in [0, 1] -> PNG, truth on the top row and reconstructions below."""
    from torchvision.utils import make_grid, save_image

    n = truth.shape[0]
    both = torch.cat([truth, recon]).float().clamp(0, 1)
    both = torch.nn.functional.interpolate(both, scale_factor=upscale, mode="nearest")
    save_image(make_grid(both, nrow=n, padding=2, pad_value=1.0), str(path))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    check_numbers(args, batch_size=">=1", grid=">=1", num_images=">=1")
    device = resolve_device(args.device)
    run = resolve_run(args.run, "ginr-cifar", args.runs_dir)
    out = eval_out_dir(args, run)
    try:
        model, meta = load_model(run, device)
        data = args.data if args.data is not None else meta.get("data")
        holdout = args.holdout if args.holdout is not None else int(meta.get("holdout", 500))
        cache = None if args.no_cache else args.cache_dir
        images = load_split(
            data, args.split, holdout=holdout, max_images=args.num_images, cache_dir=cache
        ).images
        if args.split == "holdout" and args.num_images is not None:
            images = images[: args.num_images]
        if len(images) == 0:
            raise ValueError(f"split {args.split!r} is empty (holdout={holdout}); nothing to evaluate")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"ginr-eval: {e}") from None

    recon = reconstruct(model, images, args.batch_size)
    truth = images.float() / 255
    psnr = psnr_per_image(recon, truth)
    result = {
        "split": args.split,
        "data": data,
        "num_images": len(images),
        "psnr": psnr.mean().item(),
        "psnr_std": psnr.std().item() if len(psnr) > 1 else 0.0,
        "mean_colour_psnr": mean_colour_psnr(images),
    }
    png = out / f"recon_{args.split}.png"
    save_grid(truth[: args.grid], recon[: args.grid], png)
    result["png"] = str(png)
    (out / f"eval_{args.split}.json").write_text(json.dumps(result, indent=2))
    print(
        f"PSNR {result['psnr']:.2f} dB (std {result['psnr_std']:.2f}) "
        f"on {result['num_images']} {args.split} images; "
        f"mean-colour baseline {result['mean_colour_psnr']:.2f} dB; grid -> {png}"
    )
    return result


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("ginr-eval", main))
