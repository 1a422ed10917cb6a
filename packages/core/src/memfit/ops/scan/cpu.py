"""The selective scan fused in C on the CPU (``memfit.ops.cpu_kernel``), with torch ops around it.

The same chunked recompute scheme as ``chunked``, but the recurrence runs in C with the state in registers
(per channel block as N lane vectors when the layout is a Mamba block's, else per (batch, dim) sequence as
an N-vector), so neither direction has chunk buffers, and softplus, D and the gate are fused in too.
"""

from __future__ import annotations

import torch

from memfit.ops import cpu_kernel as _K
from memfit.ops import device
from memfit.ops.scan.ref import _to, compute_dtype

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------------
# Fused CPU path: the recurrence in C (cpu_kernel.c), everything around it in torch
# ----------------------------------------------------------------------------------------------------
# The torch-op path above streams (batch, T, N, dim) chunk buffers through ~25 elementwise ops per
# chunk; the C kernel keeps the state in registers instead, so the scan costs about one exp2 and a few
# multiply-adds per state entry and step; softplus, D, the z gate and their gradients are fused in too.
# Memory: the forward keeps the state entering every chunk of T steps (T = chunk_size, default 64) like
# the torch-op path, and neither direction has chunk buffers in torch. The C side's own per-thread work
# buffer: the sequence path's backward holds one chunk's states (T x N values); the lane path's one
# chunk's states, decays and per-lane dB/dC partials of a block plus A, A2 and dA as lanes, about
# (4T + dim / 4) x N lane vectors (150 KiB at the MBS-Net CPU recipe's dim 64, N 8; 0.65 MiB at dim
# 1536, N 16).

FUSED_CHUNK = 64
# The kernel has two paths. The sequence path runs one (batch, dim) sequence per work item with the
# N-vector state as its SIMD axis (a horizontal sum over N every step). The channel-lane path runs a block
# of V consecutive channels per work item (V = _scan_kernel.lanes(): 16 fp32 lanes with AVX-512) with the
# state as N lane vectors: N independent recurrences per step and no sums over N; the sums over channels
# that dB and dC need are reduced once per chunk. It needs B and C the same for every channel of a block
# (per step, or groups of a multiple of V channels), which is what a Mamba block passes; shared (dim, N)
# B/C and other groupings take the sequence path. False keeps every call on the sequence path (for
# benchmarks comparing the two).
LANE_PATH = True


