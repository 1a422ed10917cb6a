"""Whether each optional CUDA kernel may run on these inputs, and which path actually ran.

Three kernels are optional (the ``cuda`` extra): mamba_ssm's ``selective_scan_fn`` (memfit.ops.scan),
causal-conv1d's ``causal_conv1d_fn`` (memfit.ops.mamba) and flash-attn's ``flash_attn_func``
(memfit.ops.attention). Importing one proves little: a wheel built for another GPU generation, a newer
mamba_ssm that imports without its compiled extension, or a driver mismatch all import and then fail at
the first call. So a kernel is used only when

* its **preconditions** hold for the call (the checks the pinned kernels make, read from their sources:
  mamba_ssm 2.3.2.post1 ``selective_scan.cpp``, causal_conv1d 1.7.0 ``causal_conv1d.cpp``,
  flash_attn 2.8.3.post2 ``flash_api.cpp``), and
* its **probe** passed: at first use on a device, one tiny call compared with our PyTorch path, cached
  per (kernel, function, device).

Otherwise the PyTorch path runs and a warning says why, once per reason. ``ran()`` counts the path each
dispatch site took ("scan", "conv", "attention"), so tests can assert that a kernel really ran.

The device test is ``is_cuda(t)`` (not ``t.is_cuda``) and the capability comes from ``capability(dev)``,
so CPU tests can fake a GPU by monkeypatching them and the kernel functions.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memfit.estimate.rules import CudaExtra

KERNELS = {
    "selective_scan": "mamba_ssm selective_scan_fn",
    "causal_conv1d": "causal_conv1d_fn",
    "flash_attn": "flash_attn_func",
}
HALF = (torch.float16, torch.bfloat16)
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256
SCAN_MAX_STATE = 256
CONV_WIDTHS = (2, 3, 4)

_lock = threading.Lock()
_ran: collections.Counter = collections.Counter()
_said: set[str] = set()
_fallbacks: dict[tuple[str, str], int] = {}


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "matches the PyTorch path (max err 2e-07)" or why it failed


_probes: dict[tuple, ProbeResult] = {}


# ----------------------------------------------------------------------------------------------------
# What ran (tests and `memfit doctor` read this)
# ----------------------------------------------------------------------------------------------------


def record(site: str, path: str) -> None:
    """Count one call of ``site`` ("scan", "conv", "attention") on ``path`` (e.g. "mamba_ssm", "torch").
    Not counted while torch.compile traces (a traced side effect would be replayed or break the graph)."""
    if torch.compiler.is_compiling():
        return
    with _lock:
        _ran[(site, path)] += 1


def ran(site: str | None = None) -> dict:
    """Calls per (site, path) since the last ``reset()``; with ``site``: {path: calls} for that site."""
    with _lock:
        if site is None:
            return dict(_ran)
        return {p: n for (s, p), n in _ran.items() if s == site}


def fallbacks() -> dict[tuple[str, str], int]:
    """{(kernel, reason): times} of calls that fell back to the PyTorch path since ``reset()``."""
    with _lock:
        return dict(_fallbacks)


def reset(probes: bool = False) -> None:
    """Forget the counts and the warnings given (and the cached probe results with ``probes=True``)."""
    with _lock:
        _ran.clear()
        _said.clear()
        _fallbacks.clear()
        if probes:
            _probes.clear()


def _fall_back(kernel: str, reason: str) -> None:
    """Note a fallback; warn once per (kernel, reason)."""
    if torch.compiler.is_compiling():
        return
    key = f"{kernel}: {reason}"
    with _lock:
        _fallbacks[(kernel, reason)] = _fallbacks.get((kernel, reason), 0) + 1
        new = key not in _said
        _said.add(key)
    if new:
        warnings.warn(
            f"memfit: {KERNELS[kernel]} not used ({reason}); running the PyTorch path instead",
            RuntimeWarning,
            stacklevel=4,
        )


# ----------------------------------------------------------------------------------------------------
# Device facts (monkeypatched by CPU tests)
# ----------------------------------------------------------------------------------------------------


def is_cuda(t: torch.Tensor) -> bool:
    """Whether t lives on a CUDA device (fake tensors, which memory estimates trace, never do)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_cuda and not isinstance(t, FakeTensor)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``, e.g. (8, 0) for an A100."""
    return torch.cuda.get_device_capability(device)


# ----------------------------------------------------------------------------------------------------
# Preconditions: None when the kernel takes these inputs, else why not
# ----------------------------------------------------------------------------------------------------


def scan_problem(u, delta, A, B, C, D, z, delta_bias, last_state_grad: bool) -> str | None:
    """mamba_ssm 2.3.2.post1 (selective_scan.cpp): u, delta (and z, variable B/C) one dtype of fp32/fp16/bf16;
    A real fp32; shared (dim, N) B/C fp32; D and delta_bias fp32; N <= 256. Its backward ignores the last
    state's gradient (``SelectiveScanFn.backward(ctx, dout, *args)``), so a call whose last state needs
    one takes our path, which propagates it."""
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
    if last_state_grad:
        return "the last state needs a gradient, which mamba_ssm's backward drops"
    return None


def conv_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """causal_conv1d 1.7.0 (causal_conv1d.cpp): width 2..4; x, weight fp32/fp16/bf16, bias weight's dtype;
    x (batch, dim, L) either L-contiguous, or channels-last (dim stride 1) with dim % 8 == 0 (its strides
    must then be multiples of 8: ``conv_layout`` copies into that layout when they are not)."""
    width = weight.shape[-1]
    if width not in CONV_WIDTHS:
        return f"width {width}; the kernel takes 2 to 4"
    if x.dtype not in (torch.float32, *HALF) or weight.dtype not in (torch.float32, *HALF):
        return f"dtypes {x.dtype}/{weight.dtype}; the kernel takes fp32, fp16 or bf16"
    if bias is not None and bias.dtype != weight.dtype:
        return f"bias is {bias.dtype} and weight {weight.dtype}"
    if _channels_last(x) and x.shape[1] % 8:
        return f"{x.shape[1]} channels in channels-last layout; the kernel needs a multiple of 8"
    return None


def _channels_last(x: torch.Tensor) -> bool:
    # the kernel's own test: is_channel_last = x.stride(1) == 1 && x.stride(2) > 1 (the wrapper makes any
    # x with neither stride 1 contiguous, i.e. L-contiguous)
    return x.stride(1) == 1 and x.stride(2) > 1


def conv_layout(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel takes it: a channels-last x whose batch/L strides are not multiples of 8 (a view
    into a wider tensor) is copied into a dense channels-last tensor, whose strides are dim and L*dim."""
    if _channels_last(x) and (x.stride(0) % 8 or x.stride(2) % 8):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


