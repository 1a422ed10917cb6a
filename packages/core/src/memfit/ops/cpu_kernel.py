"""Builds and loads cpu_kernel.c (Mamba-1's fused CPU kernels: the selective scan, the conv) on first use.

The C file needs nothing but a C compiler (``cc``/``gcc``/``clang``, or ``$CC``) and pthreads: no torch
headers, no ninja. It is compiled once per source/flags/CPU into ``$MEMFIT_CACHE`` (default
``~/.cache/memfit``) and called through ctypes on tensors' data pointers; ctypes releases the GIL and the
kernel splits its work items ((batch, dim) sequences, or (batch, block of channels) on its channel-lane
path) over ``torch.get_num_threads()`` pthreads.

``library()`` returns None (and memfit.ops.scan uses its torch-op path) when there is no compiler, the build
fails, the platform is not POSIX, or the registry switches it off (``MEMFIT_DISABLE=cpu_kernel``). The
first failure is reported once as a
warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from memfit.errors import UsageError
from memfit.ops import device

SOURCE = Path(__file__).with_name("cpu_kernel.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_kernel_body.h"))  # the .c includes the body once per dtype
NMAX = 64  # the largest state size N the kernel takes (NMAX in the C file)
# no -ffast-math: with gcc < 13 it links crtfastmath.o into the shared object, which would switch the
# whole process to flush-denormals-to-zero; these four flags are the part the reductions over N need.
# -fopenmp-simd honours the file's `omp simd` loop annotations only (no OpenMP runtime): those mark every loop
# that needs vectorising, and the lane path's loops are vector code already, so -O2 is enough. -O3 built the
# same speed in ten times the time (~30 s instead of ~5 s, mostly register allocation over the copies its
# loop unswitching and peeling make of the specialised lane loops), inside a user's first memory estimate.
FLAGS = ["-O2", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]  # fmt: skip

_I = ctypes.c_int64
_P = ctypes.c_void_p


class Strides(ctypes.Structure):
    """Element strides by (batch, channel, group, step): ``Strides`` in the C file."""

    _fields_ = [("b", _I), ("d", _I), ("g", _I), ("t", _I)]


class ScanArgs(ctypes.Structure):
    """The arguments of ``scan_fwd_*`` / ``scan_bwd_*``: ``ScanArgs`` in the C file, field by field (what
    each field means is written there). Pointers left unset are NULL (an absent optional tensor)."""

    _fields_ = [
        *((name, _I) for name in ("batch", "dim", "L", "N", "T", "softplus", "lanes", "bfm", "nthreads",
                                  "gsB", "gsC")),
        *((name, _P) for name in ("delta", "bias", "u", "z", "D", "A2", "A", "B", "C", "dlast", "dout")),
        *((name, _P) for name in ("y", "starts", "last", "du", "ddelta", "dz", "dA", "dB", "dC", "dD",
                                  "dbias")),
        *((name, Strides) for name in ("sdl", "su", "sz", "sy", "sdo", "sdu", "sdd", "sdz", "sB", "sC", "pB",
                                       "pC")),
    ]  # fmt: skip


class ConvArgs(ctypes.Structure):
    """The arguments of ``conv_fwd_*`` / ``conv_bwd_*``: ``ConvArgs`` in the C file."""

    _fields_ = [
        *((name, _I) for name in ("batch", "L", "dim", "K", "sx_b", "sx_t", "nthreads")),
        *((name, _P) for name in ("x", "w", "bias", "gu", "u", "gx", "gw", "gb")),
    ]


# Bits telling the kernel which per-step tensors it reads or writes as bf16 (BF_* in the C file), and what a
# kernel returns besides 0 (E_* there)
BF_BITS = {name: 1 << i for i, name in enumerate(
    ("BF_U", "BF_DELTA", "BF_Z", "BF_DOUT", "BF_Y", "BF_DU", "BF_DDELTA", "BF_DZ"))}  # fmt: skip
E_NOMEM, E_STATE = -1, -2


def abi() -> dict[str, int]:
    """The boundary as the C file's ``ABI`` table names it, from the mirrors here: each struct's size, every
    field's offset, NMAX, the BF_* bits and the error codes."""
    out: dict[str, int] = {}
    for struct in (ScanArgs, ConvArgs, Strides):
        out[f"sizeof {struct.__name__}"] = ctypes.sizeof(struct)
        out |= {f"{struct.__name__}.{name}": getattr(struct, name).offset for name, _ in struct._fields_}
    return out | {"NMAX": NMAX} | BF_BITS | {"E_NOMEM": E_NOMEM, "E_STATE": E_STATE}


def library_abi(lib: ctypes.CDLL) -> dict[str, int]:
    """The C side's table, read entry by entry."""
    lib.abi_count.restype, lib.abi_value.restype = ctypes.c_int64, ctypes.c_int64
    lib.abi_name.restype, lib.abi_name.argtypes = ctypes.c_char_p, [ctypes.c_int64]
    lib.abi_value.argtypes = [ctypes.c_int64]
    return {lib.abi_name(i).decode(): lib.abi_value(i) for i in range(lib.abi_count())}


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@cache  # a PATH search of several names: every dispatch asks whether the kernel can be had
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


