"""MBS-Net: band-split Mamba speech enhancement with a magnitude mask and an explicit phase estimate.

wav (B, T) -> STFT (16 kHz, n_fft 512, hop 100, win 400) -> compressed magnitude |X|^0.3 and phase
-> band split into K sub-bands (per-band LayerNorm + Linear to C channels) -> N encoder layers, each a
temporal Mamba over frames (per band) and a cross-band Mamba over bands (per frame), pre-norm residual
-> magnitude mask head (per-band Linear + sigmoid) and phase head (per-band Linear to two outputs,
offset = atan2) -> iSTFT.

Everything before the heads acts frame by frame except the temporal Mamba, so with a unidirectional
temporal Mamba the mask and phase of frame t depend on frames <= t only (streamable).

Two scans: "chunked" uses memfit.ops.mamba (memfit.ops.scan.selective_scan: chunked, recomputed in backward);
"materialise" reproduces the seed's real_mamba scan that builds (B, L, D, N) tensors and loops over L,
kept as the memory baseline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from memfit.ops.layers import checkpointed
from torch import nn

from mbsnet_speech.baselines import SeedBiMamba, SeedMamba
from mbsnet_speech.config import MBSNetConfig, band_widths


def make_mamba(cfg: MBSNetConfig, bidirectional: bool) -> nn.Module:
    """A (bi)directional Mamba over (b, L, channels) with the config's scan."""
    if cfg.scan == "materialise":
        kw = dict(d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand)
        return SeedBiMamba(cfg.channels, **kw) if bidirectional else SeedMamba(cfg.channels, **kw)
    from memfit.ops.mamba import BiMamba, Mamba

    mcfg = _mamba_config(cfg)
    return BiMamba(mcfg, combine="sum") if bidirectional else Mamba(mcfg)


def _mamba_config(cfg: MBSNetConfig):
    """memfit.ops.mamba.MambaConfig for the config; a fractional expand (1.5) gives d_inner = int(expand *
    C)."""
    from memfit.ops.mamba import MambaConfig

    return MambaConfig(d_model=cfg.channels, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand)


# ----------------------------------------------------------------------------------------------------
# Band split, encoder, heads
# ----------------------------------------------------------------------------------------------------


