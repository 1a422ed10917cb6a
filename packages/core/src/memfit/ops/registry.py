"""Every implementation of every op, one record each; the call sites, `memfit doctor` and the estimator's
CUDA target all read these records.

A record (``Impl``) says: the op ("scan", "conv", "attention"), the implementation's name, the device type
it runs on, how it is imported (``load``, "module:attribute", resolved on first use; a failed import means
"not available", never an error), the inputs it takes (``problem``: None, or why not), a probe against the
op's reference (``probe``: one tiny call per device at first use, cached), and its priority. ``choose``
walks an op's records from the highest priority and returns the first that is available here, not switched
off, takes these inputs and passed its probe; the op's plain torch record (priority 0) always does. So
adding an implementation is one record here and one file beside the op's reference.

Where no rule is known in advance (window attention on CUDA: compiled Flex wins at some shapes,
FlashAttention-2's window at others), records are ``timed``: when the first record that takes a call is
timed and others are too, ``choose`` times every timed record that takes it, once per (shapes, dtypes,
arguments, backward or not) key on the device, as cudnn.benchmark does, and keeps the fastest
(``timed_choices`` lists what it kept; a candidate that fails is left out for inputs of that dtype and
last dimension, with a warning). One dispatcher chooses, times and reports.

Optional kernels (the ``cuda`` extra: mamba_ssm, causal-conv1d, flash-attn) are used only when installed,
their preconditions hold (read from the pinned kernels' sources: mamba_ssm 2.3.2.post1
``selective_scan.cpp``, causal_conv1d 1.7.0 ``causal_conv1d.cpp``, flash_attn 2.8.3.post2 ``flash_api.cpp``)
and their probe passed: a wheel built for another GPU, a newer release that imports without its compiled
extension, or a driver mismatch all import and then fail at the first call. A candidate that is installed
but cannot take a call warns once per reason and the next record runs.

The device test is ``device_type(t)``, the one place that says which device a tensor's op runs for: a real
CUDA tensor is "cuda"; a fake tensor (a memory estimate's trace) is whatever the estimator's ``target`` says
it stands for. ``ran()`` counts the implementation each call site took, so tests can assert what really ran.

Switches, read by ``memfit.ops.device`` only: ``MEMFIT_DISABLE=name[,name...]`` turns implementations
off by name (e.g. ``triton``, ``cpu_kernel``, ``mamba_ssm``). The older ``MEMFIT_SCAN_KERNEL=0`` is no
longer read: set, it gets a warning that names ``MEMFIT_DISABLE=cpu_kernel``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch

from memfit.ops.device import (  # noqa: F401 - the registry's names for them, as before
    _is_fake,
    _target,
    capability,
    channels_last,
    constant_result,
    current_target,
    defer_compiler,
    device_type,
    disabled,
    is_cuda,
    outside_compile,
    own_graph,
)

HALF = (torch.float16, torch.bfloat16)
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256
SCAN_MAX_STATE = 256
CONV_WIDTHS = (2, 3, 4)
TRITON_MAX_STATE = 256


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "matches the PyTorch path (max err 2e-07)" or why it failed


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op (see the module docstring)."""

    op: str  # "scan", "conv", "attention"
    name: str  # what ``ran()`` and `memfit doctor` call it
    device: str  # "cuda" or "cpu": the device type it runs on
    priority: int  # higher is tried first; the op's plain torch path is 0 and takes every call
    load: str  # "module:attribute" of the function in the op's calling convention
    title: str  # one line for `memfit doctor`
    problem: Callable[..., str | None] | str | None = None  # None: takes these inputs; else why not
    probe: str | None = None  # "module:attribute" of the op's probe (fn, device) -> (ok, detail)
    package: str | None = None  # the optional distribution it comes from (None: memfit and torch)
    fake: str | None = None  # "module:attribute" whose fake ops stand in for it in an estimate's trace
    ready: str | None = None  # "module:attribute" of () -> None, or why it cannot run here (a C compiler...)
    timed: bool = False  # chosen among the op's other timed records by timing them on the device (above)


# ----------------------------------------------------------------------------------------------------
# Preconditions: None when the implementation takes these inputs, else why not
# ----------------------------------------------------------------------------------------------------


