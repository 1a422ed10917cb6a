"""The selective scan in chunks that recompute, on torch ops only (the path every device has).

Forward keeps only the state at each chunk boundary (batch, dim, N); backward walks the chunks in reverse,
recomputes each chunk's states from its boundary state and carries the state gradient to the previous
chunk. Memory O(batch*dim*chunk*N + batch*dim*N*L/chunk). Inside a chunk everything except the recurrence
itself is one vectorised op over the chunk, and the recurrence is one fused multiply-add per step on a
contiguous (batch, dim, N) slice. The scan runs in fp32 (fp64 when u is fp64; autocast is off inside); the
output has u's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.ops.scan.ref import _to, compute_dtype


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


def chunked_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size):
    """The registry's calling convention: out (batch, dim, L) [, last state (batch, dim, N)]."""
    if chunk_size is None:
        batch, dim, L = u.shape
        chunk_size = auto_chunk_size(batch, dim, L, A.shape[1])
    out, last = _ChunkedScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), chunk_size)
    return (out, last) if return_last_state else out
