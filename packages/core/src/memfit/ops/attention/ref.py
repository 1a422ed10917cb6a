"""The plain masked-softmax attention every other path here is tested against."""

from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, *, causal=False, window=None, scale=None):
    """Naive masked-softmax attention; q (B, H, Lq, D), k/v (B, H, Lk, D) -> (B, H, Lq, D)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * scale
    Lq, Lk = q.shape[-2], k.shape[-2]
    if causal or window is not None:
        i = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
        j = torch.arange(Lk, device=q.device)[None, :]
        mask = j <= i
        if window is not None:
            mask = mask & (j > i - window)
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).to(v.dtype)) @ v


def probe(fn, device: torch.device) -> tuple[bool, str]:
    """One tiny bf16 call of a window-attention implementation ``fn`` (the registry's convention) on
    ``device`` against ``attention_ref``: (ok, detail)."""
    from memfit.ops.scan.ref import compare

    g = torch.Generator(device=device).manual_seed(0)
    batch, L, heads, hd, window = 2, 40, 2, 64, 8
    q, k, v = (
        torch.randn(batch, heads, L, hd, generator=g, device=device).to(torch.bfloat16) for _ in range(3)
    )
    out = fn(q, k, v, window, None)
    want = attention_ref(q.float(), k.float(), v.float(), window=window)
    return compare([out], [want], 2e-2)
