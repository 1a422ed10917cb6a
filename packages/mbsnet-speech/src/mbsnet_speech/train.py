"""Train MBS-Net: `uv run mbsnet-train [--config default|seed|tiny] [--data VOICEBANK_ROOT] [--steps N]`.

Without --data it trains on the embedded generator of speech-like noisy/clean pairs (offline).
Losses (losses.py) as MP-SENet: compressed magnitude MSE, compressed complex MSE, anti-wrapping phase
losses (instantaneous phase, group delay, instantaneous frequency), waveform L1 and optionally a
multi-resolution STFT loss; each term is logged to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import fields, replace

import numpy as np
import torch
from memfit.flags import fill_from_recipe
from memfit.loop import warmup_cosine_lambda
from memfit.training import check_numbers, dist_info, resolve_device

from mbsnet_speech.config import PRESETS, LossWeights, Recipe, get_config, recipe_for
from mbsnet_speech.data import (
    HELDOUT_STREAM,
    MIX_SNR,
    SAMPLE_RATE,
    MixSource,
    PairFolder,
    PairRemix,
    audio_files,
    find_pairs,
    folder_batch,
    heldout_pairs,
    mix_batch,
    pair_rng,
    read_wav,
    synth_batch,
)
from mbsnet_speech.losses import enhancement_loss
from mbsnet_speech.model import MBSNet, count_params

SYSTEM_NAME = "mbsnet-speech"
VAL_SEED = 4321  # the held-out validation files and mixes do not depend on --seed


def training_step_loss(model: MBSNet, batch) -> torch.Tensor:
    """Scalar loss for memfit.memory.TrainStep (the default loss weights)."""
    return enhancement_loss(model, batch)[0]


def build_parser() -> argparse.ArgumentParser:
    from memfit.training import add_loop_args, add_model_args, hidden_alias

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    m = add_model_args(
        p,
        PRESETS,
        "auto",
        help="model preset; auto: default on a GPU, the CPU recipe (cpu) otherwise",
        checkpointing_help="recompute each encoder layer in backward (default: the preset's)",
    )
    hidden_alias(m, "--no_checkpoint", dest="checkpointing", action="store_false")
    p.add_argument("--layers", type=int, default=None, help="override the number of encoder layers")
    p.add_argument("--channels", type=int, default=None, help="override the channel width")
    p.add_argument("--bidirectional", action="store_true", help="bidirectional temporal Mamba (not causal)")
    p.add_argument(
        "--data", default=None, help="VoiceBank+DEMAND-style root (clean_*/ noisy_*/); default: generated"
    )
    p.add_argument(
        "--remix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --data: every step mix one pair's clean speech with another pair's noise (noisy - clean) "
        "at a random SNR (--snr, default -5 15) and gain; --no-remix trains on the fixed pairs",
    )
    p.add_argument("--clean", default=None, help="folder of clean speech to mix noise into on the fly")
    p.add_argument("--noise", default=None, help="folder of noise files for --clean (default: built-in)")
    p.add_argument("--batch_size", type=int, default=None, help="default 6 (CPU recipe: 4)")
    p.add_argument(
        "--seconds", type=float, default=None, help="crop length in seconds (default 2; CPU recipe 1)"
    )
    p.add_argument(
        "--snr",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="SNR range in dB of the mixes (generated: 0 20, --clean and --data --remix: -5 15)",
    )
    p.add_argument("--lr", type=float, default=None, help="default 5e-4 (CPU recipe: 3e-3)")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: min(50, steps // 10))")
    p.add_argument(
        "--loss", default=None, metavar="TERM=W,...", help="loss weights, e.g. mag=0.9,stft=0.5 (losses.py)"
    )
    p.add_argument(
        "--noisy_phase",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the noisy phase (phase head frozen; default: the recipe's, CPU recipe on)",
    )
    p.add_argument("--eval_every", type=int, default=None, help="validate every N steps (0: at the end)")
    p.add_argument("--val_files", type=int, default=None, help="held-out files validated (default 8)")
    add_loop_args(p, steps=None, log_every=10, save_every=200, amp=None, ema=None)
    return p


def layer_recompute(args: argparse.Namespace, recipe: Recipe) -> bool | None:
    """--checkpointing/--no-checkpointing, else the recipe's choice on CPU (None: the preset's)."""
    if args.checkpointing is not None:
        return args.checkpointing
    if recipe.cpu_checkpoint is not None and resolve_device(args.device).type == "cpu":
        return recipe.cpu_checkpoint
    return None


def resolve_recipe(args: argparse.Namespace) -> Recipe:
    """Fill the flags left unset from the recipe that fits this machine (auto) or the chosen preset."""
    if args.config == "auto":
        on_gpu = resolve_device(args.device).type == "cuda"
        args.config = "default" if on_gpu else "cpu"
        if not on_gpu and dist_info().rank == 0:
            print(
                "mbsnet-train: no GPU, so the CPU recipe (--config cpu); `--config default` trains the "
                "2.6M-parameter model",
                file=sys.stderr,
            )
    recipe = recipe_for(args.config)
    keys = (
        "batch_size",
        "seconds",
        "lr",
        "steps",
        "amp",
        "threads",
        "noisy_phase",
        "eval_every",
        "val_files",
        "ema",
    )
    fill_from_recipe(args, recipe, keys)
    return recipe


def loss_weights(spec: str | None, base: LossWeights) -> LossWeights:
    """'mag=0.9,stft=0.5' over the recipe's weights; ValueError naming a bad term."""
    if not spec:
        return base
    known = {f.name for f in fields(LossWeights)}
    out = {}
    for item in spec.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in known:
            raise ValueError(f"--loss: unknown term {key!r}; terms are {', '.join(sorted(known))}")
        try:
            out[key] = float(val)
        except ValueError:
            raise ValueError(f"--loss: {item!r} needs a number, e.g. {key}=0.5") from None
    return replace(base, **out)


