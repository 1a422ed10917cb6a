"""causal-conv1d's CUDA kernel (the ``cuda`` extra) in the registry's conv calling convention.

Importing this module fails where causal-conv1d is not installed or its extension does not load; the
registry then counts the implementation as not available."""

from __future__ import annotations

import torch
from causal_conv1d import causal_conv1d_fn as _causal_conv1d_fn

from memfit.ops.conv.ref import conv_layout


def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (batch, d, L), weight (d, 1, k) -> silu(causal conv) (batch, d, L)."""
    return _causal_conv1d_fn(conv_layout(x), weight.squeeze(1), bias, activation="silu")
