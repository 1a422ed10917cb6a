"""The memory pre-flight of every `train`: the training step's peak, estimated before the first step.

A run that will not fit its device is refused at once, in one line that names the batch that does fit,
instead of failing minutes (or hours) later with an allocator traceback. The estimate is memfit's own
(``memory.estimate_training_step``: the real step on fake tensors, no memory and no compute), judged by
the margin rule every command shares (``memfit.estimate.fit``: ``needed_bytes`` within ``usable_bytes``
of what the device has). On CUDA the step needs its card total (reserved peak + CUDA context) of what the
card has for this process: its free memory plus what the process already holds (reserved, and its own
context); on the CPU its tensors times ``fit.CPU_OVERHEAD`` of the least of the kernel's MemAvailable, the
cgroup's limit and the process's address-space limit. `train --no_preflight` skips it.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import UsageError, first_line
from memfit.estimate import workspaces
from memfit.estimate.fit import MARGIN, needed_bytes, usable_bytes
from memfit.estimate.steps import estimate_training_step
from memfit.estimate.target import DeviceTarget
from memfit.estimate.tracker import GIB
from memfit.step import TrainStep

MemoryStep = Callable[[int, bool], TrainStep]  # (batch size, activation checkpointing) -> the step


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """cgroup v2: memory.max - memory.current of this process's cgroup (None without a limit)."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_available() -> int | None:
    """RLIMIT_AS minus the process's virtual size (`ulimit -v`), None without a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return soft - int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """(bytes the device has for this process's training step, what they are), None where nothing can be
    told. On CUDA: free memory, plus what this process holds already (its reserved memory, and its CUDA
    context, which the step's card total counts: the measured constant of ``workspaces.Card``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        own = torch.cuda.memory_reserved(device) + workspaces.card_of_device(device).context_bytes
        return free + own, f"{device}'s free memory + this process's"
    found = {
        "available RAM": _meminfo_available(),
        "the cgroup's memory limit": _cgroup_available(),
        "the address-space limit, ulimit -v": _address_space_available(),
    }
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return None, "the CPU's memory (unknown on this OS)"
    what = min(found, key=found.__getitem__)
    return max(0, found[what]), what


@dataclass
class Preflight:
    needed: int  # bytes the step needs at the batch asked for
    available: int | None
    what: str  # where `available` comes from
    seconds: float  # time the estimates took

    def line(self) -> str:
        have = ""
        if self.available is not None:
            usable = usable_bytes(self.available) / GIB
            have = (
                f" of {usable:.2f} GiB usable ({100 * MARGIN:g}% margin on {self.available / GIB:.2f} GiB, "
                f"{self.what})"
            )
        return (
            f"[memfit] memory pre-flight: a training step needs ~{self.needed / GIB:.2f} GiB{have} "
            f"(estimated in {self.seconds:.1f} s)"
        )


def _needs(make: MemoryStep, batch: int, checkpointing: bool, device: torch.device) -> int:
    """Bytes the process needs of the device for a step (``fit.needed_bytes``): the card total of the
    CUDA target's estimate for this GPU, or the CPU tensors times ``fit.CPU_OVERHEAD``."""
    target = "cuda" if device.type == "cuda" else "cpu"  # the kernels (and allocator) the run will use
    # on CUDA the Mamba kernels this GPU has: without mamba_ssm the torch-op scan needs 2-3x the memory
    with DeviceTarget.of_device(device).entered():
        report = estimate_training_step(make(batch, checkpointing), device=target)
    return needed_bytes(report, target)


def largest_fitting_batch(
    make: MemoryStep, batch: int, needed: int, limit: int, checkpointing: bool, device: torch.device
) -> int:
    """The largest batch below `batch` whose step fits `limit` bytes (0: not even 1): a line through the
    estimates at 1 and at `batch` (the peak grows linearly with the batch), then checked and walked down."""
    one = _needs(make, 1, checkpointing, device)
    if one > limit:
        return 0
    per = max(1.0, (needed - one) / max(1, batch - 1))
    n = max(1, min(batch - 1, math.floor(1 + (limit - one) / per)))
    for _ in range(4):  # the estimate is near-linear; a few corrections at most
        if n <= 1 or _needs(make, n, checkpointing, device) <= limit:
            return n
        n = max(1, math.floor(n * 0.9))
    return n


def preflight(
    make: MemoryStep, batch: int, checkpointing: bool | None, device: torch.device, flag: str = "--batch_size"
) -> Preflight | None:
    """Estimate the step; raise UsageError naming the batch (or --checkpointing) that fits when it does
    not fit; None when the step cannot be estimated (said in one line, and the run goes on)."""
    t0 = time.perf_counter()
    try:
        needed = _needs(make, batch, bool(checkpointing), device)
    except UsageError:
        raise
    except Exception as e:  # a model the estimator cannot trace must not stop the run
        why = first_line(e, 120)
        print(f"[memfit] memory pre-flight skipped: the step could not be estimated ({why})", file=sys.stderr)
        return None
    available, what = available_bytes(device)
    result = Preflight(needed, available, what, time.perf_counter() - t0)
    if available is None or needed <= usable_bytes(available):
        return result
    limit = int(usable_bytes(available))
    fits = largest_fitting_batch(make, batch, needed, limit, bool(checkpointing), device)
    hints = [f"{flag} {fits} fits"] if fits else []
    if checkpointing is False and _needs(make, batch, True, device) <= limit:
        hints.append(f"--checkpointing fits {flag} {batch}")
    fix = " or ".join(hints) if hints else f"not even {flag} 1 fits: choose a smaller --config"
    raise UsageError(
        f"error: a training step needs ~{needed / GIB:.2f} GiB at {flag} {batch}, and the {device.type} "
        f"has {available / GIB:.2f} GiB ({what}; {limit / GIB:.2f} GiB usable with the {100 * MARGIN:g}% "
        f"margin); {fix} (memfit's estimate; --no_preflight skips it)"
    )
