"""The fused depthwise causal conv1d + SiLU in C on the CPU (``memfit.ops.cpu_kernel``), as torch ops."""

from __future__ import annotations

import torch

from memfit.ops import cpu_kernel as _K
from memfit.ops import device
from memfit.ops.scan.cpu import OP_TAGS, cast_bdl, sfx
from memfit.ops.scan.ref import compute_dtype

# implementations making the same outputs, and _ConvSiLU around them as memfit.ops.scan's _FusedScan is around
# the scan's ops (casts as torch ops, the block's own tensors saved for backward).


def _conv_args(xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, nthreads: int) -> _K.ConvArgs:
    batch, L, dim = xt.shape
    a = _K.ConvArgs(batch=batch, L=L, dim=dim, K=wt.shape[0], sx_b=xt.stride(0), sx_t=xt.stride(1))
    a.x, a.w, a.bias, a.nthreads = xt.data_ptr(), wt.data_ptr(), _K.ptr(bias), nthreads
    return a


@torch.library.custom_op("memfit::conv_fwd", mutates_args=(), device_types="cpu", tags=OP_TAGS)
def _conv_fwd(xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, nthreads: int) -> torch.Tensor:
    """silu(depthwise causal conv1d) of xt (batch, L, d), d contiguous, weight wt (k, d) contiguous, bias
    (d,) or None: a new (batch, L, d) tensor."""
    a = _conv_args(xt, wt, bias, nthreads)
    u = torch.empty_like(xt, memory_format=torch.contiguous_format)
    a.u = u.data_ptr()
    _K.call(f"conv_fwd_{sfx(xt.dtype)}", a)
    return u


@_conv_fwd.register_fake
def _(xt, wt, bias, nthreads):
    return torch.empty_like(xt, memory_format=torch.contiguous_format)


def _conv_bwd_outputs(xt: torch.Tensor, wt: torch.Tensor, bias, nthreads) -> tuple:
    """(gx (batch, L, d), per-thread gw (nth, k, d) and gb (nth, d), gb empty without a bias)."""
    nth = max(1, min(nthreads, xt.shape[0]))
    gx = torch.empty_like(xt, memory_format=torch.contiguous_format)
    gw = xt.new_zeros((nth, *wt.shape))
    gb = xt.new_zeros((nth, xt.shape[2])) if bias is not None else xt.new_empty(0)
    return gx, gw, gb


@torch.library.custom_op("memfit::conv_bwd", mutates_args=(), device_types="cpu", tags=OP_TAGS)
def _conv_bwd(
    xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, gu: torch.Tensor, nthreads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward from the gradient gu (batch, L, d), contiguous, of the output: see _conv_bwd_outputs."""
    gx, gw, gb = _conv_bwd_outputs(xt, wt, bias, nthreads)
    a = _conv_args(xt, wt, bias, gw.shape[0])
    a.gu, a.gx, a.gw, a.gb = gu.data_ptr(), gx.data_ptr(), gw.data_ptr(), _K.ptr(bias if bias is None else gb)
    _K.call(f"conv_bwd_{sfx(xt.dtype)}", a)
    return gx, gw, gb


@_conv_bwd.register_fake
def _(xt, wt, bias, gu, nthreads):
    return _conv_bwd_outputs(xt, wt, bias, nthreads)


class _ConvSiLU(torch.autograd.Function):
    """silu(depthwise causal conv1d) on CPU in C, channels last: x (batch, d, L), typically a transposed
    view of a (batch, L, d) projection, read in place; the result is a (batch, d, L) view of a
    (batch, L, d) tensor, the layout x_proj and the scan read without copies. Backward recomputes the
    pre-activation instead of keeping it. The kernel computes in fp32 (fp64 for fp64 x); bf16/fp16 x (under
    autocast) is cast on the way in and the result cast back to x's dtype, as autocast's conv1d gives."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xt, wt, b = _conv_inputs(x, weight, bias)
        u = _conv_fwd(xt, wt, b, _K.threads())
        ctx.save_for_backward(x, weight, bias)
        return u.to(x.dtype).transpose(1, 2)

    @staticmethod
    def backward(ctx, gu):
        x, weight, bias = ctx.saved_tensors
        xt, wt, b = _conv_inputs(x, weight, bias)
        gut = gu.transpose(1, 2).to(xt.dtype).contiguous()
        gx, gw, gb = _conv_bwd(xt, wt, b, gut, _K.threads())
        gw = gw.sum(0).t().reshape(weight.shape).to(weight.dtype)
        gb = gb.sum(0).to(bias.dtype) if bias is not None else None
        return gx.to(x.dtype).transpose(1, 2), gw, gb


def _conv_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """x, the conv's weight (d, 1, k) and bias as the kernel reads them: (x as (batch, L, d) with d
    contiguous, the weight as (k, d) contiguous, the bias contiguous), in the compute dtype."""
    dim, k = weight.shape[0], weight.shape[-1]
    cd = compute_dtype(x)
    xt = _channels_last(x, cd)
    wt = weight.detach().reshape(dim, k).t().contiguous().to(cd)
    b = bias.detach().to(cd).contiguous() if bias is not None else None
    return xt, wt, b


def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(depthwise causal conv1d(x)) on the fused CPU kernel: x (batch, d, L), weight (d, 1, k), bias
    (d,) or None -> (batch, d, L) in x's dtype, a view of a (batch, L, d) tensor."""
    return _ConvSiLU.apply(x, weight, bias)


def _channels_last(x: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """(batch, d, L) x as a (batch, L, d) tensor of dtype cd with d contiguous (a view when it is one)."""
    xt = cast_bdl(x, cd).transpose(1, 2)  # the scan's cast, which keeps a channel stride of 1
    return xt if xt.stride(2) == 1 else xt.contiguous()


device.defer_compiler(_conv_fwd, _conv_bwd)
