"""Train Mamba-GINR on CIFAR-10 (or the embedded default set): `ginr-train --help`.

Each step takes random images and a random subset of their pixels (``--num_sample_coords``, default 512
of 1024), encodes the images to latent tokens and decodes the sampled coordinates. Batches are drawn
from one uint8 tensor by a generator seeded per (seed, step, micro), so ``--resume`` is exact.
``--profile`` times encode vs decode and reports their memory, then exits (the seed's profile_model).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from memfit.errors import UsageError
from memfit.train.settings import TrainParser

from ginr_cifar.config import SETTINGS, default_cache_dir

if TYPE_CHECKING:  # torch and the model load when training starts: `--help` stays fast
    import torch

    from ginr_cifar.model import GINR

SYSTEM_NAME = "ginr-cifar"


def build_parser() -> TrainParser:
    p = TrainParser(SYSTEM_NAME, __doc__, SETTINGS, auto=("balanced", "cpu"))
    m = p.group("model")
    p.flag(m, "--checkpointing", path="model.checkpoint", help="per-block activation checkpointing")
    p.flag(m, "--decoder", path="model.decoder", choices=["attn", "ff", "xattn"], help="decoder variant")
    p.flag(m, "--decoder_width", path="model.decoder_width", help="decoder width")
    p.flag(m, "--decoder_depth", path="model.decoder_depth", help="decoder scales")
    d = p.group("data and optimizer")
    p.flag(
        d,
        "--data",
        path="train.data",
        file=True,
        help="CIFAR-10 batches folder or ImageFolder tree (none: embedded)",
    )
    p.flag(d, "--max_images", path="train.max_images", help="use only the first N training images")
    p.flag(
        d,
        "--holdout",
        path="train.holdout",
        help="training images held out, unseen by training and validation (eval's default split)",
    )
    p.flag(d, "--batch_size", path="train.batch_size", help="images per step")
    p.flag(
        d, "--num_sample_coords", path="train.num_sample_coords", help="pixels per image per step (of 1024)"
    )
    p.flag(
        d,
        "--jitter",
        path="train.jitter",
        help="move sampled coordinates up to this many pixels off their centres, bilinear targets",
    )
    p.optimizer_flags(d)
    p.flag(
        d,
        "--eval_every",
        path="train.eval_every",
        help="validation PSNR every N steps, the best kept as best.pt (0: at the end)",
    )
    p.flag(
        d, "--eval_images", path="train.eval_images", help="validation images, carved from the training part"
    )
    x = p.group("other")
    x.add_argument("--cache_dir", default=str(default_cache_dir()), help="decoded-image cache for folders")
    x.add_argument("--no_cache", action="store_true", help="decode image folders every time")
    x.add_argument("--profile", action="store_true", help="time encode vs decode, report memory, and exit")
    x.add_argument("--profile_iters", type=int, default=10)
    return p


def mse_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Batch (images, coords, rgb) -> mean squared error of the decoded pixels (fp32)."""
    import torch.nn.functional as F

    images, coords, target = batch
    return F.mse_loss(model(images, coords).float(), target)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(model: GINR, batch, device: torch.device, amp: str, iters: int = 10) -> dict[str, float]:
    """Time encode vs decode (forward, ms) and measure peak memory of each and of a training step (MiB)."""
    import torch
    import torch.nn.functional as F
    from memfit.estimate.steps import measure_peak
    from memfit.train.loop import autocast_context

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
    run = build_parser().parse(argv)
    import torch
    from memfit.step import AMP_DTYPES
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer, WarmupCosine, set_seed, step_generator

    from ginr_cifar.data import load_split, sample_batch
    from ginr_cifar.eval import evaluate_psnr, mean_colour_psnr
    from ginr_cifar.model import GINR
    from ginr_cifar.system import ginr_step

    extras, device = run.extras, run.device
    cfg, t, loop = run.settings.model, run.settings.train, run.settings.loop
    if extras["profile_iters"] < 1:
        raise UsageError(f"error: --profile_iters must be >= 1, got {extras['profile_iters']}")
    if t.num_sample_coords > cfg.num_pixels:
        raise UsageError(f"error: --num_sample_coords must be <= {cfg.num_pixels}, got {t.num_sample_coords}")
    try:
        # validation images come out of the training part, never out of the holdout: best.pt is chosen
        # on them, and the holdout stays unseen by training and by every choice
        split = {
            "holdout": t.holdout,
            "val": t.eval_images,
            "cache_dir": None if extras["no_cache"] else extras["cache_dir"],
        }
        train_set = load_split(t.data, "train", max_images=t.max_images, **split)
        val_set = load_split(t.data, "val", **split)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None

    set_seed(loop.seed)
    model = GINR(cfg)
    print(
        f"ginr-train: config {run.preset} (decoder {cfg.decoder}, width {cfg.decoder_width}), "
        f"{model.num_params() / 1e6:.2f}M params; {len(train_set)} training images from {train_set.source}"
        + f", {len(val_set)} more for validation"
        + (f"; {t.holdout} held out, unseen" if t.holdout else ""),
        file=sys.stderr,
    )
    images = train_set.images
    if device.type == "cuda":  # the whole set fits on the GPU (150 MB): batches are then pure indexing
        images = images.pin_memory().to(device, non_blocking=True)

    rank = dist_info().rank  # each DDP rank draws its own batches

    def get_batch(step: int, micro: int):
        g = step_generator(loop.seed, step, micro, rank=rank)
        return sample_batch(images, t.batch_size, t.num_sample_coords, g, device, jitter=t.jitter)

    if extras["profile"]:
        batch = get_batch(0, 0)
        res = profile_model(model.to(device), batch, device, loop.amp, extras["profile_iters"])
        print(
            f"profile ({device.type}, batch {t.batch_size}, {t.num_sample_coords} coords, "
            f"amp {loop.amp}): "
            f"encode {res['encode_ms']:.1f} ms, decode {res['decode_ms']:.1f} ms forward; "
            f"peak memory: encode fwd {res['encode_fwd_mib']:.1f} MiB, "
            f"decode fwd {res['decode_fwd_mib']:.1f} MiB, "
            f"backward {res['backward_mib']:.1f} MiB"
        )
        return res

    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.99))
    amp = AMP_DTYPES[loop.amp]
    eval_imgs = val_set.images

    def eval_fn(m: GINR) -> dict[str, float]:
        return {"val_psnr": evaluate_psnr(m, eval_imgs)}

    trainer = Trainer(
        model,
        opt,
        mse_loss,
        get_batch,
        run,
        lr_schedule=WarmupCosine(t.warmup),
        eval_fn=eval_fn if eval_imgs is not None and len(eval_imgs) else None,
        eval_every=t.eval_every,
        best_metric="val_psnr",
        config=cfg,
        meta={"preset": run.preset, "data": t.data, "holdout": t.holdout, "val": t.eval_images},
        items_per_step=t.batch_size * loop.grad_accum,
        memory_step=lambda b, ckpt: ginr_step(replace(cfg, checkpoint=ckpt), b, t.num_sample_coords, amp),
        batch_size=t.batch_size,
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
        raise UsageError("error: the loss is not finite; lower --lr or use --amp none")
    return result


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("ginr-train", main))
