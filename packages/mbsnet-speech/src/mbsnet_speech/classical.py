"""The classical baseline: a Wiener filter with a decision-directed a-priori SNR (Ephraim & Malah, 1984).

Everything comes from the noisy input alone: the noise power spectrum is the mean power of its quietest
frames (speech has pauses; stationary noise fills them), the a-priori SNR of each bin is the
decision-directed blend of the previous frame's clean estimate and this frame's a-posteriori SNR, and
the gain xi / (1 + xi) is floored so residual noise stays smooth instead of turning into musical tones.
``eval`` reports it beside the model: a learned enhancer that does not beat it has not learned much.
"""

from __future__ import annotations

import numpy as np
import torch

N_FFT, HOP = 512, 128  # 32 ms frames, 75% overlap at 16 kHz


def wiener_enhance(
    noisy: np.ndarray,
    quiet_fraction: float = 0.1,
    alpha: float = 0.98,
    gain_floor: float = 0.1,
    n_fft: int = N_FFT,
    hop: int = HOP,
) -> np.ndarray:
    """Enhance a mono float signal (n,) -> (n,) with a decision-directed Wiener filter."""
    x = torch.from_numpy(np.asarray(noisy, dtype=np.float32))
    if x.ndim != 1 or x.numel() < n_fft // 2 + 1:
        raise ValueError(f"wiener_enhance needs a mono signal of at least {n_fft // 2 + 1} samples")
    window = torch.hann_window(n_fft)
    spec = torch.stft(x, n_fft, hop, window=window, return_complex=True)  # (F, T)
    power = spec.abs().pow(2).double()
    frames = power.shape[1]
    quiet = power.sum(0).argsort()[: max(1, int(round(quiet_fraction * frames)))]
    noise = power[:, quiet].mean(1).clamp_min(1e-12)  # (F,)
    gamma = power / noise[:, None]  # a-posteriori SNR
    gain = torch.empty_like(power)
    prev = torch.zeros_like(noise)  # |S_hat(t-1)|^2 / noise
    for t in range(frames):
        xi = alpha * prev + (1 - alpha) * (gamma[:, t] - 1).clamp_min(0)
        g = (xi / (1 + xi)).clamp_min(gain_floor)
        gain[:, t] = g
        prev = g**2 * gamma[:, t]
    out = torch.istft(spec * gain.float(), n_fft, hop, window=window, length=x.numel())
    return out.numpy()
