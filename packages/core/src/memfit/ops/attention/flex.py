"""FlexAttention's causal window: compiled on CUDA (block-sparse kernels), eager on the CPU, with its block
masks in ONE bounded LRU cache keyed by (L, window, device, block size), built once per key with
B=None/H=None so one mask broadcasts over batch and heads. Two CUDA candidates: ``flex_window`` (128-wide
blocks, inductor's default kernels) and ``flex_narrow_window`` (64-wide blocks, autotuned; windows up to
``FLEX_NARROW_MAX_WINDOW``, training only)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from memfit.ops import device

# FlexAttention's block sizes: its default, and the narrow candidate's for windows up to
# FLEX_NARROW_MAX_WINDOW keys (wider windows fill most of a 128-wide tile anyway)
FLEX_BLOCK = 128
FLEX_NARROW_BLOCK = 64
FLEX_NARROW_MAX_WINDOW = 128


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
    if not device.is_cuda(q):
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


def narrow_problem(q, k, v, window: int, scale=None) -> str | None:
    """The narrow candidate is for training keys of narrow windows: its autotuned compile (tens of seconds
    per shape) pays off over a run's steps, not over the lengths a generation loop passes through once."""
    if window > FLEX_NARROW_MAX_WINDOW:
        return f"window {window} > {FLEX_NARROW_MAX_WINDOW}: 128-wide blocks are filled anyway"
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return "forward only: its autotuned compile per shape pays off over training steps"
    return None
