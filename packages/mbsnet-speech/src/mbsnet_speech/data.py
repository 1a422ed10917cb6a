"""Noisy/clean speech pairs: VoiceBank+DEMAND-style wav folders, or an embedded generator (offline default).

Folder layout (``--data ROOT``)::

    ROOT/clean_<split>/<name>.wav    ROOT/noisy_<split>/<name>.wav    (same names in both)

e.g. VoiceBank+DEMAND's clean_trainset_28spk_wav / noisy_trainset_28spk_wav. Files at another sample
rate (VoiceBank ships 48 kHz) are resampled to 16 kHz and stereo is averaged to mono, with a note.

The generator makes speech-like signals without shipping any recording: syllables of a glottal-pulse
harmonic series with a moving f0, shaped by vowel formants, unvoiced fricative bursts and pauses, then
mixed with white, pink or babble (several other generated voices) noise at a chosen SNR. Every batch is
a function of (seed, step, micro, stream), so training resumes exactly and held-out pairs (another
stream) are never seen in training.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch

from mbsnet_speech import augment
from mbsnet_speech.config import (  # noqa: F401 - parse_names: data's name too
    HELDOUT_SNR,
    MIN_SAMPLES,
    SAMPLE_RATE,
    Augment,
    parse_names,
)

TRAIN_STREAM, HELDOUT_STREAM = 0, 1

# ----------------------------------------------------------------------------------------------------
# Reading wav files
# ----------------------------------------------------------------------------------------------------


def _note(msg: str) -> None:
    print(f"[mbsnet] {msg}", file=sys.stderr)


def read_wav(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Any wav/flac -> float32 mono (n,) at sample_rate; ValueError on unreadable or empty files."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"audio file {path} does not exist")
    try:
        audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"cannot read {path} as audio ({e}); is it a valid wav file?") from e
    if audio.shape[0] == 0:
        raise ValueError(f"{path} contains no samples")
    audio = audio.mean(axis=1)  # stereo (or more channels): average to mono
    if sr != sample_rate:
        import torchaudio.functional as AF

        audio = AF.resample(torch.from_numpy(audio), sr, sample_rate).numpy()
    if not np.all(np.isfinite(audio)):
        raise ValueError(f"{path} contains NaN or Inf samples")
    return np.ascontiguousarray(audio, dtype=np.float32)


def read_blocks(
    path: str | Path, seconds: float = 30.0, sample_rate: int = SAMPLE_RATE
) -> Iterator[np.ndarray]:
    """An audio file as consecutive float32 mono blocks at sample_rate, ~`seconds` each: what read_wav
    returns, without holding the file. Each block is resampled with 50 ms of its neighbours around it (cut
    off after), so block edges leave no mark. ValueError names the file on unreadable or non-finite audio."""
    path = Path(path)
    try:
        f = sf.SoundFile(str(path))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"cannot read {path} as audio ({e}); is it a valid wav file?") from e
    with f:
        sr, total = f.samplerate, f.frames
        block, ctx = max(1, int(seconds * sr)), int(0.05 * sr) if sr != sample_rate else 0
        for pos in range(0, total, block):
            start, stop = max(0, pos - ctx), min(total, pos + block + ctx)
            f.seek(start)
            x = f.read(stop - start, dtype="float32", always_2d=True).mean(axis=1)
            if not np.all(np.isfinite(x)):
                raise ValueError(f"{path} contains NaN or Inf samples")
            if sr != sample_rate:
                import torchaudio.functional as AF

                y = AF.resample(torch.from_numpy(np.ascontiguousarray(x)), sr, sample_rate).numpy()
                first = round(pos * sample_rate / sr)
                left = first - round(start * sample_rate / sr)
                count = round(min(pos + block, total) * sample_rate / sr) - first
                x = y[left : left + count]
            yield np.ascontiguousarray(x, dtype=np.float32)


def conversion_notes(info: Any) -> list[str]:
    """What read_wav will do to a file (soundfile info): resample to 16 kHz, average channels to mono."""
    notes = []
    if info.samplerate != SAMPLE_RATE:
        notes.append(f"{info.samplerate} Hz files are resampled to 16 kHz")
    if info.channels > 1:
        notes.append(f"{info.channels}-channel files are averaged to mono")
    return notes


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """float (n,) in [-1, 1] -> 16-bit PCM wav (clipped)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sf.write(
        str(path), np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0), sample_rate, subtype="PCM_16"
    )


