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

from memfit.ops import conv, scan


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
        return conv.causal_conv_silu(x, self.conv1d.weight, self.conv1d.bias, kernels=self.config.use_kernels)

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
        y = scan.selective_scan(
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
