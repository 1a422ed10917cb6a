"""Checks of a user's own data and flags before step 1: what would otherwise train to nan scores in silence.

- flags that only mean something with another (``--noise`` without ``--clean`` was silently ignored);
- clean speech that is silent or constant (a mix of it is noise alone: nothing to learn, nothing to score);
- validation files that cannot be scored (shorter than PESQ's quarter second, a silent reference).

Each refusal is one line naming the files and the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from memfit.errors import UsageError, first_line

from mbsnet_speech.config import SAMPLE_RATE, TrainConfig

QUIET = 1e-4  # peak-to-peak at or below this (a few 16-bit steps): silent or constant, no speech
SHOWN = 3  # files named in a message


def _named(names: Sequence[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def note_files(what: str, names: Sequence[str]) -> None:
    """'mbsnet-train: <what>: a.wav, b.wav, c.wav and 2 more' on stderr (rank 0), when there are any."""
    from memfit.train.distributed import dist_info

    if names and dist_info().is_main:
        print(f"mbsnet-train: {what}: {_named(names)}", file=sys.stderr)


# the setting a flag sets, when it means nothing here, why
_TOGETHER: list[tuple[str, Callable[[TrainConfig], bool], str]] = [
    ("train.noise", lambda t: t.clean is None,
     "--noise is mixed into --clean speech; give --clean DIR too (--data pairs bring their own noise)"),
    ("train.builtin_noise", lambda t: t.noise is None,
     "--builtin_noise is the share of built-in noise beside --noise files; give --noise DIR too"),
    ("train.data_share", lambda t: not (t.data and t.clean),
     "--data_share splits the mixes between --data pairs and --clean mixes; give both"),
    ("train.augment", lambda t: t.clean is None, "--augment applies to --clean mixes; give --clean DIR too"),
    ("train.remix", lambda t: t.data is None or t.clean is not None,
     "--remix / --no_remix choose how --data pairs are used alone; give --data DIR without --clean"),
    ("train.snr", lambda t: bool(t.data) and not t.remix and t.clean is None,
     "--snr sets the SNR of mixes, but --no_remix trains on --data's fixed pairs; drop one of them"),
    ("train.val_voices", lambda t: t.clean is None,
     "--val_voices names voices of --clean; give --clean DIR too"),
    ("train.test_voices", lambda t: t.clean is None,
     "--test_voices names voices of --clean; give --clean DIR too"),
    ("train.val_noises", lambda t: t.noise is None,
     "--val_noises names recordings of --noise; give --noise DIR too"),
    ("train.test_noises", lambda t: t.noise is None,
     "--test_noises names recordings of --noise; give --noise DIR too"),
]  # fmt: skip


def check_flags_together(t: TrainConfig, flags: frozenset[str]) -> None:
    """A flag given on the command line (``flags``: the settings it set, ``TrainRun.flags``) that means
    nothing with the others: one line, never ignored."""
    for path, idle, why in _TOGETHER:
        if any(f == path or f.startswith(path + ".") for f in flags) and idle(t):
            raise UsageError(f"error: {why}")


def quiet(x: np.ndarray) -> bool:
    """Silent or constant: nothing to learn from, nothing PESQ, STOI or SI-SDR can score."""
    return x.size == 0 or float(np.max(x) - np.min(x)) <= QUIET


def check_speech(paths: Sequence[Path], load: Callable[[str], np.ndarray], what: str) -> list[str]:
    """The clean-speech files of `paths` that are silent or constant; all of them: UsageError naming them
    (a mix of silence is noise alone). Returns the quiet ones for a note."""
    bad = [str(p) for p in paths if quiet(load(str(p)))]
    if paths and len(bad) == len(paths):
        checked = f"all {len(paths)} checked are" if len(paths) > 1 else "the one file is"
        raise UsageError(
            f"error: {what} hold no speech: {checked} silent or constant ({_named(bad)}); give recordings "
            "of speech"
        )
    return bad


def check_validation(items: list[tuple[str, Any, Any]]) -> list[str]:
    """Validation [(name, noisy, clean)] that PESQ-wb, STOI and SI-SDR cannot score (too short, a silent or
    constant reference); when none can be: UsageError naming them and the fix. Returns the unscorable
    ones' names for a note (they are left out of the means)."""
    from mbsnet_speech.metrics import MIN_SECONDS, check_pair

    bad: list[tuple[str, str]] = []
    for name, noisy, clean in items:
        try:
            check_pair(clean, noisy, SAMPLE_RATE)
            if quiet(np.asarray(clean)):
                raise ValueError("reference is constant (no speech)")
        except ValueError as e:
            bad.append((name, first_line(e)))
    if items and len(bad) == len(items):
        raise UsageError(
            f"error: none of the {len(items)} validation files can be scored ({_named([n for n, _ in bad])}; "
            f"the first: {bad[0][1]}); give pairs of at least {MIN_SECONDS} s with speech, or --val_files 0 "
            "to train without validation (no best.pt)"
        )
    return [n for n, _ in bad]


def check_scores(scores: dict[str, float], count: int) -> None:
    """The noisy input's validation scores: NaN means no file could be scored (PESQ found no speech)."""
    nan = [k for k, v in scores.items() if not np.isfinite(v)]
    if nan:
        raise UsageError(
            f"error: the {count} validation files' noisy input scores nan ({', '.join(nan)}): no file could "
            "be scored (PESQ found no speech?); give validation pairs with speech, or --val_files 0"
        )
