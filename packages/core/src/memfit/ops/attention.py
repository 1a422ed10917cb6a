"""One attention entry point, dispatching to the cheapest path that computes the same thing.

``attention(q, k, v, *, causal=False, window=None, scale=None)`` takes q, k, v as
``scaled_dot_product_attention`` does, (batch, heads, L, head_dim), and ``window=w`` means a causal
sliding window: query i sees keys i-w+1 .. i. Paths, in order:

1. ``flash`` - flash-attn's ``flash_attn_func`` with ``window_size=(w-1, 0)``: CUDA, installed, its probe
   passed, and the inputs meet its preconditions (sm80+, fp16/bf16, head dim <= 256; memfit.ops.registry).
2. ``sdpa`` - no window, or a window that covers the whole sequence (Lq <= w): ``is_causal``, never a
   dense mask. Cross-attention (Lq != Lk) without a window also lands here.
3. ``tuned`` - CUDA without flash-attn: the fastest of the candidates, timed once per (shape, dtype,
   window, backward or not) on the device, as cudnn.benchmark does (``cuda_window``): ``flex``, compiled
   FlexAttention with a block mask from ONE bounded LRU cache keyed by (L, window, device, block size),
   built once per key with B=None/H=None so it broadcasts over batch and heads; ``flex_narrow`` (windows
   up to ``FLEX_NARROW_MAX_WINDOW``, training only), the same with 64-wide blocks and inductor's
   autotuned kernels;
   ``varlen``, the FlashAttention-2 kernel PyTorch bundles (``varlen_attn(window_size=(w-1, 0))``,
   fp16/bf16); ``triton``, memfit's own band kernels (``memfit.ops.window_triton``: 64-wide tiles over only
   the blocks the window reaches, FlashAttention-2's backward); ``blocks`` (below).
4. ``blocks`` - CPU, moderate L / w: SDPA (its CPU flash kernel) once per block of queries, each block
   against the keys its window reaches with a boolean band mask. A single block when L is small: then
   it is dense SDPA with a band mask, as fast as causal SDPA there.
5. ``band`` - CPU, L at least ``BAND_MIN_RATIO`` windows long: queries in blocks, each block against
   only its key band, inside a custom autograd Function that keeps (out, logsumexp) and recomputes the
   band scores in backward, flash-style. Time O(L*w); memory O(L*D) plus one bounded group of band
   scores.

The CPU rule (``select_backend``) comes from tools/bench_attention.py ``--grid``: fwd+bwd, 1 thread,
L 64..8192 and w 16..L/2 against causal SDPA; see that tool for the figures.

``attention_ref`` is the plain masked-softmax reference the tests compare every path against.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memfit.ops import registry

BACKENDS = ("auto", "flash", "sdpa", "flex", "flex_narrow", "varlen", "triton", "blocks", "band", "ref")

# Queries per block on the band path (at most), and a cap on the bytes of fp32 band buffers one group of
# blocks may hold (the group is the unit of work: bigger groups mean fewer Python steps, smaller ones a
# lower peak; see _groups).
BAND_BLOCK = 64
BAND_GROUP_BYTES = 64 * 2**20
# SDPA per query block of max(w // 2, BLOCKS_MIN) queries (the registry's rule: the band path from
# L >= BAND_MIN_RATIO windows on the CPU)
BLOCKS_MIN = 32
# FlexAttention's block sizes: its default, and the narrow candidate's for windows up to
# FLEX_NARROW_MAX_WINDOW keys (wider windows fill most of a 128-wide tile anyway)
FLEX_BLOCK = 128
FLEX_NARROW_BLOCK = 64
FLEX_NARROW_MAX_WINDOW = 128


def attention_ref(q, k, v, *, causal=False, window=None, scale=None):
    """Naive masked-softmax attention; q (B, H, Lq, D), k/v (B, H, Lk, D) -> (B, H, Lq, D)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * scale
    Lq, Lk = q.shape[-2], k.shape[-2]
    if causal or window is not None:
        i = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
        j = torch.arange(Lk, device=q.device)[None, :]
        mask = j <= i
        if window is not None:
            mask = mask & (j > i - window)
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).to(v.dtype)) @ v


# ----------------------------------------------------------------------------------------------------
# Forcing a path (tests, benchmarks)
# ----------------------------------------------------------------------------------------------------

