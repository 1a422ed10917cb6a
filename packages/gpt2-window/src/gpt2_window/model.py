"""GPT-2 (nanoGPT layout) whose attention is causal or sliding-window, always through memfit.ops.attention.

Why the sliding window never costs more memory than causal here: the model creates no mask at all.
``memfit.ops.attention.attention(q, k, v, causal=True, window=w)`` picks a kernel that knows the window
(flash-attn's window on CUDA, FlexAttention with one bounded block-mask cache, or a CPU band path that
skips masked blocks), and a sequence no longer than the window is plain causal SDPA. Everything the
attention needs is made inside the block, so per-block activation checkpointing covers it too.

``attn_impl="seed"`` keeps the original script's mistake as a measurable baseline: per-length masks
created with B=H=1, broadcast to dense (B, H, T, T) masks once per forward outside the blocks (so
checkpointing cannot free them), held for backward, and cached for up to 10 lengths.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from memfit.ops import registry
from memfit.ops.attention import attention, attention_ref
from memfit.ops.layers import checkpointed
from torch import nn

from gpt2_window.baselines import SeedMaskCache
from gpt2_window.config import MIN_TEMPERATURE, GPTConfig

SAMPLING_MIN_LENGTH = 64  # generate() on CUDA runs contexts at powers of two from this (_sampling_length)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.window = window
        self.attn_impl = config.attn_impl

    def forward(self, x: torch.Tensor, dense_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). dense_mask: only for attn_impl="seed" (B, H, T, T) additive."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attn_impl == "memfit":
            y = attention(q, k, v, causal=True, window=self.window)
        elif self.attn_impl == "ref":
            y = attention_ref(q, k, v, causal=True, window=self.window)
        elif dense_mask is not None:  # the seed's windowed layers
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
        else:  # the seed's causal layers used plain SDPA
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, window)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, dense_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x), dense_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "GPTConfig.vocab_size is None: set it from the tokenizer before building the model"
            )
        self.config = config
        self.windows = config.layer_windows()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, w) for w in self.windows]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings, as GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.seed_cache = SeedMaskCache() if config.attn_impl == "seed" else None

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def _seed_dense_masks(self, B: int, T: int, device: torch.device) -> dict[int, torch.Tensor]:
        """The seed's masks: cached at B=H=1, then broadcast to dense (B, H, T, T) additive tensors."""
        assert self.seed_cache is not None
        dense = {}
        for w in {w for w in self.windows if w is not None and w < T}:
            allowed = self.seed_cache.get(T, w, device).expand(B, self.config.n_head, T, T)
            dense[w] = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
        return dense

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, V) and the mean cross-entropy against targets (B, T), if given.

        Without targets only the last position's logits are computed (B, 1, V), as for sampling.
        """
        x = self._features(idx)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def _features(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> the final layer norm's output (B, T, C)."""
        B, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} is longer than the model's context (block_size "
                f"{self.config.block_size}); use --sequence_length <= {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        dense = self._seed_dense_masks(B, T, idx.device) if self.seed_cache is not None else {}
        for block, w in zip(self.transformer.h, self.windows):
            mask = dense.get(w)
            x = checkpointed(block, x, mask, enabled=self.config.checkpoint and self.training)
        return self.transformer.ln_f(x)

    def _sampling_length(self, idx: torch.Tensor) -> int:
        """The length generate() runs a (B, T) context at. On CUDA a windowed layer may take compiled
        FlexAttention, which compiles once per length: T is rounded up to a power of two (at least 64, at
        most block_size), so a whole generation compiles a handful of lengths instead of one per token.
        The context is right-padded to it; causal attention keeps the padding out of position T-1."""
        T = idx.shape[1]
        windowed = any(w is not None for w in self.windows) and self.config.attn_impl == "memfit"
        if not (windowed and registry.is_cuda(idx)):
            return T
        return min(self.config.block_size, max(SAMPLING_MIN_LENGTH, 1 << (T - 1).bit_length()))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """idx (B, T) -> (B, T + max_new_tokens): sample one token at a time, cropping to block_size.

        vocab_limit: sample only ids below it (the tokenizer's size; the rest is padding of the embedding).
        """
        if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE:g} and finite, got {temperature:g}")
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size :]
            T = ctx.shape[1]
            ctx = F.pad(ctx, (0, self._sampling_length(ctx) - T))
            logits = self.lm_head(self._features(ctx)[:, T - 1, :])
            logits = logits[:, :vocab_limit].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        return idx


def param_groups(params, weight_decay: float) -> list[dict]:
    """nanoGPT's AdamW groups: matrices and embeddings decay; biases and norm gains do not."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(
    params, lr: float = 6e-4, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW with nanoGPT's decay groups; fused (one kernel, no model-sized temporaries) where supported."""
    return torch.optim.AdamW(param_groups(params, weight_decay), lr=lr, betas=betas, fused=True)
