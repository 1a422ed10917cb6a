"""Image quality metrics shared by the image systems (GINR reconstructions, triplane renders)."""

from __future__ import annotations

import torch


def psnr_per_image(pred: torch.Tensor, target: torch.Tensor, max_value: float = 1.0) -> torch.Tensor:
    """pred, target (N, ...) with values in [0, max_value] -> PSNR in dB per item (N,).

    The MSE is floored at 1e-10 so an exact reconstruction gives a large finite number, not inf.
    """
    if pred.shape != target.shape:
        raise ValueError(f"psnr: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    mse = (pred.float() - target.float()).pow(2).flatten(1).mean(1).clamp_min(1e-10)
    return 10 * torch.log10(max_value**2 / mse)
