"""GINRConfig: one dataclass for the encoder, the modulation network, the SCENT-style decoder and the hyponet.

Presets ``fast`` / ``balanced`` / ``high`` are the seed's three ``MambaGINR_CIFAR`` configurations
(dim 128/256/512, LP tokens 16/32/64, Mamba depth 3/4/6, hidden 64/128/256); ``tiny`` is for CPU tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from memfit.train import config
from memfit.train.config import COUNT, COUNT0, RATE, STEPS, WEIGHT, check_config
from memfit.train.settings import LoopConfig, Settings

DECODERS = ("attn", "ff", "xattn")


@dataclass(frozen=True)
class GINRConfig:
    # image and tokenisation
    image_size: int = 32
    channels: int = 3
    patch_size: int = 2  # 32x32 -> 256 patch tokens
    # encoder: BiMamba blocks over patch tokens with learnable latent (LP) tokens interleaved
    dim: int = 256
    num_lp: int = 32
    depth: int = 4
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    ff_mult: int = 4
    # coordinate encoding, modulation network and hyponet
    hidden_dim: int = 128  # hyponet width
    num_bands: int = 16  # Fourier bands per scale (the finest scale reaches max_freq)
    max_freq: float = 32.0  # = image_size: the finest band sits at the pixel Nyquist frequency
    locality_bias: bool = True  # bias each coordinate's attention towards LP tokens' learnt positions
    locality_init: float = 2.0  # its initial strength: logits - locality_init * squared distance
    # SCENT-style decoder between modulation and hyponet
    decoder: str = "ff"  # "attn" (naive baseline) | "ff" (Solution 1) | "xattn" (Solution 2)
    decoder_width: int = 512
    decoder_depth: int = 2  # number of scales; 3*depth - 1 mixer blocks, as many feed-forward blocks
    decoder_heads: int = 8
    decoder_ff_mult: int = 4
    # memory
    checkpoint: bool = False  # per-block activation checkpointing in encoder and decoder
    RANGES: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("image_size", "channels", "patch_size", "dim", "num_lp", "depth", "d_state",
                         "d_conv", "expand", "ff_mult", "hidden_dim", "num_bands", "decoder_width",
                         "decoder_depth", "decoder_heads", "decoder_ff_mult"), "[1, 2**16]"),
        "max_freq": "(0, 1e4]",
        "locality_init": "[0, 1e4]",
    }  # fmt: skip

    def __post_init__(self) -> None:
        check_config(self)  # sizes first: the checks below divide by them
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        if self.num_patches % self.num_lp:
            raise ValueError(
                f"num_lp {self.num_lp} must divide the number of patches {self.num_patches} "
                "(LP tokens are interleaved evenly among the patch tokens)"
            )
        if self.decoder_width % self.decoder_heads:
            raise ValueError(
                f"decoder_width {self.decoder_width} not divisible by heads {self.decoder_heads}"
            )
        if self.decoder_depth < 1:
            raise ValueError("decoder_depth must be >= 1")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_pixels(self) -> int:
        return self.image_size**2


PRESETS: dict[str, GINRConfig] = {
    "fast": GINRConfig(dim=128, num_lp=16, depth=3, hidden_dim=64),
    "balanced": GINRConfig(dim=256, num_lp=32, depth=4, hidden_dim=128),
    "high": GINRConfig(dim=512, num_lp=64, depth=6, hidden_dim=256),
    # CPU tests and the learning check: small everywhere, coarser patches for speed.
    "tiny": GINRConfig(
        patch_size=4,
        dim=64,
        num_lp=16,
        depth=2,
        d_state=8,
        hidden_dim=64,
        num_bands=8,
        decoder_width=64,
        decoder_depth=1,
        decoder_heads=4,
        decoder_ff_mult=2,
    ),
    # The CPU recipe (train.RECIPES["cpu"] holds its training flags), chosen by measurement (README).
    "cpu": GINRConfig(
        patch_size=4,
        dim=48,  # 16 LP tokens x 48 = a 768-number code, the size of the 16x16 -> bicubic baseline's
        num_lp=16,
        depth=2,
        d_state=8,
        hidden_dim=64,
        num_bands=8,
        max_freq=16.0,  # finest band at half the pixel Nyquist: no stripes between pixel centres
        locality_init=16.0,  # each coordinate reads mostly its own LP token from the first step
        decoder_width=64,
        decoder_depth=1,
        decoder_heads=4,
        decoder_ff_mult=2,
    ),
}


def get_config(name: str = "balanced", **overrides) -> GINRConfig:
    """A preset by name with field overrides (memfit.train.config.get_config)."""
    return config.get_config(PRESETS, name, **overrides)


@dataclass(frozen=True)
class TrainConfig:
    """How `train` trains (settings.train): data, sampled pixels, optimizer and validation."""

    data: str | None = None  # CIFAR-10 batches folder or ImageFolder tree; None: the embedded set
    max_images: int | None = None  # use only the first N training images
    holdout: int = 500  # training images held out, unseen by training and validation (eval's split)
    batch_size: int = 64  # images per step
    num_sample_coords: int = 512  # pixels per image per step (of 1024)
    jitter: float = 0.0  # move sampled coordinates up to this many pixels off their centres
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    eval_every: int = 0  # validation PSNR every N steps, the best kept as best.pt (0: at the end)
    eval_images: int = 500  # validation images, carved from the training part

    RANGES: ClassVar[dict[str, str]] = {
        "max_images": COUNT,
        "holdout": COUNT0,
        "batch_size": "[1, 2**20]",
        "num_sample_coords": "[1, 2**20]",  # and at most the image's pixels (data.sample_batch)
        # pixels off a sampled centre; coordinates are clamped to the image, so more than its side (CIFAR's
        # 32) only moves every sample onto the border
        "jitter": "[0, 32]",
        "lr": RATE,
        "weight_decay": WEIGHT,
        "warmup": STEPS,
        "eval_every": STEPS,
        "eval_images": COUNT,
    }

    def __post_init__(self) -> None:
        check_config(self)


def _settings(name: str, train: TrainConfig = TrainConfig()):
    def make(device) -> Settings:
        return Settings(get_config(name), train, LoopConfig(steps=1000, log_every=10, save_every=200))

    return make


# "cpu": chosen by measurement on one CPU thread (docs/results.md); every other preset keeps the seed's
# training recipe.
CPU_TRAIN = TrainConfig(
    batch_size=32, num_sample_coords=256, jitter=0.5, lr=3e-3, warmup=50, eval_every=100, eval_images=250
)
SETTINGS = {name: _settings(name, CPU_TRAIN if name == "cpu" else TrainConfig()) for name in PRESETS}


SPLITS = ("train", "val", "holdout", "test", "all")  # the image sets data.load_split serves (`eval --split`)


def default_cache_dir() -> Path:
    """Where decoded image folders are cached (`--cache_dir`): $XDG_CACHE_HOME/ginr_cifar, else
    ~/.cache/ginr_cifar."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ginr_cifar"
