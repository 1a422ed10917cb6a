"""Train MBS-Net: `uv run memfit train mbsnet-speech [--config auto|cpu|default|seed|tiny] [--data ROOT]`.

Without --data it trains on the embedded generator of speech-like noisy/clean pairs (offline).
Losses (losses.py) as MP-SENet: compressed magnitude MSE, compressed complex MSE, anti-wrapping phase
losses (instantaneous phase, group delay, instantaneous frequency), waveform L1 and optionally a
multi-resolution STFT loss; each term is logged to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace

import numpy as np
import torch
from memfit.distributed import dist_info
from memfit.errors import UsageError
from memfit.loop import Trainer, WarmupCosine
from memfit.memory import AMP_DTYPES, TrainStep
from memfit.settings import TrainParser, TrainRun

from mbsnet_speech.config import SETTINGS, LossWeights, TrainConfig
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


def parse_loss(spec: str) -> dict[str, float]:
    """--loss 'mag=0.9,stft=0.5' -> {"mag": 0.9, "stft": 0.5} (the terms of LossWeights)."""
    known = set(LossWeights.__dataclass_fields__)
    out = {}
    for item in spec.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in known:
            raise argparse.ArgumentTypeError(f"unknown term {key!r}; terms are {', '.join(sorted(known))}")
        try:
            out[key] = float(val)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} needs a number, e.g. {key}=0.5") from None
    return out


def build_parser() -> TrainParser:
    Bool = argparse.BooleanOptionalAction
    p = TrainParser(SYSTEM_NAME, __doc__, SETTINGS, auto=("default", "cpu"))
    m = p.group("model")
    p.flag(m, "--checkpointing", path="model.checkpoint", action=Bool,
           help="recompute each encoder layer in backward (a GPU memory saving; slower on a CPU)")
    p.flag(m, "--layers", path="model.num_layers", type=int, help="encoder layers")
    p.flag(m, "--channels", path="model.channels", type=int, help="channel width")
    p.flag(m, "--bidirectional", path="model.temporal_bidirectional", action=Bool,
           help="bidirectional temporal Mamba (offline; not streamable)")
    d = p.group("data")
    p.flag(d, "--data", path="train.data",
           help="VoiceBank+DEMAND-style root (clean_*/ noisy_*/); none: generated")
    p.flag(d, "--remix", path="train.remix", action=Bool,
           help="with --data: every step mix one pair's clean speech with another pair's noise (noisy - "
           "clean) at a random SNR (--snr) and gain; --no-remix trains on the fixed pairs")
    p.flag(d, "--clean", path="train.clean", help="folder of clean speech to mix noise into on the fly")
    p.flag(d, "--noise", path="train.noise", help="folder of noise files for --clean (none: built-in noises)")
    p.flag(d, "--snr", path="train.snr", type=float, nargs=2, metavar=("MIN", "MAX"),
           help="SNR range in dB of the mixes (none: 0 20 generated, -5 15 for --clean and --data --remix)")
    p.flag(d, "--batch_size", path="train.batch_size", type=int, help="crops per step")
    p.flag(d, "--seconds", path="train.seconds", type=float, help="crop length in seconds")
    o = p.group("optimizer and validation")
    p.flag(o, "--lr", path="train.lr", type=float, help="peak learning rate")
    p.flag(o, "--weight_decay", path="train.weight_decay", type=float, help="AdamW weight decay")
    p.flag(o, "--warmup", path="train.warmup", type=int, help="warmup steps (none: min(50, steps // 10))")
    p.flag(o, "--loss", path="train.loss", type=parse_loss, expand=True, metavar="TERM=W,...",
           show_default=False, help="loss weights over the preset's, e.g. mag=0.9,stft=0.5 (losses.py)")
    p.flag(o, "--noisy_phase", path="train.noisy_phase", action=Bool,
           help="keep the noisy phase (phase head frozen)")
    p.flag(o, "--eval_every", path="train.eval_every", type=int,
           help="validate every N steps (0: at the end)")
    p.flag(o, "--val_files", path="train.val_files", type=int, help="held-out files validated")
    return p


def _split_heldout(n: int, count: int) -> tuple[list[int], list[int]]:
    """A fixed (seed-independent) choice of `count` of n files (at most a quarter) held out for
    validation; (train, val)."""
    count = min(count, n // 4)
    perm = np.random.default_rng(VAL_SEED).permutation(n)
    return sorted(int(i) for i in perm[count:]), sorted(int(i) for i in perm[:count])


def build_data(t: TrainConfig, crop: int):
    """(get_arrays(rng) -> (noisy, clean), validation items [(name, noisy, clean)], description)."""
    n_val = max(0, t.val_files)
    if t.data:
        try:
            pairs = find_pairs(t.data, split="train")
        except FileNotFoundError:
            pairs = find_pairs(t.data)
        train_idx, val_idx = _split_heldout(len(pairs), n_val)
        val = [(pairs.names[i], *pairs.load(i)[::-1]) for i in val_idx]
        train = PairFolder(
            pairs.root, [pairs.clean[i] for i in train_idx], [pairs.noisy[i] for i in train_idx]
        )
        desc = f"{len(train)} pairs from {t.data} (+{len(val)} held out for validation)"
        if not t.remix:
            return (lambda rng: folder_batch(train, t.batch_size, crop, rng)), val, desc
        remix = PairRemix(train, tuple(t.snr) if t.snr else MIX_SNR)
        desc += f", remixed: speech x noise of other pairs at {remix.snr[0]:g}..{remix.snr[1]:g} dB"
        return (lambda rng: mix_batch(remix, t.batch_size, crop, rng)[:2]), val, desc
    if t.clean:
        files = audio_files(t.clean, "--clean")
        noise = audio_files(t.noise, "--noise") if t.noise else None
        snr = tuple(t.snr) if t.snr else MIX_SNR
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
        desc = f"{len(src.clean)} clean files from {t.clean} + {kinds} at {snr[0]:g}..{snr[1]:g} dB"
        return (lambda rng: mix_batch(src, t.batch_size, crop, rng)[:2]), val, desc
    snr = tuple(t.snr) if t.snr else (0.0, 20.0)
    val = heldout_pairs(n_val, seconds=3.0, seed=VAL_SEED)
    return (lambda rng: synth_batch(t.batch_size, crop, rng, snr_range=snr)), val, "generated pairs"


def main(argv: list[str] | None = None) -> dict:
    """Train from the command line (argv None -> sys.argv[1:]); returns the last metrics."""
    run: TrainRun = build_parser().parse(argv)
    cfg, t, loop = run.settings.model, run.settings.train, run.settings.loop
    crop = int(t.seconds * SAMPLE_RATE)
    try:
        arrays, val_items, source = build_data(t, crop)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None
    torch.manual_seed(loop.seed)
    model = MBSNet(cfg)
    if t.noisy_phase:
        freeze_phase_head(model)
    rank = dist_info().rank
    if rank == 0:
        print(
            f"mbsnet-train: {run.preset} config, {count_params(model) / 1e6:.3f}M params, "
            f"batch {t.batch_size} x {t.seconds:g} s, lr {t.lr:g}, data: {source}, "
            f"layer recompute {'on' if cfg.checkpoint else 'off'}, threads {torch.get_num_threads()}"
            + (f", budget {loop.max_minutes:g} min" if loop.max_minutes else ""),
            file=sys.stderr,
        )

    def get_batch(step: int, micro: int):
        noisy, clean = arrays(pair_rng(loop.seed, step, micro * 1000 + rank))
        dev = trainer.device
        return torch.from_numpy(np.ascontiguousarray(noisy)).to(dev), torch.from_numpy(clean).to(dev)

    warmup = t.warmup if t.warmup is not None else min(50, (loop.steps or 500) // 10)
    device_model = model.to(run.device)
    opt = torch.optim.AdamW(
        [q for q in device_model.parameters() if q.requires_grad],
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=(0.8, 0.99),
    )
    loss_fn = functools.partial(enhancement_loss, weights=t.loss)

    def memory_step(batch: int, checkpointing: bool) -> TrainStep:  # the pre-flight's step: this run's
        return TrainStep(
            build_model=lambda: MBSNet(replace(cfg, checkpoint=checkpointing)),
            make_batch=lambda d: (torch.zeros(batch, crop, device=d), torch.zeros(batch, crop, device=d)),
            loss=lambda model, b: loss_fn(model, b)[0],
            optimizer=lambda params: torch.optim.AdamW(params, lr=t.lr, betas=(0.8, 0.99)),
            amp_dtype=AMP_DTYPES[loop.amp],
        )

    trainer = Trainer(
        device_model,
        opt,
        loss_fn,
        get_batch,
        loop,
        lr_schedule=WarmupCosine(warmup),
        config=cfg,
        meta={"preset": run.preset},
        items_per_step=t.batch_size * crop * loop.grad_accum,
        system=SYSTEM_NAME,
        settings=run.settings,
        preset=run.preset,
        resume=run.resume,
        overwrite=run.overwrite,
        memory_step=memory_step,
        batch_size=t.batch_size,
        **validation_hooks(val_items, t.eval_every),
    )
    say_noisy_scores(val_items)  # after the pre-flight and the run-folder checks: no work wasted on a refusal
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

    return dict(
        eval_fn=lambda model: score_model(model, items), eval_every=every, best_metric="pesq", best_mode="max"
    )


def say_noisy_scores(items) -> None:
    """What the validation files score unprocessed: the line the run's validation is read against."""
    from mbsnet_speech.eval import score_model

    if items and dist_info().rank == 0:
        ref = score_model(None, items)
        print(
            f"mbsnet-train: validation on {len(items)} held-out files; the noisy input scores "
            f"PESQ-wb {ref['pesq']:.3f}, STOI {ref['stoi']:.3f}, SI-SDR {ref['si_sdr']:.2f} dB",
            file=sys.stderr,
        )


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet-train", main))
