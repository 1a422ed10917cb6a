"""The seed's self-attention, kept as the memory baseline (`--attention naive`), out of the model file.

``nn.MultiheadAttention`` over 3 x 64 x 64 = 12,288 triplane tokens materialised a (batch, heads, 12288,
12288) fp32 score matrix: 36 GiB at batch 4 with 16 heads. ``memfit budget`` measures it against the
model's own ``SelfAttention`` (memfit.ops.attention: SDPA / flash, memory linear in tokens).
"""

from __future__ import annotations

import torch
from memfit.ops.attention import attention_ref
from torch import nn


class NaiveSelfAttention(nn.Module):
    """``SelfAttention`` with the (B, heads, N, N) scores materialised (attention_ref); the same
    parameters, so one state dict loads into either."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, dim) -> (B, N, dim); builds the (B, heads, N, N) score matrix."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = attention_ref(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, self.heads * self.head_dim))
