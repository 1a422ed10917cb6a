"""Checkpoint files: atomic writes, pruning, the newest or best checkpoint of a run, RNG state."""

from __future__ import annotations

import pickle
import random
import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import UsageError, first_line
from memfit.train.outputs import write_file, write_text

CKPT_PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")
BEST_NAME = "best.pt"
CHECKPOINT_FORMAT = 1  # version of the checkpoint schema: format, system, step, model, optimizer, rng, ...


def memfit_version() -> str:
    """The installed memfit-core's version: what checkpoints and exports record as their writer."""
    try:
        return version("memfit-core")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


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
    np.random.set_state(
        ("MT19937", state["numpy"]["keys"].cpu().numpy().astype(np.uint32), state["numpy"]["pos"])
    )
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


def write_atomic(path: Path, state: dict[str, Any]) -> Path:
    """torch.save to path through the one output path (memfit.train.outputs: temp file, fsync, rename; a
    failure, Ctrl-C or SIGTERM leaves no temp file)."""

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)

    return write_file(path, save, overwrite=True)


def write_text_atomic(path: Path, text: str) -> Path:
    """A text file of the run written atomically (memfit.train.outputs), replacing the run's own."""
    return write_text(path, text, overwrite=True)


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write run_dir/ckpt_<step>.pt atomically (temp file, fsync, rename) and keep the newest keep_last."""
    path = write_atomic(Path(run_dir) / f"ckpt_{step:07d}.pt", state)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def checkpoint_candidates(run_dir: str | Path, which: str = "best") -> list[Path]:
    """The checkpoints to try, in order, when a run folder is loaded: which="best": best.pt if the run
    tracked a best metric, then the step checkpoints newest first; which="latest": the step checkpoints
    newest first. load_intact takes the first that is intact."""
    if which not in ("best", "latest"):
        raise ValueError(f"which must be 'best' or 'latest', got {which!r}")
    run_dir = Path(run_dir)
    best = [run_dir / BEST_NAME] if which == "best" and (run_dir / BEST_NAME).is_file() else []
    return best + list(reversed(list_checkpoints(run_dir)))


def _unreadable_why(path: Path, e: Exception) -> str:
    """Why torch.load refused a file, in a few words (never torch's advice to load it unsafely)."""
    try:
        head = path.read_bytes()[:4]
    except OSError as err:
        return err.strerror or str(err)
    if not head:
        return "the file is empty (a save that never finished?)"
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save's zip archive, or its legacy pickle
        return "not a PyTorch checkpoint"
    if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
        return "it holds objects other than tensors and plain data (refused: loading them could run code)"
    return f"truncated or damaged ({first_line(e, 120)})"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint file, or the newest one in a run folder (weights_only=True: no code runs).
    ValueError, in one line, for a file that does not read as a checkpoint."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint (ckpt_*.pt) in {path}; train first or pass a .pt file")
        path = found
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and why, not a pickle traceback
        raise ValueError(f"could not read checkpoint {path}: {_unreadable_why(path, e)}") from e
    if not isinstance(state, dict):
        kind = type(state).__name__
        raise ValueError(f"could not read checkpoint {path}: it holds a {kind}, not a checkpoint")
    return state


def _is(kind: type | tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kind) and not (kind is int and isinstance(v, bool))


def _tensors(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and torch.is_tensor(t) for k, t in v.items())


