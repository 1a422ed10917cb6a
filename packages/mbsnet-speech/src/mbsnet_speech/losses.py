"""Speech-enhancement losses as MP-SENet / SEMamba / CMGAN train them, each term returned for the log.

- ``mag``: MSE of the compressed magnitudes |S|^0.3 (the model's own representation)
- ``com``: MSE of the compressed complex spectrum's real and imaginary parts (x2, as MP-SENet)
- ``pha``: anti-wrapping phase losses: instantaneous phase, group delay (difference along frequency)
  and instantaneous angular frequency (difference along time); a 2*pi*k error counts as zero
- ``time``: L1 of the waveforms
- ``stft``: multi-resolution STFT loss (Parallel WaveGAN): spectral convergence + L1 of log magnitudes
  at three window sizes, on the waveform the model outputs
- ``sisdr``: negative scale-invariant SDR of the waveforms in dB (Le Roux et al. 2019), as
  time-domain separation and enhancement models train (Conv-TasNet, DEMUCS variants)
- ``pesq``: a differentiable PESQ (ITU-T P.862) distance from `torch-pesq` (its loss: 0.1 x symmetric +
  0.0309 x asymmetric disturbance, the two numbers the MOS is made of; no time alignment, which the
  model's aligned output does not need): the metric we report, as a training signal
- ``stoi``: negative STOI (Taal et al. 2011) from `torch-stoi`, in [-1, 0]: the intelligibility metric we
  report, as a training signal (it keeps a PESQ-trained model from trading intelligibility for quality)

The weights live in ``LossWeights`` (config.py); a zero weight skips its term.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch_pesq import PesqLoss
from torch_stoi import NegSTOILoss

from mbsnet_speech.config import SAMPLE_RATE, LossWeights
from mbsnet_speech.metrics import si_sdr_db

# (n_fft, hop) of the multi-resolution STFT loss at 16 kHz: 16, 32 and 64 ms windows
STFT_RESOLUTIONS = ((256, 64), (512, 128), (1024, 256))


def anti_wrapping(x: torch.Tensor) -> torch.Tensor:
    """|x| folded into [0, pi]: a phase error of 2*pi*k counts as zero."""
    return torch.abs(x - 2 * math.pi * torch.round(x / (2 * math.pi)))


def phase_loss(pha_hat: torch.Tensor, pha: torch.Tensor) -> torch.Tensor:
    """Anti-wrapping instantaneous phase + group delay (along F) + inst. frequency (along T); (B, F, T)."""
    ip = anti_wrapping(pha_hat - pha).mean()
    gd = anti_wrapping(torch.diff(pha_hat, dim=1) - torch.diff(pha, dim=1)).mean()
    iaf = anti_wrapping(torch.diff(pha_hat, dim=2) - torch.diff(pha, dim=2)).mean()
    return ip + gd + iaf


def complex_loss(mag_hat: torch.Tensor, pha_hat: torch.Tensor, mag: torch.Tensor, pha: torch.Tensor):
    """2 x MSE of (real, imag) of the compressed spectra mag * exp(i pha)."""
    return 2 * F.mse_loss(
        torch.stack((mag_hat * torch.cos(pha_hat), mag_hat * torch.sin(pha_hat))),
        torch.stack((mag * torch.cos(pha), mag * torch.sin(pha))),
    )


def stft_loss(wav_hat: torch.Tensor, wav: torch.Tensor, resolutions=STFT_RESOLUTIONS) -> torch.Tensor:
    """Mean over resolutions of spectral convergence ||S - S_hat||_F / ||S||_F + mean |log S - log S_hat|.
    The target's spectra are taken outside autograd: one STFT with a backward instead of a batch of both
    (batch 4 x 1 s, 1 thread: forward and backward 17 ms instead of 37, the same value and gradient)."""

    def magnitude(x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
        window = torch.hann_window(n_fft, device=x.device)
        return torch.stft(x.float(), n_fft, hop, window=window, return_complex=True).abs().clamp_min(1e-7)

    total = wav.new_zeros(())
    for n_fft, hop in resolutions:
        m_hat = magnitude(wav_hat, n_fft, hop)
        with torch.no_grad():
            m = magnitude(wav, n_fft, hop)
        sc = torch.linalg.norm(m - m_hat) / torch.linalg.norm(m).clamp_min(1e-7)
        total = total + sc + F.l1_loss(torch.log(m_hat), torch.log(m))
    return total / len(resolutions)


def neg_si_sdr(wav_hat: torch.Tensor, wav: torch.Tensor) -> torch.Tensor:
    """-SI-SDR in dB (metrics.si_sdr_db), mean over the batch; (B, T) each."""
    return -si_sdr_db(wav_hat.float(), wav.float()).mean()


class _FirPesq(PesqLoss):
    """torch-pesq's PesqLoss with its two IIR filters (the 325-3250 Hz band that aligns the level, and
    P.862's pre-emphasis) run as their impulse responses cut at 1,024 taps (both have decayed below 1e-6
    of their peak) through an FFT convolution: the same figures (tests) in a few ops, where the IIR's
    sample-by-sample loop is thousands of ops under FakeTensorMode (a 15x slower memory pre-flight)."""

    TAPS = 1024
    responses: dict[str, np.ndarray] = {}  # filled once below, outside any FakeTensorMode

    @classmethod
    def impulse_responses(cls) -> None:
        iir = PesqLoss(1.0, sample_rate=SAMPLE_RATE)
        impulse = np.zeros(cls.TAPS)
        impulse[0] = 1.0
        for name in ("power_filter", "pre_filter"):
            b, a = getattr(iir, name).detach().numpy().astype(np.float64)
            import scipy.signal  # on first use: 0.7 s of start-up for every importer of the losses

            cls.responses[name] = scipy.signal.lfilter(b, a, impulse)

    def _fir(self, signal: torch.Tensor, name: str) -> torch.Tensor:
        """The causal filter's output (same length): an FFT convolution at a fast FFT size (at 1 s, 17,280
        instead of a plain full convolution's 17,023: the loss's forward and backward at batch 4 x 1 s on
        1 thread took 13 ms instead of 53; torch-pesq's own IIR version 16 ms)."""
        n = signal.shape[1]
        import scipy.fft

        size = scipy.fft.next_fast_len(n + self.TAPS - 1, real=True)
        h = torch.as_tensor(self.responses[name], dtype=signal.dtype, device=signal.device)
        return torch.fft.irfft(torch.fft.rfft(signal, size) * torch.fft.rfft(h, size), size)[:, :n]

    def align_level(self, signal: torch.Tensor) -> torch.Tensor:
        filtered = self._fir(signal, "power_filter")
        power = (filtered**2).sum(dim=1, keepdim=True) / (filtered.shape[1] + 5120) / 1.04684
        return signal * (10**7 / power).sqrt()

    def preemphasize(self, signal: torch.Tensor) -> torch.Tensor:
        emp = torch.linspace(0, 15, 16, device=signal.device)[1:] / 16.0
        ramps = torch.ones(signal.shape[1], device=signal.device)
        ramps[:15], ramps[-15:] = emp, torch.flip(emp, dims=(0,))
        return self._fir(signal * ramps, "pre_filter")


