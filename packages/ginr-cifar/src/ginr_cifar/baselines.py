"""The seed's naive decoder mixer, kept as the memory baseline (`--decoder attn`), out of the model file.

Self-attention over all N query coordinates with the (B, heads, N, N) scores materialised: what made the
paper-size step need >= 25 GiB. ``memfit budget`` measures it against the ``ff`` / ``xattn`` decoders.
"""

from __future__ import annotations

import torch
from memfit.ops.attention import attention_ref
from torch import nn


class NaiveSelfAttention(nn.Module):
    """Self-attention over the query coordinates with materialised scores (the seed's baseline)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, dim); builds the (B, heads, N, N) score matrix."""
        B, N, D = x.shape
        q, k, v = self.to_qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = attention_ref(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(B, N, D))
