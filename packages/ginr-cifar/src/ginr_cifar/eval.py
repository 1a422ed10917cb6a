"""Evaluate a trained Mamba-GINR: full-resolution PSNR on a split and a PNG of truth vs reconstruction.

`ginr-eval --run runs/ginr-cifar/run` decodes all 1024 pixels of every image in the split (default: the
images held out of training), prints the mean PSNR (dB, pixels in [0, 1]) beside the mean-colour baseline,
writes ``eval_<split>.json`` and ``recon_<split>.png`` (top row truth, bottom row reconstruction) in the run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from memfit.training import load_checkpoint, resolve_device

from ginr_cifar.config import GINRConfig
from ginr_cifar.data import default_cache_dir, load_split
from ginr_cifar.model import GINR
from ginr_cifar.train import mean_colour_psnr, psnr_per_image, reconstruct


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--run", default="runs/ginr-cifar/run", help="run folder (newest checkpoint) or a .pt file"
    )
    p.add_argument("--data", default=None, help="dataset (default: the one the run trained on)")
    p.add_argument("--split", default="holdout", choices=["holdout", "test", "train"])
    p.add_argument("--holdout", type=int, default=None, help="held-out count (default: the run's)")
    p.add_argument("--num_images", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--grid", type=int, default=16, help="images in the PNG grid")
    p.add_argument("--out", default=None, help="output folder (default: the run folder)")
    p.add_argument("--device", default="auto")
    p.add_argument("--cache_dir", default=str(default_cache_dir()))
    p.add_argument("--no_cache", action="store_true")
    return p


def load_model(path: str | Path, device: torch.device) -> tuple[GINR, dict]:
    """Rebuild the model from a checkpoint (file or run folder); returns (model, model_config)."""
    state = load_checkpoint(path, map_location=device)
    meta = state.get("model_config") or {}
    if "ginr" not in meta:
        raise ValueError(f"{path}: checkpoint has no ginr model_config; was it written by ginr-train?")
    model = GINR(GINRConfig.from_dict(meta["ginr"])).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    return model, meta


def save_grid(truth: torch.Tensor, recon: torch.Tensor, path: str | Path, upscale: int = 4) -> None:
    """truth, recon (N, 3, H, W) in [0, 1] -> PNG, truth on the top row and reconstructions below."""
    from torchvision.utils import make_grid, save_image

    n = truth.shape[0]
    both = torch.cat([truth, recon]).float().clamp(0, 1)
    both = torch.nn.functional.interpolate(both, scale_factor=upscale, mode="nearest")
    save_image(make_grid(both, nrow=n, padding=2, pad_value=1.0), str(path))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    try:
        model, meta = load_model(args.run, device)
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
    run = Path(args.run)
    out = Path(args.out) if args.out else (run if run.is_dir() else run.parent)
    out.mkdir(parents=True, exist_ok=True)
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


if __name__ == "__main__":
    main()
