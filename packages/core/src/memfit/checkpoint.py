"""Checkpoint files: atomic writes, pruning, the newest or best checkpoint of a run, RNG state."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CKPT_PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")
BEST_NAME = "best.pt"
CHECKPOINT_FORMAT = 1  # version of the checkpoint schema: format, system, step, model, optimizer, rng, ...


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[2]],
        "python_version": random.getstate()[0],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore _rng_state(); torch wants CPU ByteTensors, whatever device the checkpoint was loaded to."""
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    py = state["python"]
    random.setstate((state["python_version"], tuple(py[:-1]), py[-1]))
    np.random.set_state(("MT19937", state["numpy"]["keys"].cpu().numpy().astype(np.uint32),
                         state["numpy"]["pos"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to("cpu", torch.uint8) for t in state["cuda"]])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints in run_dir, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _write_atomic(path: Path, write: Callable[[Any], None]) -> Path:
    """write(file) into a temp file beside path, fsync, rename: readers never see half a file, and a
    failure (full disk, Ctrl-C) leaves no temp file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_atomic(path: Path, state: dict[str, Any]) -> Path:
    """torch.save to path atomically (temp file, fsync, rename)."""
    return _write_atomic(path, lambda f: torch.save(state, f))


def write_text_atomic(path: Path, text: str) -> Path:
    """A text file written atomically (temp file, fsync, rename)."""
    return _write_atomic(path, lambda f: f.write(text.encode()))


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write run_dir/ckpt_<step>.pt atomically (temp file, fsync, rename) and keep the newest keep_last."""
    path = write_atomic(Path(run_dir) / f"ckpt_{step:07d}.pt", state)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def find_checkpoint(run_dir: str | Path, which: str = "best") -> Path | None:
    """The checkpoint to use from a run folder.

    which="best": run_dir/best.pt if the run tracked a best metric, else the newest intact step
    checkpoint; which="latest": the newest intact step checkpoint. None when there is none.
    """
    if which not in ("best", "latest"):
        raise ValueError(f"which must be 'best' or 'latest', got {which!r}")
    run_dir = Path(run_dir)
    if which == "best" and (run_dir / BEST_NAME).is_file():
        return run_dir / BEST_NAME
    return latest_checkpoint(run_dir)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint file, or the newest one in a run folder (weights_only=True: no code runs)."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint (ckpt_*.pt) in {path}; train first or pass a .pt file")
        path = found
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and why, not a pickle traceback
        raise ValueError(f"could not read checkpoint {path}: {e}") from e
