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

# The folder under --runs_dir/<system>/ that holds the eval results of exported models (one subfolder per
# export, by its folder name). `train` refuses it as a run name (memfit.train.settings.check_run_name), so
# an export's results can never land in, or replace, a real run's eval/.
EXPORTED = "exported"


def summary_of(module: str, whole: bool = False) -> str:
    """The first line of ``module``'s docstring (``whole``: all of it), read from its source without
    importing it: a command's flags (in a torch-free module) describe the command with the docstring of
    the module that does the work, which imports torch. Only the package above ``module`` is imported (to
    find the file)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(f"no module named {module!r}")
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    return doc if whole or not doc else doc.splitlines()[0]


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


def thread_count(text: str) -> int:
    """--threads' type: a whole number >= 1, refused while the flags are read (before torch's import)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads",
        type=thread_count,
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


def add_eval_args(
    parser: argparse.ArgumentParser, system: str, out: bool = True, shipped: bool = False
) -> argparse.ArgumentParser:
    """The flags every `eval` shares: --run, --runs_dir, --out (a folder), --device, --threads. shipped:
    the system ships weights, which are the model when no --run is given (and `--run shipped`).

    `--run_name` is accepted as a hidden alias of --run (train's spelling of the same name)."""
    g = parser.add_argument_group("run (memfit)")
    default = "the weights shipped in the package, also `--run shipped`" if shipped else "run"
    g.add_argument(
        "--run",
        default=None,
        help=f"run name (as given to train --run_name; under --runs_dir/{system}/), run folder, .pt file or "
        f"exported folder (default: {default}); a run folder is evaluated at its best.pt, else its newest "
        "checkpoint",
    )
    hidden_alias(g, "--run_name", dest="run")
    g.add_argument("--runs_dir", default="runs", help="where train wrote its runs (default %(default)s)")
    parser.set_defaults(eval_system=system)
    if out:
        g.add_argument(
            "--out",
            default=None,
            help="output folder (default: <run folder>/eval; for an exported model, which is never written "
            f"to: --runs_dir/{system}/{EXPORTED}/<its folder name>-<8 hex digits of its path>/eval"
            + (f"; for the shipped weights: --runs_dir/{system}/shipped/eval)" if shipped else ")"),
        )
        g.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_threads_arg(g)
    return parser


def export_eval_name(folder: Path) -> str:
    """The folder under --runs_dir/<system>/exported/ that holds an exported model's eval results: its
    folder name and 8 hex digits of its absolute path, so two exports that share a name (x/model and
    y/model) never replace each other's results, and the same export's next eval replaces its own."""
    import hashlib

    where = str(Path(folder).resolve())
    return f"{Path(where).name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def eval_out_dir(
    args: argparse.Namespace, run_path: Path, inputs: tuple = (), name: str | None = None
) -> Path:
    """--out, or <run folder>/eval (the run's own: a new eval replaces its files); created here so an
    unwritable location fails before the work. An exported folder (the shipped weights among them) is
    read, never written: its results go to --runs_dir/<system>/exported/<export_eval_name>/eval, a folder
    no run can have (`train` refuses the run name "exported"), so an export named like a run never
    replaces that run's results; `name` (e.g. "shipped", itself a name no run can have) puts them in
    --runs_dir/<system>/<name>/eval instead. --out may not lie inside an input (`inputs`, e.g. --data, and
    the model), and a non-empty --out needs --overwrite (memfit.train.outputs.output_dir)."""
    from memfit.train.export import is_export
    from memfit.train.outputs import output_dir

    model_folder = run_path if run_path.is_dir() else run_path.parent
    exported = is_export(model_folder)
    if args.out:
        out = Path(args.out)
    elif exported:
        where = [name] if name else [EXPORTED, export_eval_name(model_folder)]
        out = Path(args.runs_dir, args.eval_system, *where, "eval")
    else:
        out = model_folder / "eval"
    read_only = [model_folder] if exported else []
    return output_dir(
        out, [*inputs, *read_only], overwrite=getattr(args, "overwrite", False), own=not args.out
    )


class BooleanFlag(argparse.Action):
    """``--x`` / ``--no_x``: a switch in memfit's one flag spelling (underscores, as every other flag).
    ``--no-x``, argparse's spelling that earlier versions printed, is still accepted for scripts that have
    it, and --help says so; it is left out of the usage line."""

    def __init__(self, option_strings, dest, default=None, required=False, help=None, **kwargs):
        names = [s.removeprefix("--") for s in option_strings if s.startswith("--")]
        self.negative = {f"--no_{n}" for n in names} | {f"--no-{n}" for n in names}
        old = ", ".join(f"--no-{n}" for n in names)
        if help is not None and help is not argparse.SUPPRESS:
            help = f"{help} (also {old}, the older spelling)"
        strings = [*option_strings, *(f"--no_{n}" for n in names), *(f"--no-{n}" for n in names)]
        super().__init__(strings, dest, nargs=0, default=default, required=required, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.negative)

    def format_usage(self) -> str:
        return " | ".join(s for s in self.option_strings if not s.startswith("--no-"))


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
