"""MBS-Net configuration: the model dataclass and its presets (the default fits: ~2.6M params; the seed's
bloated one), the training recipe, and the settings presets `train --config NAME` starts from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from memfit.train import config
from memfit.train.config import RATE, SHARE, STEPS, WEIGHT, check_config
from memfit.train.settings import LoopConfig, Settings

SAMPLE_RATE = 16_000
MIN_SAMPLES = 400  # one STFT window at 16 kHz; shorter clips carry no frame
HELDOUT_SNR = (0.0, 10.0)  # SNR range (dB) of the fixed held-out-voice mixes (data.heldout_mixes, eval --snr)


@dataclass(frozen=True)
class Augment:
    """Probability that each augmentation (augment.py) is applied to a training mix (0: never)."""

    speed: float = 0.0  # speed perturbation x0.9..1.1 (tempo and pitch together, as Kaldi's)
    eq: float = 0.0  # microphone colour: a random spectral tilt and two peaking bands
    reverb: float = 0.0  # a synthetic room: exponentially decaying noise, RT60 0.15..0.7 s
    gain: float = 0.0  # a quiet recording: mix peak 0.01..0.1 instead of 0.1..0.9
    clip: float = 0.0  # a clipped recording: the noisy mix clipped at 30..80% of its peak (target not)
    bandlimit: float = 0.0  # a narrow-band recording: speech and noise low-passed at 3.4..7 kHz

    RANGES: ClassVar[dict[str, str]] = dict.fromkeys(
        ("speed", "eq", "reverb", "gain", "clip", "bandlimit"), SHARE
    )

    def __post_init__(self) -> None:
        for name in self.RANGES:
            value = getattr(self, name)
            if isinstance(value, (int, float)) and value > 1:  # the line says what the number is
                raise ValueError(f"{name} is a probability; give 0..1, got {value:g}")
        check_config(self)


def parse_names(spec: str) -> tuple[str, ...]:
    """'ked,pc,nsh' -> ('ked', 'pc', 'nsh') (group names for data.split_groups); 'none' -> ()."""
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    return () if names == ("none",) else names


@dataclass(frozen=True)
class MBSNetConfig:
    # STFT front end (16 kHz)
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 512
    hop: int = 100
    win: int = 400
    compress: float = 0.3  # magnitude power-law compression, as MP-SENet / SEMamba
    # band split and encoder
    num_bands: int = 30
    band_growth: float = 4.0  # last band's width over the first's (geometric widths; not BSRNN's (257, 30))
    channels: int = 128
    num_layers: int = 14
    d_state: int = 16
    d_conv: int = 4
    expand: float = 1.5
    temporal_bidirectional: bool = False  # False: frame t sees frames <= t only (streamable)
    crossband_bidirectional: bool = False  # bands have no "future"; the seed ran both directions
    band_energy: bool = False  # also feed each band's log energy per frame (the LayerNorm removes it)
    # heads: 0 = a single linear per band (ours); > 0 = the seed's per-band MLP with this hidden width
    head_hidden: int = 0
    dual_branch: bool = False  # the seed: separate magnitude and phase encoders
    # memory
    scan: str = (
        "chunked"  # "chunked": memfit.ops.scan.selective_scan; "materialise": the seed's real_mamba scan
    )
    checkpoint: bool = True  # recompute each encoder layer in backward (keeps only layer inputs)
    pcs: bool = False  # perceptual contrast stretching of the output magnitude (inference only)
    keep_noisy: float = 0.0  # share of the noisy input mixed back into the output (inference only)
    # inference only: average the outputs of the input delayed by 0, hop/shifts, 2 hop/shifts, ... samples
    # (the STFT frames land elsewhere each time: translation-invariant denoising); 1 = one pass
    shifts: int = 1
    # how the model runs, not what it computes: `train --resume` may change these
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("checkpoint", "scan", "pcs", "keep_noisy", "shifts")
    RANGES: ClassVar[dict[str, str]] = {
        "sample_rate": "[1, 384000]",
        **dict.fromkeys(("n_fft", "hop", "win", "channels", "num_layers", "d_state", "d_conv", "num_bands",
                         "shifts"), "[1, 2**16]"),
        **dict.fromkeys(("compress", "band_growth", "expand"), "(0, 1e3]"),
        "head_hidden": "[0, 2**16]",
        "keep_noisy": SHARE,
    }  # fmt: skip

    def __post_init__(self) -> None:
        sizes = all(isinstance(getattr(self, n), int) for n in ("n_fft", "num_bands", "hop", "shifts"))
        if sizes and not 1 <= self.num_bands <= self.n_bins:  # before the ranges: the line names n_bins
            raise ValueError(f"num_bands must be in 1..{self.n_bins} (n_fft//2+1), got {self.num_bands}")
        if sizes and not 1 <= self.shifts <= max(self.hop, 1):
            raise ValueError(f"shifts must be in 1..hop ({self.hop}), got {self.shifts}")
        check_config(self)
        if self.scan not in ("chunked", "materialise"):
            raise ValueError(f"scan must be 'chunked' or 'materialise', got {self.scan!r}")
        if not self.band_growth > 0:
            raise ValueError(f"band_growth must be > 0 (last band width / first), got {self.band_growth}")
        if self.win > self.n_fft:
            raise ValueError(f"win ({self.win}) must be <= n_fft ({self.n_fft})")
        if self.hop < 1 or self.hop > self.win:
            raise ValueError(f"hop must be in 1..win ({self.win}), got {self.hop}")
        if not 0 <= self.keep_noisy <= 1:
            raise ValueError(f"keep_noisy is a share of the input; give 0..1, got {self.keep_noisy:g}")

    @property
    def n_bins(self) -> int:
        return self.n_fft // 2 + 1


def band_widths(n_bins: int, num_bands: int, growth: float = 4.0) -> list[int]:
    """Bins per sub-band, low to high frequency; sums to n_bins.

    (257, 30) is BSRNN's 16 kHz recipe in whole bins: 10 bands of 3 bins (~94 Hz) up to ~940 Hz,
    12 of 8 (250 Hz) up to ~3.9 kHz, 8 of 16 (500 Hz) to Nyquist. Other sizes: widths growing
    geometrically (the last `growth` times the first), so low frequencies (where speech harmonics are
    dense) keep fine resolution.
    """
    if n_bins == 257 and num_bands == 30:
        widths = [3] * 10 + [8] * 12 + [16] * 8
        widths[-1] += n_bins - sum(widths)
        return widths
    ratio = growth ** (1 / max(1, num_bands - 1))  # last band ~growth x the first
    raw = [ratio**k for k in range(num_bands)]
    scale = n_bins / sum(raw)
    widths = [max(1, math.floor(r * scale)) for r in raw]
    k = num_bands - 1
    while sum(widths) < n_bins:  # hand leftovers to the high bands
        widths[k] += 1
        k = k - 1 if k > 0 else num_bands - 1
    while sum(widths) > n_bins:
        k = max(range(num_bands), key=lambda i: widths[i])
        widths[k] -= 1
    return widths


# The model presets; the settings presets `train --config NAME` starts from (SETTINGS, below) take these
# and the recipe. Why each CPU setting is what it is, with the runs that chose it: docs/results.md ("The
# CPU recipe's settings, and the runs behind them").
PRESETS: dict[str, MBSNetConfig] = {
    # the model that fits: shared encoder, unidirectional Mamba, expand 1.5, single-linear heads (~2.6M)
    "default": MBSNetConfig(),
    # the seed's MBS-Net (~7.3M params): dual branches, expand 2, bidirectional everywhere, per-band MLP
    # heads (296 wide: the seed's reported 7.33M), and its materialising real_mamba scan without recompute
    "seed": MBSNetConfig(num_layers=5, expand=2.0, temporal_bidirectional=True, crossband_bidirectional=True,
                         head_hidden=296, dual_branch=True, scan="materialise", checkpoint=False),
    # a few-thousand-parameter model for CPU tests and quick learning runs
    "tiny": MBSNetConfig(num_bands=12, channels=24, num_layers=2, d_state=8, expand=1.0, checkpoint=False),
    # the CPU recipe's model: 64 channels, 3 layers, bidirectional temporal Mamba (offline enhancement),
    # band log energy, bands growing 16x (BSRNN-like ~94 Hz bands below 1 kHz), contrast stretching at
    # inference; ~0.22M parameters, trained on one thread in 20 minutes
    "cpu": MBSNetConfig(num_bands=12, channels=64, num_layers=3, d_state=8, expand=1.0,
                        temporal_bidirectional=True, checkpoint=False, band_energy=True, band_growth=16.0,
                        pcs=True),
}  # fmt: skip


def default_config(**overrides: Any) -> MBSNetConfig:
    """The model that fits (``PRESETS["default"]``) with field overrides."""
    return get_config("default", **overrides)


def seed_config(**overrides: Any) -> MBSNetConfig:
    """The seed's MBS-Net (``PRESETS["seed"]``) with field overrides."""
    return get_config("seed", **overrides)