# What a checkpoint holds (format 1): entry -> (check, what it must be). MODEL_KEYS are all that loading a
# model needs; a resume needs every entry of RESUME_KEYS too.
_SCHEMA: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (lambda v: v == CHECKPOINT_FORMAT, f"{CHECKPOINT_FORMAT} (this memfit's checkpoint format)"),
    "system": (_is((str, type(None))), "a system name"),
    "step": (lambda v: _is(int)(v) and v >= 0, "a step count"),
    "config": (_is(dict), "the model config (a dict)"),
    "model": (_tensors, "the model's weights (names to tensors)"),
    "ema_model": (_tensors, "the weight average (names to tensors)"),
    "optimizer": (lambda v: isinstance(v, dict) and {"state", "param_groups"} <= set(v), "an optimizer's"),
    "scaler": (_is(dict), "a GradScaler state (a dict)"),
    "rng": (lambda v: isinstance(v, dict) and isinstance(v.get("torch"), torch.Tensor), "the RNG states"),
    "progress": (lambda v: isinstance(v, dict) and _is((int, float))(v.get("seconds", 0.0)), "the progress"),
    "best": (_is((dict, type(None))), "the best metric (a dict)"),
    "meta": (_is(dict), "a dict"),
}
MODEL_KEYS = ("format", "system", "config", "model")
RESUME_KEYS = (*MODEL_KEYS, "step", "optimizer", "scaler", "rng")


def refuse_newer_format(doc: dict[str, Any], path: Path, what: str = "checkpoint") -> None:
    """UsageError naming the file and the memfit that wrote it when `doc` (a checkpoint, an export's
    config.json) is of a newer format than this memfit reads: a newer memfit's work is never skipped,
    deleted or half-read, whatever else is tried."""
    fmt = doc.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > CHECKPOINT_FORMAT:
        by = doc.get("memfit_version")
        writer = f"memfit {by}" if isinstance(by, str) else "a newer memfit (its version is not recorded)"
        raise UsageError(
            f"error: {path} is a {what} of format {fmt}, written by {writer}; this memfit "
            f"({memfit_version()}) reads format {CHECKPOINT_FORMAT}: upgrade memfit to use it (the file is "
            "left as it is)"
        )


def check_checkpoint(state: dict[str, Any], path: Path, required: tuple[str, ...] = MODEL_KEYS) -> None:
    """ValueError naming the file and the entry when a checkpoint lacks a required entry or holds the
    wrong kind of value anywhere (checked before anything is restored)."""
    for key in required:
        if key not in state:
            raise ValueError(f"{path} has no {key!r} entry (not a complete memfit checkpoint)")
    for key, value in state.items():
        if key in _SCHEMA and (key in required or value is not None) and not _SCHEMA[key][0](value):
            raise ValueError(f"{path}: its {key!r} entry is not {_SCHEMA[key][1]}")


def nonfinite_parameter(model: torch.nn.Module) -> str | None:
    """'decoder.weight holds NaN' for the first parameter with a NaN or an infinity; None when all are
    finite. A model with such weights only computes garbage (a constant wav, NaN scores)."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return f"{name} holds {'NaN' if bool(torch.isnan(p).any()) else 'infinity'}"
    return None


class WeightsMismatch(ValueError):
    """A checkpoint's weights do not fit the model: a damaged file, or another model (when every
    checkpoint of a run says so)."""


def load_intact(
    candidates: list[Path], use: Callable[[dict[str, Any], Path], Any], required: tuple[str, ...] = MODEL_KEYS
) -> tuple[Any, Path, list[tuple[Path, str]]]:
    """The first of `candidates` that reads, passes check_checkpoint and `use(state, path)` (which raises
    ValueError for weights that do not fit); returns (use's result, its path, [(skipped path, why)]).
    `train --resume` and `eval` both fall back through this one function. A checkpoint of a newer format
    stops the search (UsageError): it is another memfit's work, not a broken file."""
    skipped: list[tuple[Path, str]] = []
    errors: list[ValueError] = []
    for path in candidates:
        try:
            state = load_checkpoint(path)
            refuse_newer_format(state, path)  # not a broken file to fall back from: a UsageError
            check_checkpoint(state, path, required)
            return use(state, path), path, skipped
        except ValueError as e:
            skipped.append((path, str(e)))
            errors.append(e)
    if errors and all(isinstance(e, WeightsMismatch) for e in errors):
        raise errors[0]
    why = "; ".join(f"{p.name}: {w.split(': ', 1)[-1]}" for p, w in skipped[:3])
    raise ValueError(f"no intact checkpoint ({why})")
