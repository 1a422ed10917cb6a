"""The cuDNN RNN workspace table in memfit.estimate.workspaces, fitted from the recorded H200 readings.

`packages/core/tests/data/h200-2026-11-26/rnn.json.gz` holds `torch._cudnn_rnn` forward and backward on
128 GRU/LSTM shapes (input 64/256, hidden 128/512, T 50/200, batch 8/32, 1/2 layers, uni- and
bidirectional, fp32, batch-first): the allocator's peak during each call above what the call left
allocated, i.e. what the call allocated and freed before returning. Per (mode, directions, layers,
hidden, input) this prints the least-squares line ``a + b * T * B`` (bytes) of the forward's transient
less the batch-first input's time-major copy (which the estimate makes itself): cuDNN's workspace, the
size cudnnGetRNNTempSpaceSizes gives for training, which the backward's two calls ask for again. It is
printed as the Python literal `CUDNN_RNN_WORKSPACE` is written; packages/core/tests/test_cuda_memory.py
checks that the two agree, so the table can be regenerated and never drifts from the readings. The rule
(`cudnn_rnn_workspace_bytes`) reads each line as cuDNN's terms: its constant is 8 MiB per layer and
direction plus the weight matrices' bytes (within 1.1 MiB on every line), computed exactly for any shape;
only the small rest and the slope are interpolated between the lines.

    uv run python tools/cudnn_rnn_table.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

RECORDED = Path(__file__).resolve().parents[1] / "packages/core/tests/data/h200-2026-11-26/rnn.json.gz"


def _line(points: list[tuple[int, int]]) -> tuple[int, int]:
    """Least-squares (a, b) of y = a + b * x, rounded to whole bytes."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return round(my - b * mx), round(b)


def rows(path: Path = RECORDED) -> list[dict]:
    """The recorded readings, one dict per shape (columns as named in the file)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return [dict(zip(data["columns"], values)) for values in data["rows"]]


def fit(path: Path = RECORDED) -> dict[tuple, tuple[int, int]]:
    """{(mode, directions, layers, hidden, input): (a, b)}: the workspace a + b * T * B bytes."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for r in rows(path):
        key = (
            "gru" if r["mode"] == 3 else "lstm",
            1 + r["bidirectional"],
            r["layers"],
            r["hidden"],
            r["input"],
        )
        tb = r["seq"] * r["batch"]
        forward = (
            r["peak_forward"] - r["allocated_after_forward"] - tb * r["input"] * 4
        )  # less the input copy
        groups.setdefault(key, []).append((tb, forward))
    return {key: _line(pts) for key, pts in sorted(groups.items())}


def main() -> int:
    print("CUDNN_RNN_WORKSPACE = {")
    for key, value in fit().items():
        print(f"    {key!r}: {value!r},")
    print("}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
