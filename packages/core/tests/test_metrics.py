import math

import pytest
import torch
from memfit.train.metrics import psnr_per_image


def test_psnr_known_values():
    target = torch.zeros(2, 3, 4, 4)
    pred = torch.stack([torch.full((3, 4, 4), 0.1), torch.full((3, 4, 4), 0.01)])
    torch.testing.assert_close(psnr_per_image(pred, target), torch.tensor([20.0, 40.0]))
    assert psnr_per_image(target, target)[0] == pytest.approx(100.0)  # floored MSE, not inf
    assert psnr_per_image(pred * 255, target, max_value=255)[0] == pytest.approx(20.0, abs=1e-4)
    assert math.isfinite(psnr_per_image(torch.rand(1, 5), torch.rand(1, 5)).item())


def test_psnr_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="differ in shape"):
        psnr_per_image(torch.zeros(1, 3), torch.zeros(1, 4))


def test_psnr_is_the_formula_it_replaced():
    """torchmetrics' PSNR gives, to float32 rounding, what memfit computed by hand before it used it:
    10 log10(max^2 / MSE per image), MSE floored at 1e-10."""

    def by_hand(pred, target, max_value=1.0):
        mse = (pred.float() - target.float()).pow(2).flatten(1).mean(1).clamp_min(1e-10)
        return 10 * torch.log10(max_value**2 / mse)

    g = torch.Generator().manual_seed(0)
    target = torch.rand(8, 3, 32, 32, generator=g)
    noise = torch.randn(8, 3, 32, 32, generator=g) * torch.logspace(-4, -0.5, 8).view(8, 1, 1, 1)
    pred = (target + noise).clamp(0, 1)
    pred[0] = target[0]  # exact: the floor
    torch.testing.assert_close(psnr_per_image(pred, target), by_hand(pred, target), rtol=1e-5, atol=1e-4)
    as_bytes = (pred * 255).round().to(torch.uint8), (target * 255).round().to(torch.uint8)
    torch.testing.assert_close(psnr_per_image(*as_bytes, max_value=255), by_hand(*as_bytes, 255.0))
