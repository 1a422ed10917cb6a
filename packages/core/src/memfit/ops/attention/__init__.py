"""One attention entry point, dispatching to the cheapest path that computes the same thing.

``attention(q, k, v, *, causal=False, window=None, scale=None)`` takes q, k, v as
``scaled_dot_product_attention`` does, (batch, heads, L, head_dim), and ``window=w`` means a causal
sliding window: query i sees keys i-w+1 .. i. No window, or a window that covers the whole sequence
(Lq <= w), is SDPA's job (``is_causal``, never a dense mask; cross-attention lands here too). A window
shorter than the sequence goes to the implementation ``memfit.ops.registry`` chooses; each lives in a file
of this package, in the registry's calling convention ``fn(q, k, v, window, scale)``:

- ``ref.py``: ``attention_ref``, the plain masked-softmax reference every path is tested against, and the
  probe a kernel passes before it is used.
- ``flash_attn.py``: flash-attn's ``flash_attn_func`` with ``window_size=(w-1, 0)`` (the ``cuda`` extra;
  sm80+, fp16/bf16, head dim <= 256): first on CUDA when installed and its probe passed.
- ``flex.py``: compiled FlexAttention with a block mask from one bounded LRU cache (``flex``, 128-wide
  blocks; ``flex_narrow``, 64-wide blocks with autotuned kernels, training keys of windows up to
  ``FLEX_NARROW_MAX_WINDOW``).
- ``varlen.py``: the FlashAttention-2 window PyTorch bundles (``varlen_attn``, fp16/bf16).
- ``triton.py``: memfit's own Triton band kernels (64-wide tiles over only the blocks the window reaches).
- ``blocks.py``: SDPA once per block of queries against the keys its window reaches (every device).
- ``band.py``: the CPU path for L >= ``registry.BAND_MIN_RATIO`` windows: blocked queries against their
  key band in a custom autograd Function, recomputed in backward; O(L*w) time, O(L*D) memory.

What chooses: the registry's records (``memfit.ops.registry.RECORDS``). On the CPU the rule is fixed (band
from 16 windows, else blocks; tools/bench_attention.py ``--grid``). On CUDA without flash-attn the flex,
flex_narrow, varlen, triton and blocks records are ``timed``: the registry times those that take a call once
per (shape, dtype, window, backward or not) key on the device and keeps the fastest
(``registry.timed_choices``; `memfit doctor` lists them). A new CUDA kernel for the window is one file here
and one record there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from memfit.ops import registry
from memfit.ops.attention.band import BAND_BLOCK, BAND_GROUP_BYTES, band_attention
from memfit.ops.attention.blocks import BLOCKS_MIN, sdpa_blocks
from memfit.ops.attention.flex import (
    FLEX_BLOCK,
    FLEX_NARROW_BLOCK,
    FLEX_NARROW_MAX_WINDOW,
    block_mask_cache_info,
    clear_block_mask_cache,
    flex_narrow_window,
    flex_window,
    set_block_mask_cache_size,
    window_block_mask,
)
from memfit.ops.attention.ref import attention_ref
from memfit.ops.attention.ref import probe as probe_flash
from memfit.ops.attention.sdpa import _sdpa, flash_like
from memfit.ops.attention.varlen import varlen_window

__all__ = [
    "BACKENDS",
    "BAND_BLOCK",
    "BAND_GROUP_BYTES",
    "BLOCKS_MIN",
    "FLEX_BLOCK",
    "FLEX_NARROW_BLOCK",
    "FLEX_NARROW_MAX_WINDOW",
    "attention",
    "attention_ref",
    "band_attention",
    "block_mask_cache_info",
    "clear_block_mask_cache",
    "cuda_window_choices",
    "flash_available",
    "flash_like",
    "flex_narrow_window",
    "flex_window",
    "force_backend",
    "probe_flash",
    "sdpa_blocks",
    "select_backend",
    "set_block_mask_cache_size",
    "varlen_window",
    "window_block_mask",
]

BACKENDS = ("auto", "flash", "sdpa", "flex", "flex_narrow", "varlen", "triton", "blocks", "band", "ref")


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


def cuda_window_choices() -> dict[tuple, str]:
    """{(B, H, L, D, dtype, window, backward): record} the registry's timing kept so far in this process."""
    out = {}
    for key, name in registry.timed_choices("attention").items():
        q, window, backward = key[1], key[4], key[-1]
        out[(*q[:-1], q[-1], window, backward)] = name
    return out


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


def select_backend(q, k, v, *, causal=False, window=None) -> str:
    """The path ``attention`` would take for these inputs (ignoring ``force_backend``); records nothing."""
    L = q.shape[-2]
    if window is None or window >= L:
        return "sdpa"
    return _choose(q, k, v, window, record=False)[0]


def _choose(q, k, v, window: int, scale=None, record: bool = True):
    impl, fn = registry.choose("attention", q, k, v, window, scale, count=record)
    return impl.name, fn


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
        _, fn = _choose(q, k, v, window, scale)
        return fn(q, k, v, window, scale)
    registry.record("attention", name)
    if name == "sdpa":
        if q.shape[-2] > window:
            raise ValueError(
                f"attention: the sdpa path covers windows only when L <= window (L={q.shape[-2]}, "
                f"window={window}); use backend='band', 'flex' or 'auto'"
            )
        return _sdpa(q, k, v, True, scale)
    impl = registry.record_of("attention", name)
    if name != "flash":
        fn = registry.resolve(impl.load)
        if fn is None:
            raise ValueError(f"attention: backend={name!r} cannot run here: {registry.load_error(impl)}")
        return fn(q, k, v, window, scale)
    fn = registry.resolve(impl.load)
    if fn is None or not registry.is_cuda(q):
        raise ValueError("attention: backend='flash' needs flash-attn installed and CUDA tensors")
    problem = registry._problem(impl, (q, k, v, window, scale))
    if problem is None and not (res := registry.probe(impl, q.device)).ok:
        problem = f"its probe failed: {res.detail}"
    if problem is not None:
        raise ValueError(f"attention: backend='flash' cannot run here: {problem}")
    return fn(q, k, v, window, scale)
