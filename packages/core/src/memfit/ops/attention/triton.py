"""Causal sliding-window attention as Triton kernels (forward, and FlashAttention-2's backward), one of the
CUDA window candidates the registry times (``memfit.ops.registry``, rule "timed").

Query i sees keys i-w+1 .. i. q, k, v: (batch, heads, L, head_dim), any strides (a model's views of one
projection included), fp32/bf16/fp16; the output has q's dtype. Scores, the running softmax and every
accumulator are fp32.

Kernels
-------
* Forward, grid (batch * heads, cdiv(L, BLOCK)): one query block against only the key blocks its window
  reaches (``N_BLOCKS = 1 + ceil((w - 1) / BLOCK)``, a compile-time loop bound), online softmax in
  registers; it writes the output and each row's log-sum-exp (fp32, log2 units), the only tensor kept for
  backward beside q, k, v and the output: nothing of size L x w is stored.
* Backward, as FlashAttention-2 lays it out: a row-sum kernel (``delta = rowsum(dO * O)``, fp32), then one
  kernel per key block for dK and dV, looping over the query blocks that see it, and one per query block
  for dQ, looping over the key blocks it sees; the probabilities are recomputed from the log-sum-exp. No
  atomics: each program owns the rows it writes.

Compared with compiled FlexAttention (the other candidates), the band is computed from the block indices
(no block-mask tables, no mask function), the tiles are 64 wide (a window of 64 keys fills half of each
tile it touches, against a quarter with Flex's 128-wide blocks) and the op is one custom-op call per
direction. Whether that is faster is the GPU's to say: the registry times it beside the others.

Registration follows ``memfit.ops.scan.triton``: ``torch.library.custom_op`` with ``register_fake``
(the fake makes exactly the outputs the kernels write, the backward's row sums included), so the
estimator and torch.compile see what the op allocates; under ``TRITON_INTERPRET=1`` the same op runs the
kernels on CPU tensors (the tests). Loop bounds are compile-time constants (the interpreter takes no
runtime ``range`` bound, and a constant-trip ``for`` is what Triton pipelines): a kernel is compiled per
``N_BLOCKS``, i.e. per window rounded up to the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_HEAD_DIM", "problem", "triton_window", "window_attention_triton", "why_unavailable"]

_LOG2E = 1.4426950408889634
BLOCK = 64  # queries and keys per tile
# A (64, head dim) tile per operand, the backward's dK/dV kernel holding four of them in fp32: up to 128 the
# registers hold them (head dims of GPT-2/Llama-style models: 64, 128); wider heads take the other candidates.
MAX_HEAD_DIM = 128


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """tl.dot: fp32 operands in full precision (PREC "ieee", as torch's matmul and Flex by default; "tf32"
    for half inputs, where it does not apply), and under the interpreter bf16 operands in fp32 (triton 3.6's
    interpreter multiplies bf16 operands wrongly; a compiled kernel takes them as they are)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _band_mask(qm, kn, L, W):
    """True where query qm may see key kn (qm - W < kn <= qm < L), broadcast: queries on one axis, keys on
    the other (so a transposed tile gets its mask made transposed, not a transposed mask)."""
    return (kn <= qm) & (kn > qm - W) & (qm < L) & (kn < L)


@triton.jit
def _program(H, BLOCK: tl.constexpr, DP: tl.constexpr):
    """This program's (batch, head, first row, its BLOCK rows, the head-dim lanes). The grid is
    (batch * heads, row blocks): batch * heads on axis 0, whose limit is 2**31 - 1 (axis 1 stops at
    65535). Batch and head in int64, so offsets past 2**31 elements do not wrap."""
    bh = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK
    return bh // H, bh % H, first, first + tl.arange(0, BLOCK), tl.arange(0, DP)


@triton.jit
def _tile_ptrs(X, sb, sh, sl, sd, b, h, rows, offs_d):
    return X + b * sb + h * sh + rows[:, None].to(tl.int64) * sl + offs_d[None, :] * sd


