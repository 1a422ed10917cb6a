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
