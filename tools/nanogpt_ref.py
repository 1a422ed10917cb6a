"""An independent, minimal nanoGPT-equivalent character model: the yardstick for gpt2-window on CPU.

Same architecture as nanoGPT's ``model.py`` at its shakespeare_char CPU config (pre-norm blocks,
LayerNorm without bias, causal SDPA, GELU MLP of width 4C, tied input/output embeddings, N(0, 0.02)
init with residual projections scaled by 1/sqrt(2 * n_layer)), written from the GPT-2 description
without sharing code with ``gpt2_window.model``, so timing or loss differences between the two point
at our code, not at the architecture. Used by tools/bench_gpt2.py (``speed``, ``quality``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RefBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.attn_out = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_out(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, block: int = 64, layers: int = 4, heads: int = 4, width: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(RefBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.tok.weight = self.head.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("attn_out.weight", "down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.99)) -> torch.optim.AdamW:
    """nanoGPT's groups: weight decay on matrices (embeddings included), none on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)