def _lane_path_fits(B: torch.Tensor, C: torch.Tensor, dim: int, sfx: str, *per_step) -> bool:
    """The channel-lane path runs when B and C are the same for every channel of a block and the
    per-step (batch, dim, L) tensors given (None: absent) have channel stride 1 (any other stride is
    correct there too, but gathered lane by lane: the sequence path is faster then)."""
    if not LANE_PATH:
        return False
    V = _K.lanes(sfx)
    if not all(X.dim() == 3 or (X.dim() == 4 and (dim // X.shape[1]) % V == 0) for X in (B, C)):
        return False
    return all(x is None or dim == 1 or x.stride(1) == 1 for x in per_step)


def _bc_kernel(X: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """B or C for the kernel: in dtype cd with N contiguous."""
    X = X.to(cd)
    if X.dim() == 2:  # shared (dim, N)
        return X.contiguous()
    n_axis = X.dim() - 2
    if X.stride(n_axis) != 1:
        X = X.transpose(n_axis, -1).contiguous().transpose(n_axis, -1)
    return X


def _bc_strides(X: torch.Tensor, dim: int) -> tuple[_K.Strides, int]:
    """A _bc_kernel tensor's (batch, group, t) strides and its group size (channels per group)."""
    if X.dim() == 2:  # shared (dim, N): a group per channel
        return _K.Strides(g=X.stride(0)), 1
    if X.dim() == 3:  # per step (batch, N, L): one group of all channels
        return _K.Strides(b=X.stride(0), t=X.stride(2)), dim
    return _K.Strides(b=X.stride(0), g=X.stride(1), t=X.stride(3)), dim // X.shape[1]


def _grad_accumulator(X: torch.Tensor, nth: int, cd: torch.dtype) -> torch.Tensor:
    """Per-thread gradient accumulators for B or C, n contiguous: (nth, dim, N) for shared B/C,
    (nth, batch, L, N) per step, (nth, batch, G, L, N) grouped."""
    if X.dim() == 2:
        return X.new_zeros((nth, *X.shape), dtype=cd)
    return X.new_zeros((nth, *X.shape[:-2], X.shape[-1], X.shape[-2]), dtype=cd)


def _accumulator_strides(acc: torch.Tensor) -> _K.Strides:
    """(thread in the channel slot, batch, group, t) strides of a _grad_accumulator."""
    if acc.dim() == 3:  # shared: (thread, dim, N), indexed by group = channel
        return _K.Strides(b=0, d=acc.stride(0), g=acc.stride(1), t=0)
    if acc.dim() == 4:
        return _K.Strides(b=acc.stride(1), d=acc.stride(0), g=0, t=acc.stride(2))
    return _K.Strides(b=acc.stride(1), d=acc.stride(0), g=acc.stride(2), t=acc.stride(3))


def _grad_from_accumulator(acc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    g = acc.sum(0) if acc.shape[0] > 1 else acc[0]
    return g if like.dim() == 2 else g.transpose(-1, -2)


def _cd_or_none(x: torch.Tensor | None, cd: torch.dtype, contiguous: bool = False) -> torch.Tensor | None:
    if x is None:
        return None
    x = x.to(cd)
    return x.contiguous() if contiguous else x


def cast_bdl(x: torch.Tensor | None, cd: torch.dtype) -> torch.Tensor | None:
    """A (batch, dim, L) tensor in dtype cd, keeping a channel stride of 1 through the cast (``to`` makes a
    non-dense view such as half of a projection's output contiguous in (batch, dim, L), which would put
    bf16 inputs under autocast off the lane path)."""
    if x is None or x.dtype == cd:
        return x
    if x.dim() == 3 and x.stride(1) == 1:
        return x.transpose(1, 2).to(cd).transpose(1, 2)
    return x.to(cd)


# Bits telling the kernel which per-step tensors it reads or writes as bf16 (BF_* in cpu_kernel.c).
_BF = _K.BF_BITS
_BF_U, _BF_DELTA, _BF_Z, _BF_DOUT = _BF["BF_U"], _BF["BF_DELTA"], _BF["BF_Z"], _BF["BF_DOUT"]
_BF_Y, _BF_DU, _BF_DDELTA, _BF_DZ = _BF["BF_Y"], _BF["BF_DU"], _BF["BF_DDELTA"], _BF["BF_DZ"]


def _kernel_in(x: torch.Tensor | None, cd: torch.dtype, lanes: bool) -> torch.Tensor | None:
    """A per-step (batch, dim, L) input as the kernel reads it: bf16 as it is on the fp32 lane path (under
    autocast: no cast, no copy), anything else cast to the compute dtype."""
    if lanes and x is not None and x.dtype == torch.bfloat16 and cd == torch.float32:
        return x
    return cast_bdl(x, cd)


def sfx(cd: torch.dtype) -> str:
    """The fused kernels' suffix for compute dtype cd."""
    return "f64" if cd == torch.float64 else "f32"


def _bf16(t: torch.Tensor | None, bit: int) -> int:
    return bit if t is not None and t.dtype == torch.bfloat16 else 0


def _opt(t: torch.Tensor) -> torch.Tensor | None:
    """An op's optional output: empty (0,) stands for None (ops cannot return None)."""
    return None if t.dim() == 1 and t.numel() == 0 else t


# The kernel as torch ops: memfit::scan_fwd and memfit::scan_bwd. They take the tensors as the kernel reads
# them (see _kernel_inputs) and return what it writes, per-step outputs as (batch, L, dim) tensors and the
# parameter gradients as per-thread partial sums; the fake implementations make the same outputs from the
# same functions (_scan_fwd_outputs, _scan_bwd_outputs), so FakeTensorMode and memfit's estimator see
# every allocation and torch.compile traces through them. ``lanes`` (the kernel's path) and ``nthreads``
# are arguments, so an op's outputs follow from its arguments alone. The casts around them run as torch
# ops in _FusedScan (the autograd.Function below), which saves the scan's own arguments for backward and
# casts again there, as the kernel wants them: register_autograd's context could only save the op's
# inputs, i.e. keep cast copies (fp32 B/C under bf16 autocast) alive from forward to backward.


def _scan_args(u, delta, A2, B, C, D, z, delta_bias, softplus, chunk, lanes, nthreads) -> _K.ScanArgs:
    """The kernel's arguments (both directions) from kernel-ready tensors (all but the outputs)."""
    batch, dim, L = u.shape
    a = _K.ScanArgs(batch=batch, dim=dim, L=L, N=A2.shape[1], T=chunk, softplus=int(softplus),
                    lanes=int(lanes), nthreads=nthreads)  # fmt: skip
    a.sB, a.gsB = _bc_strides(B, dim)
    a.sC, a.gsC = _bc_strides(C, dim)
    a.u, a.delta, a.z, a.D, a.bias, a.A2, a.B, a.C = map(_K.ptr, (u, delta, z, D, delta_bias, A2, B, C))
    a.su, a.sdl, a.sz = _K.bdl(u), _K.bdl(delta), _K.bdl(z)
    a.bfm = _bf16(u, _BF_U) | _bf16(delta, _BF_DELTA) | _bf16(z, _BF_Z)
    return a


def _scan_fwd_outputs(u, A2, chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (batch, L, dim) in u's dtype (bf16 or the compute dtype), last (batch, dim, N), starts
    (batch, n_chunks - 1, dim, N))."""
    batch, dim, L = u.shape
    N, cd = A2.shape[1], A2.dtype
    y = u.new_empty((batch, L, dim))
    starts = u.new_empty((batch, (L + chunk - 1) // chunk - 1, dim, N), dtype=cd)
    last = u.new_empty((batch, dim, N), dtype=cd)
    return y, last, starts


# the fused ops' tags: torch.compile passes them the strides eager mode gives (the lane path's layout)
OP_TAGS = (torch.Tag.needs_fixed_stride_order,)


@torch.library.custom_op("memfit::scan_fwd", mutates_args=(), device_types="cpu", tags=OP_TAGS)
def _scan_fwd(
    u: torch.Tensor, delta: torch.Tensor, A2: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None, delta_softplus: bool,
    chunk: int, lanes: bool, nthreads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The fused scan's forward: (y (batch, L, dim), last state, the states entering chunks 1..)."""
    a = _scan_args(u, delta, A2, B, C, D, z, delta_bias, delta_softplus, chunk, lanes, nthreads)
    y, last, starts = _scan_fwd_outputs(u, A2, chunk)
    a.y, a.sy, a.starts, a.last = y.data_ptr(), _K.bdl(y.transpose(1, 2)), starts.data_ptr(), last.data_ptr()
    a.bfm |= _bf16(y, _BF_Y)
    _K.call(f"scan_fwd_{sfx(A2.dtype)}", a)
    return y, last, starts


@_scan_fwd.register_fake
def _(u, delta, A2, B, C, D, z, delta_bias, delta_softplus, chunk, lanes, nthreads):
    return _scan_fwd_outputs(u, A2, chunk)


def _scan_bwd_outputs(u, delta, A2, B, C, D, z, delta_bias, nthreads) -> tuple:
    """(du, ddelta, dz: (batch, L, dim) in u's, delta's, z's dtype; per-thread dA (nth, dim, N), dB, dC
    (see _grad_accumulator), dD, dbias (nth, dim)); absent ones (no z, D, delta_bias) are empty."""
    cd = A2.dtype
    batch, dim, L = u.shape
    nth = max(1, min(nthreads, batch * dim))
    du, ddelta = u.new_empty((batch, L, dim)), delta.new_empty((batch, L, dim))
    dz = z.new_empty((batch, L, dim)) if z is not None else u.new_empty(0, dtype=cd)
    dA = u.new_zeros((nth, *A2.shape), dtype=cd)
    dB, dC = _grad_accumulator(B, nth, cd), _grad_accumulator(C, nth, cd)
    dD = u.new_zeros((nth, dim), dtype=cd) if D is not None else u.new_empty(0, dtype=cd)
    dbias = u.new_zeros((nth, dim), dtype=cd) if delta_bias is not None else u.new_empty(0, dtype=cd)
    return du, ddelta, dz, dA, dB, dC, dD, dbias


@torch.library.custom_op("memfit::scan_bwd", mutates_args=(), device_types="cpu", tags=OP_TAGS)
def _scan_bwd(
    u: torch.Tensor, delta: torch.Tensor, A2: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
    delta_softplus: bool, chunk: int, lanes: bool, nthreads: int, starts: torch.Tensor,
    dout: torch.Tensor | None, dlast: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    """The fused scan's backward from the forward's ``starts`` and the gradients of y (batch, dim, L) and of
    the last state (None: zero): see _scan_bwd_outputs."""
    outs = _scan_bwd_outputs(u, delta, A2, B, C, D, z, delta_bias, nthreads)
    du, ddelta, dz, dA, dB, dC, dD, dbias = outs
    a = _scan_args(u, delta, A2, B, C, D, z, delta_bias, delta_softplus, chunk, lanes, dA.shape[0])
    a.A, a.starts, a.dlast = A.data_ptr(), starts.data_ptr(), _K.ptr(dlast)
    a.dout, a.sdo = _K.ptr(dout), _K.bdl(dout)
    a.du, a.ddelta, a.dA, a.dB, a.dC = (t.data_ptr() for t in (du, ddelta, dA, dB, dC))
    a.dD, a.dbias = _K.ptr(_opt(dD)), _K.ptr(_opt(dbias))
    a.sdu, a.sdd = _K.bdl(du.transpose(1, 2)), _K.bdl(ddelta.transpose(1, 2))
    if z is not None:
        a.dz, a.sdz = dz.data_ptr(), _K.bdl(dz.transpose(1, 2))
    a.pB, a.pC = _accumulator_strides(dB), _accumulator_strides(dC)
    a.bfm |= _bf16(dout, _BF_DOUT) | _bf16(du, _BF_DU) | _bf16(ddelta, _BF_DDELTA) | _bf16(_opt(dz), _BF_DZ)
    _K.call(f"scan_bwd_{sfx(A2.dtype)}", a)
    return outs


@_scan_bwd.register_fake
def _(u, delta, A2, A, B, C, D, z, delta_bias, delta_softplus, chunk, lanes, nthreads, starts, dout, dlast):
    return _scan_bwd_outputs(u, delta, A2, B, C, D, z, delta_bias, nthreads)


def _kernel_inputs(u, delta, A, B, C, D, z, delta_bias, lanes: bool) -> tuple:
    """The scan's arguments as the kernel reads them: (u, delta, z (see _kernel_in), A (dim, N) and A2 (A
    * log2(e) in fp32 for its exp2, A in fp64) contiguous, B and C with N contiguous, D, delta_bias
    contiguous), all in the compute dtype but bf16 per-step tensors on the lane path."""
    cd = compute_dtype(u)
    Ac = A.to(cd).contiguous()
    A2 = (Ac * (_LOG2E if cd == torch.float32 else 1.0)).contiguous()
    uc, dl, zc = (_kernel_in(x, cd, lanes) for x in (u, delta, z))
    Dc, bias = _cd_or_none(D, cd, True), _cd_or_none(delta_bias, cd, True)
    return uc, dl, zc, Ac, A2, _bc_kernel(B, cd), _bc_kernel(C, cd), Dc, bias


class _FusedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_size):
        with torch.autocast(device_type=u.device.type, enabled=False):
            T = min(chunk_size, u.shape[2])
            cd = compute_dtype(u)
            lanes = _lane_path_fits(B, C, u.shape[1], sfx(cd), u, delta, z)  # the casts keep channel strides
            uc, dl, zc, _, A2, Bk, Ck, Dc, bias = _kernel_inputs(u, delta, A, B, C, D, z, delta_bias, lanes)
            nth = _K.threads()
            y, last, starts = _scan_fwd(uc, dl, A2, Bk, Ck, Dc, zc, bias, delta_softplus, T, lanes, nth)
        ctx.delta_softplus = delta_softplus
        ctx.chunk_size = T
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, starts)
        ctx.set_materialize_grads(False)
        return _to(y.transpose(1, 2), u.dtype), last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, starts = ctx.saved_tensors
        with torch.autocast(device_type=u.device.type, enabled=False):
            cd = compute_dtype(u)
            lanes = _lane_path_fits(B, C, u.shape[1], sfx(cd), u, delta, z, dout)  # either path continues
            uc, dl, zc, Ac, A2, Bk, Ck, Dc, bias = _kernel_inputs(u, delta, A, B, C, D, z, delta_bias, lanes)
            go, dl_last = _kernel_in(dout, cd, lanes), _cd_or_none(dlast, cd, True)
            du, ddelta, dz, dA, dB, dC, dD, dbias = _scan_bwd(
                uc, dl, A2, Ac, Bk, Ck, Dc, zc, bias, ctx.delta_softplus, ctx.chunk_size, lanes,
                _K.threads(), starts, go, dl_last,
            )  # fmt: skip

        def cast(g, like):
            return None if g is None or like is None else g.to(like.dtype)

        def total(acc):  # per-thread accumulators, summed
            return None if acc is None else (acc.sum(0) if acc.shape[0] > 1 else acc[0])

        return (
            cast(du.transpose(1, 2), u),
            cast(ddelta.transpose(1, 2), delta),
            cast(total(dA), A),
            cast(_grad_from_accumulator(dB, B), B),
            cast(_grad_from_accumulator(dC, C), C),
            cast(total(_opt(dD)), D),
            cast(dz.transpose(1, 2) if z is not None else None, z),
            cast(total(_opt(dbias)), delta_bias),
            None,
            None,
        )


def _fused_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk):
    """The scan on the fused CPU kernel: (out (batch, dim, L) in u's dtype, last state (batch, dim, N))."""
    return _FusedScan.apply(u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk)


def fused_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size):
    """The registry's calling convention: out (batch, dim, L) [, last state (batch, dim, N)]."""
    out, last = _fused_scan(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk_size or FUSED_CHUNK
    )
    return (out, last) if return_last_state else out


def takes(u, delta, A, *args) -> str | None:
    """None when the fused kernel takes these inputs (N <= its NMAX), else why not."""
    if A.shape[1] > _K.NMAX:
        return f"state size {A.shape[1]} > the C kernel's NMAX {_K.NMAX}"
    return None


device.defer_compiler(_scan_fwd, _scan_bwd)
