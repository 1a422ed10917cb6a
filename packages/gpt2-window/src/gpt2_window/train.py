"""Train the GPT: `gpt2-train` / `uv run --package gpt2-window train`.

Accepts the seed script's flags (`--model d12|d12_window --sequence_length 1024 --batch_size 4
--num_iterations 5`) and memfit's flags (`--config` is `--model`, `--steps` is `--num_iterations`).
With no --data it trains on the embedded default corpus (Python standard-library sources), offline.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from memfit.config import config_dict, overrides_from_args
from memfit.training import (
    Trainer,
    add_loop_args,
    add_model_args,
    check_numbers,
    dist_info,
    hidden_alias,
    latest_checkpoint,
    load_checkpoint,
    loop_config_from_args,
    resolve_device,
    step_generator,
    warmup_cosine_lambda,
)

from gpt2_window.config import ATTN_IMPLS, PRESETS, GPTConfig, get_config
from gpt2_window.data import TokenData, load_data
from gpt2_window.eval import estimate_loss
from gpt2_window.model import GPT, make_optimizer

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    m = add_model_args(p, PRESETS, "tiny", attention=list(ATTN_IMPLS))
    hidden_alias(m, "--model", dest="config", choices=list(PRESETS))  # the seed's spelling
    hidden_alias(m, "--attn_impl", dest="attention", choices=list(ATTN_IMPLS))
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--sequence_length", type=int, default=None, help="tokens per row (default: model context)"
    )
    g.add_argument("--batch_size", type=int, default=12, help="rows per micro-batch")
    g.add_argument(
        "--num_iterations", type=int, dest="steps", default=argparse.SUPPRESS, help="same as --steps"
    )
    g.add_argument(
        "--window",
        type=parse_window,
        default=argparse.SUPPRESS,
        help="sliding window: an int, 'none', or one per layer '64,none,...' (default: preset's)",
    )
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument(
        "--data", default=None, help="UTF-8 text file or uint16 token shards (default: embedded corpus)"
    )
    g.add_argument(
        "--tokenizer",
        choices=["auto", "char", "gpt2"],
        default="auto",
        help="auto: characters for the default corpus and the character presets, GPT-2 BPE for d12 "
        "presets on --data text (needs the `bpe` extra; an error, not a silent switch, without it)",
    )
    o = p.add_argument_group("optimizer and evaluation")
    o.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    o.add_argument("--min_lr", type=float, default=None, help="final learning rate (default lr / 10)")
    o.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    o.add_argument("--weight_decay", type=float, default=0.1)
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.99)
    o.add_argument("--eval_every", type=int, default=250, help="evaluate every N steps (0 = only at the end)")
    o.add_argument("--eval_iters", type=int, default=20, help="batches per evaluation")
    add_loop_args(p, steps=2000, save_every=500, log_every=10)
    return p


def build_config(args: argparse.Namespace, data: TokenData) -> tuple[GPTConfig, int]:
    """The model config from --model and overrides, and the sequence length; ValueError on bad input."""
    cfg = get_config(args.config)
    overrides = {"dropout": args.dropout}
    overrides.update(overrides_from_args(args, {"checkpointing": "checkpoint", "attention": "attn_impl"}))
    if hasattr(args, "window"):
        overrides["window"] = args.window
    if cfg.vocab_size is None:  # character presets: exactly the data's vocabulary, as nanoGPT's char model
        overrides["vocab_size"] = data.vocab_size
    elif cfg.vocab_size < data.vocab_size:
        overrides["vocab_size"] = -(-data.vocab_size // 64) * 64  # padded for fast matmuls, as GPT-2's 50304
    cfg = replace(cfg, **overrides)
    T = args.sequence_length or cfg.block_size
    if T < 1:
        raise ValueError(f"--sequence_length must be >= 1, got {T}")
    if cfg.block_size < T:
        raise ValueError(
            f"--sequence_length {T} is longer than the context of --config {args.config} "
            f"({cfg.block_size} positions); use --sequence_length <= {cfg.block_size}"
        )
    if args.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
    return cfg, T


def run(argv: list[str] | None = None) -> dict:
    """main() returning its results (for tests and scripts)."""
    args = build_parser().parse_args(argv)
    check_numbers(args, lr=">0", min_lr=">=0", warmup=">=0", weight_decay=">=0", batch_size=">=1")
    check_numbers(args, eval_every=">=0", eval_iters=">=1", beta1=">=0", beta2=">=0")
    loop = loop_config_from_args(args, system=SYSTEM_NAME)
    try:
        tok_choice = args.tokenizer
        if tok_choice == "auto" and (get_config(args.config).vocab_size is None or args.data is None):
            tok_choice = "char"  # character presets, and the default corpus: the text's characters
        data = load_data(args.data, tok_choice)
        cfg, T = build_config(args, data)
        data.check_length(T)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"gpt2-train: error: {e}") from None

    meta = {
        "tokenizer": data.tokenizer.to_dict() if data.tokenizer else None,
        "sequence_length": T,
        "data": args.data,
        "preset": args.config,
    }
    if loop.resume and (ckpt := latest_checkpoint(loop.run_dir)) is not None:
        try:
            saved = load_checkpoint(ckpt)
        except ValueError:
            saved = {}  # unreadable: the Trainer falls back to an older checkpoint and says so
        if saved and (
            saved.get("config") != config_dict(cfg)
            or (saved.get("meta") or {}).get("tokenizer") != meta["tokenizer"]
        ):
            raise SystemExit(
                f"gpt2-train: error: --resume: {ckpt} was trained with a different model or vocabulary; "
                "pass the same --config/--window/--data, or a new --run_name"
            )

    device = resolve_device(loop.device)
    torch.manual_seed(loop.seed)
    with torch.device(device):
        model = GPT(cfg)
    optimizer = make_optimizer(model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2))
    min_ratio = (args.min_lr if args.min_lr is not None else args.lr / 10) / args.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine_lambda(loop.steps, args.warmup, min_ratio)
    )
    B, rank = args.batch_size, dist_info().rank  # each rank draws its own rows

    def get_batch(step: int, micro: int):
        return data.batch("train", B, T, step_generator(loop.seed, step, micro, rank), device)

    def loss_fn(model, batch):
        return model(*batch)[1]

    def eval_fn(model):
        out = {}
        for split in ("train", "val"):
            out[f"{split}_loss"] = estimate_loss(model, data, split, B, T, args.eval_iters, device)
        return out

    tokens_per_step = B * T * loop.grad_accum
    trainer = Trainer(
        model, optimizer, loss_fn, get_batch, loop,
        scheduler=scheduler, eval_fn=eval_fn, eval_every=args.eval_every,
        config=cfg, meta=meta, items_per_step=tokens_per_step, system=SYSTEM_NAME,
    )  # fmt: skip

    if trainer.dist.is_main:
        windows = sorted({str(w) for w in cfg.layer_windows()})
        print(
            f"gpt2-window: model {args.config} ({model.num_params() / 1e6:.2f}M params, "
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
