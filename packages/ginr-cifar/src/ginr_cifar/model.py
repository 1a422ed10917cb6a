"""Mamba-GINR for CIFAR-10: a BiMamba encoder to latent (LP) tokens, a coordinate decoder that fits.

    image (B, 3, 32, 32) --patches + LP tokens--> BiMamba x depth --> latent (B, num_lp, dim)
    coords (B, N, 2) --Fourier--> modulation (cross-attention to latent) --> SCENT-style decoder --> hyponet
        --> rgb (B, N, 3)

The SCENT-style decoder follows the seed's structure: per scale s a "bandwidth" branch on the Fourier
features of that scale and a "modulation" branch on the modulation vector, each Linear -> ReLU -> block,
multiplied together, with "hidden value" blocks merging the scales. A block is a mixer sub-layer then a
feed-forward sub-layer (both pre-norm, residual). The mixer is the decoder variant:

* ``attn``: self-attention over the N query coordinates, written naively (scores materialised, as the
  seed's decoder did). Memory O(B * heads * N^2): the paper-size step needs >= 25 GiB. Outputs are NOT
  query-independent: a pixel's colour depends on which other coordinates are decoded with it, so
  decoding a subset of pixels (training) and all of them (evaluation) are different functions.
* ``ff``: a PreNorm GEGLU feed-forward in place of each self-attention (seed's Solution 1). O(B * N).
* ``xattn``: cross-attention from each coordinate to the LP tokens (seed's Solution 2). O(B * N * num_lp).

``ff`` and ``xattn`` process every coordinate alone: decode(cat(c1, c2)) == cat(decode(c1), decode(c2)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from memfit.ops.layers import CrossAttention, FeedForward, FourierFeatures, PreNorm, checkpointed
from memfit.ops.mamba import BiMamba, MambaConfig
from torch import nn

from ginr_cifar.baselines import NaiveSelfAttention
from ginr_cifar.config import GINRConfig


@torch.library.custom_op("ginr_cifar::check_coord_range", mutates_args=())
def check_coord_range(coords: torch.Tensor) -> None:
    """A clear ValueError for coordinates outside [-1, 1] (or NaN). An op, so that its fake registration
    below is where tensors without data (memory estimation) pass, and torch.compile keeps it whole."""
    lo, hi = coords.detach().aminmax()
    if not (lo >= -1 and hi <= 1):  # NaN fails both comparisons too
        raise ValueError(
            f"coords must lie in [-1, 1] (pixel centres are (i + 0.5) / size * 2 - 1); got values in "
            f"[{float(lo):.4g}, {float(hi):.4g}]. Rescale them, e.g. with ginr_cifar.data.pixel_coords()."
        )


@check_coord_range.register_fake
def _(coords: torch.Tensor) -> None:
    return None  # no values to check


def check_coords(coords: torch.Tensor) -> None:
    """Validate query coordinates (B, N, 2) in [-1, 1]; a clear ValueError otherwise."""
    if coords.dim() != 3 or coords.shape[-1] != 2:
        raise ValueError(f"coords must have shape (batch, num_coords, 2), got {tuple(coords.shape)}")
    check_coord_range(coords)


class Residual(nn.Module):
    """x + fn(norm(x), **kw): one pre-norm residual sub-layer."""

    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.inner = PreNorm(dim, fn)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return x + self.inner(x, **kwargs)


class DecoderBlock(nn.Module):
    """Mixer sub-layer (variant) then GEGLU feed-forward sub-layer, each pre-norm residual."""

    def __init__(self, cfg: GINRConfig):
        super().__init__()
        W = cfg.decoder_width
        self.kind = cfg.decoder
        self.checkpoint = cfg.checkpoint
        if cfg.decoder == "attn":
            mixer: nn.Module = NaiveSelfAttention(W, cfg.decoder_heads)
        elif cfg.decoder == "ff":
            mixer = FeedForward(W, mult=cfg.decoder_ff_mult)
        else:
            mixer = CrossAttention(
                W, context_dim=cfg.dim, heads=cfg.decoder_heads, dim_head=W // cfg.decoder_heads
            )
        self.mixer = Residual(W, mixer)
        self.ff = Residual(W, FeedForward(W, mult=cfg.decoder_ff_mult))

    def _mix(self, x: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        return self.mixer(x, context=latent) if self.kind == "xattn" else self.mixer(x)

    def forward(self, x: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """x (B, N, W), latent (B, M, dim) -> (B, N, W)."""
        x = checkpointed(self._mix, x, latent, enabled=self.checkpoint)
        return checkpointed(self.ff, x, enabled=self.checkpoint)


class Branch(nn.Module):
    """Linear -> ReLU -> DecoderBlock: one of the seed's bandwidth_lins / modulation_lins entries."""

    def __init__(self, in_dim: int, cfg: GINRConfig):
        super().__init__()
        self.proj = nn.Linear(in_dim, cfg.decoder_width)
        self.block = DecoderBlock(cfg)

    def forward(self, x: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        return self.block(F.relu(self.proj(x)), latent)


class ModulationNetwork(nn.Module):
    """Each coordinate cross-attends to the LP tokens (einsum, no nn.MultiheadAttention).

    With ``locality_bias`` each LP token has a learnt 2-D position (initialised at the centre of the patches
    it follows in the sequence) and a coordinate's logits get -scale_h * |c - pos_j|^2, so nearby latents
    dominate. Every coordinate is processed alone, so the output is query-independent.
    """

    def __init__(self, fourier_dim: int, cfg: GINRConfig):
        super().__init__()
        W, H = cfg.decoder_width, cfg.decoder_heads
        self.heads = H
        self.to_q = nn.Linear(fourier_dim, W, bias=False)
        self.norm_ctx = nn.LayerNorm(cfg.dim)
        self.to_kv = nn.Linear(cfg.dim, 2 * W, bias=False)
        self.to_out = nn.Linear(W, W)
        self.locality = cfg.locality_bias
        if self.locality:
            self.lp_pos = nn.Parameter(_lp_centres(cfg))
            # default 2: sigma ~ 0.5 of the [-1, 1] span
            self.log_scale = nn.Parameter(torch.full((H,), math.log(cfg.locality_init)))

    def forward(self, gamma: torch.Tensor, coords: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """gamma (B, N, F), coords (B, N, 2), latent (B, M, dim) -> modulation (B, N, W)."""
        B, N, _ = gamma.shape
        M = latent.shape[1]
        q = self.to_q(gamma).view(B, N, self.heads, -1)
        k, v = self.to_kv(self.norm_ctx(latent)).view(B, M, 2, self.heads, -1).unbind(2)
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k) * q.shape[-1] ** -0.5
        if self.locality:
            d2 = (coords[:, :, None, :] - self.lp_pos).pow(2).sum(-1)  # (B, N, M)
            scores = scores - self.log_scale.exp()[:, None, None] * d2[:, None]
        out = torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1).to(v.dtype), v)
        return self.to_out(out.reshape(B, N, -1))


