"""Mamba-1 block (Gu & Dao, 2023) on ``memfit.ops.scan.selective_scan``, and a bidirectional wrapper.

``Mamba`` follows mamba_ssm's ``Mamba`` (mamba_simple.py) layer for layer, so parameter names, shapes
and initialisation match: in_proj -> depthwise causal conv1d + SiLU -> x_proj (dt, B, C) -> dt_proj
-> selective scan with A = -exp(A_log), D and gate z -> out_proj. Parameters:
d_inner * (3*d_model + 2*dt_rank + 3*d_state + d_conv + 3) with the default biases.

``BiMamba`` runs one Mamba forward and one on the time-reversed sequence, flips the second back and
combines the two by sum or by concat + Linear(2*d_model -> d_model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfit.estimate import rules as kernels
from memfit.ops import cpu_kernel as _K
from memfit.ops import registry as probes
from memfit.ops import scan as ssm

try:  # causal-conv1d's CUDA kernel: optional, its import fails without CUDA.
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_fn
except (ImportError, OSError, RuntimeError):  # pragma: no cover - depends on the machine
    _causal_conv1d_fn = None


@dataclass
class MambaConfig:
    d_model: int
    d_state: int = 16
    d_conv: int = 4
    expand: float = 2  # d_inner = int(expand * d_model), as mamba_ssm (1.5 is common in speech models)
    dt_rank: int | str = "auto"  # "auto": ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    bias: bool = False
    conv_bias: bool = True
    chunk_size: int | None = None  # scan chunk length; None: memfit.ops.scan.auto_chunk_size
    use_kernels: bool = True  # mamba_ssm / causal-conv1d CUDA kernels when importable and on CUDA

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @property
    def rank(self) -> int:
        return math.ceil(self.d_model / 16) if self.dt_rank == "auto" else int(self.dt_rank)

    def __post_init__(self) -> None:
        for name in ("d_model", "d_state", "d_conv"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"MambaConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if isinstance(self.expand, bool) or not isinstance(self.expand, int | float) or self.expand <= 0:
            raise ValueError(f"MambaConfig.expand must be a positive number, got {self.expand!r}")
        if self.d_inner < 1:
            raise ValueError(f"MambaConfig: int(expand * d_model) must be >= 1, got {self.d_inner}")
        if self.dt_rank != "auto" and (not isinstance(self.dt_rank, int) or self.dt_rank < 1):
            raise ValueError(f"MambaConfig.dt_rank must be 'auto' or a positive int, got {self.dt_rank!r}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"MambaConfig needs 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")


def _fused_cpu(x: torch.Tensor) -> bool:
    """CPU tensors with the fused kernels built (memfit/cpu_kernel.c). Fake tensors (memory estimates)
    take it too: the conv ops' fake implementations make the outputs the kernel makes (and stand in for
    causal-conv1d's, except in a CUDA estimate for a GPU without it:
    ``memfit.estimate.rules.cuda_target_lacks``)."""
    return x.device.type == "cpu" and not kernels.cuda_target_lacks("conv") and _K.available()


# The fused depthwise causal conv1d + SiLU as torch ops, memfit::conv_fwd and memfit::conv_bwd, on the
# tensors as the kernel reads them (x channels last in the compute dtype, the weight as (k, d)), with fake
# implementations making the same outputs, and _ConvSiLU around them as memfit.ops.scan's _FusedScan is around
# the scan's ops (casts as torch ops, the block's own tensors saved for backward).


def _conv_args(xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, nthreads: int) -> _K.ConvArgs:
    batch, L, dim = xt.shape
    a = _K.ConvArgs(batch=batch, L=L, dim=dim, K=wt.shape[0], sx_b=xt.stride(0), sx_t=xt.stride(1))
    a.x, a.w, a.bias, a.nthreads = xt.data_ptr(), wt.data_ptr(), _K.ptr(bias), nthreads
    return a


@torch.library.custom_op("memfit::conv_fwd", mutates_args=(), device_types="cpu", tags=ssm.OP_TAGS)
def _conv_fwd(xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, nthreads: int) -> torch.Tensor:
    """silu(depthwise causal conv1d) of xt (batch, L, d), d contiguous, weight wt (k, d) contiguous, bias
    (d,) or None: a new (batch, L, d) tensor."""
    a = _conv_args(xt, wt, bias, nthreads)
    u = torch.empty_like(xt, memory_format=torch.contiguous_format)
    a.u = u.data_ptr()
    _K.call(f"conv_fwd_{ssm.sfx(xt.dtype)}", a)
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


@torch.library.custom_op("memfit::conv_bwd", mutates_args=(), device_types="cpu", tags=ssm.OP_TAGS)
def _conv_bwd(
    xt: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, gu: torch.Tensor, nthreads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward from the gradient gu (batch, L, d), contiguous, of the output: see _conv_bwd_outputs."""
    gx, gw, gb = _conv_bwd_outputs(xt, wt, bias, nthreads)
    a = _conv_args(xt, wt, bias, gw.shape[0])
    a.gu, a.gx, a.gw, a.gb = gu.data_ptr(), gx.data_ptr(), gw.data_ptr(), _K.ptr(bias if bias is None else gb)
    _K.call(f"conv_bwd_{ssm.sfx(xt.dtype)}", a)
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
    cd = ssm.compute_dtype(x)
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
    xt = ssm.cast_bdl(x, cd).transpose(1, 2)  # the scan's cast, which keeps a channel stride of 1
    return xt if xt.stride(2) == 1 else xt.contiguous()


