"""`memfit estimate --measure` and `memfit budget --measure`: the estimate beside a real CUDA step.

On a machine with a GPU, each step is estimated for that GPU (its compute capability, the ``cuda`` extra's
kernels that pass their probes there) and then run for real: the model built on the GPU and ``steps``
training steps, from an empty caching allocator (``torch.cuda.empty_cache``) and no cuBLAS workspaces
(``torch._C._cuda_clearCublasWorkspaces``), as in a fresh process. Read on the GPU:

* allocated: ``torch.cuda.max_memory_allocated`` over the build and the steps;
* reserved: ``torch.cuda.max_memory_reserved`` over the same;
* total: reserved + the CUDA context as this process has it then (``mem_get_info``'s used memory minus
  ``memory_reserved``: the context grows as kernels load, so it is the process's, not one step's; on a
  GPU other processes use too, their memory counts as well);
* by category, where the GPU can tell: the parameters (allocated after the build), the optimizer state
  (its tensors' bytes), the CUDA libraries' workspaces (what ``_cuda_clearCublasWorkspaces`` frees at the
  end), and the rest of the peak (activations and gradients).

``compare_budgets(systems)`` is the function a benchmark script calls (``tools/bench_gpu.py``): one dict
per budget row. Importing this module starts nothing on the GPU.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UsageError
from memfit.estimate.fit import needed_bytes
from memfit.estimate.steps import _run_step, estimate_training_step
from memfit.estimate.target import DeviceTarget
from memfit.estimate.tracker import GIB, WORKSPACES, MemoryReport
from memfit.step import TrainStep

NO_GPU = (
    "error: --measure needs a CUDA GPU (torch.cuda.is_available() is False here); run it on a machine "
    "with one, or drop --measure for the estimate alone"
)


def require_gpu() -> torch.device:
    """The current CUDA device, or the one-line refusal (exit 2) where there is none."""
    if not torch.cuda.is_available():
        raise UsageError(NO_GPU)
    return torch.device("cuda", torch.cuda.current_device())


def _fresh(device: torch.device) -> None:
    """The allocator as a new process has it: no cached segments, no cuBLAS workspaces, peaks reset."""
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


@contextlib.contextmanager
def _recorded(path: str | None) -> Iterator[None]:
    """With a path, the caching allocator records every event inside the block
    (``torch.cuda.memory._record_memory_history``) and its snapshot is dumped there when the block ends
    normally; the recording stops however it ends."""
    if path is None:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def measure_step(
    step: TrainStep, device: torch.device | None = None, steps: int = 3, snapshot: str | None = None
) -> dict[str, Any]:
    """Run ``steps`` real training steps of ``step`` on the GPU (model built there) and read the three
    figures and the split the GPU can tell (see the module docstring). Bytes, not GiB. ``snapshot``: a
    file for the allocator's own record of the build and the steps (``torch.cuda.memory._dump_snapshot``)."""
    device = device or require_gpu()
    _fresh(device)
    base = torch.cuda.memory_allocated(device)  # what the process holds beyond the step (0 normally)
    reserved_base = torch.cuda.memory_reserved(device)
    with _recorded(snapshot), torch.device(device):
        model = step.build_model()
        params = torch.cuda.memory_allocated(device) - base
        opt = step.optimizer(model.parameters())
        for _ in range(steps):
            _run_step(step, model, opt, device)
        torch.cuda.synchronize(device)
    state = sum(
        v.untyped_storage().nbytes()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.is_cuda
    )
    allocated = torch.cuda.max_memory_allocated(device) - base
    reserved = torch.cuda.max_memory_reserved(device) - reserved_base
    free, total_memory = torch.cuda.mem_get_info(device)
    context = total_memory - free - torch.cuda.memory_reserved(device)
    before = torch.cuda.memory_allocated(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    libraries = before - torch.cuda.memory_allocated(device)
    del model, opt
    _fresh(device)
    return {
        "allocated": allocated,
        "reserved": reserved,
        "context": context,
        "total": reserved + context,
        "by_category": {
            "params": params,
            "optimizer": state,
            WORKSPACES: libraries,
            "grads + activations": max(0, allocated - params - state - libraries),
        },
    }


def estimate_for(step: TrainStep, device: torch.device, cuda_kernels: bool | None = None) -> MemoryReport:
    """The CUDA estimate of ``step`` for this GPU: its card, and the cuda extra's kernels that pass their
    probes here (none with ``cuda_kernels=False``)."""
    with DeviceTarget.of_device(device, cuda_kernels).entered():
        return estimate_training_step(step, device="cuda")


def compare(report: MemoryReport, measured: dict[str, Any]) -> dict[str, Any]:
    """One row: the estimate's three figures and split beside the measured ones, and the gaps."""
    c = report.cuda
    assert c is not None
    cats = report.by_category
    # as measured: the parameters, the optimizer state, the cuBLAS/cuBLASLt workspaces the step made
    # (persistent), and the rest of the allocator peak
    params, state = cats.get("params", 0), cats.get("optimizer", 0)
    libraries = sum(v for k, v in c.libraries.items() if k.startswith("cuBLAS"))
    est = {
        "allocated": c.allocated,
        "reserved": c.reserved,
        "context": c.context,
        "total": needed_bytes(report, "cuda"),
        "by_category": {
            "params": params,
            "optimizer": state,
            WORKSPACES: libraries,
            "grads + activations": max(0, c.allocated - params - state - libraries),
        },
    }
    gap = {
        k: (est[k] / measured[k] - 1) if measured.get(k) else None for k in ("allocated", "reserved", "total")
    }

    def gib(d: dict) -> dict:
        return {k: (gib(v) if isinstance(v, dict) else v / GIB) for k, v in d.items()}

    return {"estimate_gib": gib(est), "measured_gib": gib(measured), "gap": gap}


def _environment(device: torch.device) -> dict[str, Any]:
    return {
        "card": torch.cuda.get_device_name(device),
        "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.date.today().isoformat(),
    }


def compare_budgets(
    budgets: Mapping[str, Iterable], steps: int = 3, cuda_kernels: bool | None = None
) -> list[dict[str, Any]]:
    """Every budget row (``{system name: its BudgetEntry list}``, what ``System.budgets()`` returns)
    estimated for this GPU and measured on it: one dict per row with "system", "variant", "batch",
    "estimate_gib" / "measured_gib" (allocated, reserved, context, total, by_category), "gap" (estimate /
    measured - 1), the card and versions; a row whose estimate does not fit the GPU, or that runs out of
    memory, has "skipped" and the reason. Raises UsageError without a GPU. ``memfit.cli.compare_budgets``
    loads the installed systems' budgets for it."""
    device = require_gpu()
    env = _environment(device)
    capacity = torch.cuda.mem_get_info(device)[1]
    rows = []
    for name, entries in budgets.items():
        for entry in entries:
            row: dict[str, Any] = {"system": name, "variant": entry.variant, "batch": entry.batch, **env}
            report = estimate_for(entry.step, device, cuda_kernels)
            row["estimate_gib"] = {"allocated": report.peak_bytes / GIB}
            if needed_bytes(report, "cuda") > capacity:
                row["skipped"] = (
                    f"the estimate needs {needed_bytes(report, 'cuda') / GIB:.1f} GiB of the card"
                )
                rows.append(row)
                continue
            measured = _measured_or_why(entry.step, device, steps)
            if isinstance(measured, str):
                row["skipped"] = measured
            else:
                row.update(compare(report, measured))
            rows.append(row)
    return rows


def _measured_or_why(
    step: TrainStep, device: torch.device, steps: int = 3, snapshot: str | None = None
) -> dict[str, Any] | str:
    """measure_step's figures, or why there are none (out of memory on the GPU); the memory the failed
    step held is released before returning (the exception's frames hold it until then)."""
    why = None
    try:
        return measure_step(step, device, steps, snapshot)
    except torch.cuda.OutOfMemoryError as e:
        why = f"out of memory on the GPU: {str(e).splitlines()[0][:160]}"
    _fresh(device)
    return why


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table (GiB; gap = estimate / measured - 1)."""
    if not rows:
        return "(no budget rows)"
    first = rows[0]
    lines = [
        f"Estimate vs measured on {first['card']} (sm{first['compute_capability'].replace('.', '')}), "
        f"torch {first['torch']}, {first['date']}; GiB, gap = estimate / measured - 1",
        f"{'system':<20} {'variant':<18} {'allocated est/real':>24} {'reserved est/real':>24} "
        f"{'total est/real':>24}",
    ]
    for r in rows:
        head = f"{r['system']:<20} {r['variant']:<18}"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']}")
            continue
        cells = []
        for k in ("allocated", "reserved", "total"):
            e, m, g = r["estimate_gib"][k], r["measured_gib"][k], r["gap"][k]
            cells.append(f"{e:>7.3f} {m:>7.3f} {'' if g is None else f'{100 * g:+.1f}%':>7}")
        lines.append(f"{head} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24}")
    lines += ["", "By category (GiB, estimate / measured; the GPU tells these apart):"]
    for r in rows:
        if "skipped" in r:
            continue
        parts = [
            f"{k} {r['estimate_gib']['by_category'][k]:.3f}/{v:.3f}"
            for k, v in r["measured_gib"]["by_category"].items()
        ]
        lines.append(f"  {r['system']}/{r['variant']}: " + ", ".join(parts))
    return "\n".join(lines)


def measured_snapshot_path(predicted: str) -> str:
    """Where ``--measure`` puts the real snapshot beside ``--snapshot NAME.pickle``: NAME.measured.pickle."""
    p = Path(predicted)
    return str(p.with_name(f"{p.stem}.measured{p.suffix or '.pickle'}"))


def estimate_measure(
    step: TrainStep, label: str, cuda_kernels: bool | None = None, snapshot: str | None = None
) -> dict:
    """`memfit estimate --measure`: the target's step estimated for this GPU and run on it (one row);
    ``snapshot``: a file for the real step's memory snapshot."""
    device = require_gpu()
    report = estimate_for(step, device, cuda_kernels)
    row: dict[str, Any] = {"system": label, "variant": "-", **_environment(device)}
    measured = _measured_or_why(step, device, snapshot=snapshot)
    if isinstance(measured, str):
        row["skipped"] = measured
    else:
        row.update(compare(report, measured))
    return row
