"""The one metrics writer: JSON lines in run_dir/metrics.jsonl, always; TensorBoard events too on request.

TensorBoard needs the optional extra (`uv sync --extra tensorboard`, i.e. the `tensorboard` package that
torch.utils.tensorboard writes with); asking for it without the extra is a one-line error, not a
silent no-op. Event files go to run_dir/tensorboard/; on resume, events after the resumed step are
purged (as metrics.jsonl's rows are), so curves have one point per step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from memfit.errors import UsageError

TENSORBOARD_HINT = (
    "error: --tensorboard needs the optional tensorboard extra: `uv sync --all-packages --extra tensorboard` "
    "(or `pip install tensorboard`); metrics.jsonl is written without it"
)


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