def _split_heldout(n: int, count: int) -> tuple[list[int], list[int]]:
    """A fixed (seed-independent) choice of `count` of n files (at most a quarter) held out for
    validation; (train, val)."""
    count = min(count, n // 4)
    perm = np.random.default_rng(VAL_SEED).permutation(n)
    return sorted(int(i) for i in perm[count:]), sorted(int(i) for i in perm[:count])


def build_data(args: argparse.Namespace, crop: int):
    """(get_arrays(rng) -> (noisy, clean), validation items [(name, noisy, clean)], description)."""
    n_val = max(0, args.val_files)
    if args.data and args.clean:
        raise ValueError("--data and --clean both given; pass pairs (--data) or clean speech (--clean)")
    if args.data:
        try:
            pairs = find_pairs(args.data, split="train")
        except FileNotFoundError:
            pairs = find_pairs(args.data)
        train_idx, val_idx = _split_heldout(len(pairs), n_val)
        val = [(pairs.names[i], *pairs.load(i)[::-1]) for i in val_idx]
        train = PairFolder(
            pairs.root, [pairs.clean[i] for i in train_idx], [pairs.noisy[i] for i in train_idx]
        )
        desc = f"{len(train)} pairs from {args.data} (+{len(val)} held out for validation)"
        if not args.remix:
            return (lambda rng: folder_batch(train, args.batch_size, crop, rng)), val, desc
        remix = PairRemix(train, tuple(args.snr) if args.snr else MIX_SNR)
        desc += f", remixed: speech x noise of other pairs at {remix.snr[0]:g}..{remix.snr[1]:g} dB"
        return (lambda rng: mix_batch(remix, args.batch_size, crop, rng)[:2]), val, desc
    if args.clean:
        files = audio_files(args.clean, "--clean")
        noise = audio_files(args.noise, "--noise") if args.noise else None
        snr = tuple(args.snr) if args.snr else MIX_SNR
        train_idx, val_idx = _split_heldout(len(files), n_val)
        src = MixSource([files[i] for i in train_idx], noise, snr)
        val = []
        if val_idx:  # fixed validation mixes of the held-out utterances: same noise and SNR every time
            rng = pair_rng(VAL_SEED, 0, 0, HELDOUT_STREAM)
            for i in val_idx:
                n = len(read_wav(files[i]))
                noisy, cl, _ = mix_batch(MixSource([files[i]], noise, snr), 1, n, rng)
                val.append((files[i].name, noisy[0], cl[0]))
        kinds = f"{len(noise)} noise files" if noise else "built-in noises"
        desc = f"{len(src.clean)} clean files from {args.clean} + {kinds} at {snr[0]:g}..{snr[1]:g} dB"
        return (lambda rng: mix_batch(src, args.batch_size, crop, rng)[:2]), val, desc
    snr = tuple(args.snr) if args.snr else (0.0, 20.0)
    if snr[0] > snr[1]:
        raise ValueError(f"--snr MIN MAX needs MIN <= MAX, got {snr[0]:g} > {snr[1]:g}; swap them")
    val = heldout_pairs(n_val, seconds=3.0, seed=VAL_SEED)
    return (lambda rng: synth_batch(args.batch_size, crop, rng, snr_range=snr)), val, "generated pairs"


def main(argv: list[str] | None = None) -> dict:
    """Train from the command line (argv None -> sys.argv[1:]); returns the last metrics."""
    from memfit.training import Trainer, loop_config_from_args

    args = build_parser().parse_args(argv)
    recipe = resolve_recipe(args)
    check_numbers(args, lr=">0", weight_decay=">=0", warmup=">=0", batch_size=">=1", seconds=">0")
    overrides = {}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.channels is not None:
        overrides["channels"] = args.channels
    if args.bidirectional:
        overrides["temporal_bidirectional"] = True
    recompute = layer_recompute(args, recipe)
    if recompute is not None:
        overrides["checkpoint"] = recompute
    if args.batch_size < 1 or args.seconds * SAMPLE_RATE < 400:
        raise SystemExit("error: --batch_size must be >= 1 and --seconds >= 0.025 (one STFT window)")
    crop = int(args.seconds * SAMPLE_RATE)
    loop = loop_config_from_args(args, system=SYSTEM_NAME)
    try:
        cfg = get_config(args.config, **overrides)
        weights = loss_weights(args.loss, recipe.loss)
        arrays, val_items, source = build_data(args, crop)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)  # one line, no traceback, exit status 2 (bad input)
        raise SystemExit(2) from None
    torch.manual_seed(loop.seed)
    model = MBSNet(cfg)
    if args.noisy_phase:
        freeze_phase_head(model)
    rank = dist_info().rank
    if rank == 0:
        print(
            f"mbsnet-train: {args.config} config, {count_params(model) / 1e6:.3f}M params, "
            f"batch {args.batch_size} x {args.seconds:g} s, lr {args.lr:g}, data: {source}, "
            f"layer recompute {'on' if cfg.checkpoint else 'off'}, {torch.get_num_threads()} threads"
            + (f", budget {args.max_minutes:g} min" if args.max_minutes else ""),
            file=sys.stderr,
        )

    def get_batch(step: int, micro: int):
        noisy, clean = arrays(pair_rng(loop.seed, step, micro * 1000 + rank))
        dev = trainer.device
        return torch.from_numpy(np.ascontiguousarray(noisy)).to(dev), torch.from_numpy(clean).to(dev)

    warmup = args.warmup if args.warmup is not None else min(50, loop.steps // 10)
    device_model = model.to(resolve_device(loop.device))
    opt = torch.optim.AdamW(
        [q for q in device_model.parameters() if q.requires_grad],
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(0.8, 0.99),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine_lambda(loop.steps, warmup, max_minutes=args.max_minutes)
    )
    eval_kw = validation_hooks(val_items, args.eval_every)
    trainer = Trainer(
        device_model,
        opt,
        functools.partial(enhancement_loss, weights=weights),
        get_batch,
        loop,
        scheduler=sched,
        config=cfg,
        meta={"preset": args.config},
        items_per_step=args.batch_size * crop * loop.grad_accum,
        system=SYSTEM_NAME,
        **eval_kw,
    )
    return trainer.fit()


def freeze_phase_head(model: MBSNet) -> None:
    """Phase head outputs (a, b) = (1, 0) whatever the input, and stays so: the phase offset atan2(b, a)
    is exactly 0 and the model keeps the noisy phase (a magnitude mask, as RNNoise or Wiener filters)."""
    for head in model.phase_head.heads:
        last = head[-1] if isinstance(head, torch.nn.Sequential) else head
        with torch.no_grad():
            last.weight.zero_()
            last.bias.view(-1, 2).copy_(torch.tensor([1.0, 0.0]))
    for q in model.phase_head.parameters():
        q.requires_grad_(False)


def validation_hooks(items, every: int) -> dict:
    """Trainer keyword arguments that validate on `items` (PESQ-wb, STOI, SI-SDR) every `every` steps
    (0: at the end) and keep the best checkpoint (best.pt) by PESQ."""
    if not items:
        return {}
    from mbsnet_speech.eval import score_model

    if dist_info().rank == 0:
        ref = score_model(None, items)
        print(
            f"mbsnet-train: validation on {len(items)} held-out files; the noisy input scores "
            f"PESQ-wb {ref['pesq']:.3f}, STOI {ref['stoi']:.3f}, SI-SDR {ref['si_sdr']:.2f} dB",
            file=sys.stderr,
        )
    return dict(
        eval_fn=lambda model: score_model(model, items), eval_every=every, best_metric="pesq", best_mode="max"
    )


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet-train", main))
