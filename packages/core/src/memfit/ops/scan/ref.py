"""The selective scan's argument checks and its plain reference (Mamba-1's SSM core, as mamba_ssm's
``selective_scan_fn``)::

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t        state (batch, dim, N)
    y_t = <C_t, h_t> + D * u_t ;   out = y * silu(z)

u, delta, z: (batch, dim, L); A: (dim, N) real; D, delta_bias: (dim,); B and C each one of
(dim, N) shared over time, (batch, N, L) per step, or (batch, groups, N, L) with dim split evenly
over the groups. ``delta_bias`` is added to delta and ``delta_softplus`` applies softplus before use.

``selective_scan_ref`` materialises exp(delta*A) and delta*B*u for the whole sequence, (batch, dim, L, N)
each, and lets autograd keep every step's state: memory O(batch*dim*L*N). Every implementation in this
folder is tested against it, and ``probe`` checks a kernel against it on the device before first use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------
# Argument checks (shapes only, so they also run on fake tensors)
# ----------------------------------------------------------------------------------------------------


def _check_bc(X: torch.Tensor, name: str, batch: int, dim: int, N: int, L: int) -> None:
    shape = tuple(X.shape)
    if X.dim() == 2 and shape == (dim, N):
        return
    if X.dim() == 3 and shape == (batch, N, L):
        return
    if X.dim() == 4 and shape[0] == batch and shape[2:] == (N, L) and shape[1] > 0 and dim % shape[1] == 0:
        return
    raise ValueError(
        f"selective_scan: {name} has shape {shape}; expected ({dim}, {N}) shared, ({batch}, {N}, {L}) per "
        f"step, or ({batch}, groups, {N}, {L}) with groups dividing dim={dim}"
    )


def check_args(u, delta, A, B, C, D, z, delta_bias) -> tuple[int, int, int, int]:
    if u.dim() != 3:
        raise ValueError(f"selective_scan: u must be (batch, dim, L), got shape {tuple(u.shape)}")
    batch, dim, L = u.shape
    if L == 0:
        raise ValueError("selective_scan: empty sequence (L == 0); pass at least one step")
    if tuple(delta.shape) != tuple(u.shape):
        raise ValueError(
            f"selective_scan: delta has shape {tuple(delta.shape)}, must equal u's {tuple(u.shape)}"
        )
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"selective_scan: A must be (dim={dim}, N), got shape {tuple(A.shape)}")
    if A.is_complex():
        raise ValueError(
            "selective_scan: complex A is not supported; pass a real A (Mamba's A = -exp(A_log))"
        )
    N = A.shape[1]
    _check_bc(B, "B", batch, dim, N, L)
    _check_bc(C, "C", batch, dim, N, L)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and tuple(t.shape) != (dim,):
            raise ValueError(f"selective_scan: {name} must be (dim={dim},), got shape {tuple(t.shape)}")
    if z is not None and tuple(z.shape) != tuple(u.shape):
        raise ValueError(f"selective_scan: z has shape {tuple(z.shape)}, must equal u's {tuple(u.shape)}")
    return batch, dim, L, N


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------


def compute_dtype(u: torch.Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _bc_per_channel(X: torch.Tensor, dim: int) -> torch.Tensor:
    """Variable B/C as (batch, dim, N, L): per-step (batch, N, L) or grouped (batch, G, N, L)."""
    if X.dim() == 3:
        return X.unsqueeze(1).expand(-1, dim, -1, -1)
    return X.repeat_interleave(dim // X.shape[1], dim=1)


def selective_scan_ref(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False
):
    """Plain materialising scan: u, delta (batch, dim, L) -> out (batch, dim, L) [, last (batch, dim, N)]."""
    batch, dim, L, N = check_args(u, delta, A, B, C, D, z, delta_bias)
    dtype_in = u.dtype
    cd = compute_dtype(u)
    u, delta, A = u.to(cd), delta.to(cd), A.to(cd)
    if delta_bias is not None:
        delta = delta + delta_bias.to(cd)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    dA = torch.exp(delta.unsqueeze(-1) * A[:, None, :])  # (batch, dim, L, N)
    du = delta * u
    if B.dim() == 2:
        dBu = du.unsqueeze(-1) * B.to(cd)[:, None, :]
    else:
        dBu = du.unsqueeze(-1) * _bc_per_channel(B.to(cd), dim).transpose(2, 3)
    Cf = C.to(cd) if C.dim() == 2 else _bc_per_channel(C.to(cd), dim)
    # unbind, not dA[:, :, t]: autograd would turn each indexed step into a full-size zero gradient
    # (quadratic time in L); unbind's backward stacks the step gradients once.
    dA_t, dBu_t = dA.unbind(2), dBu.unbind(2)
    C_t = [Cf] * L if C.dim() == 2 else Cf.unbind(3)
    h = u.new_zeros(batch, dim, N)
    ys = []
    for t in range(L):
        h = dA_t[t] * h + dBu_t[t]
        ys.append((h * C_t[t]).sum(-1))
    out = torch.stack(ys, dim=-1)
    if D is not None:
        out = out + u * D.to(cd)[:, None]
    if z is not None:
        out = out * F.silu(z.to(cd))
    out = out.to(dtype_in)
    return (out, h) if return_last_state else out


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself when it has it. An autograd.Function's forward must return its outputs this way,
    not as ``x.to(dtype)``: under torch.compile, dynamo records the no-op ``to`` as a second node, and at run
    time the function then returns one tensor object as both the output and a saved intermediate; autograd
    keeps the last of the two, so the output's gradient arrives in the intermediate's slot and the output's
    own backward sees none (every gradient below the scan zero, torch 2.11)."""
    return x if x.dtype == dtype else x.to(dtype)


def probe(fn, device: torch.device) -> tuple[bool, str]:
    """One tiny call of a scan implementation ``fn`` (the registry's calling convention) on ``device``,
    forward and the gradient of u, against the reference: (ok, detail)."""
    g = torch.Generator(device=device).manual_seed(0)  # a private generator: the run's RNG does not move
    batch, dim, L, N = 2, 8, 37, 4

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device) * scale

    u, delta, z = r(batch, dim, L), r(batch, dim, L, scale=0.5), r(batch, dim, L)
    A = -torch.rand(dim, N, generator=g, device=device) - 0.5
    B, C, D, bias = r(batch, N, L), r(batch, N, L), r(dim), r(dim, scale=0.1)
    u.requires_grad_(True)
    out = fn(u, delta, A, B, C, D, z, bias, True, False, None)
    (gu,) = torch.autograd.grad(out.float().sum(), u)
    u_ref = u.detach().requires_grad_(True)
    want = selective_scan_ref(u_ref, delta, A, B, C, D, z, bias, True)
    (gu_ref,) = torch.autograd.grad(want.sum(), u_ref)
    return compare([out, gu], [want, gu_ref], 1e-3)


def compare(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> tuple[bool, str]:
    """(ok, detail) of tensors against their references: shapes equal, relative max error <= tol."""
    worst = 0.0
    for a, b in zip(got, want):
        a, b = a.float(), b.float()
        if a.shape != b.shape:
            return False, f"shape {tuple(a.shape)} instead of {tuple(b.shape)}"
        err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
        if not math.isfinite(err) or err > tol:
            return False, f"differs from the PyTorch path (relative max error {err:.2g} > {tol:g})"
        worst = max(worst, err)
    return True, f"matches the PyTorch path (relative max error {worst:.1g})"
