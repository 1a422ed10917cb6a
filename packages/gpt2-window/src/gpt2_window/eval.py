"""Evaluate a trained GPT: `gpt2-eval [--run RUN_DIR_OR_CKPT]` prints validation loss and perplexity.

`gpt2-eval generate ...` samples text instead (the same as `gpt2_window.generate`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from memfit.training import autocast_context, load_checkpoint, resolve_device, step_generator

from gpt2_window.config import GPTConfig
from gpt2_window.data import TokenData, Tokenizer, load_data
from gpt2_window.model import GPT

EVAL_SEED = 1234  # fixed batches: evaluations of different steps and runs see the same windows


@torch.no_grad()
def estimate_loss(
    model: GPT,
    data: TokenData,
    split: str,
    batch_size: int,
    block: int,
    iters: int,
    device,
    seed: int = EVAL_SEED,
) -> float:
    """Mean cross-entropy over `iters` fixed random batches (B, block) of a split."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(iters):
        x, y = data.batch(split, batch_size, block, step_generator(seed, i), device)
        total += model(x, y)[1].float().item()
    model.train(was_training)
    return total / max(1, iters)


def load_model(run: str | Path, device: torch.device) -> tuple[GPT, dict]:
    """Rebuild the model of a run folder (newest checkpoint) or a checkpoint file; (model, model_config)."""
    state = load_checkpoint(run, map_location=device)
    mc = state.get("model_config") or {}
    if "gpt" not in mc:
        raise ValueError(f"{run} is not a gpt2-window checkpoint (its model_config has no 'gpt' entry)")
    cfg = GPTConfig.from_dict(mc["gpt"])
    with torch.device(device):
        model = GPT(cfg)
    model.load_state_dict(state["model"])
    model.eval()
    mc = dict(mc, step=int(state.get("step", 0)))
    return model, mc


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, help="run folder or checkpoint file (default runs/gpt2-window/run)")
    p.add_argument("--runs_dir", default="runs")
    p.add_argument("--run_name", default="run")
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"], default="none", help="autocast for evaluation")


def run_path(args: argparse.Namespace) -> Path:
    return Path(args.run) if args.run else Path(args.runs_dir) / "gpt2-window" / args.run_name


def run(argv: list[str] | None = None) -> dict | list[str]:
    """main() returning its results (for tests and scripts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        from gpt2_window.generate import run as generate_run

        return generate_run(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--data", default=None, help="evaluation data (default: the data the run trained on)")
    p.add_argument("--split", choices=["val", "train"], default="val")
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--sequence_length", type=int, default=None, help="default: the training length")
    p.add_argument("--eval_iters", type=int, default=200, help="batches to average over")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    try:
        model, mc = load_model(run_path(args), device)
        tok = Tokenizer.from_dict(mc["tokenizer"]) if mc.get("tokenizer") else "char"
        data = load_data(args.data if args.data is not None else mc.get("data"), tok)
        T = args.sequence_length or mc.get("sequence_length") or model.config.block_size
        if model.config.block_size < T:
            raise ValueError(
                f"--sequence_length {T} is longer than the model's context ({model.config.block_size})"
            )
        if data.vocab_size > model.config.vocab_size:
            raise ValueError(f"the data's vocabulary ({data.vocab_size}) exceeds the model's")
        data.check_length(T)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"gpt2-eval: error: {e}") from None
    with autocast_context(args.amp, device):
        loss = estimate_loss(model, data, args.split, args.batch_size, T, args.eval_iters, device)
    result = {
        "step": mc["step"],
        "split": args.split,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": args.eval_iters * args.batch_size * T,
        "data": data.source,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"step {result['step']}: {args.split} loss {loss:.4f}, perplexity {result['perplexity']:.3f} "
            f"({result['tokens']:,} tokens of {data.source})"
        )
    return result


def main(argv: list[str] | None = None) -> None:
    """Console entry point (returns None so the exit status is 0)."""
    run(argv)


if __name__ == "__main__":
    main()
