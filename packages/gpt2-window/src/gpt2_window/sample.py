"""Sample text from a trained GPT: `memfit run gpt2-window generate --run RUN --prompt "ROMEO:"`."""

from __future__ import annotations

import sys

from memfit.train.flags import Parser, add_eval_args, apply_threads, check_numbers

from gpt2_window.api import samples
from gpt2_window.model import MIN_TEMPERATURE


def run(argv: list[str] | None = None) -> list[str]:
    """main() returning its results (for tests and scripts)."""
    p = Parser(prog="memfit run gpt2-window generate", description=__doc__.splitlines()[0])
    add_eval_args(p, "gpt2-window", out=False)
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=200)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    temperature = f"[{MIN_TEMPERATURE:g}, 1e4]"
    check_numbers(args, max_new_tokens="[0, 2**24]", num_samples="[1, 2**16]", temperature=temperature,
                  top_k="[1, 2**31-1]", seed="0..2**63-1")  # fmt: skip
    apply_threads(args)
    from memfit.train.export import model_line

    from gpt2_window.system import SYSTEM

    def say_model(state: dict) -> None:
        print(model_line(SYSTEM, state), file=sys.stderr)

    texts = samples(args.prompt, args.run, args.num_samples, args.max_new_tokens, args.temperature,
                    args.top_k, args.seed, args.device, args.runs_dir, on_load=say_model)  # fmt: skip
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
