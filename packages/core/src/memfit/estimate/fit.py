"""Whether a step fits its device (one rule for every command), and the fit finder: the largest batch of a
system that fits a GPU, and whether checkpointing is needed.

**The margin rule.** A step fits a device when what it needs of the device (``needed_bytes``) is at most
``usable_bytes(capacity)`` = capacity x (1 - ``MARGIN``). ``memfit fit``, ``memfit estimate --gpu_gib``
(``--margin`` overrides the fraction there), the what-ifs' "fits" and the memory pre-flight of every
``train`` all decide with these two functions. What a step needs:

* on CUDA, the **card total** of the CUDA target's estimate: the caching allocator's reserved peak plus
  the CUDA context (``memfit.estimate.cuda_memory``); capacity is the GPU's memory (``--gpu_gib``), or in
  the pre-flight what the card has for this process (free + what the process holds + its context);
* on the CPU, the tensors' peak times ``CPU_OVERHEAD`` (malloc's heap: fragmentation and freed memory it
  keeps); capacity is the least of available RAM, the cgroup's limit and ``ulimit -v``.

The 10% margin covers what the estimate cannot see: on a GPU its remaining error (the allocator peak
within 2% and the reserved peak within 5% of a real H200 step, cuDNN's convolution workspaces that are
not modelled) and the CUDA context's growth as kernels load lazily (+110-240 MiB after a few steps on
an H200); on a shared machine the memory other processes take while the step runs (a pre-flight that
passed a step needing 22.17 of 22.33 GiB available reached 15.8 GB RSS and stalled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.estimate.steps import estimate_training_step
from memfit.estimate.tracker import GIB, MemoryReport

#: The one margin: a step may plan on (1 - MARGIN) of what its device has.
MARGIN = 0.10

#: The most GPU memory a command takes (GiB): a mebigibyte, beyond any card or node; a larger --gpu_gib is
#: a typo (1e30), refused in one line rather than searched for a batch.
MAX_GPU_GIB = 2**20

#: Process memory per byte of tensors on the CPU: a step's peak RSS grew by 1.1-1.5x its tensors with
#: malloc's defaults and 1.3-1.9x with the Trainer's keep_freed_memory (heap fragmentation), measured on
#: the four systems by `uv run python tools/preflight_overhead.py`.
CPU_OVERHEAD = 2.0


def usable_bytes(capacity: float, margin: float = MARGIN) -> float:
    """What a step may plan to use of a device that has ``capacity`` bytes: capacity x (1 - margin)."""
    return capacity * (1 - margin)


def needed_bytes(report: MemoryReport, device: str) -> int:
    """What a step needs of its device (see the module docstring): the card total of a CUDA estimate, the
    CPU tensors' peak times CPU_OVERHEAD; a CUDA estimate without its figures (none traced) falls back to
    its peak."""
    if device == "cuda":
        return report.cuda.total if report.cuda is not None else report.peak_bytes
    return int(report.peak_bytes * CPU_OVERHEAD)


def fits(report: MemoryReport, device: str, capacity: float, margin: float = MARGIN) -> bool:
    """The margin rule: the step's needed bytes within the usable part of the device's capacity."""
    return needed_bytes(report, device) <= usable_bytes(capacity, margin)


@dataclass
class FitResult:
    variant: str
    checkpointing: bool
    batch: int  # 0 when not even batch 1 fits
    estimated_gib: float  # the card total at `batch` (or at batch 1 when nothing fits)
    next_gib: float | None  # at the first batch that did not fit (None if the search cap was reached)
    probes: int
    allocated_gib: float = 0.0  # the allocator peak at `batch`
    reserved_gib: float = 0.0  # the reserved peak at `batch`


def largest_batch(peak_gib: Callable[[int], float], limit_gib: float, max_batch: int = 4096) -> tuple:
    """Largest b in [1, max_batch] with peak_gib(b) <= limit_gib, assuming the peak grows with b.

    The peak of a training step is close to linear in the batch, so each probe is the batch where the line
    through the two nearest probes crosses the limit (a few estimates when it is linear), with a doubling
    or bisection step whenever two probes in a row land on the same side (never more than about
    2·log2(b) estimates). A step that cannot train at batch 1 but can at 2 (BatchNorm needs two values per
    channel: a ResNet's 1x1 last feature map at batch 1 has one) is searched from 2; when batch 2 fails
    too, batch 1's error stands. Returns (b, gib at b, gib at the next batch or None when max_batch fits,
    estimates, the smallest batch searched); b is 0 when not even the smallest batch fits.
    """
    cache: dict[int, float] = {}

    def peak(b: int) -> float:
        if b not in cache:
            cache[b] = peak_gib(b)
        return cache[b]

    first = 1
    try:
        peak(1)
    except Exception as one:
        if max_batch < 2:
            raise
        try:
            peak(2)
        except Exception:
            raise one from None
        first = 2
    if cache[first] > limit_gib:
        return 0, cache[first], cache[first], len(cache), first
    lo, hi = first, None  # lo fits; hi (when known) does not
    sides: list[bool] = []
    bisect = False
    while hi is None or hi - lo > 1:
        cap = max_batch if hi is None else hi - 1
        if lo >= cap:
            break
        if hi is not None and len(sides) >= 2 and sides[-1] == sides[-2]:
            bisect = True  # the line keeps landing on one side: bisection from here on
        if bisect and hi is not None:
            guess = (lo + hi) // 2
        elif hi is None and len(sides) >= 3 and all(sides[-3:]):
            guess = lo * 2  # safeguard: doubling
        else:
            other = hi if hi is not None else (max(b for b in cache if b < lo) if len(cache) > 1 else None)
            if other is None:
                guess = lo * 2
            else:
                slope = (cache[other] - cache[lo]) / (other - lo)
                guess = lo * 2 if slope <= 0 else lo + int((limit_gib - cache[lo]) / slope)
        guess = max(lo + 1, min(guess, cap))
        fits = peak(guess) <= limit_gib
        sides.append(fits)
        if fits:
            lo = guess
        else:
            hi = guess
    if hi is None:
        return lo, cache[lo], None, len(cache), first
    return lo, cache[lo], cache[hi], len(cache), first


def fit_system(budgets, gpu_gib: float, max_batch: int = 4096, variants: list[str] | None = None):
    """For every budgeted variant (a system's ``budgets()``, ``memfit.system.BudgetEntry``) that can be
    rebuilt at other batch sizes: the largest batch without checkpointing and, when checkpointing helps,
    with it, whose card total fits the GPU under the margin rule; estimated for a CUDA run (its kernels,
    libraries and caching allocator: memfit.estimate.rules, workspaces, cuda_memory)."""
    results = []
    limit = usable_bytes(gpu_gib * GIB) / GIB
    for entry in budgets:
        if entry.is_baseline or entry.make_step is None:
            continue
        if variants and entry.variant not in variants:
            continue
        for ckpt in (False, True):
            reports: dict[int, MemoryReport] = {}

            def total_gib(bs: int, ckpt: bool = ckpt, e=entry, reports=reports) -> float:
                reports[bs] = estimate_training_step(e.make_step(bs, ckpt), device="cuda")
                return needed_bytes(reports[bs], "cuda") / GIB

            b, gib, nxt, probes, _ = largest_batch(total_gib, limit, max_batch)
            at = reports[b] if b else reports[min(reports)]
            alloc = at.peak_bytes / GIB
            reserved = at.cuda.reserved / GIB if at.cuda is not None else alloc
            results.append(FitResult(entry.variant, ckpt, b, gib, nxt, probes, alloc, reserved))
    return results


def nothing_fits(system: str, gpu_gib: float, results: list[FitResult]) -> str | None:
    """One `error:` line when not even batch 1 of any variant fits (with or without checkpointing)."""
    if not results or any(r.batch > 0 for r in results):
        return None
    best = min(results, key=lambda r: r.estimated_gib)
    ckpt = " with checkpointing" if best.checkpointing else ""
    return (
        f"error: nothing fits {gpu_gib:g} GiB ({100 * MARGIN:g}% margin): the smallest {system} step, "
        f"{best.variant}{ckpt} at batch 1, needs {best.estimated_gib:.2f} GiB of the card (reserved + CUDA "
        "context); give a larger --gpu_gib"
    )


def format_fit(system: str, gpu_gib: float, results: list[FitResult], kernels: str) -> str:
    """The fit table; ``kernels``: how the estimates' CUDA kernels are named (``CudaExtra.describe``)."""
    usable = usable_bytes(gpu_gib * GIB) / GIB
    lines = [
        f"{system}: the largest batch whose training step (estimated for CUDA, {kernels}) fits {gpu_gib:g} "
        f"GiB ({100 * MARGIN:g}% margin: {usable:.2f} GiB for the card total = reserved peak + CUDA context)"
    ]
    lines.append(
        f"{'variant':<14} {'checkpointing':<13} {'batch':>6} {'allocated':>9} {'reserved':>9} "
        f"{'total GiB':>9} {'next GiB':>9}"
    )
    for r in results:
        nxt = "-" if r.next_gib is None else f"{r.next_gib:.2f}"
        ckpt = "yes" if r.checkpointing else "no"
        lines.append(
            f"{r.variant:<14} {ckpt:<13} {r.batch:>6} {r.allocated_gib:>9.2f} {r.reserved_gib:>9.2f} "
            f"{r.estimated_gib:>9.2f} {nxt:>9}"
        )
    by_variant: dict[str, dict[bool, FitResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, {})[r.checkpointing] = r
    for variant, pair in by_variant.items():
        plain, ckpt = pair.get(False), pair.get(True)
        if plain and ckpt and ckpt.batch > plain.batch:
            advice = f"checkpointing raises the batch from {plain.batch} to {ckpt.batch}"
            if plain.batch == 0:
                advice = f"needs checkpointing to fit at all (batch {ckpt.batch} with it)"
            lines.append(f"{variant}: {advice}")
        elif plain:
            lines.append(f"{variant}: checkpointing not needed (batch {plain.batch} without it)")
    if not results:
        lines.append("(this system registers no variant that can be rebuilt at other batch sizes)")
    return "\n".join(lines)
