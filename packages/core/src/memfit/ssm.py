"""Selective scan, the SSM core of Mamba-1: a plain reference and a chunked version that recomputes.

Both follow mamba_ssm's ``selective_scan_fn`` (same arguments, shapes and result)::

    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t        state (batch, dim, N)
    y_t = <C_t, h_t> + D * u_t ;   out = y * silu(z)

u, delta, z: (batch, dim, L); A: (dim, N) real; D, delta_bias: (dim,); B and C each one of
(dim, N) shared over time, (batch, N, L) per step, or (batch, groups, N, L) with dim split evenly
over the groups. ``delta_bias`` is added to delta and ``delta_softplus`` applies softplus before use.

* ``selective_scan_ref`` materialises exp(delta*A) and delta*B*u for the whole sequence,
  (batch, dim, L, N) each, and lets autograd keep every step's state: memory O(batch*dim*L*N).
* ``selective_scan`` walks the sequence in chunks inside a custom autograd Function. Forward keeps
  only the state at each chunk boundary (batch, dim, N); backward walks the chunks in reverse,
  recomputes each chunk's states from its boundary state and carries the state gradient to the previous
  chunk. Memory O(batch*dim*chunk*N + batch*dim*N*L/chunk). Inside a chunk everything except the
  recurrence itself is one vectorised op over the chunk, and the recurrence is one fused multiply-add per
  step on a contiguous (batch, dim, N) slice. On CUDA with mamba_ssm installed it calls mamba_ssm's kernel.

The scan always runs in fp32 (fp64 when u is fp64; autocast is switched off inside); the output has u's
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

try:  # mamba_ssm's fused CUDA kernel: optional, and its import fails on machines without CUDA.
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as _mamba_scan_fn
except (ImportError, OSError, RuntimeError):  # pragma: no cover - depends on the machine
    _mamba_scan_fn = None


def auto_chunk_size(batch: int, dim: int, L: int, N: int) -> int:
    """The chunk length ``selective_scan`` uses when none is given (measured with tools/bench_scan.py).

    Memory beyond the unavoidable (batch, dim, L) tensors is about 3 chunk buffers plus one state per
    chunk, 3*T + L/T states, least at T ~ sqrt(L/3); at batch 60, L 200, dim 256, N 16, T = 8 was also the
    fastest on CPU (0.80 s vs 0.83 s at 16 and 0.98 s at 64). When the whole (batch, dim, L, N) tensor is
    small, memory does not matter and longer chunks save per-chunk Python overhead (T = 64 was 30% faster
    than 8 at batch 4, dim 128, L 256).
    """
    if batch * dim * L * N * 4 < 32 * 2**20:
        return 64
    return max(8, min(64, 8 * round((L / 3) ** 0.5 / 8)))


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


def _check_args(u, delta, A, B, C, D, z, delta_bias) -> tuple[int, int, int, int]:
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


def _compute_dtype(u: torch.Tensor) -> torch.dtype:
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
    batch, dim, L, N = _check_args(u, delta, A, B, C, D, z, delta_bias)
    dtype_in = u.dtype
    cd = _compute_dtype(u)
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


# ----------------------------------------------------------------------------------------------------
# Chunked scan
# ----------------------------------------------------------------------------------------------------
# Inside a chunk everything is time-major: (T, batch, dim) and (T, batch, dim, N), so step t is one
# contiguous slice. Variable B/C are held time-major as (L, batch, G, N) (per-step is G = 1) and the dim
# axis is viewed as (G, dim // G) where they meet; shared B/C stay (dim, N).


def _time_major_bc(X: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    if X.dim() == 2:
        return X.to(cd)
    if X.dim() == 3:
        X = X.unsqueeze(1)
    return X.to(cd).permute(3, 0, 1, 2).contiguous()


def _bc_times(w: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (T, b, d, N) = w (T, b, d) times a B/C chunk; variable B/C as a batched outer product."""
    if X.dim() == 2:
        return torch.mul(w.unsqueeze(-1), X, out=out)
    T, b, d = w.shape
    G, N = X.shape[2], X.shape[3]
    torch.bmm(w.reshape(T * b * G, d // G, 1), X.reshape(T * b * G, 1, N), out=out.view(T * b * G, d // G, N))
    return out


def _contract_n(Y: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """sum_n Y * X: Y (T, b, d, N) with a B/C chunk (or A) -> (T, b, d)."""
    if X.dim() == 2:
        return torch.einsum("tbdn,dn->tbd", Y, X)
    T, b, d, N = Y.shape
    G = X.shape[2]
    return torch.bmm(Y.view(T * b * G, d // G, N), X.reshape(T * b * G, N, 1)).view(T, b, d)


def _contract_d(Y: torch.Tensor, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Gradient of a B/C chunk X from Y (T, b, d, N) weighted by w (T, b, d), summed where X is shared."""
    T, b, d, N = Y.shape
    if X.dim() == 2:
        return (Y * w.unsqueeze(-1)).view(T * b, d, N).sum(0)
    G = X.shape[2]
    return torch.bmm(w.reshape(T * b * G, 1, d // G), Y.view(T * b * G, d // G, N)).view(T, b, G, N)


def _time_major(x: torch.Tensor, s: int, e: int, cd: torch.dtype) -> torch.Tensor:
    return x[:, :, s:e].to(cd).permute(2, 0, 1).contiguous()


def _chunk_delta(delta, delta_bias, softplus, s, e, cd):
    """(T, b, d) raw delta (+ bias) and the delta the scan uses (softplus applied when asked)."""
    raw = _time_major(delta, s, e, cd)
    if delta_bias is not None:
        raw = raw + delta_bias.to(cd)
    return raw, (F.softplus(raw) if softplus else raw)


def _chunk_states(dt, dtu, A, Bc, h0, decay, H):
    """Fill decay = exp(dt*A) and H = the states after every step of the chunk (both (T, b, d, N)),
    starting from h0 (None: zeros)."""
    torch.mul(dt.unsqueeze(-1), A, out=decay).exp_()
    _bc_times(dtu, Bc, out=H)  # the inputs delta*B*u, turned into states in place
    if _is_fake(H):
        return  # the recurrence is in place: it allocates nothing, so memory estimates can skip it
    if h0 is not None:
        H[0].addcmul_(decay[0], h0)
    for t in range(1, H.shape[0]):
        H[t].addcmul_(decay[t], H[t - 1])


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def _bc_chunk(X: torch.Tensor, s: int, e: int) -> torch.Tensor:
    return X if X.dim() == 2 else X[s:e]


def _chunks(n_chunks: int, fake: bool) -> list[int]:
    """Chunks to run. Every chunk allocates and frees the same temporaries (into reused buffers), so on
    fake tensors, where only allocations matter, the first two and the last (maybe shorter) chunk give
    the same peak as all of them, at a fraction of the estimate's time."""
    if not fake:
        return list(range(n_chunks))
    return sorted({0, min(1, n_chunks - 1), n_chunks - 1})


class _ChunkedScan(torch.autograd.Function):
    # Work buffers of one chunk, (T, batch, dim, N), are allocated once per call and reused by every
    # chunk: fresh multi-MB allocations per chunk cost page faults that were a third of the time on CPU.

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_size):
        with torch.autocast(device_type=u.device.type, enabled=False):
            batch, dim, L = u.shape
            N = A.shape[1]
            T = min(chunk_size, L)
            n_chunks = (L + T - 1) // T
            cd = _compute_dtype(u)
            Af = A.to(cd)
            Bt, Ct = _time_major_bc(B, cd), _time_major_bc(C, cd)
            y = u.new_empty((batch, dim, L), dtype=cd)
            # state entering chunk c, for c >= 1 (chunk 0 starts from zeros)
            starts = u.new_empty((n_chunks - 1, batch, dim, N), dtype=cd)
            decay_buf = u.new_empty((T, batch, dim, N), dtype=cd)
            H_buf = torch.empty_like(decay_buf)
            h = None
            for c in _chunks(n_chunks, _is_fake(u)):
                s, e = c * T, min(L, (c + 1) * T)
                decay, H = decay_buf[: e - s], H_buf[: e - s]
                _, dt = _chunk_delta(delta, delta_bias, delta_softplus, s, e, cd)
                _chunk_states(dt, dt * _time_major(u, s, e, cd), Af, _bc_chunk(Bt, s, e), h, decay, H)
                y[:, :, s:e] = _contract_n(H, _bc_chunk(Ct, s, e)).permute(1, 2, 0)
                if c < n_chunks - 1:
                    starts[c] = H[-1]
                    h = starts[c]
            last = H[-1].clone()
            del decay_buf, H_buf, decay, H
            # in place on y: the whole-sequence tensors are the forward's largest
            if D is not None:
                y.addcmul_(u.to(cd), D.to(cd)[:, None])
            if z is not None:
                y.mul_(F.silu(z.to(cd)))
        ctx.delta_softplus = delta_softplus
        ctx.chunk_size = T
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, starts)
        ctx.set_materialize_grads(False)
        return y.to(u.dtype), last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, starts = ctx.saved_tensors
        with torch.autocast(device_type=u.device.type, enabled=False):
            batch, dim, L = u.shape
            N = A.shape[1]
            T = ctx.chunk_size
            n_chunks = (L + T - 1) // T
            cd = _compute_dtype(u)
            fp = dict(dtype=cd, device=u.device)
            Af = A.to(cd)
            Df = D.to(cd) if D is not None else None
            Bt, Ct = _time_major_bc(B, cd), _time_major_bc(C, cd)
            if dout is None:
                dout = torch.zeros_like(u)
            du = torch.empty((batch, dim, L), **fp)
            ddelta = torch.empty((batch, dim, L), **fp)
            dz = torch.empty((batch, dim, L), **fp) if z is not None else None
            dA = torch.zeros_like(Af)
            dB = torch.zeros_like(Bt)
            dC = torch.zeros_like(Ct)
            dD = torch.zeros_like(Df) if D is not None else None
            dbias = torch.zeros((dim,), **fp) if delta_bias is not None else None
            decay_buf = torch.empty((T, batch, dim, N), **fp)
            H_buf = torch.empty_like(decay_buf)
            G_buf = torch.empty_like(decay_buf)
            # gradient w.r.t. the state leaving the current chunk, from the chunks after it
            carry = dlast.to(cd) if dlast is not None else None
            for c in reversed(_chunks(n_chunks, _is_fake(u))):
                s, e = c * T, min(L, (c + 1) * T)
                decay, H, Gs = decay_buf[: e - s], H_buf[: e - s], G_buf[: e - s]
                Bc, Cc = _bc_chunk(Bt, s, e), _bc_chunk(Ct, s, e)
                h0 = starts[c - 1] if c > 0 else None
                raw, dt = _chunk_delta(delta, delta_bias, ctx.delta_softplus, s, e, cd)
                uc = _time_major(u, s, e, cd)
                dtu = dt * uc
                _chunk_states(dt, dtu, Af, Bc, h0, decay, H)

                dy = _time_major(dout, s, e, cd)
                if z is not None:
                    zc = _time_major(z, s, e, cd)
                    yc = _contract_n(H, Cc)
                    if Df is not None:
                        yc = yc + uc * Df
                    sz = torch.sigmoid(zc)
                    dz[:, :, s:e] = (dy * yc * sz * (1 + zc * (1 - sz))).permute(1, 2, 0)
                    dy = dy * zc * sz
                if Df is not None:
                    dD += (dy * uc).sum((0, 1))
                    duc = dy * Df
                else:
                    duc = torch.zeros_like(dy)
                if C.dim() == 2:
                    dC += _contract_d(H, dy, Cc)
                else:
                    dC[s:e] = _contract_d(H, dy, Cc)

                # state gradients: g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}, run backwards in place
                _bc_times(dy, Cc, out=Gs)
                if carry is not None:
                    Gs[-1] += carry
                if not _is_fake(Gs):  # in place, allocates nothing: estimates skip it
                    for t in range(Gs.shape[0] - 2, -1, -1):
                        Gs[t].addcmul_(decay[t + 1], Gs[t + 1])
                if c > 0:
                    carry = decay[0] * Gs[0]

                # the inputs delta*B*u receive g_t directly
                W = _contract_n(Gs, Bc)
                ddt = W * uc
                duc += W * dt
                if B.dim() == 2:
                    dB += _contract_d(Gs, dtu, Bc)
                else:
                    dB[s:e] = _contract_d(Gs, dtu, Bc)
                # the decays exp(dt*A) receive g_t * h_{t-1}; P = that times the decay = grad of dt*A
                P = decay.mul_(Gs)
                P[1:].mul_(H[:-1])
                if h0 is not None:
                    P[0].mul_(h0)
                else:
                    P[0].zero_()
                ddt += _contract_n(P, Af)
                dA += P.mul_(dt.unsqueeze(-1)).view(-1, dim, N).sum(0)
                if ctx.delta_softplus:
                    ddt = ddt * torch.sigmoid(raw)
                if dbias is not None:
                    dbias += ddt.sum((0, 1))
                ddelta[:, :, s:e] = ddt.permute(1, 2, 0)
                du[:, :, s:e] = duc.permute(1, 2, 0)
            del decay_buf, H_buf, G_buf, decay, H, Gs, P

            if B.dim() == 3:
                dB = dB.squeeze(2).permute(1, 2, 0)
            elif B.dim() == 4:
                dB = dB.permute(1, 2, 3, 0)
            if C.dim() == 3:
                dC = dC.squeeze(2).permute(1, 2, 0)
            elif C.dim() == 4:
                dC = dC.permute(1, 2, 3, 0)

        def cast(g, like):
            return None if g is None or like is None else g.to(like.dtype)

        return (
            cast(du, u),
            cast(ddelta, delta),
            cast(dA, A),
            cast(dB.contiguous(), B),
            cast(dC.contiguous(), C),
            cast(dD, D),
            cast(dz, z),
            cast(dbias, delta_bias),
            None,
            None,
        )


def _use_mamba_kernel(u: torch.Tensor) -> bool:
    return _mamba_scan_fn is not None and u.is_cuda and not _is_fake(u)


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    *,
    chunk_size=None,
    use_kernels=True,
):
    """Chunked recomputing scan: u, delta (batch, dim, L) -> out (batch, dim, L) [, last (batch, dim, N)].

    Same arguments and result as mamba_ssm's ``selective_scan_fn``; ``chunk_size`` steps per chunk bound
    the memory (None: ``auto_chunk_size``); ``use_kernels=False`` keeps mamba_ssm's CUDA kernel out. Unlike
    mamba_ssm's, the gradient of ``last_state`` propagates.
    """
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"selective_scan: chunk_size must be a positive int or None, got {chunk_size!r}")
    batch, dim, L, N = _check_args(u, delta, A, B, C, D, z, delta_bias)
    if chunk_size is None:
        chunk_size = auto_chunk_size(batch, dim, L, N)
    if use_kernels and _use_mamba_kernel(u):
        return _mamba_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    out, last = _ChunkedScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk_size)
    return (out, last) if return_last_state else out