def _mamba_scan_problem(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk):
    """mamba_ssm 2.3.2.post1 (selective_scan.cpp): u, delta (and z, variable B/C) one dtype of fp32/fp16/bf16;
    A real fp32; shared (dim, N) B/C fp32; D and delta_bias fp32; N <= 256. Its backward ignores the last
    state's gradient (``SelectiveScanFn.backward(ctx, dout, *args)``), so a call whose last state needs one
    takes our path, which propagates it."""
    if u.dtype not in (torch.float32, *HALF):
        return f"u is {u.dtype}; the kernel takes fp32, fp16 or bf16"
    if A.dtype != torch.float32:
        return f"A is {A.dtype}; the kernel takes real fp32 A"
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.dtype != u.dtype:
            return f"{name} is {t.dtype} and u {u.dtype}; the kernel needs one dtype"
    for name, t in (("B", B), ("C", C)):
        want = torch.float32 if t.dim() == 2 else u.dtype
        if t.dtype != want:
            return f"{name} is {t.dtype}, the kernel needs {want} here"
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and t.dtype != torch.float32:
            return f"{name} is {t.dtype}; the kernel takes fp32"
    if A.shape[1] > SCAN_MAX_STATE:
        return f"state size {A.shape[1]} > {SCAN_MAX_STATE}"
    if _last_state_needs_grad(return_last_state, u, delta, A, B, C, D, z, delta_bias):
        return "the last state needs a gradient, which mamba_ssm's backward drops"
    return None


def _last_state_needs_grad(return_last_state, *tensors) -> bool:
    return (
        bool(return_last_state)
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in tensors)
    )


def _triton_scan_problem(u, delta, A, *args) -> str | None:
    """memfit's Triton scan: fp32, fp16 or bf16 inputs (fp64 takes the torch path), N <= 256."""
    if u.dtype not in (torch.float32, *HALF):
        return f"u is {u.dtype}; the Triton scan takes fp32, fp16 or bf16"
    if A.shape[1] > TRITON_MAX_STATE:
        return f"state size {A.shape[1]} > {TRITON_MAX_STATE}"
    return None


def _causal_conv_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """causal_conv1d 1.7.0 (causal_conv1d.cpp): width 2..4; x, weight fp32/fp16/bf16, bias weight's dtype;
    x (batch, dim, L) either L-contiguous, or channels-last (dim stride 1) with dim % 8 == 0 (its strides
    must then be multiples of 8: ``memfit.ops.conv.conv_layout`` copies into that layout when they are
    not)."""
    width = weight.shape[-1]
    if width not in CONV_WIDTHS:
        return f"width {width}; the kernel takes 2 to 4"
    if x.dtype not in (torch.float32, *HALF) or weight.dtype not in (torch.float32, *HALF):
        return f"dtypes {x.dtype}/{weight.dtype}; the kernel takes fp32, fp16 or bf16"
    if bias is not None and bias.dtype != weight.dtype:
        return f"bias is {bias.dtype} and weight {weight.dtype}"
    if channels_last(x) and x.shape[1] % 8:
        return f"{x.shape[1]} channels in channels-last layout; the kernel needs a multiple of 8"
    return None


def _cpu_conv_problem(x: torch.Tensor, weight: torch.Tensor, bias) -> str | None:
    return None if x.is_floating_point() else f"x is {x.dtype}; the C kernel takes floating point"


def _capability_of(t: torch.Tensor) -> tuple[int, int]:
    """The compute capability ``t``'s ops run on: for a fake tensor in an estimate's trace, the card the
    estimate is for (no GPU needed), else its own device's."""
    target = current_target() if _is_fake(t) else None
    if target is not None and target.capability is not None:
        return target.capability
    return capability(t.device)


def _flash_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale=None) -> str | None:
    """flash_attn 2.8.3.post2 (flash_api.cpp): compute capability >= 8.0 (Ampere or newer), fp16/bf16,
    q/k/v one dtype, head dim <= 256 (same for q, k, v)."""
    cap = _capability_of(q)
    if tuple(cap) < FLASH_MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} < 8.0"
    if q.dtype not in HALF:
        return f"{q.dtype}; the kernel takes fp16 or bf16"
    if q.shape[-1] > FLASH_MAX_HEAD_DIM or v.shape[-1] != q.shape[-1]:
        dims = f"{q.shape[-1]}/{v.shape[-1]}"
        return f"head dim {dims}; the kernel takes equal head dims <= {FLASH_MAX_HEAD_DIM}"
    return None


