"""Where every console script starts: Ctrl-C and SIGTERM are one line from the first instruction on.

A console script imports its function's module before it calls the function, and memfit's commands
import torch (seconds of start-up): a Ctrl-C then was a 30-line KeyboardInterrupt traceback from inside
torch, before any handler existed. So every script of the workspace names a function of this module,
which imports nothing heavy: it runs the command under ``memfit.errors.run_command`` (Ctrl-C: status
130, SIGTERM: 143, one line each) and imports the command's module inside it, under
``memfit.errors.exit_at_once`` (a signal during the imports ends the process there, in one line).

    memfit = "memfit.launch:memfit"
    train = "memfit.launch:train"                   # the dispatcher: --system, `uv run --package`, ...
    ginr-train = "memfit.launch:train.ginr_cifar"   # one system's alias: the system whose
                                                    # memfit.systems entry point lives in ginr_cifar
    memfit-report = "memfit_report.console:cli"     # a light module of its own: launch(spec, prog, argv)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from memfit.errors import UsageError, exit_at_once, run_command


def _prog() -> str:
    return os.path.basename(sys.argv[0])


def launch(spec: str, prog: str | None = None, argv: list[str] | None = None) -> int:
    """Run the command "package.module:function" (imported here, under run_command) on argv; its exit
    status. prog defaults to the name the script was started by."""
    prog = prog or _prog()

    def call(args: list[str] | None) -> Any:
        module, _, attr = spec.partition(":")
        with exit_at_once(prog):
            fn = getattr(importlib.import_module(module), attr)
        return fn(args)

    return run_command(prog, call, argv)


def _system_of(package: str) -> str:
    """The name of the system whose memfit.systems entry point lives in `package` (metadata only)."""
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="memfit.systems") if ep.module.split(".")[0] == package]
    if len(names) != 1:
        raise UsageError(f"error: {package} registers {len(names)} memfit systems, not one; reinstall it")
    return names[0]


def _system_command(package: str, kind: str, argv: list[str] | None) -> Any:
    with exit_at_once(_prog()):
        from memfit.system import load_system

        fn = load_system(_system_of(package)).entry(kind)
    return fn(argv)


class _Command:
    """A console entry point for `kind` (train, eval): called, the core dispatcher; `.<package>`, the
    alias of the system that package registers (`ginr-train`)."""

    def __init__(self, kind: str, spec: str) -> None:
        self.kind, self.spec = kind, spec

    def __call__(self, argv: list[str] | None = None) -> int:
        return launch(self.spec, None, argv)

    def __getattr__(self, package: str) -> Callable[..., int]:
        if package.startswith("__"):
            raise AttributeError(package)

        def entry(argv: list[str] | None = None) -> int:
            return run_command(_prog(), lambda a: _system_command(package, self.kind, a), argv)

        entry.__name__ = f"{package}_{self.kind}"
        return entry


def memfit(argv: list[str] | None = None) -> int:
    """The `memfit` command."""
    return launch("memfit.cli:main", "memfit", argv)


train = _Command("train", "memfit.bare:train_main")
eval = _Command("eval", "memfit.bare:eval_main")  # noqa: A001 (the console script's name)
