"""Sample text from a trained GPT: `gpt2-eval generate --run RUN --prompt "ROMEO:" --max_new_tokens 200`."""

from __future__ import annotations

import argparse

import torch
from memfit.distributed import resolve_device
from memfit.errors import UsageError
from memfit.flags import add_eval_args, apply_threads, check_numbers

from gpt2_window.data import Tokenizer


def run(argv: list[str] | None = None) -> list[str]:
    """main() returning its results (for tests and scripts)."""
    p = argparse.ArgumentParser(prog="gpt2-eval generate", description=__doc__.splitlines()[0])
    add_eval_args(p, "gpt2-window", out=False)
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    check_numbers(args, max_new_tokens=">=0", num_samples=">=1", temperature=">0", top_k=">=1")
    apply_threads(args)
    device = resolve_device(args.device)
    try:
        from gpt2_window.system import SYSTEM

        model, state = SYSTEM.load_model(args.run, device, runs_dir=args.runs_dir)
        mc = state["meta"]
        if not mc.get("tokenizer"):
            raise ValueError(
                "this run trained on token ids with an unknown vocabulary; nothing to decode text with"
            )
        tok = Tokenizer.from_dict(mc["tokenizer"])
        ids = tok.encode(args.prompt)
        if not ids:
            raise ValueError("--prompt is empty; give at least one character")
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"error: {e}") from None
    g = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    out = model.generate(
        x, args.max_new_tokens, args.temperature, args.top_k or None, generator=g, vocab_limit=tok.vocab_size
    )
    texts = [tok.decode(row.tolist()) for row in out]
    for i, t in enumerate(texts):
        if args.num_samples > 1:
            print(f"---------- sample {i} ----------")
        print(t)
    return texts


def main(argv: list[str] | None = None) -> None:
    """Console entry point (returns None so the exit status is 0)."""
    run(argv)


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("gpt2-window generate", main))
