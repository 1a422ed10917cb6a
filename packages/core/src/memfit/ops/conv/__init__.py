"""The depthwise causal conv1d + SiLU of a Mamba block: one entry point, every implementation beside its
reference (the scan's shape, ``memfit.ops.scan``).

``causal_conv_silu(x, weight, bias)``: x (batch, d, L), weight (d, 1, k), bias (d,) or None ->
silu(conv1d(x) trimmed to the causal outputs), (batch, d, L) in x's dtype. The registry
(``memfit.ops.registry``) chooses:

- ``ref.py``: ``conv_silu_ref`` (PyTorch's conv1d, cuDNN on CUDA), everywhere; the reference and the probe.
- ``cpu.py``: the fused C kernel on the CPU (``memfit.ops.cpu_kernel``), as torch custom ops.
- ``causal_conv1d.py``: causal-conv1d's CUDA kernel (the ``cuda`` extra), when installed and its probe passed.
"""

from __future__ import annotations

import torch

from memfit.ops import registry
from memfit.ops.conv.cpu import conv_silu
from memfit.ops.conv.ref import conv_layout, conv_silu_ref, probe

__all__ = ["causal_conv_silu", "conv_layout", "conv_silu", "conv_silu_ref", "probe"]


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: bool = True):
    """silu(depthwise causal conv1d(x)): x (batch, d, L) -> (batch, d, L); the registry's choice."""
    _, fn = registry.choose("conv", x, weight, bias, kernels=kernels)
    return fn(x, weight, bias)