# CPU window attention (tools/bench_attention.py --grid, fwd+bwd, 1 thread, L 64..8192, w 16..L/2 against
# causal SDPA): the band path wins once L >= 16 w (0.04-0.83x); below that SDPA on query blocks of
# max(w/2, 32) is 0.36-1.03x causal SDPA's time (one masked call at L <= 64).
BAND_MIN_RATIO = 16


def _band_problem(q, k, v, window: int, scale=None) -> str | None:
    L = q.shape[-2]
    return (
        None if BAND_MIN_RATIO * window <= L else f"L {L} < {BAND_MIN_RATIO} windows: query blocks are faster"
    )


# ----------------------------------------------------------------------------------------------------
# The records
# ----------------------------------------------------------------------------------------------------

RECORDS: tuple[Impl, ...] = (
    # selective scan: fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size)
    Impl("scan", "mamba_ssm", "cuda", 30, "memfit.ops.scan.mamba_ssm:selective_scan",
         "mamba_ssm's fused CUDA kernel (the torch-op path when the last state needs a gradient)",
         _mamba_scan_problem, "memfit.ops.scan.ref:probe", "mamba-ssm",
         fake="memfit.ops.scan.cpu:fused_scan"),
    Impl("scan", "triton", "cuda", 20, "memfit.ops.scan.triton:scan",
         "memfit's Triton kernel (chunk states saved, chunks recomputed in backward)",
         _triton_scan_problem, "memfit.ops.scan.ref:probe", ready="memfit.ops.scan.triton:why_unavailable"),
    Impl("scan", "cpu_kernel", "cpu", 20, "memfit.ops.scan.cpu:fused_scan",
         "fused C kernel (memfit/ops/cpu_kernel.c, built on first use)", "memfit.ops.scan.cpu:takes",
         ready="memfit.ops.cpu_kernel:why_unavailable"),
    Impl("scan", "torch", "any", 0, "memfit.ops.scan.chunked:chunked_scan", "torch-op chunked scan"),
    # causal depthwise conv + SiLU: fn(x (batch, d, L), weight (d, 1, k), bias) -> (batch, d, L)
    Impl("conv", "causal_conv1d", "cuda", 30, "memfit.ops.conv.causal_conv1d:conv_silu",
         "causal-conv1d (width 2-4, channels a multiple of 8 when channels-last)",
         _causal_conv_problem, "memfit.ops.conv.ref:probe", "causal-conv1d",
         fake="memfit.ops.conv.cpu:conv_silu"),
    Impl("conv", "cpu_kernel", "cpu", 20, "memfit.ops.conv.cpu:conv_silu",
         "fused C kernel (memfit/ops/cpu_kernel.c)", _cpu_conv_problem,
         ready="memfit.ops.cpu_kernel:why_unavailable"),
    Impl("conv", "torch", "any", 0, "memfit.ops.conv.ref:conv_silu_ref", "PyTorch conv1d (cuDNN on CUDA)"),
    # a causal window shorter than the sequence: fn(q, k, v, window, scale) -> (B, H, L, D); on CUDA without
    # flash-attn the timed records race (memfit.ops.attention's docstring)
    Impl("attention", "flash", "cuda", 30, "memfit.ops.attention.flash_attn:window_attention",
         "flash-attn's window (fp16/bf16, head dim <= 256)", _flash_problem,
         "memfit.ops.attention.ref:probe", "flash-attn", fake="memfit.ops.attention.sdpa:flash_like"),
    Impl("attention", "flex", "cuda", 20, "memfit.ops.attention.flex:flex_window",
         "compiled FlexAttention, 128-wide blocks (timed)", fake="memfit.ops.attention.sdpa:flash_like",
         timed=True),
    Impl("attention", "flex_narrow", "cuda", 20, "memfit.ops.attention.flex:flex_narrow_window",
         "compiled FlexAttention, 64-wide blocks, autotuned: training, windows <= 128 (timed)",
         "memfit.ops.attention.flex:narrow_problem", fake="memfit.ops.attention.sdpa:flash_like", timed=True),
    Impl("attention", "varlen", "cuda", 20, "memfit.ops.attention.varlen:varlen_window",
         "FlashAttention-2's window bundled in PyTorch, fp16/bf16 (timed)",
         "memfit.ops.attention.varlen:problem", fake="memfit.ops.attention.sdpa:flash_like", timed=True),
    Impl("attention", "triton", "cuda", 20, "memfit.ops.attention.triton:triton_window",
         "memfit's Triton band kernels (timed)", "memfit.ops.attention.triton:problem",
         fake="memfit.ops.attention.sdpa:flash_like", timed=True),
    Impl("attention", "band", "cpu", 20, "memfit.ops.attention.band:band_attention",
         "the band path (long sequences: L >= 16 windows)", _band_problem),
    Impl("attention", "blocks", "any", 0, "memfit.ops.attention.blocks:sdpa_blocks",
         "SDPA on query blocks (timed beside the others on CUDA)", timed=True),
)  # fmt: skip

