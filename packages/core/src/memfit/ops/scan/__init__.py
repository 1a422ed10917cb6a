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
  On CPU it runs the same chunked recompute scheme fused in C (cpu_kernel.c, compiled on first use;
  without a C compiler the torch-op path runs): the state stays in registers (per channel block as N lane
  vectors when the layout is a Mamba block's, else per (batch, dim) sequence as an N-vector), so neither
  direction has chunk buffers, and softplus, D and the gate are fused in too.

The scan always runs in fp32 (fp64 when u is fp64; autocast is switched off inside); the output has u's
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.estimate import rules as kernels
from memfit.ops import cpu_kernel as _K
from memfit.ops import registry as probes

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
    batch, dim, L, N = _check_args(u, delta, A, B, C, D, z, delta_bias)
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


# ----------------------------------------------------------------------------------------------------
# Chunked scan
# ----------------------------------------------------------------------------------------------------
# Layout. Per-step (batch, dim, L) tensors are read and written as (batch, L, dim) ("channels last"):
# a chunk is x[:, s:e] and the innermost axis is the long dim axis. A Mamba block's delta, z and the
# output's gradient already are (batch, L, dim) tensors seen transposed, so reading them costs nothing,
# and the outputs (y, and the gradients of u, delta and z) are returned as transposed views of
# (batch, L, dim) tensors, which is the layout the Linear layers around the scan use. A chunk's states
# are (batch, T, N, dim): elementwise ops vectorise over dim, step t is H[:, t], and the contraction
# over N with per-step B/C is one batched (1 x N) @ (N x dim) product. B/C are held in a form that
# broadcasts against it: per-step (batch, L, N, 1); grouped (batch, L, N, G, 1) against the state
# viewed (.., N, G, dim // G); shared (N, dim).
#
# The decays exp(delta * A) are computed as exp2(delta * A * log2(e)): torch's exp2 is ~3-5x faster
# than its exp on CPU, and the one extra rounding (of A * log2(e)) is far below the fp32 tolerance.

_LOG2E = 1.4426950408889634


class _BC:
    """One of B/C prepared for the chunked scan (see the layout note above)."""

    def __init__(self, t: torch.Tensor):
        """From a tensor in this layout (``prepare``): (N, dim), (batch, L, N, 1) or (batch, L, N, G, 1)."""
        self.t = t
        self.kind = {2: "shared", 4: "step", 5: "group"}[t.dim()]
        self.G = t.shape[3] if self.kind == "group" else 1

    @classmethod
    def prepare(cls, X: torch.Tensor, cd: torch.dtype) -> _BC:
        """From the scan's argument: shared (dim, N), per-step (batch, N, L) or grouped (batch, G, N, L)."""
        if X.dim() == 2:
            return cls(X.to(cd).t().contiguous())  # (N, dim)
        if X.dim() == 3:
            return cls(X.to(cd).transpose(1, 2).contiguous().unsqueeze(-1))  # (batch, L, N, 1)
        return cls(X.to(cd).permute(0, 3, 2, 1).contiguous().unsqueeze(-1))  # (batch, L, N, G, 1)

    def chunk(self, s: int, e: int) -> torch.Tensor:
        return self.t if self.kind == "shared" else self.t[:, s:e]

    def _split(self, Y: torch.Tensor) -> torch.Tensor:
        """(b, T, N, dim) viewed as (b, T, N, G, dim // G) for grouped B/C; unchanged otherwise."""
        return Y if self.kind != "group" else Y.unflatten(-1, (self.G, -1))

    def times(self, w: torch.Tensor, Xc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (b, T, N, dim) = w (b, T, dim) times the chunk Xc, for every state entry."""
        torch.mul(self._split(w.unsqueeze(2)), Xc, out=self._split(out))
        return out

    def contract_n(self, Y: torch.Tensor, Xc: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """sum_n Y * Xc: Y (b, T, N, dim) -> (b, T, dim) (written into ``out`` when given)."""
        if self.kind == "step" and out is not None:
            torch.matmul(Xc.transpose(-1, -2), Y, out=out.unsqueeze(2))
            return out
        if self.kind == "step":
            return torch.matmul(Xc.transpose(-1, -2), Y).squeeze(2)
        r = (self._split(Y) * Xc).sum(2).flatten(2)
        return r if out is None else out.copy_(r)

    def contract_d(self, Y: torch.Tensor, w: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
        """Gradient of the chunk from Y (b, T, N, dim) weighted by w (b, T, dim): the chunk's shape for
        per-step/grouped B/C, (N, dim) summed over the chunk for shared. ``tmp``: a free buffer of Y's
        shape (a batched matrix-vector product was ~6x slower here than a multiply and a sum)."""
        prod = self._split(torch.mul(Y, w.unsqueeze(2), out=tmp))
        return prod.sum((0, 1)) if self.kind == "shared" else prod.sum(-1, keepdim=True)

    def grad_layout(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient held in this layout, back in the argument's layout."""
        if self.kind == "shared":
            return g.t().contiguous()
        if self.kind == "step":
            return g.squeeze(-1).transpose(1, 2).contiguous()
        return g.squeeze(-1).permute(0, 3, 2, 1).contiguous()


def _chunk_of(x: torch.Tensor, s: int, e: int, cd: torch.dtype) -> torch.Tensor:
    """Steps s..e of a (batch, dim, L) tensor as (batch, T, dim) with dim contiguous, compute dtype:
    a view when x already is a transposed (batch, L, dim) tensor, else a copy of the chunk only."""
    c = x.transpose(1, 2)[:, s:e].to(cd)
    return c if c.stride(-1) == 1 else c.contiguous()


def _new_bld(like: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """An empty (batch, L, dim) tensor for a (batch, dim, L) result (returned as its transpose)."""
    batch, dim, L = like.shape
    return like.new_empty((batch, L, dim), dtype=cd)


def _chunk_delta(delta, delta_bias, softplus, s, e, cd):
    """(b, T, dim) raw delta (+ bias) and the delta the scan uses (softplus when asked)."""
    raw = _chunk_of(delta, s, e, cd)
    if delta_bias is not None:
        raw = raw + delta_bias.to(cd)
    return raw, (F.softplus(raw) if softplus else raw)


# The recurrences inside a chunk, one fused multiply-add per step, are ops of their own: they write into
# their first argument in place and allocate nothing, so their fake implementations do nothing and a memory
# estimate does not walk T Python steps per chunk on fake tensors.


@torch.library.custom_op("memfit::chunk_states_", mutates_args=("H",))
def _chunk_recurrence(H: torch.Tensor, decay: torch.Tensor, h0: torch.Tensor | None) -> None:
    """H (b, T, N, dim) holds a chunk's inputs delta*B*u; make it the states: h_t = decay_t * h_{t-1} + H_t
    from h0 (b, N, dim) (None: zeros)."""
    if h0 is not None:
        H[:, 0].addcmul_(decay[:, 0], h0)
    for t in range(1, H.shape[1]):
        H[:, t].addcmul_(decay[:, t], H[:, t - 1])


@_chunk_recurrence.register_fake
def _(H, decay, h0):
    return None


@torch.library.custom_op("memfit::chunk_state_grads_", mutates_args=("G",))
def _chunk_grad_recurrence(G: torch.Tensor, decay: torch.Tensor) -> None:
    """G (b, T, N, dim) holds C_t dy_t (plus the carry at the last step); make it the state gradients:
    g_t = G_t + decay_{t+1} * g_{t+1}, backwards."""
    for t in range(G.shape[1] - 2, -1, -1):
        G[:, t].addcmul_(decay[:, t + 1], G[:, t + 1])


@_chunk_grad_recurrence.register_fake
def _(G, decay):
    return None


def _chunk_states(dt, dtu, At2, Bc, bc, h0, decay, H):
    """Fill decay = exp(dt * A) and H = the states after every step of the chunk (both (b, T, N, dim)),
    starting from h0 (None: zeros). At2 is A * log2(e) as (N, dim)."""
    torch.mul(dt.unsqueeze(2), At2, out=decay)
    torch.exp2(decay, out=decay)
    bc.times(dtu, Bc, out=H)  # the inputs delta*B*u, turned into states in place
    _chunk_recurrence(H, decay, h0)


def _head(buf: torch.Tensor, T: int) -> torch.Tensor:
    """The first T steps of a (batch, T_max, N, dim) chunk buffer as a contiguous (batch, T, N, dim) tensor
    (a shorter last chunk must not be a strided slice: ops writing into one would allocate a copy)."""
    b, _, N, dim = buf.shape
    return buf.view(-1)[: b * T * N * dim].view(b, T, N, dim)


def _chunk_plan(n_chunks: int) -> tuple[range, range, range]:
    """The chunks in forward order as (first, middle, last): the first two and the last (maybe shorter)
    chunk run here, the middle ones (2 .. n_chunks - 2) in one op (memfit::chunked_scan_fwd_ / _bwd_).
    Every middle chunk allocates and frees the same temporaries as chunk 1 and writes only into buffers
    made before it, so the ops' fake implementations run none of them: a memory estimate sees the same
    peak as with all of them, at a fraction of its time."""
    return range(min(2, n_chunks)), range(2, max(2, n_chunks - 1)), range(max(2, n_chunks - 1), n_chunks)


def _fwd_chunk(c, u, delta, delta_bias, softplus, At2, Bb, Cb, y, starts, decay_buf, H_buf) -> None:
    """Forward of chunk c: its outputs into y (batch, L, dim) and the state leaving it into starts[c]
    (the last chunk's stays in H_buf); it starts from starts[c - 1] (chunk 0: zeros)."""
    T, L, cd = decay_buf.shape[1], u.shape[2], At2.dtype
    s, e = c * T, min(L, (c + 1) * T)
    decay, H = _head(decay_buf, e - s), _head(H_buf, e - s)
    _, dt = _chunk_delta(delta, delta_bias, softplus, s, e, cd)
    dtu = dt * _chunk_of(u, s, e, cd)
    _chunk_states(dt, dtu, At2, Bb.chunk(s, e), Bb, starts[c - 1] if c > 0 else None, decay, H)
    Cb.contract_n(H, Cb.chunk(s, e), out=y[:, s:e])
    if c < starts.shape[0]:
        starts[c] = H[:, -1]


_FWD_MUTATES = ("y", "starts", "decay_buf", "H_buf")


@torch.library.custom_op("memfit::chunked_scan_fwd_", mutates_args=_FWD_MUTATES)
def _fwd_chunks(
    first: int, stop: int, u: torch.Tensor, delta: torch.Tensor, delta_bias: torch.Tensor | None,
    softplus: bool, At2: torch.Tensor, B: torch.Tensor, C: torch.Tensor, y: torch.Tensor,
    starts: torch.Tensor, decay_buf: torch.Tensor, H_buf: torch.Tensor,
) -> None:  # fmt: skip
    """_fwd_chunk for each of the chunks [first, stop) in order; B and C in _BC's layout."""
    Bb, Cb = _BC(B), _BC(C)
    for c in range(first, stop):
        _fwd_chunk(c, u, delta, delta_bias, softplus, At2, Bb, Cb, y, starts, decay_buf, H_buf)


@_fwd_chunks.register_fake
def _(first, stop, u, delta, delta_bias, softplus, At2, B, C, y, starts, decay_buf, H_buf):
    return None  # allocations as chunk 1's, all freed, writes into the buffers only: see _chunk_plan


def _bwd_chunk(
    c, u, delta, delta_bias, z, dout, starts, softplus, At, At2, Df, Bb, Cb,
    du, ddelta, dz, dA, dB, dC, dD, dbias, decay_buf, H_buf, G_buf, carry,
):  # fmt: skip
    """Backward of chunk c: recompute its states from starts[c - 1], add its gradients into du, ddelta, dz
    (its steps) and dA, dB, dC, dD, dbias, from ``carry``, the gradient w.r.t. the state leaving it (None:
    zero); return the gradient w.r.t. the state entering it (None for chunk 0)."""
    T, L, cd = decay_buf.shape[1], u.shape[2], At.dtype
    s, e = c * T, min(L, (c + 1) * T)
    decay, H, Gs = (_head(b, e - s) for b in (decay_buf, H_buf, G_buf))
    Bc, Cc = Bb.chunk(s, e), Cb.chunk(s, e)
    h0 = starts[c - 1] if c > 0 else None
    raw, dt = _chunk_delta(delta, delta_bias, softplus, s, e, cd)
    uc = _chunk_of(u, s, e, cd)
    dtu = dt * uc
    _chunk_states(dt, dtu, At2, Bc, Bb, h0, decay, H)

    dy = _chunk_of(dout, s, e, cd)
    if z is not None:
        zc = _chunk_of(z, s, e, cd)
        yc = Cb.contract_n(H, Cc)
        if Df is not None:
            yc.addcmul_(uc, Df)
        sz = torch.sigmoid(zc)
        torch.mul(dy * yc, sz * (1 + zc * (1 - sz)), out=dz[:, s:e])
        dy = dy * zc * sz
    if Df is not None:
        dD += (dy * uc).sum((0, 1))
        torch.mul(dy, Df, out=du[:, s:e])
    else:
        du[:, s:e].zero_()
    if Cb.kind == "shared":  # Gs is free until the state gradients are made
        dC += Cb.contract_d(H, dy, Gs)
    else:
        dC[:, s:e] = Cb.contract_d(H, dy, Gs)

    # state gradients: g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}, run backwards in place
    Cb.times(dy, Cc, out=Gs)
    if carry is not None:
        Gs[:, -1] += carry
    _chunk_grad_recurrence(Gs, decay)
    carry = decay[:, 0] * Gs[:, 0] if c > 0 else None

    # the inputs delta*B*u receive g_t directly
    W = Bb.contract_n(Gs, Bc)
    ddt = W * uc
    du[:, s:e].addcmul_(W, dt)
    # the decays exp(dt*A) receive g_t * h_{t-1}; P = that times the decay = grad of dt*A
    P = decay.mul_(Gs)
    P[:, 1:].mul_(H[:, :-1])
    if h0 is not None:
        P[:, 0].mul_(h0)
    else:
        P[:, 0].zero_()
    # H is free from here on, then Gs
    if Bb.kind == "shared":
        dB += Bb.contract_d(Gs, dtu, H)
    else:
        dB[:, s:e] = Bb.contract_d(Gs, dtu, H)
    ddt += torch.mul(P, At, out=Gs).sum(2)
    dA += P.mul_(dt.unsqueeze(2)).sum((0, 1))
    if softplus:
        ddt.mul_(torch.sigmoid(raw))
    if dbias is not None:
        dbias += ddt.sum((0, 1))
    ddelta[:, s:e] = ddt
    return carry


_BWD_MUTATES = ("du", "ddelta", "dz", "dA", "dB", "dC", "dD", "dbias", "decay_buf", "H_buf", "G_buf")


@torch.library.custom_op("memfit::chunked_scan_bwd_", mutates_args=_BWD_MUTATES)
def _bwd_chunks(
    first: int, stop: int, u: torch.Tensor, delta: torch.Tensor, delta_bias: torch.Tensor | None,
    z: torch.Tensor | None, dout: torch.Tensor, starts: torch.Tensor, softplus: bool, At: torch.Tensor,
    At2: torch.Tensor, D: torch.Tensor | None, B: torch.Tensor, C: torch.Tensor, du: torch.Tensor,
    ddelta: torch.Tensor, dz: torch.Tensor | None, dA: torch.Tensor, dB: torch.Tensor, dC: torch.Tensor,
    dD: torch.Tensor | None, dbias: torch.Tensor | None, decay_buf: torch.Tensor, H_buf: torch.Tensor,
    G_buf: torch.Tensor, carry: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """_bwd_chunk for each of the chunks [first, stop) in reverse (first >= 1), from ``carry`` leaving the
    last; returns the gradient w.r.t. the state entering chunk ``first``. B and C in _BC's layout."""
    Bb, Cb = _BC(B), _BC(C)
    args = (u, delta, delta_bias, z, dout, starts, softplus, At, At2, D, Bb, Cb)
    for c in range(stop - 1, first - 1, -1):
        carry = _bwd_chunk(c, *args, du, ddelta, dz, dA, dB, dC, dD, dbias, decay_buf, H_buf, G_buf, carry)
    return carry


@_bwd_chunks.register_fake
def _(first, stop, u, delta, delta_bias, z, dout, starts, softplus, At, At2, D, B, C, *grads_bufs_carry):
    # allocations as chunk 1's, all freed, writes into the gradients and buffers only (see _chunk_plan);
    # what is left is the gradient entering chunk ``first``
    return torch.empty_like(grads_bufs_carry[-1])


class _ChunkedScan(torch.autograd.Function):
    # Work buffers of one chunk, (batch, T, N, dim), are allocated once per call and reused by every
    # chunk: fresh multi-MB allocations per chunk cost page faults that were a third of the time on CPU.

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_size):
        with torch.autocast(device_type=u.device.type, enabled=False):
            batch, dim, L = u.shape
            N = A.shape[1]
            T = min(chunk_size, L)
            n_chunks = (L + T - 1) // T
            cd = compute_dtype(u)
            At2 = A.to(cd).t().mul(_LOG2E).contiguous()
            Bb, Cb = _BC.prepare(B, cd), _BC.prepare(C, cd)
            y = _new_bld(u, cd)
            # state entering chunk c, for c >= 1 (chunk 0 starts from zeros)
            starts = u.new_empty((n_chunks - 1, batch, N, dim), dtype=cd)
            decay_buf = u.new_empty((batch, T, N, dim), dtype=cd)
            H_buf = torch.empty_like(decay_buf)
            first, middle, last_chunks = _chunk_plan(n_chunks)
            args = (u, delta, delta_bias, delta_softplus, At2)
            bufs = (y, starts, decay_buf, H_buf)
            for c in first:
                _fwd_chunk(c, *args, Bb, Cb, *bufs)
            if middle:
                _fwd_chunks(middle.start, middle.stop, *args, Bb.t, Cb.t, *bufs)
            for c in last_chunks:
                _fwd_chunk(c, *args, Bb, Cb, *bufs)
            H = _head(H_buf, L - (n_chunks - 1) * T)  # the last chunk's states
            last = H[:, -1].transpose(1, 2).contiguous()  # (batch, dim, N)
            del decay_buf, H_buf, H
            y = y.transpose(1, 2)
            # in place on y: the whole-sequence tensors are the forward's largest
            if D is not None:
                y.addcmul_(u.to(cd), D.to(cd)[:, None])
            if z is not None:
                y.mul_(F.silu(z.to(cd)))
        ctx.delta_softplus = delta_softplus
        ctx.chunk_size = T
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, starts)
        ctx.set_materialize_grads(False)
        return _to(y, u.dtype), last

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, starts = ctx.saved_tensors
        with torch.autocast(device_type=u.device.type, enabled=False):
            batch, dim, L = u.shape
            N = A.shape[1]
            T = ctx.chunk_size
            n_chunks = (L + T - 1) // T
            cd = compute_dtype(u)
            fp = dict(dtype=cd, device=u.device)
            At = A.to(cd).t().contiguous()
            At2 = At * _LOG2E
            Df = D.to(cd) if D is not None else None
            Bb, Cb = _BC.prepare(B, cd), _BC.prepare(C, cd)
            if dout is None:
                dout = torch.zeros_like(u)
            du, ddelta = _new_bld(u, cd), _new_bld(u, cd)
            dz = _new_bld(u, cd) if z is not None else None
            dA = torch.zeros_like(At)
            dB = torch.zeros_like(Bb.t)
            dC = torch.zeros_like(Cb.t)
            dD = torch.zeros_like(Df) if D is not None else None
            dbias = torch.zeros((dim,), **fp) if delta_bias is not None else None
            # three chunk buffers, each also the work buffer of a contraction while it is free
            decay_buf = torch.empty((batch, T, N, dim), **fp)
            H_buf = torch.empty_like(decay_buf)
            G_buf = torch.empty_like(decay_buf)
            # gradient w.r.t. the state leaving the current chunk, from the chunks after it
            carry = dlast.to(cd).transpose(1, 2) if dlast is not None else None
            first, middle, last_chunks = _chunk_plan(n_chunks)
            args = (u, delta, delta_bias, z, dout, starts, ctx.delta_softplus, At, At2, Df)
            grads = (du, ddelta, dz, dA, dB, dC, dD, dbias)
            bufs = (decay_buf, H_buf, G_buf)
            for c in reversed(last_chunks):
                carry = _bwd_chunk(c, *args, Bb, Cb, *grads, *bufs, carry)
            if middle:
                carry = _bwd_chunks(middle.start, middle.stop, *args, Bb.t, Cb.t, *grads, *bufs, carry)
            for c in reversed(first):
                carry = _bwd_chunk(c, *args, Bb, Cb, *grads, *bufs, carry)
            del decay_buf, H_buf, G_buf

        def cast(g, like):
            return None if g is None or like is None else g.to(like.dtype)

        return (
            cast(du.transpose(1, 2), u),
            cast(ddelta.transpose(1, 2), delta),
            cast(dA.t().contiguous(), A),
            cast(Bb.grad_layout(dB), B),
            cast(Cb.grad_layout(dC), C),
            cast(dD, D),
            cast(dz.transpose(1, 2) if dz is not None else None, z),
            cast(dbias, delta_bias),
            None,
            None,
        )


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
_BF_U, _BF_DELTA, _BF_Z, _BF_DOUT, _BF_Y, _BF_DU, _BF_DDELTA, _BF_DZ = (1 << i for i in range(8))


def _kernel_in(x: torch.Tensor | None, cd: torch.dtype, lanes: bool) -> torch.Tensor | None:
    """A per-step (batch, dim, L) input as the kernel reads it: bf16 as it is on the fp32 lane path (under
    autocast: no cast, no copy), anything else cast to the compute dtype."""
    if lanes and x is not None and x.dtype == torch.bfloat16 and cd == torch.float32:
        return x
    return cast_bdl(x, cd)


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself when it has it. An autograd.Function's forward must return its outputs this way,
    not as ``x.to(dtype)``: under torch.compile, dynamo records the no-op ``to`` as a second node, and at run
    time the function then returns one tensor object as both the output and a saved intermediate; autograd
    keeps the last of the two, so the output's gradient arrives in the intermediate's slot and the output's
    own backward sees none (every gradient below the scan zero, torch 2.11)."""
    return x if x.dtype == dtype else x.to(dtype)


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


def _use_fused_cpu(u: torch.Tensor, N: int) -> bool:
    """The fused kernel runs CPU tensors with N <= its NMAX when it is built. Fake CPU tensors (memory
    estimates) take the same path: the ops' fake implementations make the outputs the kernel makes, so an
    estimate equals the measured CPU step (a CUDA run without mamba_ssm takes the torch-op path, which
    also holds about four (batch, chunk, N, dim) buffers, which a CUDA estimate for a GPU without mamba_ssm
    traces: ``memfit.estimate.rules.cuda_target_lacks``)."""
    if u.device.type != "cpu" or kernels.cuda_target_lacks("scan"):
        return False
    return N <= _K.NMAX and _K.available()


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
    the memory (None: ``auto_chunk_size``, or FUSED_CHUNK for the fused CPU kernel). ``use_kernels``: on
    CUDA mamba_ssm's kernel when installed, its probe passed and it takes these inputs
    (``memfit.ops.registry``); on CPU the fused C kernel (cpu_kernel.c, built on first use when a C compiler
    is there); False keeps both out (the torch-op path). Unlike mamba_ssm's, the gradient of
    ``last_state`` propagates: on CUDA a call whose last state needs a gradient takes the torch-op path.
    """
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"selective_scan: chunk_size must be a positive int or None, got {chunk_size!r}")
    batch, dim, L, N = _check_args(u, delta, A, B, C, D, z, delta_bias)
    if use_kernels and probes.is_cuda(
        u
    ):  # mamba_ssm's kernel when it takes these inputs (memfit.ops.registry)
        if probes.use_scan(_mamba_scan_fn, u, delta, A, B, C, D, z, delta_bias, return_last_state):
            return _mamba_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    elif use_kernels and _use_fused_cpu(u, N):
        out, last = _fused_scan(
            u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk_size or FUSED_CHUNK
        )
        return (out, last) if return_last_state else out
    if chunk_size is None:
        chunk_size = auto_chunk_size(batch, dim, L, N)
    out, last = _ChunkedScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk_size)
    return (out, last) if return_last_state else out
