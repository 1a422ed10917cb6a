"""`memfit plot RUN`: a run's training loss, learning rate and validation metrics against the step (PNG)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from memfit.errors import UsageError
from memfit.train.outputs import check_outputs
from memfit.train.run_dir import METRICS_NAME


def read_metrics(run: Path) -> list[dict]:
    """The rows of run/metrics.jsonl (unreadable lines skipped); UsageError when there is none."""
    path = run / METRICS_NAME
    if not path.is_file():
        raise UsageError(f"error: {run} has no {METRICS_NAME}; pass a run folder that `train` wrote")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(run: Path, out: Path | None = None) -> Path:
    """Write the run's curves (loss and learning rate; one panel per validation metric) to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run)
    if not any("loss" in r for r in rows):
        raise UsageError(f"error: {run / METRICS_NAME} has no training rows yet; plot after some steps")
    out = out or run / "curves.png"
    check_outputs([out], [run / METRICS_NAME], overwrite=True, flag="--out")
    evals = sorted({k for r in rows for k in r if k.startswith("eval/")})
    fig, axes = plt.subplots(1, 1 + len(evals), figsize=(4.5 * (1 + len(evals)), 3.4), squeeze=False)
    ax = axes[0][0]
    ax.plot(*series(rows, "loss"), lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(run.name)
    steps, lr = series(rows, "lr")
    if lr:
        twin = ax.twinx()
        twin.plot(steps, lr, color="grey", lw=0.8, ls="--", label="learning rate")
        twin.set_ylabel("learning rate")
    for ax, key in zip(axes[0][1:], evals):
        ax.plot(*series(rows, key), marker="o", ms=3)
        ax.set_xlabel("step")
        ax.set_title("evaluated: " + key.removeprefix("eval/"))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
