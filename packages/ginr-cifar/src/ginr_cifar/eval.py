"""Evaluate a trained Mamba-GINR: PSNR on any image set beside two baselines, and a PNG grid.

`ginr-eval --run NAME` decodes every pixel of every image of the split, prints the mean PSNR (dB, pixels
in [0, 1]) beside the mean-colour and 16x16-average-pool -> bicubic baselines (the latter a 768-number
code; our latent is num_lp x dim numbers), says which checkpoint and how many images, and writes
``eval_<split>.json`` and ``recon_<split>.png`` (truth on top, reconstruction below, images spread across
the set, so across the classes of an ImageFolder) in ``--out`` (default: the run's ``eval/`` folder).

``--data`` takes any image folder (an ImageFolder root, ``<class>/<file>``, or plain files) or CIFAR-10
python batches; ``--split auto`` then picks: the run's own data -> its held-out images; CIFAR-10 batches
or a folder with ``test/`` -> the test images; any other folder -> all its images.
``--resolution R`` decodes an R x R grid of pixel centres instead (super-resolution: the decoder is a
function of continuous coordinates) and writes it as ``recon_<split>_<R>.png``; the PSNR is then that of
the R x R decode average-pooled back to 32 x 32.

Its flags are read in ginr_cifar.flags, which imports no torch (`--help` answers at once).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from memfit.errors import UsageError
from memfit.train.distributed import resolve_device
from memfit.train.export import model_line
from memfit.train.flags import apply_threads, eval_out_dir
from memfit.train.metrics import psnr_per_image
from memfit.train.outputs import write_file, write_text
from memfit.train.run_dir import resolve_run

from ginr_cifar.data import _find_cifar_batches, load_split
from ginr_cifar.flags import eval_args
from ginr_cifar.model import GINR
from ginr_cifar.system import SYSTEM

DECODE_TOKENS = 2**17  # coordinates decoded at once (images x pixels), bounds eval memory at any resolution


def load_model(run: str | Path | None, device: torch.device) -> tuple[GINR, dict]:
    """The model of a run (name or folder: its best checkpoint) or a checkpoint file; (model, meta with the
    checkpoint's "path" and "step")."""
    model, state = SYSTEM.load_model(run, device)
    return model, {**state["meta"], "path": state.get("path"), "step": state.get("step"),
                   "settings": state.get("settings")}  # fmt: skip


@torch.no_grad()
def reconstruct(
    model: GINR, images: torch.Tensor, batch_size: int = 100, resolution: int | None = None
) -> torch.Tensor:
    """uint8 or float images (N, C, H, W) -> reconstructions (N, C, R, R) in [0, 1], R = ``resolution``
    (default: the image size): the latent decoded at the R x R pixel centres of the same [-1, 1] square."""
    from ginr_cifar.data import pixel_coords, pixels_to_image

    device = next(model.parameters()).device
    size = resolution or model.cfg.image_size
    if size < 1:
        raise ValueError(f"resolution must be >= 1, got {size}")
    grid = pixel_coords(size, device=device)
    per = max(1, min(batch_size, DECODE_TOKENS // (size * size)))  # images decoded together
    out = []
    for i in range(0, images.shape[0], batch_size):
        x = images[i : i + batch_size].to(device)
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        latent = model.encode(x)
        for j in range(0, x.shape[0], per):
            lat = latent[j : j + per]
            rgb = model.decode(lat, grid.expand(lat.shape[0], -1, -1)).float().clamp(0, 1)
            out.append(pixels_to_image(rgb, size).cpu())
    return torch.cat(out)


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 0..255 or float 0..1 images -> float 0..1."""
    return images.float() / 255 if images.dtype == torch.uint8 else images.float()


def bicubic_from(images: torch.Tensor, low: int = 16) -> torch.Tensor:
    """Average-pool to low x low, bicubic back to full size, clamped to [0, 1] (a 3*low^2-number code)."""
    x = to_unit(images)
    small = F.adaptive_avg_pool2d(x, low)
    return F.interpolate(small, size=x.shape[-2:], mode="bicubic", align_corners=False).clamp(0, 1)


def bicubic_psnr(images: torch.Tensor, low: int = 16) -> float:
    """PSNR of bicubic_from(images, low): the 16x16 -> bicubic baseline (768 numbers per image)."""
    return psnr_per_image(bicubic_from(images, low), to_unit(images)).mean().item()


def mean_colour_psnr(images: torch.Tensor) -> float:
    """PSNR of predicting each image's mean colour: the floor any reconstruction must clear."""
    x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    return psnr_per_image(x.mean((2, 3), keepdim=True).expand_as(x), x).mean().item()


def evaluate_psnr(model: GINR, images: torch.Tensor, batch_size: int = 100) -> float:
    """Mean full-resolution PSNR (dB, pixels in [0, 1]) over uint8 images (N, C, H, W)."""
    recon = reconstruct(model, images, batch_size)
    return psnr_per_image(recon, images.float() / 255).mean().item()


def high_freq_energy(images: torch.Tensor, cutoff: int) -> torch.Tensor:
    """Per-image mean spectral energy of (N, C, R, R) images at frequencies above ``cutoff`` cycles per
    image on either axis (for an upsampled image: what the low-resolution grid cannot hold)."""
    spec = torch.fft.fft2(to_unit(images) - to_unit(images).mean((-2, -1), keepdim=True)).abs().pow(2)
    f = torch.fft.fftfreq(images.shape[-1], 1 / images.shape[-1]).abs()
    high = (f[:, None] > cutoff) | (f[None, :] > cutoff)
    return (spec * high).sum((-3, -2, -1)) / images[0].numel()


def superres_check(model: GINR, images: torch.Tensor, factor: int = 2) -> dict[str, float]:
    """Super-resolution artefact figures: PSNR of the 32x32 decode and of the (factor*32)^2 decode
    average-pooled back to 32x32, and the high-frequency energy of the fine decode over that of a bicubic
    upsample of the 32x32 decode (stripes or grids show as a ratio well above 1)."""
    size = model.cfg.image_size
    truth = to_unit(images)
    coarse = reconstruct(model, images)
    fine = reconstruct(model, images, resolution=size * factor)
    up = F.interpolate(coarse, scale_factor=factor, mode="bicubic", align_corners=False).clamp(0, 1)
    return {
        "psnr": psnr_per_image(coarse, truth).mean().item(),
        "psnr_fine_pooled": psnr_per_image(F.avg_pool2d(fine, factor), truth).mean().item(),
        "hf_ratio": (high_freq_energy(fine, size // 2).sum() / high_freq_energy(up, size // 2).sum()).item(),
    }


def spread(n: int, k: int) -> torch.Tensor:
    """k indices spread evenly over range(n) (class-sorted folders: every class is shown)."""
    return torch.linspace(0, n - 1, min(n, k)).round().long()


def save_grid(truth: torch.Tensor, recon: torch.Tensor, path: str | Path, upscale: int = 4) -> None:
    """truth, recon (N, 3, H, W) in [0, 1] -> PNG, truth on the top row and reconstructions below
    (each row upscaled by nearest neighbour to the same pixel size: upscale x the truth's size)."""
    from torchvision.utils import make_grid, save_image

    n = truth.shape[0]
    side = truth.shape[-1] * upscale
    rows = [F.interpolate(r.float().clamp(0, 1), size=(side, side), mode="nearest") for r in (truth, recon)]
    both = torch.cat(rows)
    grid = make_grid(both, nrow=n, padding=2, pad_value=1.0)
    write_file(path, lambda tmp: save_image(grid, str(tmp), format="png"), overwrite=True)


def pick_split(split: str, data: str | None, run_data: str | None) -> str:
    """--split auto -> holdout (the run's own data), test (CIFAR-10 batches or a test/ folder) or all."""
    if split != "auto":
        return split
    if data is None or run_data is not None and Path(data).expanduser().resolve() == Path(run_data).resolve():
        return "holdout"
    root = Path(data).expanduser()
    return "test" if _find_cifar_batches(root) is not None or (root / "test").is_dir() else "all"


def main(argv: list[str] | None = None) -> dict:
    """`ginr-eval` with these flags (None: sys.argv[1:]); returns the results it writes."""
    return run(eval_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Evaluate with flags ginr_cifar.flags.eval_args read (the command's work: it imports torch)."""
    apply_threads(args)
    device = resolve_device(args.device)
    run_path = resolve_run(args.run, "ginr-cifar", args.runs_dir)
    out = eval_out_dir(args, run_path, (args.data,))
    try:
        model, meta = load_model(run_path, device)
        print(model_line(SYSTEM, meta))
        data = args.data if args.data is not None else meta.get("data")
        split = pick_split(args.split, args.data, meta.get("data"))
        holdout = args.holdout if args.holdout is not None else int(meta.get("holdout", 500))
        cache = None if args.no_cache else args.cache_dir
        val = int(meta.get("val", 0))  # the run's validation images, carved from its training part
        kw = {"holdout": holdout, "val": val, "max_images": args.num_images, "cache_dir": cache}
        images = load_split(data, split, **kw).images
        if split in ("holdout", "val") and args.num_images is not None:
            images = images[: args.num_images]
        if len(images) == 0:
            raise ValueError(f"split {split!r} is empty (holdout={holdout}, val={val}); nothing to evaluate")
    except UsageError:  # already one line (a run or model file that is missing or damaged)
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None

    size = model.cfg.image_size
    res = args.resolution or size
    recon = reconstruct(model, images, args.batch_size, resolution=res)
    truth = to_unit(images)
    at_size = recon if res == size else F.adaptive_avg_pool2d(recon, size)
    psnr = psnr_per_image(at_size, truth)
    cfg = model.cfg
    result = {
        "split": split,
        "data": data,
        "num_images": len(images),
        "checkpoint": str(meta.get("path")),
        "step": meta.get("step"),
        "resolution": res,
        "psnr": psnr.mean().item(),
        "psnr_std": psnr.std().item() if len(psnr) > 1 else 0.0,
        "latent_numbers": cfg.num_lp * cfg.dim,
        "mean_colour_psnr": mean_colour_psnr(images),
        "bicubic16_psnr": bicubic_psnr(images, size // 2),
        "bicubic16_numbers": 3 * (size // 2) ** 2,
    }
    pick = spread(len(images), args.grid)
    png = out / (f"recon_{split}.png" if res == size else f"recon_{split}_{res}.png")
    save_grid(truth[pick], recon[pick], png)
    result["png"] = str(png)
    write_text(out / (f"eval_{split}.json" if res == size else f"eval_{split}_{res}.json"),
               json.dumps(result, indent=2), overwrite=True)  # fmt: skip
    how = "" if res == size else f" ({res}x{res} decode average-pooled to {size}x{size})"
    print(
        f"ginr-eval: {result['num_images']} {split} images of {data or 'the embedded set'}\n"
        f"PSNR {result['psnr']:.2f} dB (std {result['psnr_std']:.2f}){how}, latent code "
        f"{result['latent_numbers']} numbers; baselines: mean colour {result['mean_colour_psnr']:.2f} dB, "
        f"{size // 2}x{size // 2} average-pool -> bicubic {result['bicubic16_psnr']:.2f} dB "
        f"({result['bicubic16_numbers']} numbers); grid -> {png}"
    )
    return result


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("ginr-eval", main))