OPS = tuple(dict.fromkeys(r.op for r in RECORDS))
_BY_OP = {op: tuple(sorted((r for r in RECORDS if r.op == op), key=lambda r: -r.priority)) for op in OPS}


def records(op: str) -> tuple[Impl, ...]:
    """The op's records, highest priority first."""
    return _BY_OP[op]


def record_of(op: str, name: str) -> Impl:
    for r in RECORDS:
        if r.op == op and r.name == name:
            return r
    raise KeyError(f"no implementation {name!r} of {op!r}")


# ----------------------------------------------------------------------------------------------------
# Loading (cached), switches
# ----------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, Callable | None] = {}
_load_errors: dict[str, str] = {}


def resolve(spec: str) -> Callable | None:
    """The function at "module:attribute", or None when its import fails (the reason: ``load_error``)."""
    if spec not in _loaded:
        module, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError
            fn = None
            _load_errors[spec] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        _loaded[spec] = fn
    return _loaded[spec]


def load_error(impl: Impl) -> str | None:
    """Why ``impl`` did not import (None: it did, or was never tried)."""
    return _load_errors.get(impl.load)


# ----------------------------------------------------------------------------------------------------
# Devices, and what an estimate's trace stands for
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """What a memory estimate's fake tensors stand for: a device type and, on CUDA, the optional kernels
    that run has (names of records with a ``package``; memfit's own implementations are always there)."""

    device: str = "cpu"
    kernels: frozenset[str] = frozenset()
    capability: tuple[int, int] | None = None  # the card's compute capability (None: the device's own)

    def describe(self, ran: Iterable[tuple[str, str]] | None = None) -> str:
        """How a report names the kernels assumed. With ``ran`` (the (op, implementation) pairs a traced
        step called, from ``ran()``): only the optional kernels that step's calls took, "without the cuda
        extra" when the step calls an op the extra would serve and the target lacks it, and "" when the
        step calls none of those ops (a ResNet is not said to use mamba_ssm)."""
        if self.device != "cuda":
            return "the CPU's kernels"
        optional = [r for r in RECORDS if r.package and r.device == self.device]
        if ran is None:
            extra = sorted(r.package for r in optional if r.name in self.kernels)
            return "with " + ", ".join(extra) if extra else "without the cuda extra"
        ran = set(ran)
        used = sorted({r.package for r in optional if (r.op, r.name) in ran})
        if used:
            return "with " + ", ".join(used)
        called = {op for op, _ in ran}
        lacking = sorted({r.package for r in optional if r.op in called and r.name not in self.kernels})
        return f"without the cuda extra's {', '.join(lacking)}" if lacking else ""


def extra_kernels() -> frozenset[str]:
    """Every optional CUDA kernel (the ``cuda`` extra)."""
    return frozenset(r.name for r in RECORDS if r.package and r.device == "cuda")


@contextlib.contextmanager
def traced_as(target: Target) -> Iterator[None]:
    """Inside, fake tensors stand for ``target``: call sites choose what a run on that device would, and run
    the chosen implementation's fake stand-in (the estimator's CUDA target)."""
    token = _target.set(target)
    try:
        yield
    finally:
        _target.reset(token)


# ----------------------------------------------------------------------------------------------------
# What ran (tests and `memfit doctor` read this)
# ----------------------------------------------------------------------------------------------------

_ran: collections.Counter = collections.Counter()
_traced: collections.Counter = collections.Counter()  # the same, for fake tensors (estimates' traces)
_said: set[str] = set()
_fallbacks: dict[tuple[str, str], int] = {}
_probes: dict[tuple, ProbeResult] = {}