@triton.jit
def _load_tile(X, sb, sh, sl, sd, b, h, rows, offs_d, L, HEAD_DIM: tl.constexpr):
    """Rows ``rows`` of (b, h) of a (B, H, L, D) tensor, zero outside L and HEAD_DIM."""
    ok = (rows[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(_tile_ptrs(X, sb, sh, sl, sd, b, h, rows, offs_d), mask=ok, other=0.0)


@triton.jit
def _store_tile(X, value, sb, sh, sl, sd, b, h, rows, offs_d, L, HEAD_DIM: tl.constexpr):
    ok = (rows[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
    tl.store(_tile_ptrs(X, sb, sh, sl, sd, b, h, rows, offs_d), value.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _load_rows(X, sb, sh, b, h, rows, L):
    """A (B, H, L) fp32 tensor's rows (the log-sum-exp, the row sums)."""
    return tl.load(X + b * sb + h * sh + rows, mask=rows < L, other=0.0)


@triton.jit
def _first_key_block(first_query, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr):
    """The first of the N_BLOCKS key blocks the queries first_query .. first_query + BLOCK - 1 see (0 near
    the start, where the last ones then lie past the queries and are masked out)."""
    return tl.maximum(first_query - (N_BLOCKS - 1) * BLOCK, 0)


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, qk_scale, L, W, H,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sob, soh, sol, sod, slb, slh,
    HEAD_DIM: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    b, h, first, offs_m, offs_d = _program(H, BLOCK, DP)
    q = _load_tile(Q, sqb, sqh, sql, sqd, b, h, offs_m, offs_d, L, HEAD_DIM)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, DP], tl.float32)
    start = _first_key_block(first, BLOCK, N_BLOCKS)
    for i in range(N_BLOCKS):
        offs_n = start + i * BLOCK + tl.arange(0, BLOCK)
        k = _load_tile(K, skb, skh, skl, skd, b, h, offs_n, offs_d, L, HEAD_DIM)
        v = _load_tile(V, svb, svh, svl, svd, b, h, offs_n, offs_d, L, HEAD_DIM)
        s = _dot(q, tl.trans(k), UPCAST, PREC) * qk_scale  # log2 units
        s = tl.where(_band_mask(offs_m[:, None], offs_n[None, :], L, W), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PREC)
        m_i = m_new
    l_safe = tl.where(offs_m < L, l_i, 1.0)
    _store_tile(O, acc / l_safe[:, None], sob, soh, sol, sod, b, h, offs_m, offs_d, L, HEAD_DIM)
    tl.store(LSE + b * slb + h * slh + offs_m, m_i + tl.math.log2(l_safe), mask=offs_m < L)


@triton.jit
def _delta_kernel(
    O, DO, DELTA, L, H, sob, soh, sol, sod, sdb, sdh, sdl, sdd, slb, slh,
    HEAD_DIM: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b, h, _, offs_m, offs_d = _program(H, BLOCK, DP)
    o = _load_tile(O, sob, soh, sol, sod, b, h, offs_m, offs_d, L, HEAD_DIM)
    do = _load_tile(DO, sdb, sdh, sdl, sdd, b, h, offs_m, offs_d, L, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * slb + h * slh + offs_m, delta, mask=offs_m < L)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, L, W, H,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sdb, sdh, sdl, sdd, slb, slh,
    sgb, sgh, sgl, sgd,
    HEAD_DIM: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block, over the N_BLOCKS query blocks from its own on, the ones that see it
    (past the sequence they are masked out); dk and dv share the strides sg*."""
    b, h, first, offs_n, offs_d = _program(H, BLOCK, DP)
    k = _load_tile(K, skb, skh, skl, skd, b, h, offs_n, offs_d, L, HEAD_DIM)
    v = _load_tile(V, svb, svh, svl, svd, b, h, offs_n, offs_d, L, HEAD_DIM)
    dk = tl.zeros([BLOCK, DP], tl.float32)
    dv = tl.zeros([BLOCK, DP], tl.float32)
    for i in range(N_BLOCKS):
        offs_m = first + i * BLOCK + tl.arange(0, BLOCK)
        q = _load_tile(Q, sqb, sqh, sql, sqd, b, h, offs_m, offs_d, L, HEAD_DIM)
        do = _load_tile(DO, sdb, sdh, sdl, sdd, b, h, offs_m, offs_d, L, HEAD_DIM)
        lse = _load_rows(LSE, slb, slh, b, h, offs_m, L)
        delta = _load_rows(DELTA, slb, slh, b, h, offs_m, L)
        st = _dot(k, tl.trans(q), UPCAST, PREC) * qk_scale  # (keys, queries), log2 units
        band = _band_mask(offs_m[None, :], offs_n[:, None], L, W)
        pt = tl.where(band, tl.math.exp2(st - lse[None, :]), 0.0)
        dv += _dot(pt.to(do.dtype), do, UPCAST, PREC)
        dst = pt * (_dot(v, tl.trans(do), UPCAST, PREC) - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, UPCAST, PREC)
    _store_tile(DK, dk * sm_scale, sgb, sgh, sgl, sgd, b, h, offs_n, offs_d, L, HEAD_DIM)
    _store_tile(DV, dv, sgb, sgh, sgl, sgd, b, h, offs_n, offs_d, L, HEAD_DIM)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, L, W, H,
    sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sdb, sdh, sdl, sdd, slb, slh,
    sgb, sgh, sgl, sgd,
    HEAD_DIM: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dQ of one query block, over the key blocks it sees."""
    b, h, first, offs_m, offs_d = _program(H, BLOCK, DP)
    q = _load_tile(Q, sqb, sqh, sql, sqd, b, h, offs_m, offs_d, L, HEAD_DIM)
    do = _load_tile(DO, sdb, sdh, sdl, sdd, b, h, offs_m, offs_d, L, HEAD_DIM)
    lse = _load_rows(LSE, slb, slh, b, h, offs_m, L)
    delta = _load_rows(DELTA, slb, slh, b, h, offs_m, L)
    dq = tl.zeros([BLOCK, DP], tl.float32)
    start = _first_key_block(first, BLOCK, N_BLOCKS)
    for i in range(N_BLOCKS):
        offs_n = start + i * BLOCK + tl.arange(0, BLOCK)
        k = _load_tile(K, skb, skh, skl, skd, b, h, offs_n, offs_d, L, HEAD_DIM)
        v = _load_tile(V, svb, svh, svl, svd, b, h, offs_n, offs_d, L, HEAD_DIM)
        s = _dot(q, tl.trans(k), UPCAST, PREC) * qk_scale
        p = tl.where(_band_mask(offs_m[:, None], offs_n[None, :], L, W), tl.math.exp2(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, tl.trans(v), UPCAST, PREC) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PREC)
    _store_tile(DQ, dq * sm_scale, sgb, sgh, sgl, sgd, b, h, offs_m, offs_d, L, HEAD_DIM)


# ----------------------------------------------------------------------------------------------------
# Ops: what each allocates (the fakes make the same), and the launches
# ----------------------------------------------------------------------------------------------------


def _fwd_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, _ = q.shape
    out = torch.empty((B, H, L, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    return out, lse


def _bwd_outputs(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, L, _ = q.shape
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = torch.empty((B, H, L), dtype=torch.float32, device=q.device)  # rowsum(dO * O)
    return dq, dk, dv, delta


def _interpreted() -> bool:
    return not isinstance(_fwd_kernel, triton.runtime.JITFunction)


def _check_launchable(q: torch.Tensor) -> None:
    if q.device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "window_attention_triton: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before "
            "importing memfit); use memfit.ops.attention.attention on the CPU"
        )


def _meta(q: torch.Tensor, window: int) -> dict:
    """The kernels' compile-time settings: head dim, its power-of-two padding, the tile, and N_BLOCKS, the
    key blocks a query block sees (= the query blocks that see a key block): 1 + ceil((w - 1) / BLOCK),
    a constant loop bound (pipelined when compiled; the interpreter takes no runtime bound)."""
    D = q.shape[-1]
    upcast = _interpreted() and q.dtype == torch.bfloat16
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    n_blocks = 1 + triton.cdiv(window - 1, BLOCK)
    return {"HEAD_DIM": D, "DP": max(16, triton.next_power_of_2(D)), "num_warps": 4 if D <= 64 else 8,
            "UPCAST": upcast, "PREC": prec, "BLOCK": BLOCK, "N_BLOCKS": n_blocks}  # fmt: skip


OP_TAGS = (torch.Tag.needs_fixed_stride_order,)


@torch.library.custom_op("memfit::window_attn_fwd", mutates_args=(), tags=OP_TAGS)
def window_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, log-sum-exp in log2 units (B, H, L) fp32)."""
    _check_launchable(q)
    B, H, L, _ = q.shape
    out, lse = _fwd_outputs(q, v)
    window = min(window, L)  # the same attention; a shorter loop
    grid = (B * H, triton.cdiv(L, BLOCK))
    _fwd_kernel[grid](
        q, k, v, out, lse, scale * _LOG2E, L, window, H,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride()[:2], **_meta(q, window),
    )  # fmt: skip
    return out, lse


@window_attn_fwd.register_fake
def _(q, k, v, window, scale):
    return _fwd_outputs(q, v)


@torch.library.custom_op("memfit::window_attn_bwd", mutates_args=(), tags=OP_TAGS)
def window_attn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, window: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv, delta): delta is the row sums the kernels share (dropped by the caller)."""
    _check_launchable(q)
    B, H, L, _ = q.shape
    dq, dk, dv, delta = _bwd_outputs(q, k, v)
    window = min(window, L)
    meta = _meta(q, window)
    grid = (B * H, triton.cdiv(L, BLOCK))
    _delta_kernel[grid](
        out, dout, delta, L, H, *out.stride(), *dout.stride(), *delta.stride()[:2],
        HEAD_DIM=meta["HEAD_DIM"], DP=meta["DP"], BLOCK=BLOCK,
    )  # fmt: skip
    common = (
        q, k, v, dout, lse, delta, scale * _LOG2E, scale, L, window, H,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride()[:2],
    )  # fmt: skip
    assert dk.stride() == dv.stride()
    _dkdv_kernel[grid](*common[:6], dk, dv, *common[6:], *dk.stride(), **meta)
    _dq_kernel[grid](*common[:6], dq, *common[6:], *dq.stride(), **meta)
    return dq, dk, dv, delta


@window_attn_bwd.register_fake
def _(q, k, v, out, lse, dout, window, scale):
    return _bwd_outputs(q, k, v)


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, scale):
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, lse = torch.ops.memfit.window_attn_fwd(q, k, v, window, scale)
        ctx.cfg = (window, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        window, scale = ctx.cfg
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv, delta = torch.ops.memfit.window_attn_bwd(q, k, v, out, lse, dout, window, scale)
        del delta
        return dq, dk, dv, None, None


def window_attention_triton(q, k, v, window: int, scale: float | None = None) -> torch.Tensor:
    """Causal window attention (query i sees keys i-window+1 .. i): q, k, v (B, H, L, D) -> (B, H, L, D)."""
    if q.shape != k.shape or k.shape[:-1] != v.shape[:-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"window_attention_triton: q, k, v must be (B, H, L, D) alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"window_attention_triton: fp32/fp16/bf16 inputs of one dtype, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")  # fmt: skip
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"window_attention_triton: head dim up to {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window_attention_triton: window must be a positive int, got {window!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _WindowAttention.apply(q, k, v, int(window), scale)


def why_unavailable() -> str | None:
    return None


def triton_window(q, k, v, window, scale):
    """The registry's window-attention convention: a causal window of ``window`` keys."""
    return window_attention_triton(q, k, v, window, scale)


def problem(q, k, v, window: int = 0, scale=None) -> str | None:
    """None when the band kernels take these inputs: fp32/fp16/bf16 of one dtype, equal head dims up to
    ``MAX_HEAD_DIM``."""
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"{q.dtype}: the band kernels take fp32/fp16/bf16 of one dtype"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] != q.shape[-1] or k.shape != q.shape:
        return f"head dims over {MAX_HEAD_DIM} or unequal"
    return None