_forced = threading.local()


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """``with force_backend("band"): ...`` makes every ``attention`` call inside take that path."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    prev = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = prev


def flash_available() -> bool:
    """True when flash-attn imported (its kernels still need CUDA tensors in fp16/bf16)."""
    return registry.resolve(registry.record_of("attention", "flash").load) is not None


def probe_flash(fn, device: torch.device) -> tuple[bool, str]:
    """One tiny bf16 window call of a window-attention implementation on ``device`` against
    ``attention_ref``."""
    from memfit.ops.scan.ref import compare

    g = torch.Generator(device=device).manual_seed(0)
    batch, L, heads, hd, window = 2, 40, 2, 64, 8
    q, k, v = (
        torch.randn(batch, heads, L, hd, generator=g, device=device).to(torch.bfloat16) for _ in range(3)
    )
    out = fn(q, k, v, window, None)
    want = attention_ref(q.float(), k.float(), v.float(), window=window)
    return compare([out], [want], 2e-2)


# ----------------------------------------------------------------------------------------------------
# Block-mask cache for FlexAttention
# ----------------------------------------------------------------------------------------------------


class _BlockMaskCache:
    """LRU of FlexAttention block masks keyed by (L, window, device, block size); one broadcastable mask
    per key."""

    def __init__(self, max_entries: int = 8) -> None:
        self.max_entries = max_entries
        self._masks: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, L: int, window: int, device: torch.device, block: int = FLEX_BLOCK):
        key = (int(L), int(window), str(torch.device(device)), int(block))
        with self._lock:
            if key in self._masks:
                self._masks.move_to_end(key)
                return self._masks[key]
        mask = _build_window_block_mask(L, window, device, block)
        with self._lock:
            self._masks[key] = mask
            self._masks.move_to_end(key)
            while len(self._masks) > self.max_entries:
                self._masks.popitem(last=False)
        return mask

    def resize(self, max_entries: int) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"block-mask cache size must be an int >= 1, got {max_entries!r}")
        with self._lock:
            self.max_entries = max_entries
            while len(self._masks) > self.max_entries:
                self._masks.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._masks.clear()

    def info(self) -> dict:
        with self._lock:
            masks = list(self._masks.values())
            keys = list(self._masks.keys())
        return {
            "entries": len(masks),
            "max_entries": self.max_entries,
            "bytes": sum(_block_mask_nbytes(m) for m in masks),
            "keys": keys,
        }


def _window_mask_mod(window: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


def _build_window_block_mask(L: int, window: int, device, block: int = FLEX_BLOCK):
    from torch.nn.attention.flex_attention import create_block_mask

    # B=None, H=None: one mask broadcast over batch and heads, so its size never grows with either.
    return create_block_mask(_window_mask_mod(window), None, None, L, L, device=device, BLOCK_SIZE=block)


def _block_mask_nbytes(mask) -> int:
    return sum(t.untyped_storage().nbytes() for t in mask.as_tuple() if isinstance(t, torch.Tensor))


_BLOCK_MASKS = _BlockMaskCache()


def block_mask_cache_info() -> dict:
    """The block-mask cache: ``{"entries", "max_entries", "bytes", "keys"}``."""
    return _BLOCK_MASKS.info()


def set_block_mask_cache_size(max_entries: int) -> None:
    """Bound the block-mask cache to ``max_entries`` masks (least recently used ones go first)."""
    _BLOCK_MASKS.resize(max_entries)


def clear_block_mask_cache() -> None:
    """Drop every cached block mask."""
    _BLOCK_MASKS.clear()


def window_block_mask(L: int, window: int, device="cpu", block: int = FLEX_BLOCK):
    """The cached FlexAttention BlockMask for a causal window of ``window`` over length ``L``, in blocks of
    ``block`` queries and keys."""
    return _BLOCK_MASKS.get(L, window, device, block)


_compiled_flex: dict[bool, object] = {}
# torch.nn.attention.flex_attention, imported on first use; its function is looked up at each call
_flex_module = None


# Two functions with the same body on purpose: each compiled mode gets its own code object, so dynamo's
# recompile limit (8 shapes per code object) is not shared between them.
def _flex_default(q, k, v, block_mask, scale, kernel_options=None):
    return _flex_module.flex_attention(
        q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options
    )


def _flex_autotuned(q, k, v, block_mask, scale, kernel_options=None):
    return _flex_module.flex_attention(
        q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options
    )


def _flex(q, autotune: bool):
    """flex_attention as it runs on q's device: eager on the CPU (it materialises the full score matrix
    there); compiled on CUDA, where it runs the block-sparse kernel, with inductor's default kernel
    configurations or (``autotune``) the fastest of its autotuning set (max-autotune, timed once per shape
    at compile time)."""
    global _flex_module
    if _flex_module is None:
        from torch.nn.attention import flex_attention

        _flex_module = flex_attention
    if not registry.is_cuda(q):
        return _flex_default
    if autotune not in _compiled_flex:
        mode = "max-autotune-no-cudagraphs" if autotune else None
        fn = _flex_autotuned if autotune else _flex_default
        _compiled_flex[autotune] = torch.compile(fn, dynamic=False, mode=mode)
    return _compiled_flex[autotune]


def flex_window(q, k, v, window, scale):
    """A causal window of ``window`` keys with FlexAttention in blocks of ``FLEX_BLOCK`` (128, its default
    and what inductor's default kernel configurations tile by)."""
    block_mask = _BLOCK_MASKS.get(q.shape[-2], window, q.device, FLEX_BLOCK)
    return _flex(q, autotune=False)(q, k, v, block_mask, scale)


def flex_narrow_window(q, k, v, window, scale):
    """A narrow causal window with FlexAttention in blocks of ``FLEX_NARROW_BLOCK`` (64) queries and keys.

    With 128-wide blocks a window of 64 keys fills a quarter of the tiles the kernel computes (every tile it
    touches is a partial one); 64-wide blocks halve that work. Inductor's default backward configuration on
    sm90 tiles by 128 and is left out for 64-wide blocks, so this candidate compiles with max-autotune,
    whose set holds 32- and 64-wide configurations (and times them once per shape). Each query sees its own
    key, so no row is empty (``ROWS_GUARANTEED_SAFE``)."""
    block_mask = _BLOCK_MASKS.get(q.shape[-2], window, q.device, FLEX_NARROW_BLOCK)
    options = {"ROWS_GUARANTEED_SAFE": True}
    return _flex(q, autotune=True)(q, k, v, block_mask, scale, options)


# ----------------------------------------------------------------------------------------------------
# Band path: blocked queries against their key band, recomputed in backward
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# Blocks path: SDPA per query block against the keys its window reaches
# ----------------------------------------------------------------------------------------------------


def _window_mask(q0: int, q1: int, k0: int, window: int, device) -> torch.Tensor:
    """Bool (q1-q0, q1-k0): True where query q0+i may see key k0+j (k0+j <= q0+i < k0+j+window).

    The band between two diagonals: three ops, ~3 us at (128, 255) on one thread, so it is built per
    call rather than cached (a cache must not keep the fake tensors of an estimate)."""
    d = q0 - k0
    band = torch.ones(q1 - q0, q1 - k0, dtype=torch.bool, device=device)
    return band.tril_(d).triu_(d - window + 1)


def sdpa_blocks(q, k, v, window: int, scale: float | None = None, block: int | None = None):
    """Causal window attention as SDPA calls on blocks of queries: q, k, v (B, H, L, D) -> (B, H, L, Dv).

    Block [s, e) attends keys [s - w + 1, e) under a boolean band mask; every full interior block shares
    one mask. Time O(L * (block + w)); SDPA's CPU flash kernel keeps its memory O(L)."""
    L = q.shape[-2]
    c = max(window // 2, BLOCKS_MIN) if block is None else block
    if c >= L or (block is None and 2 * c >= L):  # two blocks would cost about what one masked call does
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(0, L, 0, window, q.device),
                                              scale=scale)  # fmt: skip
    outs = []
    interior = None  # every full interior block sees keys at the same offsets: one mask for all of them
    for s in range(0, L, c):
        e, k0 = min(L, s + c), max(0, s - window + 1)
        if k0 > 0 and e - s == c:
            if interior is None:
                interior = _window_mask(0, c, 1 - window, window, q.device)
            mask = interior
        else:
            mask = _window_mask(s, e, k0, window, q.device)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], attn_mask=mask,
                                                   scale=scale))  # fmt: skip
    return torch.cat(outs, dim=-2)


