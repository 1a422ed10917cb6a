"""Train MBS-Net: `uv run mbsnet-train [--config default|seed|tiny] [--data VOICEBANK_ROOT] [--steps N]`.

Without --data it trains on the embedded generator of speech-like noisy/clean pairs (offline).
Losses (losses.py) as MP-SENet: compressed magnitude MSE, compressed complex MSE, anti-wrapping phase
losses (instantaneous phase, group delay, instantaneous frequency), waveform L1 and optionally a
multi-resolution STFT loss; each term is logged to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from memfit.training import dist_info, resolve_device

from mbsnet_speech.config import PRESETS, get_config
from mbsnet_speech.data import SAMPLE_RATE, find_pairs, folder_batch, pair_rng, synth_batch
from mbsnet_speech.losses import enhancement_loss
from mbsnet_speech.model import MBSNet, count_params

SYSTEM_NAME = "mbsnet-speech"


def training_step_loss(model: MBSNet, batch) -> torch.Tensor:
    """Scalar loss for memfit.memory.TrainStep (the default loss weights)."""
    return enhancement_loss(model, batch)[0]


def build_parser() -> argparse.ArgumentParser:
    from memfit.training import add_loop_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        choices=["auto", *PRESETS],
        default="auto",
        help="model preset; auto: default on a GPU, the quick CPU recipe (tiny, 32 channels) otherwise",
    )
    p.add_argument("--layers", type=int, default=None, help="override the number of encoder layers")
    p.add_argument("--channels", type=int, default=None, help="override the channel width")
    p.add_argument("--bidirectional", action="store_true", help="bidirectional temporal Mamba (not causal)")
    p.add_argument("--no_checkpoint", action="store_true", help="keep activations (no recompute)")
    p.add_argument(
        "--data", default=None, help="VoiceBank+DEMAND-style root (clean_*/ noisy_*/); default: generated"
    )
    p.add_argument("--batch_size", type=int, default=None, help="default 6 (CPU recipe: 4)")
    p.add_argument(
        "--seconds", type=float, default=None, help="crop length in seconds (default 2; CPU recipe 1)"
    )
    p.add_argument(
        "--snr", type=float, nargs=2, default=(0.0, 20.0), metavar=("MIN", "MAX"), help="generator SNRs"
    )
    p.add_argument("--lr", type=float, default=None, help="default 5e-4 (CPU recipe: 2e-3)")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: min(50, steps // 10))")
    add_loop_args(p, steps=None, log_every=10, save_every=200)
    return p


# `train` on a machine without a GPU: the recipe of the learning test (PESQ improves in ~2 minutes on
# 2 cores) instead of the paper model, whose step takes about a minute on CPU.
CPU_RECIPE = dict(config="tiny", channels=32, batch_size=4, seconds=1.0, lr=2e-3, steps=300)
PAPER_RECIPE = dict(config="default", channels=None, batch_size=6, seconds=2.0, lr=5e-4, steps=1000)


def resolve_recipe(args: argparse.Namespace) -> None:
    """Fill the flags left unset from the recipe that fits this machine (auto) or the chosen preset."""
    auto = args.config == "auto"
    on_gpu = resolve_device(args.device).type == "cuda"
    recipe = PAPER_RECIPE if (not auto or on_gpu) else CPU_RECIPE
    if auto:
        args.config = recipe["config"]
        if args.channels is None:
            args.channels = recipe["channels"]
        if not on_gpu and dist_info().rank == 0:
            print(
                "mbsnet-train: no GPU, so the quick CPU recipe (tiny config, 32 channels, batch 4 x 1 s, "
                "300 steps); `--config default` trains the 2.6M-parameter model",
                file=sys.stderr,
            )
    for key in ("batch_size", "seconds", "lr", "steps"):
        if getattr(args, key) is None:
            setattr(args, key, recipe[key])


def main(argv: list[str] | None = None) -> dict:
    """Train from the command line (argv None -> sys.argv[1:]); returns the last metrics."""
    from memfit.training import Trainer, loop_config_from_args, warmup_cosine_lambda

    args = build_parser().parse_args(argv)
    resolve_recipe(args)
    overrides = {}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.channels is not None:
        overrides["channels"] = args.channels
    if args.bidirectional:
        overrides["temporal_bidirectional"] = True
    if args.no_checkpoint:
        overrides["checkpoint"] = False
    if args.batch_size < 1 or args.seconds * SAMPLE_RATE < 400:
        raise SystemExit("error: --batch_size must be >= 1 and --seconds >= 0.025 (one STFT window)")
    try:
        cfg = get_config(args.config, **overrides)
        pairs = None
        if args.data:
            try:
                pairs = find_pairs(args.data, split="train")
            except FileNotFoundError:
                pairs = find_pairs(args.data)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    loop = loop_config_from_args(args, system=SYSTEM_NAME)
    torch.manual_seed(loop.seed)
    model = MBSNet(cfg)
    crop = int(args.seconds * SAMPLE_RATE)
    rank = dist_info().rank
    source = f"{len(pairs)} pairs from {args.data}" if pairs is not None else "generated speech-like pairs"
    if rank == 0:
        print(
            f"mbsnet-train: {args.config} config, {count_params(model) / 1e6:.3f}M params, "
            f"batch {args.batch_size} x "
            f"{args.seconds:g} s, data: {source}",
            file=sys.stderr,
        )

    def get_batch(step: int, micro: int):
        rng = pair_rng(loop.seed, step, micro * 1000 + rank)
        if pairs is not None:
            noisy, clean = folder_batch(pairs, args.batch_size, crop, rng)
        else:
            noisy, clean = synth_batch(args.batch_size, crop, rng, snr_range=tuple(args.snr))
        dev = trainer.device
        return torch.from_numpy(np.ascontiguousarray(noisy)).to(dev), torch.from_numpy(clean).to(dev)

    warmup = args.warmup if args.warmup is not None else min(50, loop.steps // 10)
    device_model = model.to(resolve_device(loop.device))
    opt = torch.optim.AdamW(
        device_model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.8, 0.99)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine_lambda(loop.steps, warmup))
    trainer = Trainer(
        device_model,
        opt,
        enhancement_loss,
        get_batch,
        loop,
        scheduler=sched,
        model_config={"preset": args.config, **cfg.to_dict()},
        items_per_step=args.batch_size * crop * loop.grad_accum,
    )
    return trainer.fit()


if __name__ == "__main__":
    main()