def tiny_config(**overrides: Any) -> MBSNetConfig:
    """The test-size model (``PRESETS["tiny"]``) with field overrides."""
    return get_config("tiny", **overrides)


def cpu_config(**overrides: Any) -> MBSNetConfig:
    """The CPU recipe's model (``PRESETS["cpu"]``) with field overrides."""
    return get_config("cpu", **overrides)


@dataclass(frozen=True)
class LossWeights:
    """Weights of the training loss terms (losses.py); 0 skips a term. Defaults: MP-SENet's generator
    weights (its metric-discriminator term left out), no multi-resolution STFT term."""

    mag: float = 0.9
    com: float = 0.1
    pha: float = 0.3
    time: float = 0.2
    stft: float = 0.0
    sisdr: float = 0.0  # weight of -SI-SDR in dB (so ~0.01 makes it comparable to the others)
    pesq: float = 0.0  # weight of a differentiable PESQ distance (torch-pesq; ~4 for a noisy mix, 0 clean)
    stoi: float = 0.0  # weight of -STOI (torch-stoi; -1 for the clean speech itself, 0 worst)

    RANGES: ClassVar[dict[str, str]] = dict.fromkeys(("mag", "com", "pha", "time", "stft", "sisdr", "pesq",
                                                      "stoi"), WEIGHT)  # fmt: skip

    def __post_init__(self) -> None:
        check_config(self)


