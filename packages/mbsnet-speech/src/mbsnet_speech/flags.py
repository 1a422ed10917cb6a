"""The flags of `eval` and `enhance`, read before their work is imported (memfit.system.parse_then_run).

This module imports neither torch nor numpy, so `--help`, an unknown flag and a number out of range answer
in a fraction of a second instead of after torch's import (tests/test_cli_speed.py). What needs the files
or the model (an input that does not exist, a --shifts the model refuses) is checked by the commands' own
``run`` (eval.run, enhance.run).
"""

from __future__ import annotations

import argparse

from memfit.errors import UsageError
from memfit.train.flags import (
    BooleanFlag,
    Parser,
    add_eval_args,
    add_threads_arg,
    check_numbers,
    summary_of,
)

from mbsnet_speech.config import HELDOUT_SNR, MIN_SAMPLES, SAMPLE_RATE, TrainConfig, parse_names


def add_pcs_arg(p: argparse.ArgumentParser) -> None:
    """--pcs / --no_pcs, --keep_noisy and --shifts for eval and enhance: None keeps the run's config."""
    p.add_argument(
        "--pcs",
        action=BooleanFlag,
        default=None,
        help="perceptual contrast stretching of the output (default: the run's config; CPU recipe: on)",
    )
    p.add_argument(
        "--keep_noisy",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of the noisy input mixed back into the output, 0..1 (default: the run's config)",
    )
    p.add_argument(
        "--shifts",
        type=int,
        default=None,
        metavar="N",
        help="average N passes over the input delayed by hop/N steps, N times the compute (default: the "
        "run's config; the generalising recipe: 4)",
    )


def eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`eval`'s flags (argv None -> sys.argv[1:]), their numbers checked; eval.run does the work."""
    p = Parser(description=summary_of("mbsnet_speech.eval"))
    p.add_argument("--data", default=None, help="clean_*/noisy_* root (its test split when it has one)")
    p.add_argument("--clean", default=None, help="folder of clean speech: held-out voices mixed with noise")
    p.add_argument(
        "--noise", default=None, help="noise files for --clean and --speech (none: built-in noises)"
    )
    p.add_argument(
        "--voices",
        type=parse_names,
        default=None,
        metavar="A,B,...",
        help="voices of --clean to score (default: the run's test voices, else its validation ones)",
    )
    p.add_argument(
        "--noises",
        type=parse_names,
        default=None,
        metavar="A,B,...",
        help="noise recordings of --noise to use (default: the run's test noises, else validation)",
    )
    p.add_argument(
        "--speech", default=None, help="a clean recording (or folder) mixed with the held-out noises"
    )
    p.add_argument(
        "--mixes", type=int, default=24, help="mixes of held-out voices (and of --speech) to score"
    )
    p.add_argument(
        "--snr",
        type=float,
        nargs=2,
        default=HELDOUT_SNR,
        metavar=("MIN", "MAX"),
        help="SNR range in dB of those mixes (default 0 10)",
    )
    p.add_argument("--pairs", type=int, default=16, help="generated pairs to evaluate")
    p.add_argument("--seconds", type=float, default=3.0, help="length of generated pairs")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many files from --data")
    add_pcs_arg(p)
    add_eval_args(p, "mbsnet-speech", shipped=True)
    args = p.parse_args(argv)
    check_numbers(args, pairs="[1, 2**20]", seconds="(0, 3600]", limit="[1, 2**31-1]", mixes="[1, 2**20]",
                  keep_noisy="[0, 1]")  # fmt: skip
    check_numbers(args, snr=TrainConfig.RANGES["snr"])  # the mixer's range, as train's --snr
    if args.seconds * SAMPLE_RATE < MIN_SAMPLES:
        raise UsageError(f"error: --seconds {args.seconds:g} is shorter than one STFT frame; give >= 0.025")
    if args.snr[0] > args.snr[1]:
        raise UsageError(f"error: --snr needs MIN <= MAX, got {args.snr[0]:g} {args.snr[1]:g}; swap them")
    return args


def enhance_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`enhance`'s flags (argv None -> sys.argv[1:]), their numbers checked; enhance.run does the work."""
    p = Parser(prog="memfit run mbsnet-speech enhance", description=summary_of("mbsnet_speech.enhance"))
    p.add_argument("input", help="an audio file (.wav/.flac) or a folder of them")
    p.add_argument("--out", required=True, help="output folder (same file names, 16 kHz mono wav)")
    p.add_argument(
        "--run",
        default=None,
        help="run name, run folder, .pt file or exported folder (default: the model shipped in the package, "
        "also `--run shipped`)",
    )
    p.add_argument("--runs_dir", default="runs", help="where train wrote its runs (default %(default)s)")
    p.add_argument("--chunk_seconds", type=float, default=4.0)
    p.add_argument("--overlap_seconds", type=float, default=0.5)
    p.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    add_pcs_arg(p)
    p.add_argument("--device", default="auto")
    add_threads_arg(p)
    args = p.parse_args(argv)
    check_numbers(args, chunk_seconds="(0, 3600]", overlap_seconds="[0, 3600]", keep_noisy="[0, 1]")
    chunk, overlap = chunk_samples(args)
    if chunk < MIN_SAMPLES or overlap >= chunk:
        raise UsageError("error: --chunk_seconds must be >= 0.025 and longer than --overlap_seconds")
    return args


def chunk_samples(args: argparse.Namespace) -> tuple[int, int]:
    """(chunk, overlap) in samples of enhance's --chunk_seconds and --overlap_seconds."""
    return int(args.chunk_seconds * SAMPLE_RATE), int(args.overlap_seconds * SAMPLE_RATE)
