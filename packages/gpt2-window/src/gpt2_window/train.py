"""Train the GPT: `gpt2-train` / `uv run --package gpt2-window train`.

Accepts the seed script's flags (`--model d12|d12_window --sequence_length 1024 --batch_size 4
--num_iterations 5`) and memfit's flags (`--config` is `--model`, `--steps` is `--num_iterations`).
With no --data it trains on the embedded default corpus (Python standard-library sources), offline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from memfit.errors import UsageError
from memfit.train.settings import TrainParser

from gpt2_window.config import ATTN_IMPLS, SETTINGS, GPTConfig, get_config

if TYPE_CHECKING:  # torch, the data and the model load when training starts: `--help` stays fast
    from gpt2_window.data import TokenData

SYSTEM_NAME = "gpt2-window"


def parse_window(text: str) -> int | list[int | None] | None:
    """'64' -> 64; 'none' -> None; '64,none,128,...' -> one window per layer."""

    def one(s: str) -> int | None:
        s = s.strip().lower()
        if s in ("none", "full", "causal"):
            return None
        try:
            w = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"window {s!r} is not an int or 'none'") from None
        if w <= 0:
            raise argparse.ArgumentTypeError(f"window must be > 0 (keys each query sees), got {w}")
        return w

    parts = text.split(",")
    return one(parts[0]) if len(parts) == 1 else [one(p) for p in parts]


def build_parser() -> TrainParser:
    p = TrainParser(SYSTEM_NAME, __doc__, SETTINGS, default="tiny")
    p.parser.add_argument(
        "--model", dest="config", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )  # the seed's
    m = p.group("model")
    p.flag(
        m, "--attention", path="model.attn_impl", choices=list(ATTN_IMPLS), help="attention implementation"
    )
    p.flag(m, "--checkpointing", path="model.checkpoint", help="per-block activation checkpointing")
    p.flag(
        m,
        "--window",
        path="model.window",
        type=parse_window,
        help="sliding window: an int, 'none', or one per layer '64,none,...'",
    )
    p.flag(m, "--dropout", path="model.dropout", help="dropout")
    d = p.group("data")
    p.flag(
        d,
        "--data",
        path="train.data",
        file=True,
        help="UTF-8 text file or uint16 token shards (none: embedded corpus)",
    )
    p.flag(
        d,
        "--tokenizer",
        path="train.tokenizer",
        choices=["auto", "char", "gpt2"],
        help="auto: characters for the default corpus and the character presets, GPT-2 BPE for d12 "
        "presets on --data text (needs the `bpe` extra; an error, not a silent switch, without it)",
    )
    p.flag(
        d,
        "--sequence_length",
        path="train.sequence_length",
        help="tokens per row (none: the model's context)",
    )
    p.flag(d, "--batch_size", path="train.batch_size", help="rows per micro-batch")
    p.flag(d, "--num_iterations", path="loop.steps", help="the seed's name for --steps", show_default=False)
    o = p.group("optimizer and evaluation")
    p.optimizer_flags(o)
    p.flag(o, "--min_lr", path="train.min_lr", help="final learning rate (none: lr / 10)")
    p.flag(o, "--beta1", path="train.beta1", help="AdamW beta1")
    p.flag(o, "--beta2", path="train.beta2", help="AdamW beta2")
    p.flag(o, "--eval_every", path="train.eval_every", help="evaluate every N steps (0 = at the end)")
    p.flag(o, "--eval_iters", path="train.eval_iters", help="batches per evaluation")
    return p


def build_config(cfg: GPTConfig, t, preset: str, data: TokenData) -> tuple[GPTConfig, int]:
    """The model config for this data (a character preset takes the data's vocabulary) and the sequence
    length; ValueError on bad input."""
    if cfg.vocab_size is None:  # character presets: exactly the data's vocabulary, as nanoGPT's char model
        cfg = replace(cfg, vocab_size=data.vocab_size)
    elif cfg.vocab_size < data.vocab_size:
        cfg = replace(cfg, vocab_size=-(-data.vocab_size // 64) * 64)  # padded for fast matmuls, as GPT-2's
    T = t.sequence_length or cfg.block_size
    if cfg.block_size < T:
        raise ValueError(
            f"--sequence_length {T} is longer than the context of --config {preset} "
            f"({cfg.block_size} positions); use --sequence_length <= {cfg.block_size}"
        )
    return cfg, T


def run(argv: list[str] | None = None) -> dict:
    """main() returning its results (for tests and scripts)."""
    r = build_parser().parse(argv)
    import torch
    from memfit.step import AMP_DTYPES
    from memfit.train.checkpoint import latest_checkpoint, load_checkpoint
    from memfit.train.distributed import dist_info
    from memfit.train.loop import Trainer, WarmupCosine, step_generator

    from gpt2_window.data import load_data
    from gpt2_window.eval import estimate_loss
    from gpt2_window.model import GPT, make_optimizer
    from gpt2_window.system import gpt_step

    model_cfg, t, loop, device = r.settings.model, r.settings.train, r.settings.loop, r.device
    try:
        tok_choice = t.tokenizer
        if tok_choice == "auto" and (get_config(r.preset).vocab_size is None or t.data is None):
            tok_choice = "char"  # character presets, and the default corpus: the text's characters
        data = load_data(t.data, tok_choice)
        cfg, T = build_config(model_cfg, t, r.preset, data)
        data.check_length(T)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None

    meta = {
        "tokenizer": data.tokenizer.to_dict() if data.tokenizer else None,
        "sequence_length": T,
        "data": t.data,
        "preset": r.preset,
    }
    run_dir = loop.run_dir(SYSTEM_NAME)
    if r.resume and (ckpt := latest_checkpoint(run_dir)) is not None:
        try:
            saved = load_checkpoint(ckpt)
        except ValueError:
            saved = {}  # unreadable: the Trainer falls back to an older checkpoint and says so
        if saved and (saved.get("meta") or {}).get("tokenizer") != meta["tokenizer"]:
            raise UsageError(
                f"error: --resume: {ckpt} was trained with another vocabulary; pass the same --data and "
                "--tokenizer, or a new --run_name"
            )

    torch.manual_seed(loop.seed)
    with torch.device(device):
        model = GPT(cfg)
    optimizer = make_optimizer(model.parameters(), t.lr, t.weight_decay, (t.beta1, t.beta2))
    min_ratio = (t.min_lr if t.min_lr is not None else t.lr / 10) / t.lr
    B, rank = t.batch_size, dist_info().rank  # each rank draws its own rows

    def get_batch(step: int, micro: int):
        return data.batch("train", B, T, step_generator(loop.seed, step, micro, rank), device)

    def loss_fn(model, batch):
        return model(*batch)[1]

    def eval_fn(model):
        out = {}
        for split in ("train", "val"):
            out[f"{split}_loss"] = estimate_loss(model, data, split, B, T, t.eval_iters, device)
        return out

    tokens_per_step = B * T * loop.grad_accum
    trainer = Trainer(
        model, optimizer, loss_fn, get_batch, r,
        lr_schedule=WarmupCosine(t.warmup, min_ratio), eval_fn=eval_fn, eval_every=t.eval_every,
        config=cfg, meta=meta, items_per_step=tokens_per_step,
        memory_step=lambda b, ckpt: gpt_step(replace(cfg, checkpoint=ckpt), b, T, AMP_DTYPES[loop.amp]),
        batch_size=B,
    )  # fmt: skip

    if trainer.dist.is_main:
        windows = sorted({str(w) for w in cfg.layer_windows()})
        print(
            f"gpt2-window: model {r.preset} ({model.num_params() / 1e6:.2f}M params, "
            f"window {'/'.join(windows)}, attention {cfg.attn_impl}), data {data.source}: "
            f"{data.num_tokens('train'):,} train / "
            f"{data.num_tokens('val'):,} val tokens, vocab {data.vocab_size}"
            + (f" ({data.tokenizer.kind})" if data.tokenizer else " (token ids)")
        )
    start_step, t0 = trainer.step, time.perf_counter()
    result = trainer.fit()
    elapsed = time.perf_counter() - t0
    steps_run = trainer.step - start_step
    if steps_run and trainer.dist.is_main:
        tps = steps_run * tokens_per_step * trainer.dist.world_size / elapsed
        result["tokens_per_s"] = tps
        print(f"tokens/s: {tps:,.0f} ({steps_run} steps in {elapsed:.1f} s, incl. evaluation)")
    return result


def main(argv: list[str] | None = None) -> None:
    """Console entry point (returns None so the exit status is 0)."""
    run(argv)


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("gpt2-train", main))