def flash_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """flash_attn 2.8.3.post2 (flash_api.cpp): compute capability >= 8.0 (Ampere or newer), fp16/bf16,
    q/k/v one dtype, head dim <= 256 (same for q, k, v)."""
    cap = capability(q.device)
    if tuple(cap) < FLASH_MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} < 8.0"
    if q.dtype not in HALF:
        return f"{q.dtype}; the kernel takes fp16 or bf16"
    if q.shape[-1] > FLASH_MAX_HEAD_DIM or v.shape[-1] != q.shape[-1]:
        dims = f"{q.shape[-1]}/{v.shape[-1]}"
        return f"head dim {dims}; the kernel takes equal head dims <= {FLASH_MAX_HEAD_DIM}"
    return None


# ----------------------------------------------------------------------------------------------------
# Probes: one tiny call per (kernel, function, device), compared with our PyTorch path
# ----------------------------------------------------------------------------------------------------


def _gen(device: torch.device) -> torch.Generator:
    # a private generator: probing must not move the training run's RNG
    return torch.Generator(device=device).manual_seed(0)


def _compare(got: torch.Tensor, want: torch.Tensor, tol: float) -> ProbeResult:
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return ProbeResult(False, f"shape {tuple(got.shape)} instead of {tuple(want.shape)}")
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    if not math.isfinite(err) or err > tol:
        return ProbeResult(False, f"differs from the PyTorch path (relative max error {err:.2g} > {tol:g})")
    return ProbeResult(True, f"matches the PyTorch path (relative max error {err:.1g})")


def _probe_scan(fn: Callable, device: torch.device) -> ProbeResult:
    from memfit.ops.scan import selective_scan_ref

    g = _gen(device)
    batch, dim, L, N = 2, 8, 37, 4

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device) * scale

    u, delta, z = r(batch, dim, L), r(batch, dim, L, scale=0.5), r(batch, dim, L)
    A = -torch.rand(dim, N, generator=g, device=device) - 0.5
    B, C, D, bias = r(batch, N, L), r(batch, N, L), r(dim), r(dim, scale=0.1)
    u.requires_grad_(True)
    out = fn(u, delta, A, B, C, D, z, bias, True, False)
    (gu,) = torch.autograd.grad(out.float().sum(), u)
    u_ref = u.detach().requires_grad_(True)
    ref = selective_scan_ref(u_ref, delta, A, B, C, D, z, bias, True)
    (gu_ref,) = torch.autograd.grad(ref.sum(), u_ref)
    res = _compare(out, ref, 1e-3)
    return res if not res.ok else _compare(gu, gu_ref, 1e-3)


def _probe_conv(fn: Callable, device: torch.device) -> ProbeResult:
    g = _gen(device)
    batch, dim, L, width = 2, 16, 37, 4
    # a Mamba block's layout: channels-last, a view of half of the in_proj output
    x = torch.randn(batch, L, 2 * dim, generator=g, device=device)[..., :dim].transpose(1, 2)
    w = torch.randn(dim, width, generator=g, device=device)
    b = torch.randn(dim, generator=g, device=device)
    x = x.detach().requires_grad_(True)
    out = fn(conv_layout(x), w, b, activation="silu")
    (gx,) = torch.autograd.grad(out.float().sum(), x)
    x_ref = x.detach().requires_grad_(True)
    ref = F.silu(F.conv1d(x_ref, w.unsqueeze(1), b, padding=width - 1, groups=dim)[..., :L])
    (gx_ref,) = torch.autograd.grad(ref.sum(), x_ref)
    res = _compare(out, ref, 1e-3)
    return res if not res.ok else _compare(gx, gx_ref, 1e-3)


