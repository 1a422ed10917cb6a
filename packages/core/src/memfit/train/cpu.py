"""CPU speed that is not in the model: how the C library hands out memory.

glibc's malloc maps every block above its mmap threshold (at most 32 MiB) fresh from the kernel and unmaps
it on free. A training step allocates and frees the same large activations every step, so each one is
page-faulted in again, one 4 KiB page at a time. ``keep_freed_memory`` tells malloc to serve those blocks
from its heap and keep freed memory for reuse. The process keeps its peak footprint until it exits, which
suits a trainer; the setting is process-wide and cannot be undone.

``uv run python tools/bench_mbsnet.py`` prints each step's page faults; with ``MEMFIT_KEEP_FREED=0`` it
runs with malloc's defaults (README, "Training speed on CPU").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_state: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed large blocks (no mmap per block, no trimming); True when it is on.

    Called once per process by ``Trainer`` on CPU and by the benchmarks. A no-op (False) off Linux/glibc or
    with ``MEMFIT_KEEP_FREED=0`` in the environment."""
    if "on" in _state:
        return _state["on"]
    on = False
    if sys.platform.startswith("linux") and os.environ.get("MEMFIT_KEEP_FREED", "1") != "0":
        try:
            mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
        except (OSError, AttributeError):  # musl and others have no mallopt
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            # trim only above 2 GiB of free heap top (the int maximum is as good as never)
            on = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    _state["on"] = on
    return on


def minor_page_faults() -> int:
    """This process's minor page faults so far (Linux; -1 elsewhere): what keep_freed_memory saves."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return -1


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(n: int) -> int:
    """Cap every thread pool of this process at n threads (torch's intra-op and inter-op pools, and the
    BLAS/OpenMP pools numpy and scipy use, through threadpoolctl); returns the n used.

    More threads than CPUs only makes each parallel region wait for descheduled threads (measured 4-5x
    slower steps on 2 cores), so n is clamped to the CPU count, with a note."""
    import torch
    from threadpoolctl import threadpool_limits

    cpus = cpu_count()
    if n > cpus:
        print(f"[memfit] --threads {n}: this machine has {cpus} CPUs; using {cpus}", file=sys.stderr)
        n = cpus
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # only possible before the process's first inter-op work
        torch.set_num_interop_threads(n)
    threadpool_limits(limits=n)  # called as a function: the limits hold for the rest of the process
    return n
