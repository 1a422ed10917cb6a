"""Speech quality metrics: PESQ (ITU-T P.862 via the `pesq` package), STOI (`pystoi`), SI-SDR (torchmetrics).

Every function checks its inputs first and raises ValueError naming the problem (silent or too-short
reference, wrong sample rate, NaN audio); ``evaluate_pairs`` records such failures per file instead of
stopping a whole evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

PESQ_RATES = {"wb": (16000,), "nb": (8000, 16000)}  # P.862 narrow band runs at 8 or 16 kHz
MIN_SECONDS = 0.25  # P.862 needs at least 1/4 s of audio


def _as_float(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a mono 1-D signal, got shape {a.shape}; mix stereo down first")
    if a.dtype == np.int16:
        return a.astype(np.float64) / 32768.0
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf samples; check the model output or the file")
    return a


def check_pair(
    ref: Any, deg: Any, fs: int, min_seconds: float = MIN_SECONDS
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (reference, degraded) pair of 1-D signals at fs; returns float64 copies, same length."""
    r, d = _as_float(ref, "reference"), _as_float(deg, "degraded")
    if len(r) != len(d):
        raise ValueError(f"reference ({len(r)} samples) and degraded ({len(d)}) differ in length; align them")
    if len(r) < min_seconds * fs:
        raise ValueError(
            f"signal too short: {len(r)} samples = {len(r) / fs:.3f} s at {fs} Hz; "
            f"PESQ needs >= {min_seconds} s"
        )
    if np.max(np.abs(r)) < 1e-6:
        raise ValueError(
            "reference is silent (all samples ~0); PESQ/STOI/SI-SDR need speech in the reference"
        )
    return r, d


def pesq_score(ref: Any, deg: Any, fs: int = 16000, mode: str = "wb") -> float:
    """PESQ (MOS-LQO) of deg against ref, 1-D arrays at fs. int16 input is passed to P.862 unchanged."""
    from pesq import PesqError, pesq

    if mode not in PESQ_RATES:
        raise ValueError(f"PESQ mode must be 'wb' or 'nb', got {mode!r}")
    if fs not in PESQ_RATES[mode]:
        want = " or ".join(str(r) for r in PESQ_RATES[mode])
        raise ValueError(f"PESQ {mode} needs a sample rate of {want} Hz, got {fs}; resample first")
    check_pair(ref, deg, fs)
    r, d = np.asarray(ref), np.asarray(deg)
    if r.dtype != np.int16 or d.dtype != np.int16:
        r, d = r.astype(np.float32), d.astype(np.float32)
    try:
        return float(pesq(fs, r, d, mode))
    except PesqError as e:  # e.g. "No utterances detected": say what it means
        raise ValueError(f"PESQ failed ({type(e).__name__}: {e}); is there speech in the reference?") from e


def stoi_score(ref: Any, deg: Any, fs: int = 16000, extended: bool = False) -> float:
    """STOI (0..1) of deg against ref, 1-D arrays at fs."""
    from pystoi import stoi

    r, d = check_pair(ref, deg, fs)
    return float(stoi(r, d, fs, extended=extended))


def si_sdr_db(est: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Scale-invariant SDR in dB of each row (..., T) of est against ref (Le Roux et al. 2019): the
    estimate projected on the zero-mean reference, over the residual; torchmetrics' definition with
    zero_mean=True (its eps is the dtype's). The one definition: the score (si_sdr) and the training loss
    (losses.neg_si_sdr) both use it."""
    from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio

    return scale_invariant_signal_distortion_ratio(est, ref, zero_mean=True)


def si_sdr(ref: Any, est: Any) -> float:
    """SI-SDR in dB of est against ref (1-D arrays), in float64."""
    r, e = _as_float(ref, "reference"), _as_float(est, "estimate")
    if len(r) != len(e):
        raise ValueError(f"reference ({len(r)}) and estimate ({len(e)}) differ in length")
    if float(np.dot(r - r.mean(), r - r.mean())) < 1e-12:
        raise ValueError("reference is silent; SI-SDR is undefined")
    e64, r64 = (torch.from_numpy(np.asarray(x, np.float64)) for x in (e, r))
    return float(si_sdr_db(e64, r64))


def all_metrics(ref: Any, deg: Any, fs: int = 16000) -> dict[str, float]:
    """{'pesq_wb', 'pesq_nb', 'stoi', 'si_sdr'} of deg against ref at fs (16 kHz for wb)."""
    out = {}
    if fs in PESQ_RATES["wb"]:
        out["pesq_wb"] = pesq_score(ref, deg, fs, "wb")
    out["pesq_nb"] = pesq_score(ref, deg, fs, "nb")
    out["stoi"] = stoi_score(ref, deg, fs)
    out["si_sdr"] = si_sdr(ref, deg)
    return out


@dataclass
class PairResult:
    name: str
    noisy: dict[str, float] = field(default_factory=dict)
    enhanced: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def evaluate_pairs(
    items: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], fs: int = 16000
) -> list[PairResult]:
    """items: (name, clean, noisy, enhanced) 1-D arrays -> per-file results; a bad file gets .error set."""
    results = []
    for name, clean, noisy, enhanced in items:
        res = PairResult(name)
        try:
            res.noisy = all_metrics(clean, noisy, fs)
            res.enhanced = all_metrics(clean, enhanced, fs)
        except ValueError as e:
            res.noisy, res.enhanced, res.error = {}, {}, str(e)
        results.append(res)
    return results


def summarise(results: list[PairResult]) -> dict[str, float]:
    """Means over files that evaluated: noisy/<m>, enhanced/<m>, delta/<m>; plus n_ok, n_failed."""
    ok = [r for r in results if r.error is None]
    out: dict[str, float] = {"n_ok": len(ok), "n_failed": len(results) - len(ok)}
    if not ok:
        return out
    for key in ok[0].noisy:
        n = float(np.mean([r.noisy[key] for r in ok]))
        e = float(np.mean([r.enhanced[key] for r in ok]))
        out[f"noisy/{key}"], out[f"enhanced/{key}"], out[f"delta/{key}"] = n, e, e - n
    return out
