"""The run folder: what `train` may do with runs/<system>/<run_name>/.

- A folder that already holds a run (checkpoints or metrics) is continued only with ``--resume``,
  replaced only with ``--overwrite``; otherwise `train` refuses, naming both and ``--run_name``.
  ``--overwrite`` deletes nothing: the old run moves aside to ``<run_name>.old-<time>/`` beside it.
- Temp files of a save that a kill interrupted (``.ckpt_*.pt.tmp<pid>``) are removed at the next start
  (memfit.train.outputs.remove_stale_temps).
- ``.lock`` holds the pid of the live trainer; a second trainer is refused while that pid lives, and a
  lock left by a dead process is taken over.
- On resume, metrics rows after the resumed step are dropped, so a run's metrics.jsonl has one row per
  step however often it was interrupted; so is a line that does not parse (torn by a crash), with a
  warning naming it (metrics_log.read_rows).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from memfit.errors import ModelFileMissing, UsageError, os_error_message
from memfit.train.checkpoint import BEST_NAME, list_checkpoints
from memfit.train.metrics_log import read_rows
from memfit.train.outputs import pid_alive, remove_stale_temps, write_file

LOCK_NAME = ".lock"
DYING_S = 3.0  # how long a surviving rank waits for a lost rank 0 (the lock's holder) to finish exiting
METRICS_NAME = "metrics.jsonl"


def resolve_run(run: str | Path | None, system: str, runs_dir: str | Path = "runs") -> Path:
    """The run folder or checkpoint file `run` names: None -> runs_dir/system/run; an existing path as is;
    a bare name -> runs_dir/system/name (what `train --run_name name` wrote). None of these: ModelFileMissing
    (a FileNotFoundError; one line)."""
    base = Path(runs_dir) / system
    path = base / "run" if run is None else Path(run)
    if path.exists():
        return path
    if run is not None and len(path.parts) == 1 and (base / path).exists():
        return base / path
    name = "run" if run is None else str(run)
    raise ModelFileMissing(
        f"error: no run {name!r}: no such path and no run of that name in {base}; "
        "train first, or pass --run RUN_NAME (and its --runs_dir) or a run folder / .pt file"
    )


def holds_run(run_dir: Path) -> bool:
    """Whether run_dir has a previous run's checkpoints or metrics."""
    return (
        bool(list_checkpoints(run_dir)) or (run_dir / BEST_NAME).exists() or (run_dir / METRICS_NAME).exists()
    )


def run_names(base: Path) -> list[str]:
    """The names of the folders in `base` (runs_dir/<system>) that hold a run, sorted."""
    try:
        return sorted(p.name for p in base.iterdir() if p.is_dir() and holds_run(p))
    except OSError:  # no such folder (no run yet), or unreadable: no names to offer
        return []


def refuse_missing_run(run_dir: Path, config_name: str, most: int = 10) -> None:
    """`--resume --run_name NAME` where runs_dir/<system>/NAME holds nothing of a run (no checkpoint, no
    metrics, no config.json; most likely a typo): one line naming the runs there (at most `most`), rather
    than a fresh run started under the misspelt name. A folder with a run's config.json but no checkpoint
    yet (a run stopped before its first save) is resumed from step 0, as a bare --resume is.
    `config_name`: that file's name (memfit.train.settings.CONFIG_NAME, which imports this module)."""
    if holds_run(run_dir) or (run_dir / config_name).is_file():
        return
    names = run_names(run_dir.parent)
    shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
    there = f"its runs: {shown}" if names else "it holds none"
    raise UsageError(
        f"error: --resume: no run {run_dir.name!r} in {run_dir.parent} ({there}); pass the --run_name of a "
        "run to continue, or leave out --resume to start a new one"
    )


