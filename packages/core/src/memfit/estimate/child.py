"""Run the user's code in a child process, so a target that ends the process still gets one line.

`memfit estimate TARGET` imports the user's file and calls their factory and forward. A target that calls
``os._exit(7)``, ``sys.exit`` from C, or kills itself would end memfit with it: exit 7 / 137 and no word.
``in_child(fn)`` forks, runs ``fn()`` in the child and hands its outcome back through a pipe: its printed
output, its return value or its exception (re-raised here, so ``run_command`` prints it as usual). The child
also says, as it goes, what it is doing (``note("while building the model")``); when it ends without an
outcome, the parent raises one UsageError: "the target ended the process (exit 7) while building the
model". A fork costs milliseconds (nothing is imported again); where there is no fork (Windows), in a
child already, or in a process that started CUDA or ran backward before (neither works in a fork of it: a
test, a notebook), ``fn()`` runs here, unguarded.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any

from memfit.errors import UsageError

_PHASE, _OUTCOME, _NO_AUTOGRAD = b"P", b"R", b"N"
_channel: int | None = None  # the pipe to the parent, in a child


def note(what: str) -> None:
    """Say what the child is doing now ("while building the model"); nothing outside a child."""
    if _channel is not None:
        _send(_PHASE, what.encode())


def _send(tag: bytes, payload: bytes) -> None:
    data = tag + struct.pack("<Q", len(payload)) + payload
    while data:
        data = data[os.write(_channel, data) :]


def _records(data: bytes) -> list[tuple[bytes, bytes]]:
    out, i = [], 0
    while i + 9 <= len(data):
        (n,) = struct.unpack("<Q", data[i + 1 : i + 9])
        if i + 9 + n > len(data):
            break  # cut short: the child died writing it
        out.append((data[i : i + 1], data[i + 9 : i + 9 + n]))
        i += 9 + n
    return out


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(sig).name}"
        return f"killed by signal {sig}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _autograd_works() -> bool:
    """Whether backward runs in this forked child: not where the parent ran one before the fork (torch's
    engine refuses: "Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), e.g. a test or a notebook that trained first. Tried before any user code runs."""
    import torch

    try:
        torch.ones(1, requires_grad=True).sum().backward()
        return True
    except RuntimeError:
        return False


def _child(fn: Callable[[], Any], write: int) -> None:
    """In the child: run fn with stdout and stderr kept, send the outcome, and end without cleanup (the
    parent's atexit handlers and buffers are the parent's)."""
    global _channel
    _channel = write
    if not _autograd_works():
        _send(_NO_AUTOGRAD, b"")
        os._exit(0)
    out, err = io.StringIO(), io.StringIO()
    result: Any = None
    error: BaseException | None = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = fn()
    except SystemExit as exc:  # the target's sys.exit(3): the process would end, as with os._exit
        if exc.code is not None and not isinstance(exc.code, int):
            error = exc  # SystemExit("error: ..."): a message for run_command
        else:
            os._exit(exc.code or 0)  # no outcome sent: the parent names the exit
    except BaseException as exc:  # every outcome goes back to the parent, raised there
        if not isinstance(exc, (UsageError, KeyboardInterrupt)):
            exc.add_note("in memfit's child process:\n" + "".join(traceback.format_exception(exc)))
        error = _picklable(exc)
    try:
        payload = pickle.dumps((result, error, out.getvalue(), err.getvalue()))
    except Exception as exc:  # an unpicklable return value
        payload = pickle.dumps((None, RuntimeError(f"cannot hand back the result: {exc}"), "", ""))
    try:
        _send(_OUTCOME, payload)
    finally:
        os._exit(0)


def in_child(fn: Callable[[], Any], what: str = "the target") -> Any:
    """fn() run in a forked child: its return value, its exception re-raised, its stdout and stderr
    printed here; a child that ends before it is done is one UsageError naming how and when it ended."""
    torch = sys.modules.get("torch")
    if not hasattr(os, "fork") or _channel is not None or (torch is not None and torch.cuda.is_initialized()):
        return fn()  # no fork here, a child already, or CUDA up in this process (a fork cannot use it)
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        _child(fn, write)
    os.close(write)
    chunks = []
    try:
        while chunk := os.read(read, 1 << 16):
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
    except BaseException:  # Ctrl-C or SIGTERM while waiting: the child goes too
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read)
    records = _records(b"".join(chunks))
    if any(tag == _NO_AUTOGRAD for tag, _ in records):  # this process used autograd: no guard possible
        return fn()
    outcome = [payload for tag, payload in records if tag == _OUTCOME]
    if not outcome:
        phases = [payload.decode() for tag, payload in records if tag == _PHASE]
        when = f" {phases[-1]}" if phases else ""
        raise UsageError(
            f"error: {what} ended the process ({_how_it_ended(status)}){when}; it must return, not end "
            "the process (look for os._exit, sys.exit or a kill in it)"
        )
    result, error, out, err = pickle.loads(outcome[0])
    sys.stdout.write(out)
    sys.stderr.write(err)
    if error is not None:
        raise error
    return result
