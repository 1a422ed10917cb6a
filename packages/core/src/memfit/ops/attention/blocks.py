"""SDPA per block of queries against the keys its window reaches (a boolean band mask): every device; on the
CPU the path below ``registry.BAND_MIN_RATIO`` windows, and a CUDA candidate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# SDPA per query block of max(w // 2, BLOCKS_MIN) queries (the registry's rule: the band path from
# L >= BAND_MIN_RATIO windows on the CPU)
BLOCKS_MIN = 32


def _window_mask(q0: int, q1: int, k0: int, window: int, device) -> torch.Tensor:
    """Bool (q1-q0, q1-k0): True where query q0+i may see key k0+j (k0+j <= q0+i < k0+j+window).

    The band between two diagonals: three ops, ~3 us at (128, 255) on one thread, so it is built per
    call rather than cached (a cache must not keep the fake tensors of an estimate)."""
    d = q0 - k0
    band = torch.ones(q1 - q0, q1 - k0, dtype=torch.bool, device=device)
    return band.tril_(d).triu_(d - window + 1)


def sdpa_blocks(q, k, v, window: int, scale: float | None = None, block: int | None = None):
    """Causal window attention as SDPA calls on blocks of queries: q, k, v (B, H, L, D) -> (B, H, L, Dv).

    Block [s, e) attends keys [s - w + 1, e) under a boolean band mask; every full interior block shares
    one mask. Time O(L * (block + w)); SDPA's CPU flash kernel keeps its memory O(L)."""
    L = q.shape[-2]
    c = max(window // 2, BLOCKS_MIN) if block is None else block
    if c >= L or (block is None and 2 * c >= L):  # two blocks would cost about what one masked call does
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(0, L, 0, window, q.device),
                                              scale=scale)  # fmt: skip
    outs = []
    interior = None  # every full interior block sees keys at the same offsets: one mask for all of them
    for s in range(0, L, c):
        e, k0 = min(L, s + c), max(0, s - window + 1)
        if k0 > 0 and e - s == c:
            if interior is None:
                interior = _window_mask(0, c, 1 - window, window, q.device)
            mask = interior
        else:
            mask = _window_mask(s, e, k0, window, q.device)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], attn_mask=mask,
                                                   scale=scale))  # fmt: skip
    return torch.cat(outs, dim=-2)
