"""The bare `train` and `eval` console scripts: `uv run --package mbsnet-speech train` and its kind.

`memfit train SYSTEM` is the command to use; these two exist because uv's own spelling names the system
only as the package to run in. uv puts every workspace member's scripts in one venv ``bin/``, so two
systems that both declared ``train`` would overwrite each other (the last installed would win). Core
declares ``train`` and ``eval`` alone and picks the system, in this order:

1. ``--system S`` on the command line, or ``MEMFIT_SYSTEM=S`` in the environment;
2. the only installed system;
3. the ``--package S`` of the ``uv run`` that started this process. uv passes nothing of it to the
   command (it sets only ``UV``, ``UV_RUN_RECURSION_DEPTH`` and ``VIRTUAL_ENV``), so it is read from the
   parent process's command line: ``/proc`` on Linux, ``ps`` elsewhere (macOS, the BSDs); not on Windows;
4. else one line naming the choices and how to say which.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from memfit.errors import UsageError, run_command
from memfit.system import available_systems, load_system


def _process(pid: int) -> tuple[int, list[str]] | None:
    """(its parent's pid, its argv) of process ``pid``; None where the system will not say."""
    proc = Path("/proc") / str(pid)
    try:  # Linux: /proc/PID/status and its NUL-separated cmdline
        status = (proc / "status").read_text()
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        return ppid, (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, StopIteration, ValueError, IndexError):
        pass  # no /proc, or another system's (FreeBSD's, illumos'): ask ps
    if os.name != "posix":
        return None
    try:  # one ps per process; -ww: never cut to $COLUMNS. Its words split on spaces: enough for --package
        ask = ["ps", "-ww", "-o", "ppid=,args=", "-p", str(pid)]
        said = subprocess.run(ask, capture_output=True, text=True, timeout=2, check=True).stdout
        ppid, *argv = said.split()
        return int(ppid), argv
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def uv_run_package(max_depth: int = 4) -> str | None:
    """The S of the nearest ancestor `uv run --package S ...` (within ``max_depth`` parents), or None."""
    pid = os.getppid()
    for _ in range(max_depth):
        found = _process(pid)
        if found is None:
            return None
        ppid, argv = found
        if argv and Path(argv[0]).name.startswith("uv") and "run" in argv:
            for i, arg in enumerate(argv):
                if arg == "--package" and i + 1 < len(argv):
                    return argv[i + 1]
                if arg.startswith("--package="):
                    return arg.split("=", 1)[1]
            return None
        if pid <= 1:  # init (or a container's first process, looked at above): no parent left
            return None
        pid = ppid
    return None


def pick_system(argv: list[str], kind: str = "train") -> tuple[str, list[str]]:
    """Decide which system a bare `train`/`eval` call (`kind`) is for; returns (name, remaining argv)."""
    systems = available_systems()
    choices = ", ".join(sorted(systems)) or "(none installed)"
    rest = list(argv)
    for i, arg in enumerate(rest):
        if arg == "--system" or arg.startswith("--system="):
            if "=" in arg:
                name = arg.split("=", 1)[1]
                del rest[i]
            else:
                if i + 1 >= len(rest):
                    raise UsageError(f"error: --system needs a name; installed systems: {choices}")
                name = rest[i + 1]
                del rest[i : i + 2]
            break
    else:
        name = os.environ.get("MEMFIT_SYSTEM")
        if name and name not in systems:
            raise UsageError(f"error: MEMFIT_SYSTEM={name} is not an installed system; installed: {choices}")
        if not name and len(systems) == 1:  # what the parent uv run names can only be this system
            name = next(iter(systems))
        elif not name:
            name = uv_run_package()
            if name is not None and name not in systems:
                name = None  # `uv run --package memfit-core train`: a package, but not a system
    if name is None:
        raise UsageError(
            f"error: which system? Several are installed; say `memfit {kind} <system>`, `{kind} --system "
            f"<system>` or `uv run --package <system> {kind}`. Installed: {choices}"
        )
    if name not in systems:
        raise UsageError(f"error: unknown system {name!r}; installed systems: {choices}")
    return name, rest


def _dispatch(kind: str, argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--list"], ["--list_systems"], ["--list-systems"]):  # the last: the older spelling
        for name in sorted(available_systems()):
            print(name)
        return
    name, rest = pick_system(argv, kind)
    system = load_system(name)
    sys.argv[0] = f"{name} {kind}"  # argparse's prog: `--help` says which system answered
    status = run_command(sys.argv[0], system.entry(kind), rest)
    if status:
        raise SystemExit(status)


def train_main(argv: list[str] | None = None) -> None:
    """`train [--system S] ...`: the chosen system's trainer."""
    _dispatch("train", argv)


def eval_main(argv: list[str] | None = None) -> None:
    """`eval [--system S] ...`: the chosen system's evaluation."""
    _dispatch("eval", argv)