# ----------------------------------------------------------------------------------------------------
# CUDA: FlashAttention-2's window, and the candidate measured fastest
# ----------------------------------------------------------------------------------------------------


def varlen_window(q, k, v, window, scale):
    """A causal window of ``window`` keys with the FlashAttention-2 kernel bundled in PyTorch
    (``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16): the batch packed as B sequences of L."""
    from torch.nn.attention.varlen import varlen_attn

    B, H, L, D = q.shape
    packed = [t.transpose(1, 2).reshape(B * L, H, t.shape[-1]) for t in (q, k, v)]
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)
    out = varlen_attn(*packed, cu, cu, L, L, scale=scale, window_size=(window - 1, 0))
    return out.view(B, L, H, -1).transpose(1, 2)


def _varlen_problem(q, k, v) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}: FlashAttention takes fp16/bf16"
    if q.shape[-1] > 256 or v.shape[-1] != q.shape[-1]:
        return "head dims over 256 or unequal"
    return None


# CUDA window attention: the fastest correct candidate for each (shape, dtype, window, backward or not),
# timed once on the device like cudnn.benchmark: compiled Flex wins at some shapes, FlashAttention-2's
# window (varlen) at others, SDPA on query blocks at a few (tools/bench_gpu.py prints what was chosen).
def triton_window(q, k, v, window, scale):
    """A causal window of ``window`` keys with memfit's Triton band kernels (``memfit.ops.window_triton``)."""
    from memfit.ops.window_triton import window_attention_triton

    return window_attention_triton(q, k, v, window, scale)


