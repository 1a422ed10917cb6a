"""Builds and loads _scan_kernel.c (Mamba-1's fused CPU kernels: the selective scan, the conv) on first use.

The C file needs nothing but a C compiler (``cc``/``gcc``/``clang``, or ``$CC``) and pthreads: no torch
headers, no ninja. It is compiled once per source/flags/CPU into ``$MEMFIT_CACHE`` (default
``~/.cache/memfit``) and called through ctypes on tensors' data pointers; ctypes releases the GIL and the
kernel splits its work items ((batch, dim) sequences, or (batch, block of channels) on its channel-lane
path) over ``torch.get_num_threads()`` pthreads.

``library()`` returns None (and memfit.ssm uses its torch-op path) when there is no compiler, the build
fails, the platform is not POSIX, or ``MEMFIT_SCAN_KERNEL=0``. The first failure is reported once as a
warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_scan_kernel.c")
NMAX = 64  # the largest state size N the kernel takes (NMAX in the C file)
# no -ffast-math: with gcc < 13 it links crtfastmath.o into the shared object, which would switch the
# whole process to flush-denormals-to-zero; these four flags are the part the reductions over N need.
# -fopenmp-simd honours the file's `omp simd` loop annotations only (no OpenMP runtime).
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]  # fmt: skip

_P = ctypes.c_void_p
_I = ctypes.c_int64
_S = ctypes.POINTER(ctypes.c_int64)  # a stride triple / quadruple


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, "-o", str(so), str(SOURCE), "-lm"], check=True, capture_output=True)
        os.replace(so, out)  # atomic: a process compiling beside us never sees half a file


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be had here (the caller falls back)."""
    if os.environ.get("MEMFIT_SCAN_KERNEL", "1") == "0" or os.name != "posix":
        return None
    cc = _compiler()
    if cc is None:
        return None
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), cc, platform.machine(), _cpu_id()]).encode()
    ).hexdigest()[:16]
    cache_dir = Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit"))
    path = cache_dir / f"scan_kernel-{key}.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if hasattr(e, "stderr") and e.stderr else e
        msg = f"memfit: the fused CPU scan kernel is unavailable ({detail}); using torch ops"
        warnings.warn(msg, stacklevel=3)
        return None
    _C = ctypes.c_int
    fwd = [_S, _P, _S, _P, _P, _S, _P, _S, _P, _P, _P, _S, _I, _P, _S, _I, _P, _S, _P, _P, _C, _C, _C]
    bwd = [_S, _P, _S, _P, _P, _S, _P, _S, _P, _P, _P, _P, _S, _I, _P, _S, _I, _P, _P, _P, _S, _P, _S,
           _P, _S, _P, _S, _P, _P, _S, _P, _S, _P, _P, _C, _C, _C]  # fmt: skip
    conv_fwd = [_S, _P, _S, _P, _P, _P, ctypes.c_int]
    conv_bwd = [_S, _P, _S, _P, _P, _P, _P, _P, _P, ctypes.c_int]
    signatures = {"scan_fwd": fwd, "scan_bwd": bwd, "conv_fwd": conv_fwd, "conv_bwd": conv_bwd}
    signatures["scan_lanes"] = []
    for sfx in ("f32", "f64"):
        for name, types in signatures.items():
            fn = getattr(lib, f"{name}_{sfx}")
            fn.argtypes, fn.restype = types, ctypes.c_int
    return lib


def lanes(sfx: str) -> int:
    """Channels per work item of the kernel's channel-lane path ("f32" or "f64")."""
    return getattr(library(), f"scan_lanes_{sfx}")()


def ints(*s: int) -> ctypes.Array:
    """A C array of int64 (dimensions, strides)."""
    return (ctypes.c_int64 * len(s))(*s)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bdl(x: torch.Tensor | None) -> ctypes.Array | None:
    """(batch, dim, L) strides of a (batch, dim, L)-indexed tensor."""
    return None if x is None else ints(x.stride(0), x.stride(1), x.stride(2))


def call(name: str, *args) -> None:
    if library() is None:
        raise RuntimeError("memfit: the fused CPU scan kernel is not available")
    if getattr(library(), name)(*args) != 0:
        raise MemoryError(f"memfit: {name} could not allocate its work buffers")
