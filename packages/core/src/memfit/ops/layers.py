"""Shared layers: activation checkpointing (`checkpointed`), PreNorm, GEGLU FeedForward,
CrossAttention (through memfit.ops.attention), FourierFeatures."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from memfit.ops.attention import attention


def checkpointed(fn: Callable[..., Any], *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
    """Run fn(*args), keeping only its inputs for backward and recomputing its inside (when enabled)."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


class PreNorm(nn.Module):
    """LayerNorm the input (and the context, when context_dim is given), then apply fn."""

    def __init__(self, dim: int, fn: nn.Module, context_dim: int | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """x (..., dim) -> fn(norm(x), ...); the context (``context=`` or first extra arg) is normed too
        when context_dim was given."""
        x = self.norm(x)
        if self.norm_context is not None:
            if kwargs.get("context") is not None:
                kwargs["context"] = self.norm_context(kwargs["context"])
            elif args and args[0] is not None:
                args = (self.norm_context(args[0]), *args[1:])
        return self.fn(x, *args, **kwargs)


class GEGLU(nn.Module):
    """Split the last dim in two halves: x * gelu(gate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU feed-forward: (..., dim) -> (..., dim), hidden width dim * mult."""

    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = dim * mult
        self.net = nn.Sequential(
            nn.Linear(dim, hidden * 2), GEGLU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (..., dim)."""
        return self.net(x)


class CrossAttention(nn.Module):
    """Multi-head attention of x over context (self-attention when context is None), via ``attention``."""

    def __init__(
        self,
        query_dim: int,
        context_dim: int | None = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        inner = heads * dim_head
        context_dim = query_dim if context_dim is None else context_dim
        self.heads = heads
        self.dim_head = dim_head
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim, inner * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Dropout(dropout))

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        causal: bool = False,
        window: int | None = None,
    ) -> torch.Tensor:
        """x (B, N, query_dim), context (B, M, context_dim) or None -> (B, N, query_dim)."""
        context = x if context is None else context
        if context.shape[0] != x.shape[0]:
            raise ValueError(
                f"CrossAttention: batch of x ({x.shape[0]}) and context ({context.shape[0]}) differ"
            )
        B, N, _ = x.shape
        M = context.shape[1]
        q = self.to_q(x).view(B, N, self.heads, self.dim_head).transpose(1, 2)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        k = k.reshape(B, M, self.heads, self.dim_head).transpose(1, 2)
        v = v.reshape(B, M, self.heads, self.dim_head).transpose(1, 2)
        out = attention(q, k, v, causal=causal, window=window, scale=self.scale)
        return self.to_out(out.transpose(1, 2).reshape(B, N, self.heads * self.dim_head))


class FourierFeatures(nn.Module):
    """Coordinates in [-1, 1] (..., in_dim) -> [x?, sin(pi f x), cos(pi f x)] (..., out_dim).

    Frequencies f are ``num_bands`` values spaced linearly from 1 to ``max_freq / 2`` (Perceiver's
    convention: max_freq is the Nyquist-style sampling rate), applied to every input coordinate.
    """

    def __init__(self, in_dim: int, num_bands: int, max_freq: float, include_input: bool = True) -> None:
        super().__init__()
        if in_dim < 1 or num_bands < 1:
            raise ValueError(f"FourierFeatures: in_dim and num_bands must be >= 1, got {in_dim}, {num_bands}")
        if max_freq < 2:
            raise ValueError(
                f"FourierFeatures: max_freq must be >= 2 (highest band is max_freq/2), got {max_freq}"
            )
        self.in_dim = in_dim
        self.include_input = include_input
        self.register_buffer("freqs", torch.linspace(1.0, max_freq / 2, num_bands), persistent=False)
        self.out_dim = in_dim * (2 * num_bands + int(include_input))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_dim) -> (..., out_dim)."""
        if x.shape[-1] != self.in_dim:
            raise ValueError(f"FourierFeatures: expected last dim {self.in_dim}, got shape {tuple(x.shape)}")
        phase = math.pi * x[..., None] * self.freqs.to(x.dtype)  # (..., in_dim, num_bands)
        feats = [phase.sin().flatten(-2), phase.cos().flatten(-2)]
        if self.include_input:
            feats.insert(0, x)
        return torch.cat(feats, dim=-1)