def _triton_problem(q, k, v) -> str | None:
    from memfit.ops.window_triton import MAX_HEAD_DIM

    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"{q.dtype}: the band kernels take fp32/fp16/bf16 of one dtype"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] != q.shape[-1] or k.shape != q.shape:
        return f"head dims over {MAX_HEAD_DIM} or unequal"
    return None


CUDA_WINDOW_CANDIDATES = {
    "flex": flex_window,
    "flex_narrow": flex_narrow_window,
    "varlen": varlen_window,
    "triton": triton_window,
    "blocks": sdpa_blocks,
}
_cuda_choice: dict[tuple, str] = {}
# (candidate, dtype, head dim) -> why it failed there: left out for inputs of that kind only (a kernel
# that cannot compile for one head dim or dtype may well run for others)
_cuda_failed: dict[tuple, str] = {}
TUNE_REPEATS = 3


def cuda_window_choices() -> dict[tuple, str]:
    """{(B, H, L, D, dtype, window, backward): candidate} chosen so far in this process."""
    return dict(_cuda_choice)


def _failure_key(name: str, q) -> tuple:
    return (name, q.dtype, q.shape[-1])


def _candidates(q, k, v, window: int, backward: bool) -> list[str]:
    names = [n for n in CUDA_WINDOW_CANDIDATES if _failure_key(n, q) not in _cuda_failed]
    if "varlen" in names and _varlen_problem(q, k, v) is not None:
        names.remove("varlen")
    if "triton" in names and _triton_problem(q, k, v) is not None:
        names.remove("triton")
    if "flex_narrow" in names and (window > FLEX_NARROW_MAX_WINDOW or not backward):
        # training keys only: its autotuned compile (tens of seconds per shape) pays off over a run's steps,
        # not over the lengths a generation loop passes through once each
        names.remove("flex_narrow")
    return names


def _time_candidate(name: str, q, k, v, window: int, scale, backward: bool) -> float:
    """Median ms of fwd (+bwd) of candidate ``name`` on copies of q, k, v (its first call, which may
    compile, is not timed). The trial keeps its own graph: the first call of a shape often comes inside
    activation checkpointing (registry.own_graph)."""
    fn = CUDA_WINDOW_CANDIDATES[name]
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    times = []
    with registry.own_graph():
        for i in range(TUNE_REPEATS + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*leaves, window, scale)
            if backward:
                out.backward(torch.ones_like(out))
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


_said_tuning = False


def _tune(key: tuple, q, k, v, window: int, scale, backward: bool) -> str:
    global _said_tuning
    names = _candidates(q, k, v, window, backward)
    if not _said_tuning:  # the first step of each new shape waits for this: say so once per process
        _said_tuning = True
        import sys

        slow = " (Flex's autotuned one for tens of seconds)" if "flex_narrow" in names else ""
        print(f"[memfit] timing {len(names)} window-attention kernels once per new shape{slow}: "
              f"{', '.join(names)}", file=sys.stderr)  # fmt: skip
    timings = {}
    for name in names:
        try:
            timings[name] = _time_candidate(name, q, k, v, window, scale, backward)
        except Exception as e:  # noqa: BLE001 - a candidate this GPU/torch cannot run is left out, said once
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            _cuda_failed[_failure_key(name, q)] = why
            import warnings

            warnings.warn(f"memfit: window attention candidate {name} left out for {q.dtype}, head dim "
                          f"{q.shape[-1]} ({why})", RuntimeWarning, stacklevel=3)  # fmt: skip
    name = min(timings, key=timings.get) if timings else "blocks"
    _cuda_choice[key] = name
    return name


_tune_outside_compile = registry.outside_compile(_tune)


