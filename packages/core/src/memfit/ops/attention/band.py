"""The band path (CPU, L at least ``registry.BAND_MIN_RATIO`` windows): queries in blocks, each block against
only its key band, inside a custom autograd Function that keeps (out, logsumexp) and recomputes the band
scores in backward, flash-style. Time O(L*w); memory O(L*D) plus one bounded group of band scores."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Queries per block on the band path (at most), and a cap on the bytes of fp32 band buffers one group of
# blocks may hold (the group is the unit of work: bigger groups mean fewer Python steps, smaller ones a
# lower peak; see _groups).
BAND_BLOCK = 64
BAND_GROUP_BYTES = 64 * 2**20


def _band_geometry(L: int, window: int, block: int) -> tuple[int, int, int]:
    """(c, m, nb): block size, how many earlier blocks a block's band reaches back, number of blocks."""
    c = max(1, min(block, L))
    m = -(-(window - 1) // c)  # ceil((w-1)/c): earlier key blocks any query of a block can see
    nb = -(-L // c)
    return c, m, nb


def _band_slice(x: torch.Tensor, j0: int, j1: int, c: int, m: int) -> torch.Tensor:
    """Key blocks j0-m .. j1-1 of x (B, H, L, D), zero-padded past either end -> (B, H, j1-j0+m, c, D)."""
    L = x.shape[-2]
    lo, hi = (j0 - m) * c, j1 * c
    part = x[:, :, max(lo, 0) : min(hi, L)]
    if lo < 0 or hi > L:
        part = F.pad(part, (0, 0, max(0, -lo), max(0, hi - L)))
    return part.reshape(x.shape[0], x.shape[1], j1 - j0 + m, c, x.shape[-1])


def _bands(blocks: torch.Tensor, G: int, m: int) -> torch.Tensor:
    """(B, H, G+m, c, D) key blocks -> (B, H, G, (m+1)*c, D): the band of each of the G query blocks."""
    B, H, _, c, D = blocks.shape
    return torch.stack([blocks[:, :, r : r + G] for r in range(m + 1)], dim=3).reshape(
        B, H, G, (m + 1) * c, D
    )


def _band_mask(j0: int, j1: int, c: int, m: int, window: int, device) -> torch.Tensor:
    """Masked-out (query, band key) pairs for query blocks j0..j1-1 -> bool (c, band) or (G, c, band)."""
    i = torch.arange(c, device=device)[:, None]
    r = torch.arange((m + 1) * c, device=device)[None, :] - m * c  # key offset from the block start
    hidden = (r > i) | (r <= i - window)
    if j0 >= m:
        return hidden  # the same for every block: broadcast
    # Only the first m blocks reach before position 0, into zero padding that must stay masked.
    key_pos = torch.arange(j0, j1, device=device)[:, None] * c + r  # (G, band)
    return hidden[None] | (key_pos < 0)[:, None, :]


def _groups(q: torch.Tensor, nb: int, c: int, m: int):
    """Spans [j0, j1) of query blocks whose fp32 band buffers fit the group budget."""
    B, H, L, D = q.shape
    band = (m + 1) * c
    # Live at once in backward, per block: scores and their gradient (c x band each), the K and V bands
    # and a band gradient with its accumulator (band x D each, in fp32). Three quarters of q's own size
    # keeps the step's peak below SDPA's (out, dq, dk, dv and one more q-sized buffer) at long lengths.
    per_block = B * H * 4 * band * (2 * c + 3 * D)
    budget = min(BAND_GROUP_BYTES, B * H * L * D * q.element_size() * 3 // 4)
    G = max(1, min(nb, budget // per_block))
    for j0 in range(0, nb, G):
        yield j0, min(nb, j0 + G)


class _BandGradAccumulator:
    """Overlap-adds per-group band gradients in fp32 and writes each key block out once it is complete.

    Key block b hears from query blocks b .. b+m only, so after query blocks < j1 are done every key block
    < j1-m is final: only m blocks are carried from group to group, and the full-length gradient is
    allocated once, in the input dtype, with no full-length fp32 accumulator beside it.
    """

    def __init__(self, like: torch.Tensor, dim: int, c: int, m: int, acc: torch.dtype) -> None:
        B, H, L, _ = like.shape
        self.out = like.new_empty(B, H, L, dim)
        self.c, self.m, self.acc = c, m, acc
        self.carry = like.new_zeros(B, H, m * c, dim, dtype=acc)

    def _write(self, src: torch.Tensor, lo: int) -> None:
        """Rows of src are keys lo, lo+1, ...; copy the ones inside [0, L)."""
        L = self.out.shape[-2]
        a, b = max(lo, 0), min(lo + src.shape[-2], L)
        if a < b:
            self.out[:, :, a:b] = src[:, :, a - lo : b - lo]

    def add(self, bands: torch.Tensor, j0: int, j1: int) -> None:
        """bands (B, H, G, (m+1)*c, Dv): gradients for the key bands of query blocks j0 .. j1-1."""
        B, H, G = bands.shape[:3]
        c, m = self.c, self.m
        local = torch.cat([self.carry, bands.new_zeros(B, H, G * c, bands.shape[-1])], dim=2)
        pieces = bands.view(B, H, G, m + 1, c, -1)
        for r in range(m + 1):  # piece r of query block j is key block j-m+r
            local[:, :, r * c : (r + G) * c] += pieces[:, :, :, r].reshape(B, H, G * c, -1)
        self._write(local[:, :, : G * c], (j0 - m) * c)
        self.carry = local[:, :, G * c :]

    def finish(self, nb: int) -> torch.Tensor:
        self._write(self.carry, (nb - self.m) * self.c)
        return self.out


def _pad_rows(x: torch.Tensor, j0: int, j1: int, c: int) -> torch.Tensor:
    """Query rows of blocks j0..j1-1, zero-padded at the end -> (B, H, G, c, D)."""
    L = x.shape[-2]
    part = x[:, :, j0 * c : min(j1 * c, L)]
    if j1 * c > L:
        part = F.pad(part, (0, 0, 0, j1 * c - L))
    return part.reshape(x.shape[0], x.shape[1], j1 - j0, c, x.shape[-1])


def _scores(qg, kb, hidden, scale):
    s = torch.matmul(qg, kb.transpose(-1, -2))
    s.mul_(scale)
    s.masked_fill_(hidden, float("-inf"))
    return s


class _BandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float, block: int):
        B, H, L, D = q.shape
        c, m, nb = _band_geometry(L, window, block)
        acc = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in fp32 at least
        out = q.new_empty(B, H, L, v.shape[-1])
        lse = torch.empty(B, H, L, dtype=acc, device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            for j0, j1 in _groups(q, nb, c, m):
                G = j1 - j0
                hidden = _band_mask(j0, j1, c, m, window, q.device)
                qg = _pad_rows(q, j0, j1, c).to(acc)
                kb = _bands(_band_slice(k, j0, j1, c, m).to(acc), G, m)
                vb = _bands(_band_slice(v, j0, j1, c, m).to(acc), G, m)
                s = _scores(qg, kb, hidden, scale)
                # Softmax by hand, in place: logsumexp would make its own copies of the scores.
                mx = s.amax(dim=-1, keepdim=True)
                s.sub_(mx).exp_()
                den = s.sum(dim=-1, keepdim=True)
                og = torch.matmul(s, vb).div_(den)
                lse_g = (mx + den.log()).squeeze(-1)
                rows = min(j1 * c, L) - j0 * c
                out[:, :, j0 * c : j0 * c + rows] = og.reshape(B, H, G * c, -1)[:, :, :rows]
                lse[:, :, j0 * c : j0 * c + rows] = lse_g.reshape(B, H, G * c)[:, :, :rows]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (window, scale, block)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        window, scale, block = ctx.cfg
        B, H, L, D = q.shape
        c, m, nb = _band_geometry(L, window, block)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty_like(q)
        dk = _BandGradAccumulator(k, D, c, m, acc)
        dv = _BandGradAccumulator(v, v.shape[-1], c, m, acc)
        with torch.autocast(q.device.type, enabled=False):
            for j0, j1 in _groups(q, nb, c, m):
                G = j1 - j0
                rows = min(j1 * c, L) - j0 * c
                hidden = _band_mask(j0, j1, c, m, window, q.device)
                qg = _pad_rows(q, j0, j1, c).to(acc)
                dog = _pad_rows(dout, j0, j1, c).to(acc)
                og = _pad_rows(out, j0, j1, c).to(acc)
                lse_g = _pad_rows(lse[..., None], j0, j1, c)  # (B, H, G, c, 1); padded rows: 0
                kb = _bands(_band_slice(k, j0, j1, c, m).to(acc), G, m)
                vb = _bands(_band_slice(v, j0, j1, c, m).to(acc), G, m)
                p = _scores(qg, kb, hidden, scale).sub_(lse_g).exp_()
                # Each band gradient is added in and dropped before the next is made: a lower peak.
                dv.add(torch.matmul(p.transpose(-1, -2), dog), j0, j1)
                delta = (dog * og).sum(-1, keepdim=True)
                ds = torch.matmul(dog, vb.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
                del p, vb
                dq[:, :, j0 * c : j0 * c + rows] = torch.matmul(ds, kb).reshape(B, H, G * c, D)[:, :, :rows]
                dk.add(torch.matmul(ds.transpose(-1, -2), qg), j0, j1)
        dk, dv = dk.finish(nb), dv.finish(nb)
        return dq, dk, dv, None, None, None


def band_attention(q, k, v, window: int, scale: float | None = None, block: int | None = None):
    """Causal sliding-window attention in O(L*w) time and memory; q, k, v (B, H, L, D) -> (B, H, L, D)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if block is None:
        # Blocks of half the window (at most BAND_BLOCK) waste at most a third of the band on masked keys.
        block = min(BAND_BLOCK, max(16, window // 2))
    return _BandAttention.apply(q, k, v, int(window), scale, int(block))
