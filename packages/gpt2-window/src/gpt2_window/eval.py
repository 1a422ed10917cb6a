"""Evaluate a trained GPT: `gpt2-eval [--run RUN_DIR_OR_CKPT]` prints validation loss and perplexity.

`gpt2-eval generate ...` samples text instead (gpt2_window.sample; in Python, `gpt2_window.generate`).

Its flags are read in gpt2_window.flags, which imports no torch (`--help` answers at once).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from memfit.errors import UsageError
from memfit.train.distributed import resolve_device
from memfit.train.export import model_line
from memfit.train.flags import apply_threads, eval_out_dir
from memfit.train.loop import autocast_context, step_generator
from memfit.train.outputs import write_text
from memfit.train.run_dir import resolve_run

from gpt2_window.data import TokenData, Tokenizer, load_data
from gpt2_window.flags import eval_args
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


def load_model(run: str | Path | None, device: torch.device, runs_dir: str = "runs") -> tuple[GPT, dict]:
    """The model of a run (name or folder: best.pt, else the newest checkpoint) or a checkpoint file;
    returns (model, the checkpoint's meta with its step)."""
    from gpt2_window.system import SYSTEM

    model, state = SYSTEM.load_model(run, device, runs_dir=runs_dir)
    return model, dict(
        state["meta"], step=int(state["step"]), path=state["path"], settings=state.get("settings")
    )


def main(argv: list[str] | None = None) -> dict | list[str]:
    """`gpt2-eval` with these flags (None: sys.argv[1:]); returns its results (the samples for
    `gpt2-eval generate ...`)."""
    return run(eval_args(argv))


def run(args: argparse.Namespace) -> dict | list[str]:
    """The work of `gpt2-eval` on the flags gpt2_window.flags.eval_args read (it imports torch); those of
    `gpt2-eval generate` sample text instead (gpt2_window.sample)."""
    if args.command == "generate":
        from gpt2_window.sample import run as sample

        return sample(args)
    apply_threads(args)
    device = resolve_device(args.device)
    run_path = resolve_run(args.run, "gpt2-window", args.runs_dir)
    out = eval_out_dir(args, run_path, (args.data,))
    try:
        model, mc = load_model(run_path, device)
        from gpt2_window.system import SYSTEM

        if not args.json:
            print(model_line(SYSTEM, mc))
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
    except UsageError:  # already one line (a run or model file that is missing or damaged)
        raise
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None
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
    write_text(out / f"eval_{args.split}.json", json.dumps(result, indent=2), overwrite=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"step {result['step']}: {args.split} loss {loss:.4f}, perplexity {result['perplexity']:.3f} "
            f"({result['tokens']:,} tokens of {data.source})"
        )
    return result


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("gpt2-eval", main))