_failed: list[str] = []  # why a build failed (then available() is False from there on)


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be had here (the caller falls back)."""
    if "cpu_kernel" in device.disabled() or os.name != "posix":
        return None
    cc = _compiler()
    if cc is None:
        return None
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in SOURCES), " ".join(FLAGS), cc, platform.machine(), _cpu_id()]
        ).encode()
    ).hexdigest()[:16]
    cache_dir = Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit"))
    path = cache_dir / f"scan_kernel-{key}.so"
    try:
        if not path.exists():  # a cache outside the run: say where, once (the build is once per machine)
            print(f"[memfit] building the fused CPU kernel once into {path} (MEMFIT_CACHE elsewhere)",
                  file=sys.stderr)  # fmt: skip
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if hasattr(e, "stderr") and e.stderr else e
        msg = f"memfit: the fused CPU scan kernel is unavailable ({detail}); using torch ops"
        warnings.warn(msg, stacklevel=3)
        _failed.append(str(detail))
        return None
    theirs, ours = library_abi(lib), abi()
    if theirs != ours:  # a field added, moved or renamed on one side only: refuse rather than corrupt memory
        differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        raise UsageError(
            f"error: memfit's C kernel and its Python mirror disagree on {', '.join(differ[:6])}; "
            "reinstall memfit-core (or set MEMFIT_DISABLE=cpu_kernel)"
        )
    for sfx in ("f32", "f64"):
        for name, struct in (("scan_fwd", ScanArgs), ("scan_bwd", ScanArgs), ("conv_fwd", ConvArgs),
                             ("conv_bwd", ConvArgs)):  # fmt: skip
            fn = getattr(lib, f"{name}_{sfx}")
            fn.argtypes, fn.restype = [ctypes.POINTER(struct)], ctypes.c_int
        getattr(lib, f"scan_lanes_{sfx}").restype = ctypes.c_int
        if lib[f"scan_lanes_{sfx}"]() != _predefined_lanes(sfx):  # estimates made before the build used these
            warnings.warn(
                f"memfit: the scan kernel's {sfx} lanes differ from the compiler's macros", stacklevel=3
            )
    return lib


# torch.compile takes these three as constants (it cannot trace a build or a ctypes call)
@device.constant_result
def threads() -> int:
    """Threads the kernels split their work over: torch's (fixed when a graph is compiled)."""
    return torch.get_num_threads()


@device.constant_result
def available() -> bool:
    """Whether the kernel is built or can be built here: a C compiler is found and no build has failed. The
    build itself waits for the first real call (library()), so a memory estimate, whose fake tensors never
    reach the kernel, does not wait for the compiler (the first `train` pre-flight on a machine)."""
    return why_unavailable() is None


def why_unavailable() -> str | None:
    """None when the kernel is built or can be built here, else why not (the registry's readiness check)."""
    if "cpu_kernel" in device.disabled():
        return "switched off (MEMFIT_DISABLE=cpu_kernel)"
    if os.name != "posix":
        return "not a POSIX platform"
    if _compiler() is None:
        return "no C compiler: install gcc or set CC for the fused kernel, several x faster"
    if _failed:
        return f"building it failed ({_failed[0][:200]})"
    return None


@device.constant_result
def lanes(sfx: str) -> int:
    """Channels per work item of the kernel's channel-lane path ("f32" or "f64"): the built kernel's, or,
    before it is built, what the compiler's predefined macros say it will be (the same rule as the C file's
    LANES32: 16 with AVX-512, else 8; f64 half that)."""
    if library.cache_info().currsize:
        lib = library()
        if lib is not None:
            return getattr(lib, f"scan_lanes_{sfx}")()
    return _predefined_lanes(sfx)


@cache
def _predefined_lanes(sfx: str) -> int:
    cc = _compiler()
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC", "-pthread")]
    try:
        out = subprocess.run(
            [cc, *flags, "-dM", "-E", "-x", "c", os.devnull], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError, TypeError):
        lib = library()  # the compiler cannot say: build and ask the kernel
        return getattr(lib, f"scan_lanes_{sfx}")() if lib is not None else 8
    lanes32 = 16 if "#define __AVX512F__ 1" in out else 8
    return lanes32 if sfx == "f32" else lanes32 // 2


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bdl(x: torch.Tensor | None) -> Strides:
    """(batch, dim, L) strides of a (batch, dim, L)-indexed tensor (zeros for None)."""
    return Strides() if x is None else Strides(b=x.stride(0), d=x.stride(1), t=x.stride(2))


def call(name: str, args: ScanArgs | ConvArgs) -> None:
    """Run kernel ``name`` (e.g. "scan_fwd_f32") on its argument struct."""
    if library() is None:
        raise UsageError(
            "error: the fused CPU scan kernel could not be built here (the warning above says why); "
            "set MEMFIT_DISABLE=cpu_kernel to use torch ops"
        )
    status = getattr(library(), name)(ctypes.byref(args))
    if status == E_STATE:
        raise ValueError(f"memfit: {name}: state size N={getattr(args, 'N', '?')} is outside 1..{NMAX}")
    if status != 0:
        raise MemoryError(f"memfit: {name} could not allocate its work buffers")