def get_config(name: str, **overrides: Any) -> MBSNetConfig:
    """A preset by name with field overrides (memfit.train.config.get_config)."""
    return config.get_config(PRESETS, name, **overrides)


@dataclass(frozen=True)
class TrainConfig:
    """How `train` trains: data, crops, optimizer, loss and validation (settings.train)."""

    data: str | None = None  # VoiceBank+DEMAND-style root (clean_*/ noisy_*/); None: generated pairs
    remix: bool = True  # with data: mix one pair's speech with another pair's noise every step
    clean: str | None = None  # a folder of clean speech to mix noise into on the fly
    noise: str | None = None  # noise files for `clean` (None: the built-in noises)
    snr: tuple[float, float] | None = None  # mix SNR range in dB (None: 0..20 generated, -5..15 otherwise)
    data_share: float = 0.3  # with both data and clean: the share of mixes drawn from data's pairs
    builtin_noise: float = 0.25  # with noise files: the share of mixes using a built-in noise kind instead
    augment: Augment = field(default_factory=Augment)  # of --clean mixes (with --data alone: none)
    # whole voices / noise recordings held out of training (names or one _-separated word of them,
    # data.split_groups): validation chooses best.pt on val_*; test_* are kept for `eval` only
    val_voices: tuple[str, ...] = ("ked", "pc", "nsh")
    val_noises: tuple[str, ...] = ("lincity-ng-data", "bucklespring-data")
    test_voices: tuple[str, ...] = ("krb", "lj", "ona")
    test_noises: tuple[str, ...] = (
        "minetest-data",
        "wordwarvi-sound",
        "extremetuxracer-data",
        "heroes-sound-effects",
    )
    batch_size: int = 6
    seconds: float = 2.0  # crop length
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup: int = 50  # warmup steps (at most a tenth of a run's --steps: memfit.train.loop.WarmupCosine)
    loss: LossWeights = field(default_factory=LossWeights)
    noisy_phase: bool = False  # freeze the phase head at "keep the noisy phase": a magnitude-mask model
    eval_every: int = 200  # validation (PESQ-wb, STOI, SI-SDR on held-out files) every N steps; 0: at the end
    val_files: int = 8

    RANGES: ClassVar[dict[str, str]] = {
        "batch_size": "[1, 2**20]",
        "seconds": "(0, 3600]",  # a crop of at most an hour
        # dB, each end: beyond +-100 dB one signal is below float32's resolution of the other
        "snr": "[-100, 100]",
        "data_share": SHARE,
        "builtin_noise": SHARE,
        "lr": RATE,
        "weight_decay": WEIGHT,
        "warmup": STEPS,
        "eval_every": STEPS,
        "val_files": "[0, 2**20]",
    }

    def __post_init__(self) -> None:
        check_config(self)
        if self.seconds * SAMPLE_RATE < MIN_SAMPLES:
            raise ValueError(f"seconds must be >= 0.025 (one STFT window), got {self.seconds:g}")
        if self.snr is not None and not (len(self.snr) == 2 and self.snr[0] <= self.snr[1]):
            raise ValueError(f"snr needs MIN <= MAX, got {' '.join(map(str, self.snr))}; swap them")


