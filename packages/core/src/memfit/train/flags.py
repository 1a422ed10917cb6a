"""Command-line pieces every command shares: the parser with one-line errors and the `eval` flags.

A system's `train` flags are declared with ``memfit.train.settings.TrainParser`` (each bound to a settings
path).
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from memfit.errors import UsageError
from memfit.train.config import check_fields


class Parser(argparse.ArgumentParser):
    """argparse with memfit's error contract: a bad or unknown flag is one line (UsageError, exit 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--lr` must never silently match `--lr_min`
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"error: {message}; see --help")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        self._refuse_two_spellings(argv)
        return super().parse_known_args(argv, namespace)

    def _refuse_two_spellings(self, argv: list[str]) -> None:
        """Two flags of one setting on one command line (--run and its old spelling --run_name): argparse
        would keep the last one silently."""
        used: dict[str, dict[int, str]] = {}
        for token in argv:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            action = self._option_string_actions.get(name) if name.startswith("--") else None
            if action is not None:
                used.setdefault(action.dest, {}).setdefault(id(action), name)
        for dest, names in used.items():
            if len(names) > 1:
                self.error(f"{' and '.join(names.values())} both set {dest}; give one of them")


def add_threads_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (torch, BLAS); default: torch's own choice, all cores",
    )


def apply_threads(args: argparse.Namespace) -> None:
    """Cap every thread pool at args.threads when --threads was given (>= 1; memfit.train.cpu.set_threads)."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        check_numbers(args, threads=">=1")
        from memfit.train.cpu import set_threads

        set_threads(threads)


def add_eval_args(parser: argparse.ArgumentParser, system: str, out: bool = True) -> argparse.ArgumentParser:
    """The flags every `eval` shares: --run, --runs_dir, --out (a folder), --device, --threads.

    `--run_name` is accepted as a hidden alias of --run (train's spelling of the same name)."""
    g = parser.add_argument_group("run (memfit)")
    g.add_argument(
        "--run",
        default=None,
        help=f"run name (as given to train --run_name; under --runs_dir/{system}/), run folder or .pt file "
        "(default: run); a folder is evaluated at its best.pt, else its newest checkpoint",
    )
    hidden_alias(g, "--run_name", dest="run")
    g.add_argument("--runs_dir", default="runs", help="where train wrote its runs (default %(default)s)")
    if out:
        g.add_argument("--out", default=None, help="output folder (default: <run folder>/eval)")
        g.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_threads_arg(g)
    return parser


def eval_out_dir(args: argparse.Namespace, run_path: Path, inputs: tuple = ()) -> Path:
    """--out, or <run folder>/eval (the run's own: a new eval replaces its files); created here so an
    unwritable location fails before the work. --out may not lie inside an input (`inputs`, e.g. --data),
    and a non-empty --out needs --overwrite (memfit.train.outputs.output_dir)."""
    from memfit.train.outputs import output_dir

    out = Path(args.out) if args.out else (run_path if run_path.is_dir() else run_path.parent) / "eval"
    return output_dir(out, inputs, overwrite=getattr(args, "overwrite", False), own=not args.out)


def hidden_alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, **kw: Any) -> None:
    """An old spelling of a flag, still accepted but not shown in --help."""
    parser.add_argument(*names, help=argparse.SUPPRESS, **kw)


def check_numbers(args: argparse.Namespace, **rules: str) -> None:
    """Refuse bad numbers in one line, e.g. check_numbers(args, seconds=">0", pairs=">=1").

    Rules as memfit.train.config.check_fields: ">0", ">=0", ">=1"; None is skipped; NaN and infinity are
    refused.
    """
    try:
        check_fields(args, **rules)
    except ValueError as e:
        raise UsageError(f"error: --{e}") from None