def record(site: str, path: str) -> None:
    """Count one call of ``site`` ("scan", "conv", "attention") on ``path`` (e.g. "mamba_ssm", "torch").
    Not counted while torch.compile traces (a traced side effect would be replayed or break the graph)."""
    if torch.compiler.is_compiling():
        return
    with _lock:
        _ran[(site, path)] += 1


def _counts(counter: collections.Counter, site: str | None) -> dict:
    with _lock:
        if site is None:
            return dict(counter)
        return {p: n for (s, p), n in counter.items() if s == site}


def ran(site: str | None = None) -> dict:
    """Calls per (site, path) since the last ``reset()``; with ``site``: {path: calls} for that site."""
    return _counts(_ran, site)


def traced(site: str | None = None) -> dict:
    """As ``ran()``, for calls on fake tensors (what an estimate's trace chose: the ops a model has)."""
    return _counts(_traced, site)


def fallbacks() -> dict[tuple[str, str], int]:
    """{(implementation, reason): times} of calls an installed implementation could not take."""
    with _lock:
        return dict(_fallbacks)


def reset(probes: bool = False) -> None:
    """Forget the counts and the warnings given (and the cached probe results with ``probes=True``)."""
    with _lock:
        _ran.clear()
        _traced.clear()
        _said.clear()
        _fallbacks.clear()
        if probes:
            _probes.clear()


def _fall_back(impl: Impl, reason: str) -> None:
    """Note that ``impl`` could not take a call; warn once per (implementation, reason)."""
    if torch.compiler.is_compiling():
        return
    key = f"{impl.op}/{impl.name}: {reason}"
    with _lock:
        _fallbacks[(impl.name, reason)] = _fallbacks.get((impl.name, reason), 0) + 1
        new = key not in _said
        _said.add(key)
    if new:
        warnings.warn(
            f"memfit: {impl.name} ({impl.op}) not used ({reason}); running the next implementation instead",
            RuntimeWarning,
            stacklevel=4,
        )


# ----------------------------------------------------------------------------------------------------
# Probes and the choice
# ----------------------------------------------------------------------------------------------------


def _run_probe(impl: Impl, fn: Callable, device: torch.device) -> ProbeResult:
    """The probe, apart from the call that asked for it: no autocast, gradients on, and the probe's graph
    keeps its own tensors (saved-tensor hooks of its own). A model's first call often runs inside
    activation checkpointing, whose hooks would otherwise take the probe's tensors: its backward would
    recompute the model in the middle of its forward, and the recomputation (probe cached) would save fewer
    tensors than the forward did."""
    try:
        check = resolve(impl.probe)
        with torch.autocast(device.type, enabled=False), own_graph():
            ok, detail = check(fn, device)
        return ProbeResult(ok, detail)
    except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not use it
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return ProbeResult(False, f"the test call failed: {type(e).__name__}: {first}")


_run_probe_outside_compile = outside_compile(_run_probe)


def probe(impl: Impl, device) -> ProbeResult:
    """The cached probe of ``impl`` on ``device`` (passes for a record without a probe, when it imports)."""
    fn = resolve(impl.load)
    if fn is None:
        return ProbeResult(False, f"not installed (its import failed: {load_error(impl)})")
    if impl.probe is None:
        return ProbeResult(True, "no probe needed (tested against the reference in the suite)")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (impl.op, impl.name, id(fn), str(device))
    res = _probes.get(key)
    if res is None:
        res = _run_probe_outside_compile(impl, fn, device)
        _probes[key] = res
    return res


def choose(
    op: str, *args, device: torch.device | None = None, kernels: bool = True, count: bool = True
) -> tuple[Impl, Callable]:
    """The implementation of ``op`` that takes this call, and the function to call (recorded in ``ran``).

    ``args`` are the call's arguments in the op's calling convention (the first is a tensor of the call);
    ``kernels=False`` keeps every implementation but the plain torch one out. Inside ``traced_as``, fake
    tensors stand for the target's device: only the optional kernels it names are candidates, nothing is
    probed or timed, and a kernel with a ``fake`` stand-in runs that stand-in's fake ops. When the first
    record that takes a real CUDA call is ``timed``, the fastest of the timed records that take it runs
    (``_fastest``). ``count=False``: not recorded in ``ran`` (a question, not a call)."""
    first = args[0]
    dev = device_type(first)
    target = current_target() if _is_fake(first) else None
    for impl in records(op):
        fn = _taking(impl, args, dev, target, kernels, device)
        if fn is None:
            continue
        if impl.timed and target is None and dev == "cuda":
            impl, fn = _fastest(op, args, dev, kernels, device, time=count)
        if count and _is_fake(first):  # an estimate's fake trace is not a run: counted apart
            with _lock:
                _traced[(op, impl.name)] += 1
        elif count:
            record(op, impl.name)
        return impl, fn
    raise RuntimeError(f"memfit: no implementation of {op} takes this call")  # torch's always does


