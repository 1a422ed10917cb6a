"""The one metrics writer: JSON lines in run_dir/metrics.jsonl, always; TensorBoard events too on request.
And the one reader, ``read_rows``: a line that does not parse (a crash mid-write, a disk error: bytes that
are not UTF-8, not JSON, not a row) is skipped with one warning naming it, so a damaged line never makes
a run unresumable or unplottable (--resume, plot and the model card all read through it).

TensorBoard needs the optional extra (`uv sync --extra tensorboard`, i.e. the `tensorboard` package that
torch.utils.tensorboard writes with); asking for it without the extra is a one-line error, not a
silent no-op. Event files go to run_dir/tensorboard/; on resume, events after the resumed step are
purged (as metrics.jsonl's rows are), so curves have one point per step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

TENSORBOARD_HINT = (
    "error: --tensorboard needs the optional tensorboard extra: `uv sync --all-packages --extra tensorboard` "
    "(or `pip install tensorboard`); metrics.jsonl is written without it"
)


MAX_WARNINGS = 5  # lines named one by one; more bad lines are counted in one further warning


def parse_row(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """(the row, "") for a metrics line: a JSON object with an integer "step"; (None, why) otherwise."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    try:
        row = json.loads(text)
    except ValueError:
        return None, "not JSON"
    except RecursionError:
        return None, "JSON nested too deeply"
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None, "not a metrics row (a JSON object with a step)"
    return row, ""


def read_rows(path: Path, action: str = "skipped") -> list[tuple[bytes, dict[str, Any]]]:
    """(line, row) for each line of a metrics.jsonl that parses (parse_row); each other line is `action`
    with one warning on stderr naming it (blank lines silently). OSError if the file cannot be read."""
    good, bad = [], []
    for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        row, why = parse_row(line)
        if row is None:
            bad.append((n, why))
        else:
            good.append((line, row))
    for n, why in bad[:MAX_WARNINGS]:
        print(f"[memfit] {path}: line {n} is {why} (a torn or damaged write?); {action}", file=sys.stderr)
    if len(bad) > MAX_WARNINGS:
        print(
            f"[memfit] {path}: {len(bad) - MAX_WARNINGS} more lines do not parse; {action}", file=sys.stderr
        )
    return good


def tensorboard_writer(log_dir: Path, purge_step: int | None = None) -> Any:
    """A torch.utils.tensorboard SummaryWriter, or UsageError naming the extra when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(TENSORBOARD_HINT) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class MetricsLog:
    """Appends one JSON object per line to `path`; with tensorboard=True also every numeric value
    as a scalar at the record's step (run_dir/tensorboard/)."""

    def __init__(
        self, path: Path, enabled: bool = True, tensorboard: bool = False, purge_step: int | None = None
    ) -> None:
        self.path = path
        self.enabled = enabled
        self.tb = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self.tb = tensorboard_writer(path.parent / "tensorboard", purge_step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
