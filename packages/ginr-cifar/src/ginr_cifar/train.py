"""Train Mamba-GINR on CIFAR-10 (or the embedded default set): `ginr-train --help`.

Each step takes random images and a random subset of their pixels (``--num_sample_coords``, default 512
of 1024), encodes the images to latent tokens and decodes the sampled coordinates. Batches are drawn
from one uint8 tensor by a generator seeded per (seed, step, micro), so ``--resume`` is exact.
``--profile`` times encode vs decode and reports their memory, then exits (the seed's profile_model).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from memfit.config import overrides_from_args
from memfit.flags import fill_from_recipe
from memfit.training import (
    Trainer,
    add_loop_args,
    add_model_args,
    autocast_context,
    check_numbers,
    dist_info,
    loop_config_from_args,
    resolve_device,
    set_seed,
    step_generator,
    warmup_cosine_lambda,
)

from ginr_cifar.config import PRESETS, get_config
from ginr_cifar.data import default_cache_dir, load_split, sample_batch
from ginr_cifar.eval import evaluate_psnr, mean_colour_psnr
from ginr_cifar.model import GINR

SYSTEM_NAME = "ginr-cifar"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--data", default=None, help="CIFAR-10 batches folder or ImageFolder tree (default: embedded)"
    )
    add_model_args(p, PRESETS, "auto", help="preset (auto: balanced on CUDA, the CPU recipe (cpu) otherwise)")
    p.add_argument("--decoder", choices=["attn", "ff", "xattn"], default=None, help="decoder variant")
    p.add_argument("--decoder_width", type=int, default=None)
    p.add_argument("--decoder_depth", type=int, default=None, help="decoder scales")
    p.add_argument("--batch_size", type=int, default=None, help="images per step (default: the recipe's)")
    p.add_argument(
        "--num_sample_coords", type=int, default=None, help="pixels per image per step (of 1024; recipe's)"
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=None,
        help="move sampled coordinates up to this many pixels off their centres, bilinear targets "
        "(0: pixel centres only; recipe's)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps before the cosine decay")
    p.add_argument(
        "--holdout",
        type=int,
        default=500,
        help="training images held out, unseen by training and validation (eval's default split)",
    )
    p.add_argument("--max_images", type=int, default=None, help="use only the first N training images")
    p.add_argument(
        "--eval_every",
        type=int,
        default=None,
        help="validation PSNR every N steps, the best kept as best.pt (0: at the end; recipe's)",
    )
    p.add_argument(
        "--eval_images",
        type=int,
        default=None,
        help="validation images, carved from the training part (recipe's)",
    )
    p.add_argument("--cache_dir", default=str(default_cache_dir()), help="decoded-image cache for folders")
    p.add_argument("--no_cache", action="store_true", help="decode image folders every time")
    p.add_argument("--profile", action="store_true", help="time encode vs decode, report memory, and exit")
    p.add_argument("--profile_iters", type=int, default=10)
    add_loop_args(p, steps=None, log_every=10, save_every=200)
    return p


@dataclass(frozen=True)
class Recipe:
    """Training flags a preset comes with (each overridable on the command line)."""

    batch_size: int = 64
    num_sample_coords: int = 512
    jitter: float = 0.0
    lr: float = 1e-3
    warmup: int = 100
    steps: int = 1000
    eval_every: int = 0
    eval_images: int = 500


# "cpu": chosen by measurement on one CPU thread (README "Learning"); every other preset keeps the seed's.
RECIPES = {
    "cpu": Recipe(
        batch_size=32, num_sample_coords=256, jitter=0.5, lr=3e-3, warmup=50, eval_every=100, eval_images=250
    )
}


def apply_recipe(args: argparse.Namespace, name: str) -> Recipe:
    """Fill the flags left unset from the preset's recipe; with --max_minutes and no --steps, train until
    the time budget (the cosine schedule then follows the clock)."""
    recipe = RECIPES.get(name, Recipe())
    keys = ("steps", "batch_size", "num_sample_coords", "jitter", "lr", "warmup", "eval_every", "eval_images")
    fill_from_recipe(args, recipe, keys)
    return recipe


def _model_config(args: argparse.Namespace, device: torch.device):
    name = args.config if args.config != "auto" else ("balanced" if device.type == "cuda" else "cpu")
    fields = {"decoder": "decoder", "decoder_width": "decoder_width", "decoder_depth": "decoder_depth"}
    fields["checkpointing"] = "checkpoint"
    return name, get_config(name, **overrides_from_args(args, fields))


def mse_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Batch (images, coords, rgb) -> mean squared error of the decoded pixels (fp32)."""
    images, coords, target = batch
    return F.mse_loss(model(images, coords).float(), target)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(model: GINR, batch, device: torch.device, amp: str, iters: int = 10) -> dict[str, float]:
    """Time encode vs decode (forward, ms) and measure peak memory of each and of a training step (MiB)."""
    from memfit.memory import measure_peak

    images, coords, target = batch
    model.eval()
    times = {"encode_ms": [], "decode_ms": []}
    with torch.no_grad(), autocast_context(amp, device):
        for i in range(iters + 1):  # the first iteration warms up and is dropped
            _sync(device)
            t0 = time.perf_counter()
            latent = model.encode(images)
            _sync(device)
            t1 = time.perf_counter()
            model.decode(latent, coords)
            _sync(device)
            t2 = time.perf_counter()
            if i:
                times["encode_ms"].append((t1 - t0) * 1e3)
                times["decode_ms"].append((t2 - t1) * 1e3)
    out = {k: sum(v) / len(v) for k, v in times.items()}
    model.train()
    with autocast_context(amp, device):
        with measure_peak(device) as m_enc:
            latent = model.encode(images)
        with measure_peak(device) as m_dec:
            loss = F.mse_loss(model.decode(latent, coords).float(), target)
    with measure_peak(device) as m_bwd:
        loss.backward()
    model.zero_grad(set_to_none=True)
    out["encode_fwd_mib"] = m_enc.peak_mib
    out["decode_fwd_mib"] = m_dec.peak_mib
    out["backward_mib"] = m_bwd.peak_mib
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        name, cfg = _model_config(args, resolve_device(args.device))
    except ValueError as e:
        raise SystemExit(f"ginr-train: {e}") from None
    apply_recipe(args, name)
    check_numbers(args, lr=">0", weight_decay=">=0", warmup=">=0", batch_size=">=1", eval_every=">=0")
    check_numbers(args, eval_images=">=1", holdout=">=0", profile_iters=">=1", jitter=">=0")
    loop = loop_config_from_args(args, system=SYSTEM_NAME)
    device = resolve_device(loop.device)
    try:
        cache = None if args.no_cache else args.cache_dir
        # validation images come out of the training part, never out of the holdout: best.pt is chosen
        # on them, and the holdout stays unseen by training and by every choice
        n_val = args.eval_images
        split = {"holdout": args.holdout, "val": n_val, "cache_dir": cache}
        train_set = load_split(args.data, "train", max_images=args.max_images, **split)
        val_set = load_split(args.data, "val", **split)
        if args.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
        if not 1 <= args.num_sample_coords <= cfg.num_pixels:
            raise ValueError(
                f"--num_sample_coords must be in [1, {cfg.num_pixels}], got {args.num_sample_coords}"
            )
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"ginr-train: {e}") from None

    set_seed(loop.seed)
    model = GINR(cfg).to(device)
    print(
        f"ginr-train: config {name} (decoder {cfg.decoder}, width {cfg.decoder_width}), "
        f"{model.num_params() / 1e6:.2f}M params; {len(train_set)} training images from {train_set.source}"
        + f", {len(val_set)} more for validation"
        + (f"; {args.holdout} held out, unseen" if args.holdout else ""),
        file=sys.stderr,
    )
    images = train_set.images
    if device.type == "cuda":  # the whole set fits on the GPU (150 MB): batches are then pure indexing
        images = images.pin_memory().to(device, non_blocking=True)

    rank = dist_info().rank  # each DDP rank draws its own batches

    def get_batch(step: int, micro: int):
        g = step_generator(loop.seed, step, micro, rank=rank)
        return sample_batch(images, args.batch_size, args.num_sample_coords, g, device, jitter=args.jitter)

    if args.profile:
        batch = get_batch(0, 0)
        res = profile_model(model, batch, device, loop.amp, args.profile_iters)
        print(
            f"profile ({device.type}, batch {args.batch_size}, {args.num_sample_coords} coords, "
            f"amp {loop.amp}): "
            f"encode {res['encode_ms']:.1f} ms, decode {res['decode_ms']:.1f} ms forward; "
            f"peak memory: encode fwd {res['encode_fwd_mib']:.1f} MiB, "
            f"decode fwd {res['decode_fwd_mib']:.1f} MiB, "
            f"backward {res['backward_mib']:.1f} MiB"
        )
        return res

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine_lambda(loop.steps, min(args.warmup, loop.steps), max_minutes=loop.max_minutes)
    )
    eval_imgs = val_set.images

    def eval_fn(m: GINR) -> dict[str, float]:
        return {"val_psnr": evaluate_psnr(m, eval_imgs)}

    trainer = Trainer(
        model,
        opt,
        mse_loss,
        get_batch,
        loop,
        scheduler=sched,
        eval_fn=eval_fn if eval_imgs is not None and len(eval_imgs) else None,
        eval_every=args.eval_every,
        best_metric="val_psnr",
        config=cfg,
        meta={"preset": name, "data": args.data, "holdout": args.holdout, "val": n_val},
        items_per_step=args.batch_size * args.grad_accum,
        system=SYSTEM_NAME,
    )
    result = trainer.fit()
    if "eval/val_psnr" in result:
        baseline = mean_colour_psnr(eval_imgs)
        print(
            f"validation PSNR {result['eval/val_psnr']:.2f} dB on {len(eval_imgs)} images, best "
            f"{result['best/val_psnr']:.2f} dB at step {result['best_step']} (best.pt; "
            f"mean-colour baseline {baseline:.2f} dB)"
        )
        result["mean_colour_psnr"] = baseline
    if not math.isfinite(result.get("loss", 0.0)):
        raise SystemExit("ginr-train: loss is not finite")
    return result


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("ginr-train", main))
