"""Train MBS-Net: `memfit train mbsnet-speech [--config auto|cpu|default|general|seed|tiny] [--data ROOT]`.

Without --data it trains on the embedded generator of speech-like noisy/clean pairs (offline).
Losses (losses.py) as MP-SENet: compressed magnitude MSE, compressed complex MSE, anti-wrapping phase
losses (instantaneous phase, group delay, instantaneous frequency), waveform L1 and optionally a
multi-resolution STFT loss; each term is logged to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from memfit.errors import UsageError
from memfit.train.settings import TrainParser, TrainRun

from mbsnet_speech.checks import (
    check_flags_together,
    check_scores,
    check_speech,
    check_validation,
    note_files,
)
from mbsnet_speech.config import SAMPLE_RATE, SETTINGS, Augment, LossWeights, TrainConfig, parse_names

if TYPE_CHECKING:  # torch, the data and the model load when training starts: `--help` stays fast
    from mbsnet_speech.data import PairFolder
    from mbsnet_speech.model import MBSNet

SYSTEM_NAME = "mbsnet-speech"


def parse_terms(cls, spec: str) -> dict[str, float]:
    """'mag=0.9,stft=0.5' -> {"mag": 0.9, "stft": 0.5} for the fields of a dataclass of floats."""
    known = set(cls.__dataclass_fields__)
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


def parse_loss(spec: str) -> dict[str, float]:
    """--loss 'mag=0.9,stft=0.5' -> {"mag": 0.9, "stft": 0.5} (the terms of LossWeights)."""
    return parse_terms(LossWeights, spec)


def parse_augment(spec: str) -> dict[str, float]:
    """--augment 'speed=0.5,reverb=0.3' -> probabilities of the augmentations (augment.Augment)."""
    return parse_terms(Augment, spec)


def build_parser() -> TrainParser:
    p = TrainParser(SYSTEM_NAME, __doc__, SETTINGS, auto=("default", "cpu"))
    m = p.group("model")
    p.flag(
        m,
        "--checkpointing",
        path="model.checkpoint",
        help="recompute each encoder layer in backward (a GPU memory saving; slower on a CPU)",
    )
    p.flag(m, "--layers", path="model.num_layers", help="encoder layers")
    p.flag(m, "--channels", path="model.channels", help="channel width")
    p.flag(m, "--hop", path="model.hop", help="STFT hop in samples (16 kHz; window 400)")
    p.flag(
        m,
        "--bidirectional",
        path="model.temporal_bidirectional",
        help="bidirectional temporal Mamba (offline; not streamable)",
    )
    p.flag(
        m,
        "--pcs",
        path="model.pcs",
        help="perceptual contrast stretching of the output at inference: validation, best.pt, eval, enhance",
    )
    p.flag(
        m,
        "--shifts",
        path="model.shifts",
        help="at inference (validation, best.pt, eval, enhance), average N passes over the input delayed by "
        "hop/N steps: N times the compute",
    )
    d = p.group("data")
    p.flag(
        d,
        "--data",
        path="train.data",
        file=True,
        help="VoiceBank+DEMAND-style root (clean_*/ noisy_*/); none: generated",
    )
    p.flag(
        d,
        "--remix",
        path="train.remix",
        help="with --data: every step mix one pair's clean speech with another pair's noise (noisy - "
        "clean) at a random SNR (--snr) and gain; --no_remix trains on the fixed pairs",
    )
    p.flag(
        d,
        "--clean",
        path="train.clean",
        file=True,
        help="folder of clean speech to mix noise into on the fly",
    )
    p.flag(
        d,
        "--noise",
        path="train.noise",
        file=True,
        help="folder of noise files for --clean (none: built-in noises)",
    )
    p.flag(
        d,
        "--snr",
        path="train.snr",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="SNR range in dB of the mixes (none: 0 20 generated, -5 15 for --clean and --data --remix)",
    )
    p.flag(
        d,
        "--data_share",
        path="train.data_share",
        help="with --data and --clean: the share of mixes drawn from --data's pairs",
    )
    p.flag(
        d,
        "--builtin_noise",
        path="train.builtin_noise",
        help="with --noise: the share of mixes with a built-in noise (white, pink, brown, babble, hum)",
    )
    p.flag(
        d,
        "--augment",
        path="train.augment",
        type=parse_augment,
        expand=True,
        metavar="NAME=P,...",
        show_default=False,
        help="augmentation probabilities of --clean mixes over the preset's: speed, eq, reverb, gain, "
        "clip, bandlimit (augment.py), e.g. reverb=0.3,eq=0.5",
    )
    held_out = {
        "val_voices": "voices of --clean held out to choose best.pt (a voice is a sub-folder, or a file name "
        "without its _NNN; one word of it is enough); when none is present, 3 are chosen (at most a quarter)",
        "val_noises": "noise recordings of --noise held out for validation, named as voices are",
        "test_voices": "voices neither trained on nor validated on, kept for eval",
        "test_noises": "noise recordings neither trained on nor validated on, kept for eval",
    }
    for name, text in held_out.items():
        p.flag(d, f"--{name}", path=f"train.{name}", type=parse_names, metavar="A,B,...", help=text)
    p.flag(d, "--batch_size", path="train.batch_size", help="crops per step")
    p.flag(d, "--seconds", path="train.seconds", help="crop length in seconds")
    o = p.group("optimizer and validation")
    p.optimizer_flags(o, warmup="warmup steps (at most a tenth of --steps)")
    p.flag(
        o,
        "--loss",
        path="train.loss",
        type=parse_loss,
        expand=True,
        metavar="TERM=W,...",
        show_default=False,
        help="loss weights over the preset's, e.g. mag=0.9,stft=0.5 (losses.py)",
    )
    p.flag(o, "--noisy_phase", path="train.noisy_phase", help="keep the noisy phase (phase head frozen)")
    p.flag(o, "--eval_every", path="train.eval_every", help="validate every N steps (0: at the end)")
    p.flag(o, "--val_files", path="train.val_files", help="held-out files validated")
    return p


SPEECH_SAMPLE = 64  # clean files of a --data corpus checked for speech before step 1


def _split_heldout(n: int, count: int) -> tuple[list[int], list[int]]:
    """A fixed (seed-independent) choice of `count` of n files (at most a quarter) held out for
    validation; (train, val)."""
    import numpy as np

    from mbsnet_speech.data import VAL_SEED

    count = min(count, n // 4)
    perm = np.random.default_rng(VAL_SEED).permutation(n)
    return sorted(int(i) for i in perm[count:]), sorted(int(i) for i in perm[:count])


def build_data(t: TrainConfig, crop: int):
    """(get_arrays(rng) -> (noisy, clean), validation items [(name, noisy, clean)], description)."""
    from mbsnet_speech.data import (
        MIX_SNR,
        VAL_SEED,
        PairRemix,
        folder_batch,
        heldout_pairs,
        mix_batch,
        synth_batch,
    )

    n_val = max(0, t.val_files)
    if t.clean:
        return _mix_data(t, crop)
    if t.data:
        pairs, val = _pairs_and_val(t.data, n_val)
        desc = f"{len(pairs)} pairs from {t.data} (+{len(val)} held out for validation)"
        if not t.remix:
            return (lambda rng: folder_batch(pairs, t.batch_size, crop, rng)), val, desc
        remix = PairRemix(pairs, tuple(t.snr) if t.snr else MIX_SNR)
        desc += f", remixed: speech x noise of other pairs at {remix.snr[0]:g}..{remix.snr[1]:g} dB"
        return (lambda rng: mix_batch(remix, t.batch_size, crop, rng)[:2]), val, desc
    snr = tuple(t.snr) if t.snr else (0.0, 20.0)
    val = heldout_pairs(n_val, seconds=3.0, seed=VAL_SEED)
    return (lambda rng: synth_batch(t.batch_size, crop, rng, snr_range=snr)), val, "generated pairs"


def _pairs_and_val(root: str, n_val: int) -> tuple[PairFolder, list]:
    """The training pairs of a clean_*/noisy_* root (its train split when it has one) less `n_val` files
    held out for validation, and those [(name, noisy, clean)]."""
    from mbsnet_speech.data import PairFolder, _load_cached, find_pairs

    try:
        pairs = find_pairs(root, split="train")
    except FileNotFoundError:
        pairs = find_pairs(root)
    train_idx, val_idx = _split_heldout(len(pairs), n_val)
    val = [(pairs.names[i], *pairs.load(i)[::-1]) for i in val_idx]
    train = PairFolder(pairs.root, [pairs.clean[i] for i in train_idx], [pairs.noisy[i] for i in train_idx])
    # speech in the clean files: all of a small set, an even spread of SPEECH_SAMPLE of a corpus (read now,
    # into the clip cache training reads from)
    step = max(1, len(train) // SPEECH_SAMPLE)
    checked = train.clean[::step]
    quiet = check_speech(checked, _load_cached, f"the clean files of --data {root}")
    note_files(f"{len(quiet)} of {len(checked)} clean files checked are silent or constant", quiet)
    return train, val


def _mix_data(t: TrainConfig, crop: int):
    """--clean (and --noise, and --data): whole voices and noise recordings held out for validation."""
    from mbsnet_speech.data import (
        MIX_SNR,
        VAL_SEED,
        MixSource,
        PairRemix,
        Sources,
        _load_cached,
        audio_files,
        heldout_mixes,
        load_all,
        mix_batch,
        split_groups,
    )

    snr = tuple(t.snr) if t.snr else MIX_SNR
    files = audio_files(t.clean, "--clean")
    train_c, val_c, _, val_g, test_g = split_groups(files, t.clean, t.val_voices, t.test_voices)
    held = f"voices held out: {', '.join(val_g)} (validation)" if val_g else ""
    if not val_g:  # too few voices to hold whole ones out: single utterances, as with --data
        train_idx, val_idx = _split_heldout(len(train_c), t.val_files)
        train_c, val_c = [train_c[i] for i in train_idx], [train_c[i] for i in val_idx]
        held = f"{len(val_c)} utterances held out (too few voices to hold whole ones out)"
    if test_g:
        held += f", {', '.join(test_g)} (test, never seen)"
    noise = val_n = None
    if t.noise:
        all_noise = audio_files(t.noise, "--noise")
        noise, val_n, _, nval_g, ntest_g = split_groups(all_noise, t.noise, t.val_noises, t.test_noises)
        val_n = val_n or noise  # too few recordings to hold whole ones out: validate on trained ones
        if nval_g:
            held += f"; noises held out: {', '.join(nval_g)} (validation)"
        if ntest_g:
            held += f", {', '.join(ntest_g)} (test, never seen)"
    load_all(files + (all_noise if t.noise else []))
    quiet = check_speech(train_c, _load_cached, f"the files of --clean {t.clean}")
    note_files(f"{len(quiet)} of {len(train_c)} --clean files hold no speech (silent or constant)", quiet)
    src = MixSource(train_c, noise, snr, builtin=t.builtin_noise if noise else 1.0)
    val = heldout_mixes(val_c, val_n, t.val_files, VAL_SEED)
    kinds = f"{len(noise)} noise files + built-ins ({t.builtin_noise:g})" if noise else "built-in noises"
    desc = f"{len(train_c)} clean files from {t.clean} + {kinds} at {snr[0]:g}..{snr[1]:g} dB"
    sources = src
    if t.data and t.data_share > 0:
        pairs, _ = _pairs_and_val(t.data, 0)
        sources = Sources([PairRemix(pairs, snr), src], [t.data_share, 1 - t.data_share])
        desc += f"; {t.data_share:g} of mixes from {len(pairs)} remixed pairs of {t.data}"
    on = [f"{k}={v:g}" for k, v in vars(t.augment).items() if v]
    desc += f"; augment {','.join(on) or 'none'}; {held}"
    return (lambda rng: mix_batch(sources, t.batch_size, crop, rng, t.augment)[:2]), val, desc


def main(argv: list[str] | None = None) -> dict:
    """Train from the command line (argv None -> sys.argv[1:]); returns the last metrics."""
    run: TrainRun = build_parser().parse(argv)
    import numpy as np
    import torch
    from memfit.step import AMP_DTYPES, TrainStep
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer, WarmupCosine

    from mbsnet_speech.data import pair_rng
    from mbsnet_speech.losses import enhancement_loss
    from mbsnet_speech.model import MBSNet, count_params

    cfg, t, loop = run.settings.model, run.settings.train, run.settings.loop
    check_flags_together(t, run.flags)
    crop = int(t.seconds * SAMPLE_RATE)
    try:
        arrays, val_items, source = build_data(t, crop)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None
    noisy = noisy_scores(val_items)
    if t.data or t.clean:  # a user's own data: validation that cannot be scored is refused before step 1
        unscored = check_validation(val_items)
        note_files(f"{len(unscored)} of {len(val_items)} validation files cannot be scored", unscored)
        if val_items:
            check_scores(noisy(), len(val_items))
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
        try:
            noisy, clean = arrays(pair_rng(loop.seed, step, micro * 1000 + rank))
        except ValueError as e:  # a file that passed the start-up checks but not a full read (NaN samples)
            raise UsageError(f"error: {e}; fix or remove it (the last checkpoint is intact)") from None
        return torch.from_numpy(np.ascontiguousarray(noisy)), torch.from_numpy(clean)

    opt = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],
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
        model,
        opt,
        loss_fn,
        get_batch,
        run,
        lr_schedule=WarmupCosine(t.warmup),
        config=cfg,
        meta={"preset": run.preset},
        items_per_step=t.batch_size * crop * loop.grad_accum,
        memory_step=memory_step,
        batch_size=t.batch_size,
        **validation_hooks(val_items, t.eval_every, noisy),
    )
    # after the pre-flight and the run-folder checks: no work wasted on a refusal
    say_noisy_scores(val_items, noisy)
    return trainer.fit()


def freeze_phase_head(model: MBSNet) -> None:
    """Phase head outputs (a, b) = (1, 0) whatever the input, and stays so: the phase offset atan2(b, a)
    is exactly 0 and the model keeps the noisy phase (a magnitude mask, as RNNoise or Wiener filters)."""
    import torch

    for head in model.phase_head.heads:
        last = head[-1] if isinstance(head, torch.nn.Sequential) else head
        with torch.no_grad():
            last.weight.zero_()
            last.bias.view(-1, 2).copy_(torch.tensor([1.0, 0.0]))
    for q in model.phase_head.parameters():
        q.requires_grad_(False)


# best.pt's rule: the highest PESQ-wb among validations that also lift STOI by this much over the noisy
# input and keep SI-SDR at or above it (a PESQ-trained model can buy PESQ with intelligibility or with
# the waveform)
STOI_FLOOR = 0.01


def choice_score(scores: dict, noisy: dict) -> float:
    """PESQ-wb where STOI gains >= STOI_FLOOR over the noisy input and SI-SDR is not below it; else -1 less
    how far the floors are missed (STOI in units of STOI_FLOOR, SI-SDR in dB). Any validation meeting the
    floors outranks any that does not (PESQ-wb >= 1), and of those that miss, the nearest miss wins. A
    score that is not a number gives NaN, which the Trainer never keeps."""
    if not all(math.isfinite(scores[k]) for k in ("pesq", "stoi", "si_sdr")):
        return math.nan
    miss = max(0.0, STOI_FLOOR - (scores["stoi"] - noisy["stoi"])) / STOI_FLOOR
    miss += max(0.0, noisy["si_sdr"] - scores["si_sdr"])
    return float(scores["pesq"]) if miss == 0 else -1.0 - float(miss)


def noisy_scores(items) -> Callable[[], dict]:
    """The validation files' scores unprocessed, computed once, when first asked for."""
    from mbsnet_speech.eval import score_model

    return functools.cache(lambda: score_model(None, items))


def validation_hooks(items, every: int, noisy: Callable[[], dict]) -> dict:
    """Trainer keyword arguments that validate on `items` (PESQ-wb, STOI, SI-SDR) every `every` steps
    (0: at the end) and keep the best checkpoint (best.pt) by `choice_score` against `noisy()`."""
    if not items:
        return {}
    from mbsnet_speech.eval import score_model

    def evaluate(model) -> dict:
        scores = score_model(model, items)
        return {**scores, "choice": choice_score(scores, noisy())}

    return dict(eval_fn=evaluate, eval_every=every, best_metric="choice", best_mode="max")


def say_noisy_scores(items, noisy: Callable[[], dict]) -> None:
    """What the validation files score unprocessed: the line the run's validation is read against."""
    from memfit.train.distributed import dist_info

    if items and dist_info().rank == 0:
        ref = noisy()
        print(
            f"mbsnet-train: validation on {len(items)} held-out files; the noisy input scores "
            f"PESQ-wb {ref['pesq']:.3f}, STOI {ref['stoi']:.3f}, SI-SDR {ref['si_sdr']:.2f} dB",
            file=sys.stderr,
        )


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("mbsnet-train", main))
