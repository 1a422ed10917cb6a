"""flash-attn's sliding-window kernel (the ``cuda`` extra) in the registry's window-attention convention.

Importing this module fails where flash-attn is not installed or its extension does not load (it builds
without CUDA only when forced, and then cannot load); the registry then counts it as not available."""

from __future__ import annotations

import torch
from flash_attn import flash_attn_func as _flash_attn_func


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale) -> torch.Tensor:
    """q, k, v (B, H, L, D) -> (B, H, L, D): query i sees keys i-w+1..i (flash-attn's layout is (B, L, H,
    D))."""
    o = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                         causal=True, window_size=(window - 1, 0))  # fmt: skip
    return o.transpose(1, 2)
