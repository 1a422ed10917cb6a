"""FlashAttention-2's causal window as PyTorch bundles it (``torch.nn.attention.varlen.varlen_attn``): a CUDA
candidate for fp16/bf16."""

from __future__ import annotations

import torch


def varlen_window(q, k, v, window, scale):
    """A causal window of ``window`` keys with the FlashAttention-2 kernel bundled in PyTorch
    (``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16): the batch packed as B sequences of L."""
    from torch.nn.attention.varlen import varlen_attn

    B, H, L, D = q.shape
    packed = [t.transpose(1, 2).reshape(B * L, H, t.shape[-1]) for t in (q, k, v)]
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)
    out = varlen_attn(*packed, cu, cu, L, L, scale=scale, window_size=(window - 1, 0))
    return out.view(B, L, H, -1).transpose(1, 2)


def problem(q, k, v, window: int = 0, scale=None) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}: FlashAttention takes fp16/bf16"
    if q.shape[-1] > 256 or v.shape[-1] != q.shape[-1]:
        return "head dims over 256 or unequal"
    return None
