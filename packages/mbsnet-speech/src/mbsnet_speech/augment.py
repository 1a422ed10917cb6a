"""Augmentations of on-the-fly mixes: what a user's recordings differ in (voices, microphones, rooms,
levels, bandwidth), applied to the clean speech before it is mixed, so the training target is the speech
as the microphone heard it and the noisy input is exactly target + noise (same length, no shift).

Every function keeps the length of its input and the time alignment (zero-phase filters, causal room
responses whose direct path is at lag 0). `Augment` holds the probability of each; the CPU recipe keeps
the ones that were not below plain runs on held-out voices (docs/results.md).
"""

from __future__ import annotations

import numpy as np

from mbsnet_speech.config import SAMPLE_RATE, Augment  # noqa: F401 - Augment: its probabilities, a setting


def fit_length(x: np.ndarray, n: int) -> np.ndarray:
    """x cut or zero-padded at the end to n samples."""
    return x[:n] if len(x) >= n else np.pad(x, (0, n - len(x)))


def speed(x: np.ndarray, rng: np.random.Generator, lo: float = 0.9, hi: float = 1.1) -> np.ndarray:
    """Play x at a random speed (torchaudio.functional.speed: band-limited resampling); same length (cut or
    zero-padded). The factor is drawn as uniform(lo, hi) and rounded to 0.01: torchaudio resamples by the
    reduced ratio of the rates, and a factor like 0.9374 (14998:16000 -> 7499:8000) builds a kernel for
    seconds where 0.94 (47:50) takes a millisecond."""
    import torch
    import torchaudio.functional as AF

    factor = round(float(rng.uniform(lo, hi)), 2)
    y, _ = AF.speed(torch.from_numpy(np.ascontiguousarray(x, np.float32)), SAMPLE_RATE, factor)
    return fit_length(y.numpy(), len(x))


def _zero_phase(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """Filter x by a real gain per rfft bin of len(x): zero phase, so nothing shifts in time."""
    return np.fft.irfft(np.fft.rfft(x) * gain, len(x)).astype(np.float32)


def eq(x: np.ndarray, rng: np.random.Generator, sr: int = SAMPLE_RATE) -> np.ndarray:
    """A microphone's colour: tilt of -3..+3 dB per octave around 1 kHz plus two peaking bands of
    -8..+8 dB (centres 150 Hz..6 kHz, about an octave wide)."""
    f = np.maximum(np.fft.rfftfreq(len(x), 1 / sr), 20.0)
    octaves = np.log2(f / 1000.0)
    db = rng.uniform(-3, 3) * octaves
    for _ in range(2):
        centre = np.log2(rng.uniform(150, 6000) / 1000.0)
        db += rng.uniform(-8, 8) * np.exp(-0.5 * ((octaves - centre) / rng.uniform(0.3, 0.8)) ** 2)
    return _zero_phase(x, 10 ** (db / 20))


def room_response(rng: np.random.Generator, sr: int = SAMPLE_RATE) -> np.ndarray:
    """A synthetic room impulse response: the direct path (1 at lag 0), then noise decaying by 60 dB in
    RT60 (0.15..0.7 s), starting 2..10 ms later, at a direct-to-reverberant ratio of 0..12 dB."""
    rt60 = rng.uniform(0.15, 0.7)
    n = int(min(rt60, 0.5) * sr)
    t = np.arange(n) / sr
    tail = rng.standard_normal(n) * np.exp(-6.9 * t / rt60)
    tail[: int(rng.uniform(0.002, 0.01) * sr)] = 0.0
    drr_db = rng.uniform(0, 12)
    tail *= 10 ** (-drr_db / 20) / (np.sqrt(np.sum(tail**2)) + 1e-12)
    tail[0] = 1.0
    return tail.astype(np.float32)


def reverb(x: np.ndarray, rng: np.random.Generator, sr: int = SAMPLE_RATE) -> np.ndarray:
    """x in a random synthetic room (room_response), same length; the direct path keeps the timing."""
    from scipy.signal import fftconvolve  # here: scipy.signal costs 0.7 s of start-up to every importer

    return fftconvolve(x, room_response(rng, sr))[: len(x)].astype(np.float32)


def lowpass_gain(n: int, cutoff: float, sr: int = SAMPLE_RATE) -> np.ndarray:
    """rfft gains of a zero-phase low-pass for n samples: 1 below cutoff, a 400 Hz raised-cosine edge."""
    f = np.fft.rfftfreq(n, 1 / sr)
    edge = np.clip((f - cutoff) / 400.0, 0.0, 1.0)
    return (0.5 + 0.5 * np.cos(np.pi * edge)).astype(np.float32)


def bandlimit(
    x: np.ndarray, rng: np.random.Generator, sr: int = SAMPLE_RATE, cutoff: float | None = None
) -> np.ndarray:
    """x low-passed at a random 3.4..7 kHz (or `cutoff`), same length, zero phase."""
    c = rng.uniform(3400, 7000) if cutoff is None else cutoff
    return _zero_phase(x, lowpass_gain(len(x), c, sr))


def clip(noisy: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The mix clipped at 30..80% of its peak, as an overdriven recording."""
    level = rng.uniform(0.3, 0.8) * (np.max(np.abs(noisy)) + 1e-8)
    return np.clip(noisy, -level, level)
