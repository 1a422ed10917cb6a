"""The flags of `gpt2-eval` and `generate`, read without importing torch: `--help` and a refused flag or
number answer before torch's import (about 2 s), which only the work in gpt2_window.eval and
gpt2_window.sample pays (memfit.system.parse_then_run).
"""

from __future__ import annotations

import argparse
import sys

from memfit.train.flags import Parser, add_eval_args, check_numbers, summary_of

from gpt2_window.config import MIN_TEMPERATURE


def eval_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`gpt2-eval`'s flags (argv None: sys.argv[1:]), their numbers checked; `gpt2-eval generate ...` reads
    generate's flags instead. args.command says which ("eval" or "generate")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        return generate_args(argv[1:])
    p = Parser(description=summary_of("gpt2_window.eval"))
    add_eval_args(p, "gpt2-window")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"], default="none", help="autocast for evaluation")
    p.add_argument("--data", default=None, help="evaluation data (default: the data the run trained on)")
    p.add_argument("--split", choices=["val", "train"], default="val")
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--sequence_length", type=int, default=None, help="default: the training length")
    p.add_argument("--eval_iters", type=int, default=200, help="batches to average over")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(command="eval")
    args = p.parse_args(argv)
    check_numbers(args, batch_size="[1, 2**20]", eval_iters="[1, 2**20]", sequence_length="[1, 2**24]")
    return args


def generate_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`memfit run gpt2-window generate`'s flags (argv None: sys.argv[1:]), their numbers checked."""
    p = Parser(prog="memfit run gpt2-window generate", description=summary_of("gpt2_window.sample"))
    add_eval_args(p, "gpt2-window", out=False)
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    p.set_defaults(command="generate")
    args = p.parse_args(argv)
    temperature = f"[{MIN_TEMPERATURE:g}, 1e4]"
    check_numbers(args, max_new_tokens="[0, 2**24]", num_samples="[1, 2**16]", temperature=temperature,
                  top_k="[1, 2**31-1]", seed="0..2**63-1")  # fmt: skip
    return args
