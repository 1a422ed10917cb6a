"""The seed's Mamba, kept as the memory baseline (`scan="materialise"`), out of the model file.

Same parameters as mamba_ssm's block; its selective scan materialises (b, L, d, n) tensors and loops
over L, which is what ran out of memory at batch 2. ``memfit budget`` measures it against ours.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def materialising_scan(u, delta, A, B, C, D):
    """The seed's real_mamba scan. u, delta (b, L, d); A (d, n); B, C (b, L, n); D (d) -> y (b, L, d).

    Builds exp(delta*A) and delta*B*u for the whole sequence, (b, L, d, n) each, then loops over L;
    autograd keeps every step's state too. This is what ran out of memory at batch 2.
    """
    dA = torch.exp(delta.unsqueeze(-1) * A)  # (b, L, d, n)
    dBu = delta.unsqueeze(-1) * B.unsqueeze(2) * u.unsqueeze(-1)  # (b, L, d, n)
    h = torch.zeros_like(dA[:, 0])
    ys = []
    for t in range(u.shape[1]):
        h = dA[:, t] * h + dBu[:, t]
        ys.append((h * C[:, t].unsqueeze(1)).sum(-1))
    return torch.stack(ys, dim=1) + u * D


class SeedMamba(nn.Module):
    """Mamba-1 block with the materialising scan; (b, L, d_model) -> (b, L, d_model)."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: float = 2.0) -> None:
        super().__init__()
        self.d_inner = d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float()).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        with torch.no_grad():  # dt in [1e-3, 1e-1] at init, as mamba_ssm
            dt = torch.exp(torch.rand(d_inner) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        L = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv1d(u.transpose(1, 2))[..., :L].transpose(1, 2))
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        y = materialising_scan(u, dt, -torch.exp(self.A_log), B, C, self.D)
        return self.out_proj(y * F.silu(z))


class SeedBiMamba(nn.Module):
    """The seed's BidirectionalMambaBlock: a forward and a time-reversed SeedMamba, summed."""

    def __init__(self, d_model: int, **kw) -> None:
        super().__init__()
        self.fwd = SeedMamba(d_model, **kw)
        self.bwd = SeedMamba(d_model, **kw)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.fwd(x) + self.bwd(x.flip(1)).flip(1)
