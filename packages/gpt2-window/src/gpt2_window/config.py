"""GPT-2 configuration and the named presets that `--config` (the seed's `--model`) picks from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.train import config
from memfit.train.config import COUNT, DECAY, RATE, STEPS, WEIGHT, check_config
from memfit.train.settings import LoopConfig, Settings

ATTN_IMPLS = ("memfit", "ref", "seed")
# The lowest sampling temperature (GPT.generate, `generate --temperature`): logits / temperature stays finite
# (logits / 1e-45 overflowed to inf and softmax gave NaN probabilities); below it sampling is all but greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class GPTConfig:
    """A nanoGPT-style GPT-2. vocab_size=None means "take it from the tokenizer" (character presets)."""

    block_size: int = 1024
    vocab_size: int | None = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    # Sliding window: None = plain causal; an int for every layer; or one entry per layer (int or None).
    window: int | list[int | None] | None = None
    # Activation checkpointing per block: keeps each block's input, recomputes the rest in backward.
    checkpoint: bool = False
    # "memfit": memfit.ops.attention (SDPA / flash-attn / Flex / CPU band path).
    # "ref": memfit.ops.attention.attention_ref, the naive masked softmax (for parity tests).
    # "seed": the original script's mistake, kept as the naive memory baseline (see baselines.SeedMaskCache).
    attn_impl: str = "memfit"
    # how the model runs, not what it computes: `train --resume` may change these
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("checkpoint", "attn_impl")
    RANGES: ClassVar[dict[str, str]] = {
        "block_size": "[1, 2**24]",
        "vocab_size": COUNT,
        "n_layer": "[1, 2**16]",
        "n_head": "[1, 2**16]",
        "n_embd": "[1, 2**20]",
        "dropout": DECAY,
        "window": "[1, 2**31-1]",  # each layer's (None: full causal)
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the fix."""
        for name in ("block_size", "n_layer", "n_head", "n_embd"):  # before check_config: a clearer line
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.window, (list, tuple)):
            object.__setattr__(self, "window", list(self.window))  # a JSON round trip gives a list
        if isinstance(self.window, list) and len(self.window) != self.n_layer:
            raise ValueError(
                f"window has {len(self.window)} entries but the model has {self.n_layer} layers; "
                "give one window (or None) per layer, or a single int for all"
            )
        for w in self.window if isinstance(self.window, list) else [self.window]:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= 2**31 - 1):
                raise ValueError(
                    f"window must be a positive int (keys seen per query, at most 2**31-1) or None, got {w!r}"
                )
        check_config(self)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {', '.join(ATTN_IMPLS)}; got {self.attn_impl!r}")

    def layer_windows(self) -> list[int | None]:
        """The window of each layer (None = full causal)."""
        if isinstance(self.window, list):
            return list(self.window)
        return [self.window] * self.n_layer


# Character-level presets leave vocab_size to the tokenizer. "tiny" is nanoGPT's shakespeare_char CPU
# config (README: 4 layers, 4 heads, 128 wide, block 64, no bias, dropout 0).
PRESETS: dict[str, GPTConfig] = {
    "d12": GPTConfig(),
    "d12_window": GPTConfig(window=64),
    "tiny": GPTConfig(block_size=64, vocab_size=None, n_layer=4, n_head=4, n_embd=128, bias=False),
    "tiny_window": GPTConfig(
        block_size=64, vocab_size=None, n_layer=4, n_head=4, n_embd=128, bias=False, window=16
    ),
    # For tests and smoke runs: seconds on one CPU core.
    "nano": GPTConfig(block_size=32, vocab_size=None, n_layer=2, n_head=2, n_embd=32, bias=True, window=8),
}


def get_config(name: str, **overrides: Any) -> GPTConfig:
    """A copy of PRESETS[name] with overrides applied (memfit.train.config.get_config)."""
    return config.get_config(PRESETS, name, **overrides)


@dataclass(frozen=True)
class TrainConfig:
    """How `train` trains (settings.train): data, batches, optimizer and evaluation (nanoGPT's names)."""

    data: str | None = None  # UTF-8 text file or uint16 token shards; None: the embedded corpus
    tokenizer: str = "auto"  # auto | char | gpt2
    sequence_length: int | None = None  # tokens per row; None: the model's context
    batch_size: int = 12  # rows per micro-batch
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate; None: lr / 10
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eval_every: int = 250  # 0: only at the end
    eval_iters: int = 20  # batches per evaluation

    RANGES: ClassVar[dict[str, str]] = {
        "sequence_length": "[1, 2**24]",
        "batch_size": "[1, 2**20]",
        "lr": RATE,
        "min_lr": "[0, 10]",
        "warmup": STEPS,
        "weight_decay": WEIGHT,
        "beta1": DECAY,
        "beta2": DECAY,
        "eval_every": STEPS,
        "eval_iters": "[1, 2**20]",
    }
    RELATIONS: ClassVar[tuple[tuple[str, str, str], ...]] = (("min_lr", "<=", "lr"),)  # a decay, not a rise

    def __post_init__(self) -> None:
        check_config(self)
        if self.tokenizer not in ("auto", "char", "gpt2"):
            raise ValueError(f"tokenizer must be auto, char or gpt2; got {self.tokenizer!r}")


def _settings(name: str):
    def make(device) -> Settings:
        return Settings(get_config(name), TrainConfig(), LoopConfig(steps=2000, save_every=500, log_every=10))

    return make


SETTINGS = {name: _settings(name) for name in PRESETS}