def _paper(name: str):
    """A paper-recipe preset: on a CPU without layer recompute (it exists to fit a GPU's memory; on 2
    cores it made a step ~1.4x slower: `tools/bench_mbsnet.py` with and without --checkpointing)."""

    def make(device) -> Settings:
        model = get_config(name)
        if device.type == "cpu":
            model = replace(model, checkpoint=False)
        return Settings(model, TrainConfig(), LoopConfig(steps=1000, log_every=10, save_every=200))

    return make


def _cpu(device) -> Settings:
    """The CPU recipe (`--config cpu`, and `auto` without a GPU): each choice (no phase term, -SI-SDR at
    0.02, the STFT term at 0.1, a PESQ term at 0.1; best.pt chosen on 24 mixes every 600 steps; the
    augmentations; one thread, no weight average) was made by short measured runs on held-out files,
    recorded in docs/results.md ("The CPU recipe's settings"). Its own run folder: the quick start never
    sits where the shipped model's users look."""
    train = TrainConfig(
        batch_size=4,
        seconds=1.0,
        lr=3e-3,
        loss=LossWeights(pha=0.0, sisdr=0.02, stft=0.1, pesq=0.1),
        eval_every=600,
        val_files=24,
        augment=Augment(speed=0.5, gain=0.2, clip=0.1, bandlimit=0.2),
    )
    loop = LoopConfig(steps=300, amp="none", threads=1, log_every=10, save_every=200, run_name="quickstart")
    return Settings(cpu_config(), train, loop)


def _general(device) -> Settings:
    """The generalising recipe (`--config general`, for --clean/--noise sources): the CPU recipe with the
    choices made on held-out voices x held-out noise recordings (docs/results.md): hop 200 (half the
    frames, 1.7x the steps in 20 minutes), the PESQ and STOI terms at 0.6 and 10 with -SI-SDR at 0.01
    (half the preset's: it decides how far a run trades PESQ-wb for SI-SDR), a weight average at 0.999
    that validation, best.pt and the saved model use, and at inference no contrast stretching and 4
    shifted passes."""
    cpu = _cpu(device)
    model = replace(cpu.model, hop=200, pcs=False, shifts=4)
    train = replace(cpu.train, loss=replace(cpu.train.loss, pesq=0.6, stoi=10.0, sisdr=0.01))
    return Settings(model, train, replace(cpu.loop, ema=0.999, run_name="general"))


# the paper-recipe presets for each model preset but the CPU one, which has its recipe; and the
# generalising recipe
SETTINGS = {**{name: _paper(name) for name in PRESETS if name != "cpu"}, "cpu": _cpu, "general": _general}