def _taking(impl: Impl, args: tuple, dev: str, target, kernels: bool, device) -> Callable | None:
    """The function to call when ``impl`` takes this call (``choose``'s tests, in order), else None."""
    first = args[0]
    if impl.device not in (dev, "any") or (impl.priority > 0 and not kernels) or _switched_off(impl.name):
        return None
    if target is not None and impl.package and impl.name not in target.kernels:
        return None
    if target is not None and impl.fake:  # a stand-in's fake ops trace it: it need not be installed here
        fn = resolve(impl.fake)
    else:
        fn = resolve(impl.load)
        if fn is None or not _ready(impl.op, impl.name):
            return None
    if (
        target is None
        and impl.timed
        and impl.priority > 0
        and (impl.op, impl.name, *_kind(first)) in _timing_failed
    ):
        return None  # left out after failing its timing; the op's plain torch record always stays
    problem = _problem(impl, args)
    if problem is None and target is None and impl.probe is not None:
        res = probe(impl, device if device is not None else first.device)
        if not res.ok:
            problem = f"its probe on {first.device}: {res.detail}"
    if problem is not None:
        if impl.probe is not None and target is None:  # a kernel that could not take it: say so once
            _fall_back(impl, problem)
        return None
    return fn


# ----------------------------------------------------------------------------------------------------
# Timed records: the fastest, measured once per key on the device
# ----------------------------------------------------------------------------------------------------

TUNE_REPEATS = 3
_timed_choice: dict[tuple, str] = {}
# (op, record, dtype, last dim) -> why it failed there: left out for inputs of that kind only (a kernel
# that cannot compile for one head dim or dtype may well run for others)
_timing_failed: dict[tuple, str] = {}
_said_timing: set[str] = set()


def _kind(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape[-1] if t.dim() else 0)