def cuda_window(q, k, v, window, scale):
    """Causal window attention on CUDA by the candidate measured fastest for this shape (tuned on the first
    call of each (shape, dtype, window, backward) key; under torch.compile a key not tuned yet takes Flex)."""
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (*q.shape, q.dtype, int(window), backward)
    name = _cuda_choice.get(key)
    if name is None:
        name = (
            "flex"
            if torch.compiler.is_compiling()
            else _tune_outside_compile(key, q, k, v, window, scale, backward)
        )
    return CUDA_WINDOW_CANDIDATES[name](q, k, v, window, scale)


# ----------------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------------


def _validate(q, k, v, causal, window, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D (batch, heads, length, head_dim), got shape "
                f"{tuple(t.shape)}; reshape with .view(B, L, H, D).transpose(1, 2)"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q and k head dims differ ({q.shape[-1]} vs {k.shape[-1]})")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: k and v lengths differ ({k.shape[-2]} vs {v.shape[-2]})")
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        raise ValueError(
            f"attention: batch/heads must match, got q {tuple(q.shape[:2])}, k {tuple(k.shape[:2])}, "
            f"v {tuple(v.shape[:2])}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them first"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v on different devices ({q.device}, {k.device}, {v.device})")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"attention: window must be a positive int (keys i-w+1..i), got {window!r}")
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"attention: a window needs self-attention (Lq == Lk), got Lq={q.shape[-2]}, Lk={k.shape[-2]}"
            )
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"attention: causal with Lq={q.shape[-2]} > Lk={k.shape[-2]} leaves queries with no keys"
        )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"attention: scale must be a float or None, got {scale!r}")


def _sdpa(q, k, v, causal, scale):
    Lq, Lk = q.shape[-2], k.shape[-2]
    if causal and Lq != Lk:
        from torch.nn.attention.bias import causal_lower_right

        # Same alignment as flash-attn and attention_ref: the last query sees every key.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Lq, Lk), scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def select_backend(q, k, v, *, causal=False, window=None) -> str:
    """The path ``attention`` would take for these inputs (ignoring ``force_backend``); records nothing."""
    L = q.shape[-2]
    if window is None or window >= L:
        return "sdpa"
    return _choose(q, k, v, window, record=False)[0]


def _choose(q, k, v, window: int, record: bool = True):
    impl, fn = registry.choose("attention", q, k, v, window, count=record)
    return impl.name, fn


def flash_like(q, k, v, window: int, scale):
    """What a CUDA window kernel keeps (flash-attn's or compiled Flex's: the output and its logsumexp), as
    causal SDPA, whose CUDA target traces the flash kernel: the stand-in of an estimate's trace."""
    return _sdpa(q, k, v, True, scale)


def attention(q, k, v, *, causal=False, window=None, scale=None, backend=None):
    """q, k, v (B, H, L, D) as SDPA -> (B, H, Lq, D); window=w: causal window, query i sees keys i-w+1..i.

    ``backend`` (or ``force_backend``) picks a path by name: auto (default), or one of ``BACKENDS``
    (flash, sdpa, flex, flex_narrow, varlen, triton, blocks, band, ref).
    """
    _validate(q, k, v, causal, window, scale)
    name = backend or getattr(_forced, "name", None) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "ref":
        registry.record("attention", "ref")
        return attention_ref(q, k, v, causal=causal, window=window, scale=scale)
    if window is None or (name == "auto" and window >= q.shape[-2]):
        # band, blocks, flex and flash exist for windows; full attention is SDPA's job.
        registry.record("attention", "sdpa")
        return _sdpa(q, k, v, causal or window is not None, scale)
    if name == "auto":
        _, fn = _choose(q, k, v, window)
        return fn(q, k, v, window, scale)
    registry.record("attention", name)
    if name == "sdpa":
        if q.shape[-2] > window:
            raise ValueError(
                f"attention: the sdpa path covers windows only when L <= window (L={q.shape[-2]}, "
                f"window={window}); use backend='band', 'flex' or 'auto'"
            )
        return _sdpa(q, k, v, True, scale)
    if name != "flash":
        return {**CUDA_WINDOW_CANDIDATES, "band": band_attention}[name](q, k, v, window, scale)
    impl = registry.record_of("attention", "flash")
    fn = registry.resolve(impl.load)
    if fn is None or not registry.is_cuda(q):
        raise ValueError("attention: backend='flash' needs flash-attn installed and CUDA tensors")
    problem = registry._problem(impl, (q, k, v, window))
    if problem is None and not (res := registry.probe(impl, q.device)).ok:
        problem = f"its probe failed: {res.detail}"
    if problem is not None:
        raise ValueError(f"attention: backend='flash' cannot run here: {problem}")
    return fn(q, k, v, window, scale)
