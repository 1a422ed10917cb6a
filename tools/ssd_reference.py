"""A plain re-implementation of Mamba-2's chunked SSD (state space duality), for benchmarks only.

Mamba-2 restricts A to one scalar per head, so the decay from step s to step t is the same for every
state entry of a head. That makes the scan a chain of matrix products (Dao & Gu 2024, "Transformers
are SSMs", section 6). Per head, with state h (P, N)::

    h_t = exp(a_t) * h_{t-1} + x_t B_t^T        x_t (P,), B_t and C_t (N,), a_t = dt_t * A <= 0
    y_t = h_t C_t

Chunked algorithm (chunks of T steps), all of it batched einsums:

1. within a chunk, y_t += sum_{s<=t} exp(cum_t - cum_s) (C_t . B_s) x_s   (a masked T x T "attention")
2. the state each chunk leaves, from its own inputs: sum_s exp(cum_T - cum_s) x_s B_s^T
3. a recurrence over the chunk states (c x c decays, again one einsum)
4. y_t += exp(cum_t) C_t h_(chunk start)

``ssd_scan`` is differentiated by autograd. ``ssd_recurrence`` is the step-by-step definition it is
tested against (packages/core/tests/test_ssd_reference.py).
"""

from __future__ import annotations

import torch


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): out[..., t, s] = a[s+1] + ... + a[t] for s <= t, -inf above the diagonal.

    Summed directly (a masked cumulative sum down each column), not as cum[t] - cum[s], which would
    lose precision when the running sums are large.
    """
    T = a.shape[-1]
    x = a.unsqueeze(-1).expand(*a.shape, T)  # x[..., t, s] = a[t]
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    x = x.masked_fill(~below, 0).cumsum(-2)
    return x.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def ssd_scan(x, a, B, C, chunk: int = 64, h0=None):
    """Chunked SSD. x (b, L, H, P); a = dt * A (b, L, H); B, C (b, L, H, N) or (b, L, N) shared by heads.

    Returns y (b, L, H, P) and the final state (b, H, P, N). L must be a multiple of ``chunk``
    (pad with a = 0, x = 0 otherwise).
    """
    b, L, H, P = x.shape
    if L % chunk:
        raise ValueError(f"ssd_scan: L={L} is not a multiple of chunk={chunk}")
    if B.dim() == 3:
        B = B.unsqueeze(2).expand(-1, -1, H, -1)
    if C.dim() == 3:
        C = C.unsqueeze(2).expand(-1, -1, H, -1)
    nc = L // chunk
    x = x.reshape(b, nc, chunk, H, P)
    B = B.reshape(b, nc, chunk, H, -1)
    C = C.reshape(b, nc, chunk, H, -1)
    a = a.reshape(b, nc, chunk, H).permute(0, 3, 1, 2)  # (b, H, c, T)
    cum = a.cumsum(-1)

    # 1. within each chunk
    decay_in = torch.exp(segment_sums(a))  # (b, H, c, T, T)
    scores = torch.einsum("bctkn,bcskn->bkcts", C, B) * decay_in
    y = torch.einsum("bkcts,bcskp->bctkp", scores, x)

    # 2. the state each chunk produces from its own inputs
    to_end = torch.exp(cum[..., -1:] - cum)  # (b, H, c, T)
    states = torch.einsum("bcskn,bkcs,bcskp->bckpn", B, to_end, x)

    # 3. chunk-to-chunk recurrence: states entering each chunk (index 0: h0) and the final one
    if h0 is None:
        h0 = x.new_zeros(b, 1, H, P, states.shape[-1])
    else:
        h0 = h0.unsqueeze(1)
    states = torch.cat([h0, states], dim=1)  # (b, c+1, H, P, N)
    chunk_decay = torch.exp(segment_sums(torch.nn.functional.pad(cum[..., -1], (1, 0))))  # (b, H, c+1, c+1)
    states = torch.einsum("bkzc,bckpn->bzkpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. each step's output from the state entering its chunk
    y = y + torch.einsum("bctkn,bckpn,bkct->bctkp", C, entering, torch.exp(cum))
    return y.reshape(b, L, H, P), final


def ssd_recurrence(x, a, B, C, h0=None):
    """Step-by-step definition: same arguments and results as ``ssd_scan`` (no chunking)."""
    b, L, H, P = x.shape
    if B.dim() == 3:
        B = B.unsqueeze(2).expand(-1, -1, H, -1)
    if C.dim() == 3:
        C = C.unsqueeze(2).expand(-1, -1, H, -1)
    h = x.new_zeros(b, H, P, B.shape[-1]) if h0 is None else h0
    ys = []
    for t in range(L):
        h = torch.exp(a[:, t])[..., None, None] * h + x[:, t].unsqueeze(-1) * B[:, t].unsqueeze(-2)
        ys.append((h * C[:, t].unsqueeze(-2)).sum(-1))
    return torch.stack(ys, dim=1), h