# ----------------------------------------------------------------------------------------------------
# VoiceBank+DEMAND-style folders
# ----------------------------------------------------------------------------------------------------

AUDIO_EXTS = (".wav", ".flac")


@dataclass
class PairFolder:
    """Matched clean/noisy files under ROOT/clean_*/ and ROOT/noisy_*/ (checked on construction)."""

    root: Path
    clean: list[Path]
    noisy: list[Path]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.clean]

    def __len__(self) -> int:
        return len(self.clean)

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(clean, noisy) float32 (n,) at 16 kHz, trimmed to a common length."""
        c, n = _load_cached(str(self.clean[i])), _load_cached(str(self.noisy[i]))
        m = min(len(c), len(n))
        return c[:m], n[:m]


@functools.lru_cache(maxsize=4096)  # ~40 hours of 2-second clips at most
def _load_cached(path: str) -> np.ndarray:
    return read_wav(path)


def _audio_files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.suffix.lower() in AUDIO_EXTS and p.is_file()}


def find_pairs(root: str | Path, split: str | None = None) -> PairFolder:
    """Scan ROOT for clean_*/noisy_* folders (optionally only those whose suffix contains `split`)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--data {root} is not a folder; expected clean_*/ and noisy_*/ inside")
    cleans = sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("clean"))
    if split:
        cleans = [d for d in cleans if split in d.name]
    pairs_dirs = []
    for cd in cleans:
        nd = root / ("noisy" + cd.name[len("clean") :])
        if nd.is_dir():
            pairs_dirs.append((cd, nd))
    if not pairs_dirs:
        have = ", ".join(sorted(d.name for d in root.iterdir() if d.is_dir())) or "nothing"
        want = f" containing {split!r}" if split else ""
        raise FileNotFoundError(
            f"no clean_*/noisy_* folder pair{want} in {root} (found: {have}); VoiceBank+DEMAND layout is "
            "ROOT/clean_trainset_wav/x.wav with ROOT/noisy_trainset_wav/x.wav"
        )
    clean, noisy = [], []
    for cd, nd in pairs_dirs:
        cf, nf = _audio_files(cd), _audio_files(nd)
        only_c, only_n = sorted(set(cf) - set(nf)), sorted(set(nf) - set(cf))
        if only_c or only_n:
            raise ValueError(
                f"clean and noisy file names differ in {cd.name}/ vs {nd.name}/: "
                f"only clean: {only_c[:5]}{'...' if len(only_c) > 5 else ''}, "
                f"only noisy: {only_n[:5]}{'...' if len(only_n) > 5 else ''}; every clean file needs a "
                "noisy file of the same name"
            )
        for name in sorted(cf):
            clean.append(cf[name])
            noisy.append(nf[name])
    if not clean:
        raise FileNotFoundError(f"no .wav files in {[str(c) for c, _ in pairs_dirs]}")
    notes = set()
    for path in clean + noisy:
        try:
            info = sf.info(str(path))
        except (sf.LibsndfileError, RuntimeError) as e:
            raise ValueError(f"cannot read {path} as audio ({e}); remove or replace the corrupt file") from e
        n16 = int(info.frames * SAMPLE_RATE / info.samplerate)
        if n16 < MIN_SAMPLES:
            raise ValueError(
                f"{path} is {info.frames} samples at {info.samplerate} Hz "
                f"({info.frames / info.samplerate:.3f} s), shorter than one STFT frame "
                f"({MIN_SAMPLES} samples at 16 kHz); remove it"
            )
        notes.update(conversion_notes(info))
    for n in sorted(notes):
        _note(n)
    return PairFolder(root, clean, noisy)


def folder_batch(
    pairs: PairFolder, batch: int, crop: int, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """Random crops of `crop` samples (shorter clips zero-padded) -> (noisy, clean) float32 (batch, crop)."""
    noisy = np.zeros((batch, crop), np.float32)
    clean = np.zeros((batch, crop), np.float32)
    for b in range(batch):
        c, n = pairs.load(int(rng.integers(len(pairs))))
        if len(c) > crop:
            s = int(rng.integers(len(c) - crop + 1))
            c, n = c[s : s + crop], n[s : s + crop]
        clean[b, : len(c)], noisy[b, : len(n)] = c, n
    return noisy, clean


# ----------------------------------------------------------------------------------------------------
# Embedded generator of speech-like pairs
# ----------------------------------------------------------------------------------------------------

# (F1, F2, F3) in Hz of a few vowels (Peterson & Barney averages, rounded)
VOWELS = np.array(
    [
        [730, 1090, 2440],
        [270, 2290, 3010],
        [530, 1840, 2480],
        [570, 840, 2410],
        [300, 870, 2240],
        [660, 1720, 2410],
    ],
    dtype=np.float32,
)
NOISE_KINDS = ("white", "pink", "babble")  # the generated default data
MIX_NOISE_KINDS = ("white", "pink", "brown", "babble", "hum")  # built-in noises of on-the-fly mixing


def _raised_cos_env(n: int, edge: int) -> np.ndarray:
    env = np.ones(n, np.float32)
    e = min(edge, n // 2)
    if e > 0:
        ramp = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, e, dtype=np.float32))
        env[:e], env[n - e :] = ramp, ramp[::-1]
    return env