class RunFolder:
    """Claims a run folder for one trainer: create, refuse or clear, lock; release() gives it back."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock = self.path / LOCK_NAME
        self.locked = False

    def check(self, resume: bool, overwrite: bool) -> None:
        """The refusals `open` makes that need nothing written (flags that contradict, a folder that holds
        a run without --resume or --overwrite): a trainer checks them before its pre-flight's estimate."""
        if resume and overwrite:
            raise UsageError("error: --resume and --overwrite contradict each other; pick one")
        if holds_run(self.path) and not resume and not overwrite:
            self._refuse()

    def _refuse(self) -> None:
        ckpts = list_checkpoints(self.path)
        what = f"checkpoints up to {ckpts[-1].name}" if ckpts else "metrics"
        raise UsageError(
            f"error: {self.path} already holds a run ({what}); continue it with --resume, "
            "start a new one with --run_name NAME, or replace it with --overwrite"
        )

    def open(self, resume: bool, overwrite: bool) -> None:
        if resume and overwrite:
            raise UsageError("error: --resume and --overwrite contradict each other; pick one")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(
                f"error: cannot create the run folder {self.path}: {os_error_message(e)}"
            ) from None
        self._lock()
        remove_stale_temps(self.path, "an interrupted save")
        if holds_run(self.path) and not resume:
            if overwrite:
                self._clear()
            else:
                self.release()
                self._refuse()

    def _lock(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid != os.getpid() and pid_alive(pid):
                    raise UsageError(
                        f"error: {self.path} is in use by another trainer (pid {pid}); wait for it to "
                        "finish, stop it, or train into another --run_name"
                    ) from None
                if pid != os.getpid():
                    print(f"[memfit] taking over the stale lock of pid {pid} in {self.path}", file=sys.stderr)
                self.lock.unlink(missing_ok=True)
                continue
            except OSError as e:
                raise UsageError(f"error: cannot write in the run folder: {os_error_message(e)}") from None
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.locked = True
            return
        raise UsageError(f"error: could not lock {self.path}; another trainer keeps taking it")

    def _clear(self) -> None:
        """--overwrite: move everything of the old run (not our lock) to <name>.old-<time>/ beside it."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.old-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.name}.old-{stamp}-{n}")
        try:
            aside.mkdir()
            for p in self.path.iterdir():
                if p.name != LOCK_NAME:
                    os.replace(p, aside / p.name)
        except OSError as e:
            self.release()
            why = os_error_message(e)
            raise UsageError(f"error: --overwrite: could not move the old run aside: {why}") from None
        print(f"[memfit] --overwrite: the previous run is now {aside}", file=sys.stderr)

    def release(self) -> None:
        if self.locked:
            try:
                if self.lock.read_text().strip() == str(os.getpid()):
                    self.lock.unlink()
            except OSError:
                pass
            self.locked = False

    def release_dead(self) -> bool:
        """Remove the lock (and the temporary files) of a trainer that died on this machine: what a
        surviving DDP rank does when rank 0, the lock's holder, was killed. Returns whether it did."""
        try:
            pid = int(self.lock.read_text().strip() or 0)
        except (OSError, ValueError):
            return False
        if pid == os.getpid():
            return False
        # a peer's socket closes while its process is still exiting, before it is even a zombie: the
        # survivor can get here first, so the dying holder is given a moment (a live one keeps its lock)
        deadline = time.monotonic() + DYING_S
        while pid_alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        try:  # still the dead holder's lock, not one a trainer restarted meanwhile has taken
            if self.lock.read_text().strip() != str(pid):
                return False
        except OSError:
            return False
        self.lock.unlink(missing_ok=True)
        remove_stale_temps(self.path, "an interrupted save")
        return True

    def truncate_metrics(self, step: int) -> int:
        """Drop metrics rows after `step`, and lines that do not parse (each named in a warning); returns
        how many rows were dropped after `step`."""
        path = self.path / METRICS_NAME
        if not path.exists():
            return 0
        lines = path.read_bytes().split(b"\n")
        rows = read_rows(path, action="dropped")
        kept = [line for line, row in rows if row["step"] <= step]
        if len(kept) < sum(1 for line in lines if line.strip()):
            write_file(path, lambda tmp: tmp.write_bytes(b"".join(x + b"\n" for x in kept)), overwrite=True)
        return len(rows) - len(kept)
