"""`memfit plot RUN`: a run's training loss, learning rate and validation metrics against the step (PNG)."""

from __future__ import annotations

import math
from pathlib import Path

from memfit.errors import UsageError
from memfit.train.metrics_log import read_rows
from memfit.train.outputs import check_outputs, write_file
from memfit.train.run_dir import METRICS_NAME


def read_metrics(run: Path) -> list[dict]:
    """The rows of run/metrics.jsonl (a line that does not parse is skipped with a warning naming it:
    metrics_log.read_rows); UsageError when there is no such file."""
    path = run / METRICS_NAME
    if not path.is_file():
        raise UsageError(f"error: {run} has no {METRICS_NAME}; pass a run folder that `train` wrote")
    return [row for _, row in read_rows(path)]


def check_run_folder(run: Path) -> None:
    """UsageError, one line saying what `run` is, unless it is a folder: a path that does not exist, or a
    file (the run's metrics.jsonl or a checkpoint: the command to plot the folder that holds it)."""
    if not run.exists():
        raise UsageError(f"error: {run} does not exist; pass a run folder that `train` wrote "
                         "(runs/<system>/<run_name>)")  # fmt: skip
    if not run.is_dir():
        what = "the run's metrics file" if run.name == METRICS_NAME else "a file"
        if (run.parent / METRICS_NAME).is_file():
            fix = f"pass the run folder that holds it: `memfit plot {run.parent}`"
        else:
            fix = "pass a run folder that `train` wrote (it holds metrics.jsonl)"
        raise UsageError(f"error: {run} is {what}, not a run folder; {fix}")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(run: Path, out: Path | None = None, overwrite: bool = False) -> Path:
    """Write the run's curves (loss and learning rate; one panel per validation metric) to `out`, a PNG
    (default: the run's own curves.png, replaced each time); an existing `out` only with `overwrite`."""
    check_run_folder(run)
    if out is not None and out.is_dir():
        example = out / "curves.png"
        raise UsageError(f"error: --out {out} is a folder; give the PNG file to write, e.g. {example}")
    if out is not None and out.suffix.lower() != ".png":
        raise UsageError(f"error: --out {out}: plot writes a PNG; give a file name ending in .png")
    if out is not None:  # refused before the work: never over the metrics, never over a file unasked
        check_outputs([out], [run / METRICS_NAME], overwrite=overwrite, flag="--out")
    rows = read_metrics(run)
    if not any("loss" in r for r in rows):
        raise UsageError(f"error: {run / METRICS_NAME} has no training rows yet; plot after some steps")
    own = out is None
    out = out or run / "curves.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    try:
        write_file(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), overwrite=own or overwrite)
    finally:
        plt.close(fig)
    return out