def _shaped_noise(n: int, rng: np.random.Generator, lo: float, hi: float, sr: int) -> np.ndarray:
    spec = np.fft.rfft(rng.standard_normal(n).astype(np.float32))
    f = np.fft.rfftfreq(n, 1 / sr)
    spec *= ((f >= lo) & (f <= hi)).astype(np.float32)
    x = np.fft.irfft(spec, n).astype(np.float32)
    return x / (np.std(x) + 1e-8)


def synth_speech(n: int, rng: np.random.Generator, sr: int = SAMPLE_RATE) -> np.ndarray:
    """A speech-like utterance of n samples: voiced syllables, fricatives and pauses; float32 (n,)."""
    out = np.zeros(n, np.float32)
    f0_base = rng.uniform(90, 240)
    t = int(rng.integers(0, int(0.15 * sr)))  # leading silence
    while t < n:
        if rng.random() < 0.35:  # unvoiced onset (fricative): band-limited noise burst
            m = int(rng.uniform(0.03, 0.09) * sr)
            lo = rng.uniform(2000, 4000)
            burst = _shaped_noise(m, rng, lo, min(lo + rng.uniform(1500, 3500), sr / 2 - 100), sr)
            seg = 0.15 * burst * _raised_cos_env(m, int(0.01 * sr))
            e = min(n, t + m)
            out[t:e] += seg[: e - t]
            t = e
        m = int(rng.uniform(0.12, 0.35) * sr)  # voiced nucleus
        e = min(n, t + m)
        m = e - t
        if m > 0:
            tt = np.arange(m, dtype=np.float32) / sr
            f0 = f0_base * (1 + 0.12 * np.sin(2 * np.pi * rng.uniform(1, 4) * tt + rng.uniform(0, 6.3)))
            f0 = f0 * np.linspace(1.05, 0.95, m, dtype=np.float32)  # declination
            phase = 2 * np.pi * np.cumsum(f0) / sr
            formants = VOWELS[rng.integers(len(VOWELS))] * rng.uniform(0.9, 1.15)
            bw = np.array([80, 120, 180], np.float32) * rng.uniform(0.8, 1.3)
            K = int(7600 // f0.max())
            k = np.arange(1, K + 1, dtype=np.float32)[:, None]
            fk = k * f0[None, :]  # (K, m) harmonic frequencies
            env = sum(1.0 / (1.0 + ((fk - F) / B) ** 2) for F, B in zip(formants, bw))
            amp = env / k  # glottal source tilt
            voiced = (amp * np.sin(k * phase[None, :])).sum(0)
            voiced /= np.max(np.abs(voiced)) + 1e-8
            out[t:e] += 0.6 * rng.uniform(0.5, 1.0) * voiced * _raised_cos_env(m, int(0.025 * sr))
        t = e + int((rng.uniform(0.03, 0.15) if rng.random() < 0.75 else rng.uniform(0.25, 0.5)) * sr)
    return out


def make_noise(kind: str, n: int, rng: np.random.Generator, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Unit-power noise of a kind in NOISE_KINDS; float32 (n,)."""
    if kind == "white":
        x = rng.standard_normal(n).astype(np.float32)
    elif kind == "pink":
        spec = np.fft.rfft(rng.standard_normal(n))
        f = np.fft.rfftfreq(n, 1 / sr)
        spec /= np.sqrt(np.maximum(f, 20.0))
        x = np.fft.irfft(spec, n).astype(np.float32)
    elif kind == "brown":
        x = np.cumsum(rng.standard_normal(n)).astype(np.float32)
        x -= np.linspace(x[0], x[-1], n, dtype=np.float32)  # no drift: a random walk pinned at both ends
    elif kind == "hum":  # mains hum (50 or 60 Hz and harmonics) with a little hiss
        t = np.arange(n, dtype=np.float32) / sr
        f = 50.0 if rng.random() < 0.5 else 60.0
        x = sum(np.sin(2 * np.pi * f * h * t + rng.uniform(0, 6.3)) / h for h in (1, 2, 3, 5))
        x = x + 0.1 * rng.standard_normal(n)
    elif kind == "babble":
        x = sum(synth_speech(n, rng, sr) for _ in range(int(rng.integers(4, 7))))
    else:
        raise ValueError(f"unknown noise kind {kind!r}; choose from {', '.join(MIX_NOISE_KINDS)}")
    return x / (np.sqrt(np.mean(x**2)) + 1e-8)


def mix(clean: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """clean + noise scaled to snr_db (powers over the whole clip)."""
    p_s = np.mean(clean**2) + 1e-10
    p_n = np.mean(noise**2) + 1e-10
    return clean + noise * np.sqrt(p_s / (p_n * 10 ** (snr_db / 10)))


def synth_pair(
    n: int,
    rng: np.random.Generator,
    snr_range: tuple[float, float] = (0.0, 20.0),
    noise_kinds: tuple[str, ...] = NOISE_KINDS,
) -> tuple[np.ndarray, np.ndarray]:
    """One (noisy, clean) pair of n samples, both scaled together to a random level."""
    clean = synth_speech(n, rng)
    noisy = mix(
        clean, make_noise(noise_kinds[int(rng.integers(len(noise_kinds)))], n, rng), rng.uniform(*snr_range)
    )
    gain = rng.uniform(0.3, 0.9) / (np.max(np.abs(noisy)) + 1e-8)
    return (noisy * gain).astype(np.float32), (clean * gain).astype(np.float32)


def pair_rng(seed: int, step: int, micro: int = 0, stream: int = TRAIN_STREAM) -> np.random.Generator:
    """The generator for batch (seed, step, micro) of a stream: training and held-out never overlap."""
    return np.random.default_rng([stream, seed, step, micro])


def synth_batch(batch: int, n: int, rng: np.random.Generator, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(noisy, clean) float32 (batch, n)."""
    pairs = [synth_pair(n, rng, **kw) for _ in range(batch)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def heldout_pairs(
    count: int, seconds: float = 3.0, seed: int = 1234, **kw
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Generated evaluation pairs, disjoint from every training batch: [(name, noisy, clean)]."""
    out = []
    for i in range(count):
        noisy, clean = synth_pair(int(seconds * SAMPLE_RATE), pair_rng(seed, i, 0, HELDOUT_STREAM), **kw)
        out.append((f"heldout_{i:03d}.wav", noisy, clean))
    return out


# ----------------------------------------------------------------------------------------------------
# On-the-fly mixing (DNS-Challenge style): clean utterances + noise at a random SNR, a new mix every step
# ----------------------------------------------------------------------------------------------------


def audio_files(d: str | Path, what: str) -> list[Path]:
    """Every .wav/.flac under folder d (recursively), sorted; ValueError naming the folder when none."""
    d = Path(d)
    if not d.is_dir():
        raise ValueError(f"{what} {d} is not a folder; pass a folder of .wav/.flac files")
    files = sorted(p for p in d.rglob("*") if p.suffix.lower() in AUDIO_EXTS and p.is_file())
    if not files:
        raise ValueError(f"{what} {d} contains no .wav or .flac files; pass a folder of audio files")
    for path in files:
        try:
            info = sf.info(str(path))
        except (sf.LibsndfileError, RuntimeError) as e:
            raise ValueError(f"cannot read {path} as audio ({e}); remove or replace the corrupt file") from e
        if info.frames * SAMPLE_RATE / info.samplerate < MIN_SAMPLES:
            raise ValueError(
                f"{path} is {info.frames} samples at {info.samplerate} Hz, shorter than one STFT frame "
                f"({MIN_SAMPLES} samples at 16 kHz); remove it"
            )
    return files


def load_all(files: list[Path]) -> None:
    """Read every file now (into the clip cache), so a bad one (NaN samples, unreadable) is one line naming
    it before training starts rather than an error mid-run."""
    for f in files:
        _load_cached(str(f))


# SNR range (dB) of on-the-fly mixes (--clean, and --data remixing): speech-tts's training range
MIX_SNR = (-5.0, 15.0)


def _check_snr(snr: tuple[float, float]) -> None:
    lo, hi = snr
    if lo > hi:
        raise ValueError(f"--snr MIN MAX needs MIN <= MAX, got {lo:g} > {hi:g}; swap them")


@dataclass
class MixSource:
    """Clean utterances mixed with noise files and/or the built-in kinds at SNRs in snr (dB)."""

    clean: list[Path]
    noise: list[Path] | None = None  # None: the built-in kinds, MIX_NOISE_KINDS
    snr: tuple[float, float] = MIX_SNR
    builtin: float = 0.0  # with noise files: the share of mixes that take a built-in kind instead
    kinds: tuple[str, ...] = MIX_NOISE_KINDS  # the built-in kinds drawn from

    def __post_init__(self) -> None:
        _check_snr(self.snr)

    def clean_clip(self, rng: np.random.Generator) -> np.ndarray:
        return _load_cached(str(self.clean[int(rng.integers(len(self.clean)))]))

    def noise_clip(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.noise and not rng.random() < self.builtin:
            return _crop_or_tile(_load_cached(str(self.noise[int(rng.integers(len(self.noise)))])), n, rng)
        return make_noise(self.kinds[int(rng.integers(len(self.kinds)))], n, rng)


@dataclass
class PairRemix:
    """Dynamic remixing of fixed noisy/clean pairs: the clean speech of one pair with the noise
    (noisy - clean) of another, at a random SNR in snr (dB). 440 fixed pairs become ~190,000 speech x
    noise combinations at any SNR and gain, so a model cannot memorise them."""

    pairs: PairFolder
    snr: tuple[float, float] = MIX_SNR

    def __post_init__(self) -> None:
        _check_snr(self.snr)

    def clean_clip(self, rng: np.random.Generator) -> np.ndarray:
        return self.pairs.load(int(rng.integers(len(self.pairs))))[0]

    def noise_clip(self, n: int, rng: np.random.Generator) -> np.ndarray:
        clean, noisy = self.pairs.load(int(rng.integers(len(self.pairs))))
        return _crop_or_tile(noisy - clean, n, rng)


def _crop_or_tile(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """A random n-sample window of x; shorter x is rolled by a random offset and repeated to n."""
    if len(x) >= n:
        s = int(rng.integers(len(x) - n + 1))
        return x[s : s + n]
    return np.resize(np.roll(x, int(rng.integers(len(x)))), n)


@dataclass
class Sources:
    """Several mix sources, each mix drawn from one of them with the given weights (e.g. a corpus's
    remixed pairs and other voices with recorded noise)."""

    sources: list
    weights: list[float]

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.weights) or not self.sources or min(self.weights) < 0:
            raise ValueError("Sources needs one non-negative weight per source")
        total = sum(self.weights)
        self.p = np.asarray(self.weights, np.float64) / total

    def pick(self, rng: np.random.Generator):
        return self.sources[int(rng.choice(len(self.sources), p=self.p))]


def mix_batch(
    src: MixSource | PairRemix | Sources,
    batch: int,
    crop: int,
    rng: np.random.Generator,
    aug: Augment | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(noisy, clean, snr_db) float32 (batch, crop), (batch,): a random crop of a random clean clip
    (zero-padded when shorter) plus a noise clip at a random SNR over the crop, both scaled by one random
    gain (peak of the mix 0.1..0.9, so nothing clips and the realised SNR is the requested one).

    With `aug` the clean speech is first sped up or slowed down, coloured and put in a room, speech and
    noise may be low-passed together, and the mix may be quiet or clipped (augment.py); the target is the
    augmented speech and, unless clipped, noisy - clean is exactly the scaled noise."""
    aug = aug or Augment()
    noisy = np.zeros((batch, crop), np.float32)
    clean = np.zeros((batch, crop), np.float32)
    snrs = np.zeros(batch, np.float32)
    for b in range(batch):
        s = src.pick(rng) if isinstance(src, Sources) else src
        snrs[b] = rng.uniform(*s.snr)
        c = s.clean_clip(rng)
        if rng.random() < aug.speed:
            c = augment.speed(c, rng)
        if len(c) > crop:
            start = int(rng.integers(len(c) - crop + 1))
            c = c[start : start + crop]
        c = np.pad(c, (0, crop - len(c)))
        if rng.random() < aug.eq:
            c = augment.eq(c, rng)
        if rng.random() < aug.reverb:
            c = augment.reverb(c, rng)
        n = s.noise_clip(crop, rng)
        if rng.random() < aug.bandlimit:
            cutoff = rng.uniform(3400, 7000)
            c = augment.bandlimit(c, rng, cutoff=cutoff)
            n = augment.bandlimit(n, rng, cutoff=cutoff)
        y = mix(c, n, float(snrs[b]))
        peak = 10 ** rng.uniform(-2, -1) if rng.random() < aug.gain else rng.uniform(0.1, 0.9)
        gain = peak / (np.max(np.abs(y)) + 1e-8)
        y, c = y * gain, c * gain
        if rng.random() < aug.clip:
            y = augment.clip(y, rng)
        noisy[b], clean[b] = y, c
    return noisy, clean, snrs


# ----------------------------------------------------------------------------------------------------
# Held-out groups: whole voices and whole noise recordings, never single files of a trained voice
# ----------------------------------------------------------------------------------------------------


def group_of(path: Path, root: Path) -> str:
    """The voice (or noise recording set) a file belongs to: its sub-folder under root when it has one
    (LibriSpeech/VCTK-style speaker folders), else its name without a trailing _NNN / -NNN number
    ('ked_diphone_007.flac' -> 'ked_diphone', 'minetest-data_03.flac' -> 'minetest-data')."""
    rel = path.relative_to(root)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return re.sub(r"[_-]\d+$", "", path.stem)


def _matches(group: str, name: str) -> bool:
    """A selector names a group whole or as one of its _-separated words ('nsh' -> 'msu_ru_nsh_clunits')."""
    return name == group or name in group.split("_")


def split_groups(
    files: list[Path],
    root: str | Path,
    val: tuple[str, ...],
    test: tuple[str, ...] = (),
    auto: int = 3,
) -> tuple[list[Path], list[Path], list[Path], list[str], list[str]]:
    """(train, val, test files, val groups, test groups) with whole groups held out.

    `val`/`test` name groups (see _matches); test groups are neither trained on nor validated on. When no
    named validation group is present, `auto` groups (a fixed choice, at most a quarter of them) are held
    out; with fewer than 4 groups nothing is held out by group (val and test empty)."""
    root = Path(root)
    group = {f: group_of(f, root) for f in files}
    groups = sorted(set(group.values()))
    test_g = [g for g in groups if any(_matches(g, n) for n in test)]
    rest = [g for g in groups if g not in test_g]
    val_g = [g for g in rest if any(_matches(g, n) for n in val)]
    if not val_g and auto and len(rest) >= 4:
        perm = np.random.default_rng(4321).permutation(len(rest))
        val_g = sorted(rest[int(i)] for i in perm[: min(auto, len(rest) // 4)])
    train = [f for f in files if group[f] not in val_g + test_g]
    v = [f for f in files if group[f] in val_g]
    t = [f for f in files if group[f] in test_g]
    return train, v, t, val_g, test_g


VAL_SEED = 4321  # the held-out validation files and mixes do not depend on --seed


def heldout_mixes(
    clean: list[Path],
    noise: list[Path] | None,
    count: int,
    seed: int,
    snr: tuple[float, float] = HELDOUT_SNR,
    seconds: float | None = None,
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Fixed evaluation mixes [(name, noisy, clean)]: `count` utterances spread evenly over `clean` (whole
    utterances, or `seconds`-long crops), each with a noise (a file of `noise`, in turn, or a built-in kind)
    at an SNR in `snr`; the same mixes for the same arguments."""
    if not clean or count < 1:
        return []
    if count > len(clean):  # fewer utterances than mixes (e.g. one recording): reuse them with other noises
        idx = np.arange(count) % len(clean)
    else:
        idx = np.linspace(0, len(clean) - 1, count).round().astype(int)
    out = []
    for k, i in enumerate(idx):
        rng = pair_rng(seed, k, 0, HELDOUT_STREAM)
        utterance = clean[int(i)]
        length = len(_load_cached(str(utterance)))  # the mix below reads it from the same cache
        n = length if seconds is None else min(length, int(seconds * SAMPLE_RATE))
        if noise:
            path = noise[int(rng.integers(len(noise)))]
            src, label = MixSource([utterance], [path], snr), group_of(path, path.parent)
        else:
            label = MIX_NOISE_KINDS[k % len(MIX_NOISE_KINDS)]
            src = MixSource([utterance], None, snr, kinds=(label,))
        noisy, cl, s = mix_batch(src, 1, n, rng)
        name = f"{utterance.stem}_{label}_{float(s[0]):.0f}dB.wav"
        out.append((name, noisy[0], cl[0]))
    return out
