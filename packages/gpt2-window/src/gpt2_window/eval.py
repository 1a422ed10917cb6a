"""Evaluate a trained GPT: `gpt2-eval [--run RUN_DIR_OR_CKPT]` prints validation loss and perplexity.

`gpt2-eval generate ...` samples text instead (gpt2_window.sample; in Python, `gpt2_window.generate`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from memfit.errors import UsageError
from memfit.train.distributed import resolve_device
from memfit.train.export import model_line
from memfit.train.flags import Parser, add_eval_args, apply_threads, check_numbers, eval_out_dir
from memfit.train.loop import autocast_context, step_generator
from memfit.train.outputs import write_text
from memfit.train.run_dir import resolve_run

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


def load_model(run: str | Path | None, device: torch.device, runs_dir: str = "runs") -> tuple[GPT, dict]:
    """The model of a run (name or folder: best.pt, else the newest checkpoint) or a checkpoint file;
    returns (model, the checkpoint's meta with its step)."""
    from gpt2_window.system import SYSTEM

    model, state = SYSTEM.load_model(run, device, runs_dir=runs_dir)
    return model, dict(
        state["meta"], step=int(state["step"]), path=state["path"], settings=state.get("settings")
    )


def run(argv: list[str] | None = None) -> dict | list[str]:
    """main() returning its results (for tests and scripts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        from gpt2_window.sample import run as generate_run

        return generate_run(argv[1:])
    p = Parser(description=__doc__.splitlines()[0])
    add_eval_args(p, "gpt2-window")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"], default="none", help="autocast for evaluation")
    p.add_argument("--data", default=None, help="evaluation data (default: the data the run trained on)")
    p.add_argument("--split", choices=["val", "train"], default="val")
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--sequence_length", type=int, default=None, help="default: the training length")
    p.add_argument("--eval_iters", type=int, default=200, help="batches to average over")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    apply_threads(args)
    check_numbers(args, batch_size="[1, 2**20]", eval_iters="[1, 2**20]", sequence_length="[1, 2**24]")
    device = resolve_device(args.device)
    run = resolve_run(args.run, "gpt2-window", args.runs_dir)
    out = eval_out_dir(args, run, (args.data,))
    try:
        model, mc = load_model(run, device)
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


def main(argv: list[str] | None = None) -> None:
    """Console entry point (returns None so the exit status is 0)."""
    run(argv)


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("gpt2-eval", main))
