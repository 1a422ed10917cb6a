"""The conv's reference (PyTorch's conv1d with left padding), the layout causal-conv1d takes, and the probe
a kernel passes before the registry uses it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.ops import device
from memfit.ops.scan.ref import compare


def conv_silu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's conv1d with left padding only: the look-ahead outputs are trimmed."""
    return F.silu(
        F.conv1d(x, weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])[..., : x.shape[-1]]
    )


def conv_layout(x: torch.Tensor) -> torch.Tensor:
    """x as causal-conv1d takes it: a channels-last x whose batch/L strides are not multiples of 8 (a view
    into a wider tensor) is copied into a dense channels-last tensor, whose strides are dim and L*dim."""
    if device.channels_last(x) and (x.stride(0) % 8 or x.stride(2) % 8):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


def probe(fn, device: torch.device) -> tuple[bool, str]:
    """One tiny call of a conv implementation on ``device`` in a Mamba block's layout (channels-last, a view
    of half of the in_proj output), forward and the gradient of x, against ``conv_silu_ref``."""
    g = torch.Generator(device=device).manual_seed(0)
    batch, dim, L, width = 2, 16, 37, 4
    x = torch.randn(batch, L, 2 * dim, generator=g, device=device)[..., :dim].transpose(1, 2)
    w = torch.randn(dim, 1, width, generator=g, device=device)
    b = torch.randn(dim, generator=g, device=device)
    x = x.detach().requires_grad_(True)
    out = fn(x, w, b)
    (gx,) = torch.autograd.grad(out.float().sum(), x)
    x_ref = x.detach().requires_grad_(True)
    want = conv_silu_ref(x_ref, w, b)
    (gx_ref,) = torch.autograd.grad(want.sum(), x_ref)
    return compare([out, gx], [want, gx_ref], 1e-3)