class BandSplit(nn.Module):
    """(B, F, T, 2) compressed complex spectrum -> (B, K, T, C): per band, LayerNorm over its bins
    (per frame, so it stays causal) and a Linear to C channels.

    The per-frame LayerNorm removes the band's level in that frame; with `energy` the band's log energy
    (a quarter of the natural log of the mean squared compressed value) goes in beside it, so the model
    can tell a quiet, noise-only frame from a loud one as a Wiener filter does."""

    def __init__(self, widths: list[int], channels: int, energy: bool = False) -> None:
        super().__init__()
        self.widths, self.energy = widths, energy
        self.norms = nn.ModuleList(nn.LayerNorm(2 * w) for w in widths)
        self.projs = nn.ModuleList(nn.Linear(2 * w + int(energy), channels) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = x.shape
        out = []
        for band, norm, proj in zip(x.split(self.widths, dim=1), self.norms, self.projs):
            band = band.permute(0, 2, 1, 3).reshape(B, T, -1)  # (B, T, 2w)
            h = norm(band)
            if self.energy:
                h = torch.cat((h, 0.25 * torch.log(band.float().pow(2).mean(-1, keepdim=True) + 1e-6)), -1)
            out.append(proj(h))
        return torch.stack(out, dim=1)


class EncoderLayer(nn.Module):
    """Temporal Mamba over frames (per band), then cross-band Mamba over bands (per frame); (B, K, T, C)."""

    def __init__(self, cfg: MBSNetConfig) -> None:
        super().__init__()
        self.norm_t = nn.LayerNorm(cfg.channels)
        self.temporal = make_mamba(cfg, cfg.temporal_bidirectional)
        self.norm_k = nn.LayerNorm(cfg.channels)
        self.crossband = make_mamba(cfg, cfg.crossband_bidirectional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, K, T, C = x.shape
        h = x.reshape(B * K, T, C)
        h = h + self.temporal(self.norm_t(h))
        h = h.reshape(B, K, T, C).transpose(1, 2).reshape(B * T, K, C)
        h = h + self.crossband(self.norm_k(h))
        return h.reshape(B, T, K, C).transpose(1, 2)


class Encoder(nn.Module):
    """Band split + N encoder layers + final norm: (B, F, T, 2) -> (B, K, T, C)."""

    def __init__(self, cfg: MBSNetConfig, widths: list[int]) -> None:
        super().__init__()
        self.checkpoint = cfg.checkpoint
        self.split = BandSplit(widths, cfg.channels, cfg.band_energy)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.split(x)
        for layer in self.layers:
            h = checkpointed(layer, h, enabled=self.checkpoint and self.training)
        return self.norm(h)


class BandHead(nn.Module):
    """(B, K, T, C) -> (B, F, T, out): per band a Linear to width*out (or the seed's MLP)."""

    def __init__(self, widths: list[int], channels: int, out: int, hidden: int = 0) -> None:
        super().__init__()
        self.widths, self.out = widths, out

        def head(w: int) -> nn.Module:
            if hidden:
                return nn.Sequential(nn.Linear(channels, hidden), nn.Tanh(), nn.Linear(hidden, w * out))
            return nn.Linear(channels, w * out)

        self.heads = nn.ModuleList(head(w) for w in widths)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = h.shape
        outs = []
        for k, (w, head) in enumerate(zip(self.widths, self.heads)):
            outs.append(head(h[:, k]).reshape(B, T, w, self.out))
        return torch.cat(outs, dim=2).transpose(1, 2)  # (B, F, T, out)


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


class Enhanced(NamedTuple):
    wav: torch.Tensor  # (B, T) enhanced waveform
    mag: torch.Tensor  # (B, F, frames) compressed magnitude |S|^0.3
    pha: torch.Tensor  # (B, F, frames) phase


def pcs_gamma(n_bins: int, sample_rate: int) -> torch.Tensor:
    """Per-bin exponent for perceptual contrast stretching: 1 outside speech, up to 1.2 in 0.3-3.4 kHz.

    Our own smooth profile in the spirit of PCS (Chao et al.; SEMamba's PCS400), not their table.
    """
    f = torch.linspace(0, sample_rate / 2, n_bins)
    rise = torch.clamp(f / 300.0, max=1.0)
    fall = torch.clamp((7000.0 - f) / (7000.0 - 3400.0), min=0.0, max=1.0)
    return 1.0 + 0.2 * rise * fall


def overlap_add_istft(spec: torch.Tensor, c: MBSNetConfig, window: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of torch.stft(center=True): complex (B, F, frames) -> (B, length).

    Same result as torch.istft, written with irfft + fold because torch.istft checks the window
    envelope with a data-dependent comparison that fake tensors (memory estimation) cannot answer.
    """
    frames = spec.shape[-1]
    left = (c.n_fft - c.win) // 2  # torch.stft centres a short window inside n_fft
    win = F.pad(window, (left, c.n_fft - c.win - left))
    x = torch.fft.irfft(spec, n=c.n_fft, dim=1) * win[:, None]  # (B, n_fft, frames)
    total = (frames - 1) * c.hop + c.n_fft
    fold = dict(output_size=(1, total), kernel_size=(1, c.n_fft), stride=(1, c.hop))
    y = F.fold(x, **fold).reshape(x.shape[0], total)
    env = F.fold((win**2)[None, :, None].expand(1, c.n_fft, frames), **fold).reshape(total)
    start = c.n_fft // 2
    y = y[:, start : start + length] / env[start : start + length].clamp_min(1e-11)
    return F.pad(y, (0, length - y.shape[1]))


class MBSNet(nn.Module):
    def __init__(self, cfg: MBSNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.widths = band_widths(cfg.n_bins, cfg.num_bands, cfg.band_growth)
        self.encoder = Encoder(cfg, self.widths)
        self.phase_encoder = Encoder(cfg, self.widths) if cfg.dual_branch else None
        self.mask_head = BandHead(self.widths, cfg.channels, 1, cfg.head_hidden)
        self.phase_head = BandHead(self.widths, cfg.channels, 2, cfg.head_hidden)
        self.register_buffer("window", torch.hann_window(cfg.win), persistent=False)
        self.register_buffer("gamma", pcs_gamma(cfg.n_bins, cfg.sample_rate), persistent=False)
        self._init_phase_head()

    def _init_phase_head(self) -> None:
        # Start at "keep the noisy phase": outputs (a, b) ~ (1, 0), so atan2(b, a) ~ 0 away from its
        # singularity at (0, 0).
        with torch.no_grad():
            for head in self.phase_head.heads:
                last = head[-1] if isinstance(head, nn.Sequential) else head
                last.weight.mul_(0.1)
                last.bias.view(-1, 2).copy_(torch.tensor([1.0, 0.0]))

    # -- STFT -------------------------------------------------------------------------------------
    def stft(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """wav (B, T) -> compressed magnitude, phase (B, F, frames); frames = T // hop + 1."""
        c = self.cfg
        spec = torch.stft(wav.float(), c.n_fft, c.hop, c.win, self.window, center=True, return_complex=True)
        return spec.abs().pow(c.compress), torch.angle(spec)

    def istft(self, mag: torch.Tensor, pha: torch.Tensor, length: int) -> torch.Tensor:
        """compressed magnitude, phase (B, F, frames) -> wav (B, length)."""
        c = self.cfg
        mag = mag.clamp_min(1e-8).pow(1.0 / c.compress)
        return overlap_add_istft(
            torch.complex(mag * torch.cos(pha), mag * torch.sin(pha)), c, self.window, length
        )

    # -- frame level ------------------------------------------------------------------------------
    def spec_forward(self, mag: torch.Tensor, pha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed magnitude, phase (B, F, frames) -> mask in (0, 1), phase offset (B, F, frames)."""
        x = torch.stack((mag * torch.cos(pha), mag * torch.sin(pha)), dim=-1)  # (B, F, T, 2)
        h = self.encoder(x)
        hp = self.phase_encoder(x) if self.phase_encoder is not None else h
        mask = torch.sigmoid(self.mask_head(h)[..., 0].float())
        ab = self.phase_head(hp).float()
        return mask, torch.atan2(ab[..., 1], ab[..., 0])

    def enhance_once(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass: noisy wav (B, T) -> enhanced wav (B, T), compressed magnitude, phase."""
        mag, pha = self.stft(wav)
        mask, dpha = self.spec_forward(mag, pha)
        mag_hat, pha_hat = mask * mag, pha + dpha
        if self.cfg.pcs and not self.training:
            lin = mag_hat.pow(1.0 / self.cfg.compress)
            lin = torch.expm1(self.gamma[:, None] * torch.log1p(lin))
            mag_hat = lin.pow(self.cfg.compress)
        return self.istft(mag_hat, pha_hat, wav.shape[1]), mag_hat, pha_hat

    def shift_average(self, wav: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The mean of `out` (the pass at delay 0) and the passes with the input delayed by k * hop / shifts
        samples (k = 1 .. shifts - 1), each output moved back: one batch of the delayed copies."""
        B, T = wav.shape
        delays = [k * self.cfg.hop // self.cfg.shifts for k in range(1, self.cfg.shifts)]
        last = delays[-1]
        batch = torch.cat([F.pad(wav, (d, last - d)) for d in delays])
        passes = self.enhance_once(batch)[0].view(len(delays), B, T + last)
        total = out + sum(passes[i, :, d : d + T] for i, d in enumerate(delays))
        return total / self.cfg.shifts

    def forward(self, wav: torch.Tensor) -> Enhanced:
        """Noisy wav (B, T) -> Enhanced(wav (B, T), compressed magnitude, phase). With shifts > 1 (eval mode)
        the wav is the average of the shifted passes; magnitude and phase are the undelayed pass's."""
        if wav.dim() != 2:
            raise ValueError(f"MBSNet expects a batch of mono waveforms (B, T), got shape {tuple(wav.shape)}")
        if wav.shape[1] < self.cfg.win:
            raise ValueError(
                f"input has {wav.shape[1]} samples, shorter than one STFT window ({self.cfg.win})"
            )
        out, mag_hat, pha_hat = self.enhance_once(wav)
        if self.cfg.shifts > 1 and not self.training:
            out = self.shift_average(wav, out)
        if self.cfg.keep_noisy and not self.training:  # a floor on suppression: fewer speech artefacts
            out = out + self.cfg.keep_noisy * (wav - out)
        return Enhanced(out, mag_hat, pha_hat)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(cfg: MBSNetConfig) -> MBSNet:
    return MBSNet(cfg)
