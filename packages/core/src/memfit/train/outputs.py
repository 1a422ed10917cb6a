"""The one output path: every file memfit writes (checkpoints, config.json, plots, exports, enhanced audio,
eval results, the report) goes through here, so none replaces an input or a file the user did not offer,
and none is ever left half-written.

- ``check_outputs(outputs, inputs, overwrite)`` refuses, in one line, an output path that is one of the
  inputs or lies inside an input folder, and (without ``--overwrite``) an output file that already exists.
- ``output_dir(out, inputs, overwrite)`` is the folder form: a non-empty folder the user named needs
  ``--overwrite``; the command's own default folder (a run's ``eval/``) is replaced freely.
- ``output_files(targets, overwrite)`` yields a temporary path beside each target (``.NAME.tmpPID``) to
  write; when the block ends they are synced and renamed onto the targets, all written before any is
  renamed. On any failure, on Ctrl-C and on SIGTERM (raised as an exception meanwhile:
  ``memfit.errors.signals_raise``) the temporary files are removed. A full disk, a read-only location or
  a missing permission is one line (``UsageError``), whichever library was writing.
- Temporary files whose process died (kill -9, a power cut) are removed, saying so, the next time
  anything is written in that folder (``remove_stale_temps``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from memfit.errors import UsageError, make_folders, os_error_message, signals_raise

TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")  # .NAME.tmpPID: a write in progress
# Below this much free space, a writer's failure that does not say why (libsndfile: "System error") is
# taken for a full disk.
FULL_BELOW_BYTES = 1 << 20
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_outputs(
    outputs: Iterable[str | Path], inputs: Iterable[str | Path], overwrite: bool = False, flag: str = "--out"
) -> None:
    """UsageError when an output is an input or lies inside an input folder, or (without overwrite) is a
    file that exists already. Give the output files themselves (and their folder): a folder that merely
    holds an input is fine as long as no output lands on it. Paths are compared resolved, so links and
    `..` cannot slip past."""
    ins = [Path(p).resolve() for p in inputs]
    for out in outputs:
        o = Path(out).resolve()
        for i in ins:
            if _inside(o, i):
                raise UsageError(
                    f"error: {flag} {out} is {'an input' if o == i else f'inside the input {i}'}: outputs "
                    "never replace inputs; choose another output location"
                )
        if not overwrite and o.is_file():
            raise UsageError(f"error: {out} exists; pass --overwrite to replace it, or choose another {flag}")


def output_dir(
    out: str | Path, inputs: Iterable[str | Path] = (), overwrite: bool = False, own: bool = False,
    flag: str = "--out",
) -> Path:  # fmt: skip
    """The folder `out`, created now (an unwritable location fails before the work). It may not be or lie
    inside an input; a non-empty one needs `overwrite` unless it is the command's `own` default folder
    (a run's eval/, whose files a new eval replaces). The folders created here are removed again, where
    still empty, if the command fails (``memfit.errors.make_folders``)."""
    out = Path(out)
    check_outputs([out], [p for p in inputs if p], overwrite=True, flag=flag)
    if out.exists() and not out.is_dir():
        raise UsageError(f"error: {flag} {out} is a file, not a folder; choose a folder")
    if not own and not overwrite and out.is_dir() and any(out.iterdir()):
        raise UsageError(
            f"error: {flag} {out} is not empty; pass --overwrite to replace its files, or another {flag}"
        )
    try:
        make_folders(out)  # removed again if the command fails before writing there
    except OSError as e:
        raise UsageError(f"error: cannot create the output folder: {os_error_message(e)}") from None
    return out


def temp_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: .NAME.tmpPID beside it."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (a zombie, dead but not yet reaped by its parent, e.g.
    a torchrun rank killed a moment ago, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS): what kill said
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def remove_stale_temps(folder: Path, what: str = "an interrupted write") -> list[Path]:
    """Remove the temporary files in `folder` whose process is gone; say so for each one."""
    removed = []
    for p in folder.glob(".*.tmp*"):
        m = TEMP_NAME.match(p.name)
        if not m or int(m["pid"]) == os.getpid() or pid_alive(int(m["pid"])) or not p.is_file():
            continue
        try:
            p.unlink()
        except OSError as e:
            print(f"[memfit] {p} was left by {what}; could not remove it ({e.strerror})", file=sys.stderr)
            continue
        removed.append(p)
        print(f"[memfit] removed {p.name}, left by {what}", file=sys.stderr)
    return removed


def _disk_full(e: BaseException, folder: Path) -> bool:
    """Whether a writer failed for want of space: its OSError says so, its message does (safetensors),
    or it does not say why and the disk is (nearly) full (libsndfile's "System error")."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if "No space left on device" in str(e):
        return True
    if isinstance(e, (ValueError, TypeError, LookupError, UsageError)):  # the input's fault, not the disk's
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def output_files(
    targets: Iterable[str | Path], overwrite: bool = False, flag: str = "--out", sync: bool = True
) -> Iterator[list[Path]]:
    """Yield a temporary path beside each target to write; at the end of the block they are synced and
    renamed onto the targets (a reader sees the old file or the new one, never half of one). An existing
    target is refused without `overwrite`. Any failure, Ctrl-C or SIGTERM removes the temporary files; a
    full disk or an unwritable location is a UsageError naming the file."""
    targets = [Path(t) for t in targets]
    for t in targets:
        if t.is_dir():
            raise UsageError(f"error: {t} is a folder; give a file name ({flag})")
        if not overwrite and t.exists():
            raise UsageError(f"error: {t} exists; pass --overwrite to replace it, or choose another {flag}")
    temps: list[Path] = []
    created: list[Path] = []  # folders made here: removed again (when empty) on a failure
    current: Path | None = None  # the file being written, where known (the block may write any of them)
    with signals_raise():
        try:
            for folder in dict.fromkeys(t.parent for t in targets):
                missing = [p for p in (folder, *folder.parents) if not p.exists()]
                folder.mkdir(parents=True, exist_ok=True)
                created += missing
                remove_stale_temps(folder)
            for t in targets:
                current = t
                tmp = temp_path(t)
                with open(tmp, "wb"):  # an unwritable folder fails here, as an OSError
                    temps.append(tmp)
            current = None
            yield list(temps)
            for tmp, t in zip(temps, targets):
                current = t
                if sync:
                    _sync(tmp)
            for tmp, t in zip(temps, targets):
                current = t
                os.replace(tmp, t)
            temps.clear()
        except BaseException as e:
            where = (current or targets[0]).parent
            full = isinstance(e, Exception) and _disk_full(e, where)
            for tmp in temps:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            for folder in created:  # deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            if full:  # inside the block, any of the targets may have been the one being written
                what = current or (targets[0] if len(targets) == 1 else f"{where} ({_names(targets)})")
                raise UsageError(
                    f"error: no space left on the device writing {what}; nothing was written there; free "
                    "some space or choose another location"
                ) from None
            if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:  # named by the target, not the temp file
                named = e.filename if e.filename and not TEMP_NAME.match(Path(e.filename).name) else current
                failed = OSError(e.errno, e.strerror, str(named or where))
                raise UsageError(f"error: {os_error_message(failed)}") from None
            raise


def write_file(
    path: str | Path, write: Callable[[Path], Any], overwrite: bool = False, sync: bool = True
) -> Path:
    """write(temporary path) for one file, through output_files; returns the path."""
    with output_files([path], overwrite=overwrite, sync=sync) as (tmp,):
        write(tmp)
    return Path(path)


def write_text(path: str | Path, text: str, overwrite: bool = False) -> Path:
    """A text file (UTF-8), whole or not at all."""
    return write_file(path, lambda tmp: tmp.write_bytes(text.encode()), overwrite=overwrite)
