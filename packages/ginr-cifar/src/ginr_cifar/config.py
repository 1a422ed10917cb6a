"""GINRConfig: one dataclass for the encoder, the modulation network, the SCENT-style decoder and the hyponet.

Presets ``fast`` / ``balanced`` / ``high`` are the seed's three ``MambaGINR_CIFAR`` configurations
(dim 128/256/512, LP tokens 16/32/64, Mamba depth 3/4/6, hidden 64/128/256); ``tiny`` is for CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit import config

DECODERS = ("attn", "ff", "xattn")


@dataclass
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

    def __post_init__(self) -> None:
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
    """A preset by name with field overrides (memfit.config.get_config)."""
    return config.get_config(PRESETS, name, **overrides)
