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
