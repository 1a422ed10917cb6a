"""One call each: load a trained (or exported) GPT, and sample text from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from memfit.errors import UsageError
from memfit.train.distributed import resolve_device

from gpt2_window.data import Tokenizer
from gpt2_window.model import GPT


def load(run: str | Path | None = None, device: str = "cpu", runs_dir: str | Path = "runs") -> GPT:
    """The model, in eval mode on `device`, from a run name or folder (default: runs/gpt2-window/run), a
    checkpoint file, or a folder `memfit export` wrote. A missing run is a FileNotFoundError, a file that
    is not a gpt2-window model a ValueError, each with one line that says what to do."""
    return _load(run, device, runs_dir)[0]


def _load(run: str | Path | None, device: str, runs_dir: str | Path) -> tuple[GPT, dict]:
    from gpt2_window.system import SYSTEM

    return SYSTEM.load_model(run, resolve_device(device), runs_dir=runs_dir)


def generate(
    prompt: str,
    run: str | Path | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 1337,
    device: str = "cpu",
    runs_dir: str | Path = "runs",
) -> str:
    """The text a trained model continues `prompt` with (the prompt and its new text), sampled with `seed`."""
    return samples(prompt, run, 1, max_new_tokens, temperature, top_k, seed, device, runs_dir)[0]


def samples(
    prompt: str,
    run: str | Path | None = None,
    num_samples: int = 1,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 1337,
    device: str = "cpu",
    runs_dir: str | Path = "runs",
    on_load: Callable[[dict], None] | None = None,
) -> list[str]:
    """`num_samples` continuations of `prompt` (each the prompt and its new text) from a trained model, as
    one batch; on_load(state) sees the loaded checkpoint's dict (the `generate` command names the model)."""
    model, state = _load(run, device, runs_dir)
    if on_load is not None:
        on_load(state)
    tokenizer = (state.get("meta") or {}).get("tokenizer")
    if not tokenizer:
        raise UsageError("error: this run trained on token ids of an unknown vocabulary: no text to decode")
    tok = Tokenizer.from_dict(tokenizer)
    try:
        ids = tok.encode(prompt)
    except ValueError as e:
        raise UsageError(f"error: {e}") from None
    if not ids:
        raise UsageError("error: the prompt is empty; give at least one character")
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)
    limit = tok.vocab_size
    out = model.generate(x, max_new_tokens, temperature, top_k or None, generator=g, vocab_limit=limit)
    return [tok.decode(row.tolist()) for row in out]
