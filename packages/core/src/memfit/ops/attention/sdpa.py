"""SDPA for full and causal attention (a window covering the whole sequence included), and the stand-in an
estimate's trace runs for a CUDA window kernel."""

from __future__ import annotations

import torch.nn.functional as F


def _sdpa(q, k, v, causal, scale):
    Lq, Lk = q.shape[-2], k.shape[-2]
    if causal and Lq != Lk:
        from torch.nn.attention.bias import causal_lower_right

        # Same alignment as flash-attn and attention_ref: the last query sees every key.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Lq, Lk), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def flash_like(q, k, v, window: int, scale):
    """What a CUDA window kernel keeps (flash-attn's or compiled Flex's: the output and its logsumexp), as
    causal SDPA, whose CUDA target traces the flash kernel: the stand-in of an estimate's trace."""
    return _sdpa(q, k, v, True, scale)