class Mamba(nn.Module):
    """Mamba-1 mixer: x (batch, L, d_model) -> (batch, L, d_model), causal in L."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.config = cfg = config
        d_inner, rank, N = cfg.d_inner, cfg.rank, cfg.d_state
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=cfg.bias)
        self.conv1d = nn.Conv1d(
            d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1, bias=cfg.conv_bias
        )
        self.x_proj = nn.Linear(d_inner, rank + 2 * N, bias=False)
        self.dt_proj = nn.Linear(rank, d_inner, bias=True)
        # S4D-real: A_n = -n for every channel; stored as log so A stays negative while training
        A = torch.arange(1, N + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=cfg.bias)
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self._init_dt()

    def _init_dt(self) -> None:
        # weights keep the variance of the rank-r input; the bias makes softplus(bias) = dt, with dt
        # log-uniform in [dt_min, dt_max] (inverse softplus: dt + log(1 - exp(-dt)))
        cfg = self.config
        std = cfg.rank**-0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(
            torch.rand(cfg.d_inner) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min)
        ).clamp(min=cfg.dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.dt_proj.bias._no_reinit = True

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU: x (batch, d_inner, L)."""
        if self.config.use_kernels and probes.is_cuda(
            x
        ):  # causal-conv1d when it takes x (memfit.ops.registry)
            w = self.conv1d.weight.squeeze(1)
            if probes.use_conv(_causal_conv1d_fn, x, w, self.conv1d.bias):
                return _causal_conv1d_fn(probes.conv_layout(x), w, self.conv1d.bias, activation="silu")
        elif self.config.use_kernels and x.is_floating_point() and _fused_cpu(x):
            return conv_silu(x, self.conv1d.weight, self.conv1d.bias)
        return F.silu(self.conv1d(x)[..., : x.shape[-1]])  # left padding only: trim the look-ahead outputs

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """x (batch, L, d_model) -> (batch, L, d_model). Other keywords (e.g. inference_params) are
        accepted and ignored: there is no step-by-step decoding cache here."""
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"Mamba expects (batch, L, d_model={self.config.d_model}), got {tuple(x.shape)}")
        cfg = self.config
        # (batch, d_inner, L) views of the (batch, L, 2*d_inner) projection, split along its last dim: the
        # backward then concatenates the two gradients straight into in_proj's layout (split along the
        # transposed view's dim 1 it built a (batch, 2*d_inner, L) tensor that in_proj's matmul had to
        # copy: 13% of the MBS-Net CPU recipe's step)
        xs, z = (t.transpose(1, 2) for t in self.in_proj(x).chunk(2, dim=-1))
        xs = self._conv(xs)
        x_dbl = self.x_proj(xs.transpose(1, 2))  # (batch, L, rank + 2N)
        dt, B, C = torch.split(x_dbl, [cfg.rank, cfg.d_state, cfg.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # its bias goes in as delta_bias, in fp32
        B, C = B.transpose(1, 2), C.transpose(1, 2)  # (batch, N, L)
        A = -torch.exp(self.A_log.float())
        y = ssm.selective_scan(
            xs, dt, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            chunk_size=cfg.chunk_size, use_kernels=cfg.use_kernels,
        )  # fmt: skip
        return self.out_proj(y.transpose(1, 2))


class BiMamba(nn.Module):
    """Bidirectional Mamba: x (batch, L, d_model) -> (batch, L, d_model); every output sees all of x."""

    def __init__(self, config: MambaConfig, combine: str = "sum") -> None:
        super().__init__()
        if combine not in ("sum", "concat"):
            raise ValueError(f"BiMamba combine must be 'sum' or 'concat', got {combine!r}")
        self.combine = combine
        self.fwd = Mamba(config)
        self.bwd = Mamba(config)
        self.proj = nn.Linear(2 * config.d_model, config.d_model) if combine == "concat" else None

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """x (batch, L, d_model) -> (batch, L, d_model); keywords go to both directions."""
        y_f = self.fwd(x, **kwargs)
        y_b = self.bwd(x.flip(1), **kwargs).flip(1)
        if self.proj is None:
            return y_f + y_b
        return self.proj(torch.cat([y_f, y_b], dim=-1))