def _probe_flash(fn: Callable, device: torch.device) -> ProbeResult:
    from memfit.ops.attention import attention_ref

    g = _gen(device)
    batch, L, heads, hd, window = 2, 40, 2, 64, 8
    q, k, v = (torch.randn(batch, L, heads, hd, generator=g, device=device).to(torch.bfloat16)
               for _ in range(3))  # fmt: skip
    out = fn(q, k, v, causal=True, window_size=(window - 1, 0))
    ref = attention_ref(*(t.float().transpose(1, 2) for t in (q, k, v)), window=window).transpose(1, 2)
    return _compare(out, ref, 2e-2)


_PROBES = {"selective_scan": _probe_scan, "causal_conv1d": _probe_conv, "flash_attn": _probe_flash}


def _run_probe(kernel: str, fn: Callable, device: torch.device) -> ProbeResult:
    try:
        with torch.autocast(device.type, enabled=False), torch.enable_grad():
            return _PROBES[kernel](fn, device)
    except Exception as e:  # noqa: BLE001 - any failure of the kernel means: do not use it
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return ProbeResult(False, f"the test call failed: {type(e).__name__}: {first}")


_run_probe_outside_compile = torch.compiler.disable(_run_probe)


def probe(kernel: str, fn: Callable | None, device) -> ProbeResult:
    """The cached probe of ``fn`` (the kernel's function, None when it did not import) on ``device``."""
    if fn is None:
        return ProbeResult(False, "not installed (its import failed)")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (kernel, id(fn), str(device))
    res = _probes.get(key)
    if res is None:
        res = _run_probe_outside_compile(kernel, fn, device)
        _probes[key] = res
    return res


# ----------------------------------------------------------------------------------------------------
# Dispatch decisions (each records the path it chose)
# ----------------------------------------------------------------------------------------------------


def _decide(site: str, kernel: str, path: str, fn: Callable | None, device, problem: str | None) -> bool:
    if fn is None:
        record(site, "torch")
        return False
    if problem is None:
        res = probe(kernel, fn, device)
        if res.ok:
            record(site, path)
            return True
        problem = f"its probe on {device}: {res.detail}"
    _fall_back(kernel, problem)
    record(site, "torch")
    return False


def use_scan(fn, u, delta, A, B, C, D, z, delta_bias, return_last_state: bool) -> bool:
    """Whether mamba_ssm's scan takes this CUDA call (records "mamba_ssm" or "torch" for "scan")."""
    last_grad = (
        bool(return_last_state)
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (u, delta, A, B, C, D, z, delta_bias))
    )
    problem = None if fn is None else scan_problem(u, delta, A, B, C, D, z, delta_bias, last_grad)
    return _decide("scan", "selective_scan", "mamba_ssm", fn, u.device, problem)


def use_conv(fn, x, weight, bias) -> bool:
    """Whether causal_conv1d takes this CUDA call (records "causal_conv1d" or "torch" for "conv")."""
    problem = None if fn is None else conv_problem(x, weight, bias)
    return _decide("conv", "causal_conv1d", "causal_conv1d", fn, x.device, problem)


def flash_ok(fn, q, k, v) -> bool:
    """Whether flash-attn may take this CUDA call (records nothing: attention records the path it runs)."""
    if fn is None:
        return False
    problem = flash_problem(q, k, v)
    if problem is None:
        res = probe("flash_attn", fn, q.device)
        if res.ok:
            return True
        problem = f"its probe on {q.device}: {res.detail}"
    _fall_back("flash_attn", problem)
    return False


def cuda_extra(device=None) -> CudaExtra:
    """The ``cuda`` extra's Mamba kernels a run on this CUDA device uses (each installed and its probe
    passed): what its memory pre-flight estimates with (``memfit.estimate.rules.CudaExtra``)."""
    from memfit.ops import mamba
    from memfit.ops import scan as ssm

    device = torch.device("cuda") if device is None else torch.device(device)
    return CudaExtra(
        scan=probe("selective_scan", ssm._mamba_scan_fn, device).ok,
        conv=probe("causal_conv1d", mamba._causal_conv1d_fn, device).ok,
    )


def cuda_extra_here() -> CudaExtra:
    """What a CUDA estimate assumes unless told: on a machine with a GPU, what ``cuda_extra`` finds there;
    without one, the extra installed and working (the README's GPU setup; ``--no_cuda_kernels``: not)."""
    return cuda_extra() if torch.cuda.is_available() else CudaExtra()
