"""User-facing errors and the one wrapper every command runs under.

Bad input (a path, a number, a checkpoint of another system, a full disk) is one line naming the problem
and the fix, and exit status 2, never a traceback. Code raises ``UsageError(message)``, an ordinary
exception (not a ``SystemExit``), so the Python API (``memfit.estimate``, ``System.from_pretrained``, the C
kernel's loader) raises it like any library error and ``except Exception`` catches it. ``run_command``,
which every command runs under, prints the line and turns it, and a plain ``SystemExit("message")``, into
status 2. It also turns an ``OSError`` (unwritable or missing location, no space left) into one line, and
Ctrl-C and SIGTERM (which cluster schedulers send) into one line and status 130 / 143: under it SIGTERM
raises ``Interrupted`` like Ctrl-C raises KeyboardInterrupt, so every ``finally`` runs and a file being
written is removed, not left half-written.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


class UsageError(Exception):
    """A user-facing error: one line naming the problem and the fix; exit status 2 under run_command."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Interrupted(KeyboardInterrupt):
    """A stop signal other than Ctrl-C (SIGTERM) raised where the program is, as Ctrl-C raises
    KeyboardInterrupt: cleanup runs on the way out, and run_command exits with 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM raises Interrupted (where it would kill the process outright); Ctrl-C
    raises KeyboardInterrupt (Python's default). A handler someone else installed is left alone, and the
    previous one is back after the block. Only the main thread can take signals; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    mine = previous == signal.SIG_DFL
    if mine:
        signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        if mine:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def exit_at_once(prog: str) -> Iterator[None]:
    """Within the block (a command's start-up: importing torch and the rest), Ctrl-C and SIGTERM print one
    line and end the process at once with 128 + signum. Raising KeyboardInterrupt into an import half done
    can be swallowed by the library being imported, or turn into another traceback; and nothing is
    written yet that would need cleaning up. The previous handlers are back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        os.write(2, f"{prog}: {what}\n".encode())
        os._exit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class ModelFileError(UsageError, ValueError):
    """A model file or folder that cannot be loaded (another system's, damaged, weights that do not fit
    their config): a ValueError to Python code, one line and exit 2 to a command."""


class ModelFileMissing(UsageError, FileNotFoundError):
    """No model where one was named (no such run, folder or checkpoint): a FileNotFoundError to Python
    code, one line and exit 2 to a command."""


def first_line(e: BaseException, limit: int = 160) -> str:
    """The telling line of an exception's message, for a one-line report (load_state_dict's first line
    is only a heading ending in ':', so the line after it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return (lines[1] if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:limit]


def out_of_memory(e: BaseException) -> bool:
    """Whether an exception is an allocation failure: MemoryError (numpy's too), torch's OutOfMemoryError
    (CUDA) or the CPU allocator's RuntimeError."""
    text = str(e)
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)
    )


def os_error_message(e: OSError) -> str:
    """One line for an OSError: what failed, on which path, and what to do."""
    where = f" {e.filename}" if getattr(e, "filename", None) else ""
    reason = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        return f"no space left on the device writing{where}; free some space or choose another location"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write{where}: {reason}; choose a writable location (--runs_dir / --out)"
    if e.errno in (errno.ENOTDIR, errno.ENOENT):
        return f"{reason}:{where}; check the path (a folder cannot be created under a file)"
    return f"{reason}:{where}; check the path and free space"


# The folders the running command created (make_folders), removed again where still empty if it fails
_MADE: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("memfit_made_folders", default=None)


def make_folders(folder: str | Path) -> Path:
    """Create `folder` and its missing parents (an OSError is the caller's to say). Under run_command,
    the folders created here are removed again, where still empty, when the command fails (a user error,
    Ctrl-C, a crash): a failed command leaves no empty output folder behind. A folder that was there
    before is never removed, nor one that holds anything."""
    folder = Path(folder)
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    made = _MADE.get()
    if made is not None:
        made.extend(missing)
    return folder


def _remove_empty(folders: list[Path]) -> None:
    for folder in sorted(set(folders), key=lambda p: len(p.parts), reverse=True):  # deepest first
        with contextlib.suppress(OSError):  # not empty (something was written there), or gone: kept
            folder.rmdir()


def run_command(prog: str, fn: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a command's main(argv); return its exit status: 0 on success (main may return a result such
    as a metrics dict; only an int is taken as a status), 2 on a user error, 128 + N on signal N. On any
    other status, or an exception let through, the empty folders it made (make_folders) are removed."""
    made: list[Path] = []
    token = _MADE.set(made)
    status = None
    try:
        status = _run_command(prog, fn, argv)
        return status
    finally:
        _MADE.reset(token)
        if status != 0:
            _remove_empty(made)


def _run_command(prog: str, fn: Callable[[list[str] | None], Any], argv: list[str] | None) -> int:
    try:
        with signals_raise():
            result = fn(argv)
    except UsageError as e:
        message = str(e)
        print(f"{prog}: {message}" if message.startswith("error:") else message, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        message = str(e.code)
        if message.startswith("error:"):
            message = f"{prog}: {message}"
        print(message, file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"{prog}: error: {os_error_message(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        print(f"{prog}: error: out of memory ({first_line(e)}); ask for less (a smaller size, batch, length)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM as Interrupted: whatever was being written is gone
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{prog}: {'interrupted' if signum == signal.SIGINT else f'stopped by {e}'}", file=sys.stderr)
        return 128 + signum
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def console(fn: Callable[[list[str] | None], Any], prog: str | None = None) -> Callable[..., int]:
    """A console-script entry point for fn: `sys.exit(entry())` gives 0 on success, 2 on a user error.

    prog defaults to the name the script was started by (e.g. `mbsnet-train`).
    """

    def entry(argv: list[str] | None = None) -> int:
        return run_command(prog or os.path.basename(sys.argv[0]), fn, argv)

    entry.__name__ = entry.__qualname__ = f"{fn.__name__}_console"
    entry.__doc__ = fn.__doc__
    return entry
