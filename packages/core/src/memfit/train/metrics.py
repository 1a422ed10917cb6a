"""Image quality metrics shared by the image systems (GINR reconstructions, triplane renders)."""

from __future__ import annotations

import math

import torch

MSE_FLOOR = 1e-10  # an exact reconstruction scores 10 log10(max^2 / MSE_FLOOR): 100 dB, not inf


def psnr_per_image(pred: torch.Tensor, target: torch.Tensor, max_value: float = 1.0) -> torch.Tensor:
    """pred, target (N, ...) with values in [0, max_value] -> PSNR in dB per item (N,): torchmetrics'
    peak_signal_noise_ratio over each item, in float32.

    The MSE is floored at MSE_FLOOR so an exact reconstruction gives a large finite number, not inf.
    """
    from torchmetrics.functional.image import peak_signal_noise_ratio

    if pred.shape != target.shape:
        raise ValueError(f"psnr: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    dims = tuple(range(1, pred.ndim))
    psnr = peak_signal_noise_ratio(
        pred.float(), target.float(), data_range=max_value, reduction="none", dim=dims
    )
    return psnr.clamp_max(10 * math.log10(max_value**2 / MSE_FLOOR))