def _lp_centres(cfg: GINRConfig) -> torch.Tensor:
    """(num_lp, 2) centre (y, x) in [-1, 1] of the group of patches each LP token follows."""
    g = cfg.image_size // cfg.patch_size
    idx = torch.arange(cfg.num_patches, dtype=torch.float32)
    centre = torch.stack([(idx // g + 0.5) / g * 2 - 1, (idx % g + 0.5) / g * 2 - 1], dim=-1)
    return centre.view(cfg.num_lp, -1, 2).mean(1)


class Hyponet(nn.Module):
    """MLP (decoder features, Fourier encoding) -> RGB, the Fourier encoding re-entering every layer."""

    def __init__(self, in_dim: int, fourier_dim: int, hidden: int, out_dim: int = 3, layers: int = 2):
        super().__init__()
        dims = [in_dim] + [hidden] * layers
        self.hidden = nn.ModuleList(nn.Linear(d + fourier_dim, hidden) for d in dims[:-1])
        self.out = nn.Linear(hidden, out_dim)
        nn.init.constant_(self.out.bias, 0.5)  # mid-grey start for pixels in [0, 1]

    def forward(self, h: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """h (B, N, in_dim), gamma (B, N, F) -> (B, N, out_dim)."""
        for lin in self.hidden:
            h = F.relu(lin(torch.cat([h, gamma.to(h.dtype)], dim=-1)))
        return self.out(h)


class Decoder(nn.Module):
    """Coordinates + latent -> RGB: Fourier features, modulation network, SCENT-style blocks, hyponet."""

    def __init__(self, cfg: GINRConfig):
        super().__init__()
        self.cfg = cfg
        S = cfg.decoder_depth
        # One Fourier encoder per scale, an octave apart; the finest reaches max_freq.
        self.fourier = nn.ModuleList(
            FourierFeatures(2, cfg.num_bands, cfg.max_freq / 2 ** (S - 1 - s)) for s in range(S)
        )
        fdim = self.fourier[-1].out_dim
        W = cfg.decoder_width
        self.modulation = ModulationNetwork(fdim, cfg)
        self.bandwidth_lins = nn.ModuleList(Branch(fdim, cfg) for _ in range(S))
        self.modulation_lins = nn.ModuleList(Branch(W, cfg) for _ in range(S))
        self.hv_lins = nn.ModuleList(DecoderBlock(cfg) for _ in range(S - 1))
        self.norm = nn.LayerNorm(W)
        self.hyponet = Hyponet(W, fdim, cfg.hidden_dim, cfg.channels)

    def forward(self, latent: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """latent (B, M, dim), coords (B, N, 2) in [-1, 1] -> rgb (B, N, channels)."""
        check_coords(coords)
        gammas = [f(coords) for f in self.fourier]
        mod = self.modulation(gammas[-1], coords, latent)
        h = None
        for s, gamma in enumerate(gammas):
            z = self.bandwidth_lins[s](gamma, latent) * self.modulation_lins[s](mod, latent)
            h = z if h is None else self.hv_lins[s - 1](h + z, latent)
        return self.hyponet(self.norm(h), gammas[-1])


class Encoder(nn.Module):
    """Image -> latent: patch tokens, an LP token after every P/num_lp of them, BiMamba blocks."""

    def __init__(self, cfg: GINRConfig):
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=p, stride=p)
        self.pos = nn.Parameter(torch.randn(1, cfg.num_patches, cfg.dim) * 0.02)
        self.lp = nn.Parameter(torch.randn(cfg.num_lp, cfg.dim) * 0.02)
        mcfg = MambaConfig(d_model=cfg.dim, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand)
        self.mixers = nn.ModuleList(Residual(cfg.dim, BiMamba(mcfg)) for _ in range(cfg.depth))
        self.ffs = nn.ModuleList(
            Residual(cfg.dim, FeedForward(cfg.dim, mult=cfg.ff_mult)) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [0, 1] -> latent (B, num_lp, dim)."""
        cfg = self.cfg
        expect = (cfg.channels, cfg.image_size, cfg.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expect:
            raise ValueError(
                f"images must have shape (batch, {', '.join(map(str, expect))}), got {tuple(images.shape)}"
            )
        x = self.patch_embed(images * 2 - 1).flatten(2).transpose(1, 2) + self.pos  # (B, P, dim)
        B, P, D = x.shape
        groups = x.view(B, cfg.num_lp, P // cfg.num_lp, D)
        lp = self.lp.to(x.dtype)[None, :, None].expand(B, -1, -1, -1)
        x = torch.cat([groups, lp], dim=2).view(B, -1, D)  # each LP token reads its group, BiMamba both ways
        for mixer, ff in zip(self.mixers, self.ffs):
            x = checkpointed(mixer, x, enabled=cfg.checkpoint)
            x = checkpointed(ff, x, enabled=cfg.checkpoint)
        x = self.norm(x)
        return x.view(B, cfg.num_lp, -1, D)[:, :, -1]


class GINR(nn.Module):
    """Mamba-GINR: encode(images) -> latent, decode(latent, coords) -> rgb; forward does both."""

    def __init__(self, cfg: GINRConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, 32, 32) in [0, 1] -> latent (B, num_lp, dim)."""
        return self.encoder(images)

    def decode(self, latent: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """latent (B, num_lp, dim), coords (B, N, 2) in [-1, 1] -> rgb (B, N, 3)."""
        return self.decoder(latent, coords)

    def forward(self, images: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """images (B, 3, 32, 32), coords (B, N, 2) -> rgb (B, N, 3)."""
        return self.decode(self.encode(images), coords)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
