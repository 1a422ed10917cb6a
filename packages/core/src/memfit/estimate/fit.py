"""The fit finder: the largest batch of a system that fits a GPU, and whether checkpointing is needed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.estimate.memory import GIB, estimate_training_step


@dataclass
class FitResult:
    variant: str
    checkpointing: bool
    batch: int  # 0 when not even batch 1 fits
    estimated_gib: float  # at `batch` (or at batch 1 when nothing fits)
    next_gib: float | None  # at the first batch that did not fit (None if the search cap was reached)
    probes: int


def largest_batch(peak_gib: Callable[[int], float], limit_gib: float, max_batch: int = 4096) -> tuple:
    """Largest b in [1, max_batch] with peak_gib(b) <= limit_gib, assuming the peak grows with b.

    The peak of a training step is close to linear in the batch, so each probe is the batch where the line
    through the two nearest probes crosses the limit (a few estimates when it is linear), with a doubling
    or bisection step whenever two probes in a row land on the same side (never more than about
    2·log2(b) estimates). Returns (b, gib at b, gib at b + 1 or None when max_batch fits, estimates).
    """
    cache: dict[int, float] = {}

    def peak(b: int) -> float:
        if b not in cache:
            cache[b] = peak_gib(b)
        return cache[b]

    if peak(1) > limit_gib:
        return 0, cache[1], cache[1], len(cache)
    lo, hi = 1, None  # lo fits; hi (when known) does not
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
        return lo, cache[lo], None, len(cache)
    return lo, cache[lo], cache[hi], len(cache)


def fit_system(budgets, gpu_gib: float, max_batch: int = 4096, variants: list[str] | None = None):
    """For every budgeted variant (a system's ``budgets()``, ``memfit.system.BudgetEntry``) that can be
    rebuilt at other batch sizes: the largest batch without checkpointing and, when checkpointing helps,
    with it; estimated for a CUDA run (its attention kernels, autocast policy and allocator rounding:
    memfit.estimate.rules), since the memory is a GPU's."""
    results = []
    for entry in budgets:
        if entry.is_baseline or entry.make_step is None:
            continue
        if variants and entry.variant not in variants:
            continue
        for ckpt in (False, True):

            def peak_gib(bs: int, ckpt: bool = ckpt, e=entry) -> float:
                return estimate_training_step(e.make_step(bs, ckpt), device="cuda").peak_bytes / GIB

            b, gib, nxt, probes = largest_batch(peak_gib, gpu_gib, max_batch)
            results.append(FitResult(entry.variant, ckpt, b, gib, nxt, probes))
    return results


def nothing_fits(system: str, gpu_gib: float, results: list[FitResult]) -> str | None:
    """One `error:` line when not even batch 1 of any variant fits (with or without checkpointing)."""
    if not results or any(r.batch > 0 for r in results):
        return None
    best = min(results, key=lambda r: r.estimated_gib)
    ckpt = " with checkpointing" if best.checkpointing else ""
    return (
        f"error: nothing fits {gpu_gib:g} GiB: the smallest {system} step, {best.variant}{ckpt} at batch 1, "
        f"needs {best.estimated_gib:.2f} GiB; give a larger --gpu_gib"
    )


def format_fit(system: str, gpu_gib: float, results: list[FitResult], kernels: str) -> str:
    """The fit table; ``kernels``: how the estimates' CUDA kernels are named (``CudaExtra.describe``)."""
    lines = [
        f"{system}: the largest batch whose training step (estimated for CUDA, {kernels}) "
        f"fits {gpu_gib:g} GiB"
    ]
    lines.append(f"{'variant':<14} {'checkpointing':<13} {'batch':>6} {'peak GiB':>9} {'next GiB':>9}")
    for r in results:
        nxt = "-" if r.next_gib is None else f"{r.next_gib:.2f}"
        ckpt = "yes" if r.checkpointing else "no"
        lines.append(f"{r.variant:<14} {ckpt:<13} {r.batch:>6} {r.estimated_gib:>9.2f} {nxt:>9}")
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
