"""Sample text from a trained GPT: `memfit run gpt2-window generate --run RUN --prompt "ROMEO:"`.

Its flags are read in gpt2_window.flags, which imports no torch (`--help` answers at once).
"""

from __future__ import annotations

import argparse
import sys

from memfit.train.flags import apply_threads

from gpt2_window.api import samples
from gpt2_window.flags import generate_args


def main(argv: list[str] | None = None) -> list[str]:
    """`generate` with these flags (None: sys.argv[1:]); prints the samples and returns them."""
    return run(generate_args(argv))


def run(args: argparse.Namespace) -> list[str]:
    """The work of `generate` on the flags gpt2_window.flags.generate_args read: prints the samples and
    returns them."""
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


if __name__ == "__main__":  # `python -m` / torchrun: the same exit statuses as the console alias
    from memfit.errors import run_command

    raise SystemExit(run_command("gpt2-window generate", main))