_FirPesq.impulse_responses()


def pesq_loss(wav_hat: torch.Tensor, wav: torch.Tensor) -> torch.Tensor:
    """torch-pesq's PESQ distance, mean over the batch items whose clean crop is not silent; (B, T) each,
    16 kHz. Kept finite: a silent reference has no PESQ, so its items score a 440 Hz tone against itself
    and weigh 0 (static shapes, for FakeTensorMode), and a fixed -100 dBFS dither goes into both signals,
    since an all-zero frame (a zero-padded crop) has a zero spectrum, whose magnitude has no gradient."""
    n = wav.shape[-1]
    keep = wav.float().pow(2).mean(-1, keepdim=True).sqrt() > 1e-3
    tone = 0.1 * torch.sin(2 * math.pi * 440 / SAMPLE_RATE * torch.arange(n, device=wav.device))
    dither = 1e-5 * torch.randn(n, generator=torch.Generator().manual_seed(0)).to(wav.device)
    ref = torch.where(keep, wav.float(), tone) + dither
    deg = torch.where(keep, wav_hat.float(), tone) + dither
    # built per call, so that its filter constants are fake tensors under FakeTensorMode
    per_item = _FirPesq(1.0, sample_rate=SAMPLE_RATE).to(wav.device)(ref, deg).float()
    return (per_item * keep.squeeze(-1)).sum() / keep.sum().clamp_min(1)


def stoi_loss(wav_hat: torch.Tensor, wav: torch.Tensor) -> torch.Tensor:
    """torch-stoi's negative STOI, mean over the batch; (B, T) each, 16 kHz (resampled to STOI's 10 kHz
    inside). Without its voice-activity step, which drops silent frames by a data-dependent selection that
    FakeTensorMode cannot trace: silent frames count here (pystoi's metric leaves them out). Built per call,
    so that its constants are fake tensors under FakeTensorMode."""
    with warnings.catch_warnings():  # torch-stoi names torchaudio's resampling method by its old name
        warnings.filterwarnings("ignore", message=".*sinc_interpolation", category=UserWarning)
        loss = NegSTOILoss(SAMPLE_RATE, use_vad=False)
    return loss.to(wav.device)(wav_hat.float(), wav.float()).mean()


def enhancement_loss(model, batch: tuple[torch.Tensor, torch.Tensor], weights: LossWeights | None = None):
    """batch = (noisy, clean) (B, T) -> (weighted loss, {term: value}) for every term with a weight."""
    w = weights or LossWeights()
    noisy, clean = batch
    out = model(noisy)
    raw = model.module if hasattr(model, "module") else model  # DDP wraps the model
    with torch.no_grad():
        mag, pha = raw.stft(clean)
    terms = {}
    if w.mag:
        terms["mag"] = F.mse_loss(out.mag, mag)
    if w.com:
        terms["com"] = complex_loss(out.mag, out.pha, mag, pha)
    if w.pha:
        terms["pha"] = phase_loss(out.pha, pha)
    if w.time:
        terms["time"] = F.l1_loss(out.wav.float(), clean.float())
    if w.stft:
        terms["stft"] = stft_loss(out.wav, clean)
    if w.sisdr:
        terms["sisdr"] = neg_si_sdr(out.wav, clean)
    if w.pesq:
        terms["pesq"] = pesq_loss(out.wav, clean)
    if w.stoi:
        terms["stoi"] = stoi_loss(out.wav, clean)
    loss = sum(getattr(w, k) * v for k, v in terms.items())
    return loss, {k: v.detach() for k, v in terms.items()}