def _grad_wanted(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def timing_key(op: str, args: tuple) -> tuple:
    """(op, the tensors' shapes and dtypes, the other arguments, backward or not): what one timing covers."""
    parts = tuple((*a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    return (op, *parts, _grad_wanted(args))


def timed_candidates(op: str, *args) -> list[str]:
    """The timed records that would race for this real call (what ``choose`` times; [] when the first
    record that takes it is not timed): for benchmarks that time each one themselves."""
    dev = device_type(args[0])
    first = next((r for r in records(op) if _taking(r, args, dev, None, True, None) is not None), None)
    return [r.name for r, _ in _timed_group(op, args, dev, True, None)] if first and first.timed else []


def _timed_group(op: str, args: tuple, dev: str, kernels: bool, device) -> list[tuple[Impl, Callable]]:
    """The timed records of ``op`` that take this real call, highest priority first, with their functions."""
    takes = ((r, _taking(r, args, dev, None, kernels, device)) for r in records(op) if r.timed)
    return [(r, fn) for r, fn in takes if fn is not None]


def timed_choices(op: str | None = None) -> dict[tuple, str]:
    """{timing key: record} kept so far in this process (``timing_key``), for ``op`` or every op."""
    return {k: v for k, v in _timed_choice.items() if op is None or k[0] == op}


def _fastest(op: str, args: tuple, dev: str, kernels: bool, device, time: bool = True) -> tuple:
    """The timed record measured fastest for this call's key, and its function: a key timed before takes
    its record at once (no candidate is asked again); a new one times the timed records that take it
    (under torch.compile, or asked without ``time``, it takes the first of them)."""
    key = timing_key(op, args)
    name = _timed_choice.get(key)
    if name is not None:
        impl = record_of(op, name)
        return impl, resolve(impl.load)
    group = _timed_group(op, args, dev, kernels, device)
    if len(group) == 1 or not time or torch.compiler.is_compiling():
        return group[0]
    name = _time_group_outside_compile(key, op, group, args)
    return next(((i, f) for i, f in group if i.name == name), group[0])


def _time_group(key: tuple, op: str, group: list[tuple[Impl, Callable]], args: tuple) -> str:
    names = [i.name for i, _ in group]
    if op not in _said_timing:  # the first step of each new shape waits for this: said once per op
        _said_timing.add(op)
        print(f"[memfit] timing {len(names)} {op} kernels once per new shape (a compiled one may take tens "
              f"of seconds): {', '.join(names)}", file=sys.stderr)  # fmt: skip
    backward = _grad_wanted(args)
    timings = {}
    for impl, fn in group:
        try:
            timings[impl.name] = time_call(fn, args, backward)
        except Exception as e:  # noqa: BLE001 - a candidate this GPU/torch cannot run is left out, said once
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            dtype, last = _kind(args[0])
            _timing_failed[(op, impl.name, dtype, last)] = why
            warnings.warn(f"memfit: {op} candidate {impl.name} left out for {dtype}, last dim {last} ({why})",
                          RuntimeWarning, stacklevel=4)  # fmt: skip
    name = min(timings, key=timings.get) if timings else names[-1]
    _timed_choice[key] = name
    return name


_time_group_outside_compile = outside_compile(_time_group)


def time_call(fn: Callable, args: tuple, backward: bool) -> float:
    """Median ms of ``fn(*args)`` (+ its backward) on copies of the tensor arguments, on their CUDA device;
    the first call, which may compile, is not timed. The trial keeps its own graph: the first call of a
    shape often comes inside activation checkpointing (``own_graph``)."""
    leaves = [
        a.detach().requires_grad_(backward and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    times = []
    with own_graph():
        for i in range(TUNE_REPEATS + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*leaves)
            if backward:
                out.backward(torch.ones_like(out))
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _problem(impl: Impl, args: tuple) -> str | None:
    check = resolve(impl.problem) if isinstance(impl.problem, str) else impl.problem
    return None if check is None else check(*args)


def why_not_ready(impl: Impl) -> str | None:
    """None when ``impl`` can run here beyond importing (its ``ready`` check), else why not."""
    if impl.ready is None:
        return None
    check = resolve(impl.ready)
    return "its readiness check did not import" if check is None else check()


# torch.compile takes these two as constants: they read the environment, the file system and build caches,
# which it cannot trace, and a compiled graph keeps the implementation it was traced with
@constant_result
def _ready(op: str, name: str) -> bool:
    return why_not_ready(record_of(op, name)) is None


@constant_result
def _switched_off(name: str) -> bool:
    return name in disabled()


def usable(op: str, device: torch.device) -> list[tuple[Impl, str]]:
    """Each record of ``op`` for ``device``'s type with a verdict: "probe passed", "not installed" ...
    (what `memfit doctor` prints; probes run on a real device)."""
    out = []
    off = disabled()
    for impl in records(op):
        if impl.device not in (device.type, "any"):
            continue
        if impl.name in off:
            out.append((impl, "switched off (MEMFIT_DISABLE)"))
            continue
        fn = resolve(impl.load)
        if fn is None:
            out.append((impl, f"not available: {load_error(impl)}"))
        elif (why := why_not_ready(impl)) is not None:
            out.append((impl, "not available: " + why))
        elif impl.probe is not None and device.type == "cuda":
            res = probe(impl, device)
            out.append((impl, ("probe passed: " if res.ok else "probe FAILED: ") + res.detail))
        else:
            out.append((impl, "available"))
    return out


def kernels_on(device) -> frozenset[str]:
    """The optional CUDA kernels a run on this CUDA device uses (installed, probe passed): what its memory
    pre-flight estimates with (``Target.kernels``)."""
    device = torch.device(device)
    return frozenset(r.name for r in RECORDS if r.package and r.device == "cuda" and probe(r, device).ok)


def kernels_assumed_here() -> frozenset[str]:
    """What a CUDA estimate assumes unless told: on a machine with a GPU, what ``kernels_on`` finds there;
    without one, the extra installed and working (the README's GPU setup; ``--no_cuda_kernels``: not)."""
    return kernels_on("cuda") if torch.cuda.is_available() else extra_kernels()
