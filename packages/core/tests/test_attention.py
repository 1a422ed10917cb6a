"""Every attention path against the plain masked-softmax reference: forward and gradients."""

from __future__ import annotations

import math
import warnings

import memfit.ops.attention as A
import pytest
import torch
from memfit.estimate.steps import measure_peak
from memfit.estimate.tracker import fake_mode
from memfit.ops import registry
from memfit.ops.attention import attention, attention_ref, band_attention, blocks, flex, force_backend
from torch.nn.attention.flex_attention import create_block_mask


def _qkv(B, H, Lq, D, Lk=None, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Lk = Lq if Lk is None else Lk
    shapes = [(B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def _fwd_bwd(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    return out, grads


def _assert_close(got, want, atol, rtol=0.0):
    out, grads = got
    out_r, grads_r = want
    torch.testing.assert_close(out.float(), out_r.float(), atol=atol, rtol=rtol)
    for name, a, b in zip("qkv", grads, grads_r):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=f"grad {name}")


# ----------------------------------------------------------------------------------------------------
# band path (the CPU window path)
# ----------------------------------------------------------------------------------------------------

# (B, H, L, D, window, block): odd lengths, L < w, L not a multiple of the block, w = 1, band > 1 block.
BAND_CASES = [
    (2, 3, 37, 8, 5, 4),
    (1, 2, 100, 16, 17, 8),
    (1, 1, 10, 4, 20, 64),
    (2, 2, 257, 8, 64, None),
    (1, 1, 64, 4, 1, 16),
    (1, 2, 129, 8, 128, 32),
    (1, 1, 33, 8, 32, 33),
]


@pytest.mark.parametrize("B,H,L,D,w,block", BAND_CASES)
def test_band_matches_reference_fp32(B, H, L, D, w, block):
    q, k, v = _qkv(B, H, L, D)
    got = _fwd_bwd(lambda q, k, v: band_attention(q, k, v, w, block=block), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w), q, k, v)
    _assert_close(got, want, atol=1e-5)


def test_band_scale_and_small_groups(monkeypatch):
    # A tiny group budget forces one block per group: the overlap-add across groups must still be exact.
    monkeypatch.setattr(A, "BAND_GROUP_BYTES", 1)
    q, k, v = _qkv(2, 2, 75, 8)
    got = _fwd_bwd(lambda q, k, v: band_attention(q, k, v, 19, scale=0.3, block=8), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=19, scale=0.3), q, k, v)
    _assert_close(got, want, atol=1e-5)


def test_band_value_head_dim_may_differ():
    q, k, _ = _qkv(1, 2, 50, 8)
    v = torch.randn(1, 2, 50, 12, requires_grad=True)
    got = _fwd_bwd(lambda q, k, v: band_attention(q, k, v, 7, block=8), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=7), q, k, v)
    _assert_close(got, want, atol=1e-5)


def test_band_gradcheck_float64():
    q, k, v = _qkv(1, 2, 13, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: band_attention(q, k, v, 4, block=3), (q, k, v))


def test_band_bf16_close_to_fp32_reference():
    q, k, v = _qkv(2, 2, 90, 16, dtype=torch.bfloat16)
    got = _fwd_bwd(lambda q, k, v: band_attention(q, k, v, 24, block=16), q, k, v)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got[1])
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=24), q32, k32, v32)
    _assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_band_ignores_autocast_and_keeps_input_dtype():
    q, k, v = _qkv(1, 2, 40, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = band_attention(q, k, v, 9, block=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, attention_ref(q, k, v, window=9), atol=1e-5, rtol=0)


def test_band_runs_under_fake_tensors():
    # memfit.estimate.memory estimates full-size training steps with fake tensors: the band path must trace.
    with fake_mode():
        q, k, v = (torch.randn(2, 4, 1024, 64, requires_grad=True) for _ in range(3))
        out = band_attention(q, k, v, 256)
        out.sum().backward()
        assert out.shape == (2, 4, 1024, 64) and q.grad.shape == q.shape


def _fit_exponent(xs, ys):
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _peak_fwd_bwd(fn, L, w):
    q, k, v = _qkv(1, 2, L, 16)
    g = torch.randn(1, 2, L, 16)
    # q, k, v and the incoming gradient count for every path alike, as they would inside a model.
    with measure_peak(existing=[q, k, v, g]) as m:
        fn(q, k, v, w).backward(g)
    return m.peak_bytes


def test_band_memory_linear_in_length_reference_quadratic():
    Ls, w = [512, 1024, 2048], 32
    band = [_peak_fwd_bwd(lambda q, k, v, w: band_attention(q, k, v, w), L, w) for L in Ls]
    ref = [_peak_fwd_bwd(lambda q, k, v, w: attention_ref(q, k, v, window=w), L, w) for L in Ls]
    e_band, e_ref = _fit_exponent(Ls, band), _fit_exponent(Ls, ref)
    assert e_band <= 1.2, f"band path memory exponent {e_band:.2f} (peaks {band})"
    assert e_ref >= 1.7, f"reference memory exponent {e_ref:.2f} (peaks {ref})"
    assert band[-1] * 4 < ref[-1]


def test_band_memory_not_above_dense_causal_sdpa():
    # SDPA's CPU flash kernel keeps O(L) memory; the band path must not cost more for it to be worth it.
    L, w = 4096, 256

    def peak(fn):
        q, k, v = _qkv(1, 4, L, 64)
        g = torch.randn(1, 4, L, 64)
        with measure_peak(existing=[q, k, v, g]) as m:
            fn(q, k, v).backward(g)
        return m.peak_bytes

    band = peak(lambda q, k, v: attention(q, k, v, window=w))
    dense = peak(lambda q, k, v: attention(q, k, v, causal=True))
    assert band <= dense, f"band path peak {band / 2**20:.1f} MiB > dense causal SDPA {dense / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------------
# dispatch, SDPA, ref and flex (CPU forward) paths
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_sdpa_full_attention_matches_reference(causal, scale):
    q, k, v = _qkv(2, 3, 45, 16)
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, causal=causal, scale=scale), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, causal=causal, scale=scale), q, k, v)
    _assert_close(got, want, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_matches_reference(causal):
    q, k, v = _qkv(2, 2, 7, 16, Lk=31)
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, causal=causal), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, causal=causal), q, k, v)
    _assert_close(got, want, atol=1e-5)


def test_window_covering_sequence_uses_sdpa_and_matches():
    q, k, v = _qkv(1, 2, 21, 8)
    assert A.select_backend(q, k, v, window=21) == "sdpa"
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, window=32), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=32), q, k, v)
    _assert_close(got, want, atol=1e-5)


@pytest.mark.parametrize(("L", "w", "path", "fn"), [(99, 5, "band", "band_attention"),
                                                    (99, 10, "blocks", "sdpa_blocks")])  # fmt: skip
def test_auto_dispatch_on_cpu_window(monkeypatch, L, w, path, fn):
    """CPU: the band path once L >= BAND_MIN_RATIO windows, SDPA on query blocks below that."""
    q, k, v = _qkv(1, 2, L, 8)
    assert A.select_backend(q, k, v, window=w) == path
    assert A.select_backend(q, k, v) == "sdpa"
    calls = []
    real = getattr(A, fn)
    monkeypatch.setitem(registry._loaded, registry.record_of("attention", path).load,
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    registry.reset()
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, window=w), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w), q, k, v)
    assert calls, f"auto dispatch did not take the {path} path"
    assert registry.ran("attention") == {path: 1}
    _assert_close(got, want, atol=1e-5)


# (L, w, block): one block (dense SDPA with a band mask), interior blocks sharing a mask, a ragged last
# block, w = 1, a window longer than a block, block 1.
@pytest.mark.parametrize(("L", "w", "block"), [(50, 7, None), (130, 9, 16), (77, 1, 8), (96, 40, 16),
                                               (33, 5, 1), (64, 63, 64)])  # fmt: skip
def test_sdpa_blocks_matches_reference(L, w, block):
    q, k, v = _qkv(2, 3, L, 16)
    got = _fwd_bwd(lambda q, k, v: A.sdpa_blocks(q, k, v, w, block=block), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w), q, k, v)
    _assert_close(got, want, atol=1e-5)
    got = _fwd_bwd(lambda q, k, v: A.sdpa_blocks(q, k, v, w, scale=0.3, block=block), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w, scale=0.3), q, k, v)
    _assert_close(got, want, atol=1e-5)


def test_sdpa_blocks_runs_under_fake_tensors_and_forced():
    with fake_mode():
        q, k, v = (torch.randn(2, 4, 1024, 64, requires_grad=True) for _ in range(3))
        out = A.sdpa_blocks(q, k, v, 256)
        out.sum().backward()
        assert out.shape == (2, 4, 1024, 64) and q.grad.shape == q.shape
    q, k, v = _qkv(1, 2, 40, 8)
    torch.testing.assert_close(attention(q, k, v, window=6, backend="blocks"),
                               attention_ref(q, k, v, window=6), atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize(
    "q0, q1, k0, window", [(0, 7, 0, 3), (0, 40, -29, 30), (160, 190, 131, 30), (5, 9, 2, 100)]
)
def test_window_mask_is_the_band_it_names(q0, q1, k0, window):
    """Query q0+i sees key k0+j exactly when k0+j <= q0+i < k0+j+window (checked element by element)."""
    keys, queries = range(k0, q1), range(q0, q1)
    want = torch.tensor([[key <= query < key + window for key in keys] for query in queries])
    assert torch.equal(blocks._window_mask(q0, q1, k0, window, "cpu"), want)


def test_sdpa_blocks_after_an_estimate_of_the_same_shapes():
    """sdpa_blocks matches the reference on a first block, three interior ones sharing a mask and a ragged
    last one (160-190), also right after an estimate (fake tensors) of the same shapes."""
    with fake_mode():
        q, k, v = (torch.randn(1, 2, 190, 8, requires_grad=True) for _ in range(3))
        A.sdpa_blocks(q, k, v, 30, block=40).sum().backward()
    q, k, v = _qkv(1, 2, 190, 8)
    got = _fwd_bwd(lambda q, k, v: A.sdpa_blocks(q, k, v, 30, block=40), q, k, v)
    _assert_close(got, _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=30), q, k, v), atol=1e-5)


def test_force_backend_context_and_keyword():
    q, k, v = _qkv(1, 2, 30, 8)
    want = attention_ref(q, k, v, window=6)
    with force_backend("ref"):
        torch.testing.assert_close(attention(q, k, v, window=6), want, atol=0, rtol=0)
    torch.testing.assert_close(attention(q, k, v, window=6, backend="band"), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sdpa path covers windows only"):
        attention(q, k, v, window=6, backend="sdpa")
    with pytest.raises(ValueError, match="unknown attention backend"), force_backend("nope"):
        pass


def test_flex_forward_on_cpu_matches_reference():
    # No FlexAttention backward on CPU; its forward (eager) still checks the cached block mask.
    A.clear_block_mask_cache()
    q, k, v = (t.detach() for t in _qkv(2, 3, 150, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = attention(q, k, v, window=40, backend="flex")
    torch.testing.assert_close(out, attention_ref(q, k, v, window=40), atol=1e-5, rtol=0)
    assert A.block_mask_cache_info()["keys"] == [(150, 40, "cpu", 128)]


@pytest.mark.parametrize("L,w", [(150, 40), (257, 64), (200, 128)])
def test_flex_narrow_forward_on_cpu_matches_reference(L, w):
    """The narrow candidate's 64-wide block mask (eager forward on the CPU; compiled on CUDA in the cuda
    tests): every key a query may see, and no other, in blocks of 64."""
    A.clear_block_mask_cache()
    q, k, v = (t.detach() for t in _qkv(2, 3, L, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = attention(q, k, v, window=w, backend="flex_narrow")
    torch.testing.assert_close(out, attention_ref(q, k, v, window=w), atol=1e-5, rtol=0)
    mask = A.window_block_mask(L, w, "cpu", 64)
    assert A.block_mask_cache_info()["keys"] == [(L, w, "cpu", 64)]
    assert mask.BLOCK_SIZE == (64, 64)
    # a block row holds the blocks its queries' windows reach: the diagonal and ceil((w-1)/64) before it
    per_row = mask.kv_num_blocks + (mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else 0)
    assert int(per_row.max()) == 1 + -(-(w - 1) // 64)


def test_block_mask_cache_is_bounded_lru_and_reports_bytes():
    A.clear_block_mask_cache()
    A.set_block_mask_cache_size(4)
    try:
        seen_bytes = []
        for i, L in enumerate(range(130, 130 + 20 * 37, 37)):
            mask = A.window_block_mask(L, 64, "cpu")
            assert mask.shape[:2] == (1, 1), "mask must broadcast over batch and heads (B=None, H=None)"
            assert A.window_block_mask(L, 64, "cpu") is mask, "a key must be built once"
            info = A.block_mask_cache_info()
            assert info["entries"] == min(i + 1, 4) <= info["max_entries"] == 4
            assert info["bytes"] > 0
            seen_bytes.append(info["bytes"])
        # The longest lengths are the ones kept, and their bytes match the masks' own tensors.
        kept = A.block_mask_cache_info()["keys"]
        assert [key[0] for key in kept] == [130 + 37 * i for i in range(16, 20)]
        direct = create_block_mask(
            flex._window_mask_mod(64), None, None, kept[-1][0], kept[-1][0], device="cpu"
        )
        assert flex._block_mask_nbytes(direct) > 0
        # LRU: touching the oldest entry saves it from the next eviction.
        A.window_block_mask(kept[0][0], 64, "cpu")
        A.window_block_mask(50, 64, "cpu")
        lengths = [key[0] for key in A.block_mask_cache_info()["keys"]]
        assert kept[0][0] in lengths and kept[1][0] not in lengths
        A.set_block_mask_cache_size(2)
        assert A.block_mask_cache_info()["entries"] == 2
        with pytest.raises(ValueError, match="cache size"):
            A.set_block_mask_cache_size(0)
    finally:
        A.set_block_mask_cache_size(8)
        A.clear_block_mask_cache()


# ----------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,shapes,match",
    [
        ({"window": 0}, None, "window must be a positive int"),
        ({"window": -3}, None, "window must be a positive int"),
        ({"window": 2.5}, None, "window must be a positive int"),
        ({"window": True}, None, "window must be a positive int"),
        ({}, [(1, 2, 8, 16), (1, 2, 8, 8), (1, 2, 8, 8)], "head dims differ"),
        ({"window": 4}, [(1, 2, 8, 16), (1, 2, 12, 16), (1, 2, 12, 16)], "Lq == Lk"),
        ({}, [(1, 2, 8, 16), (1, 2, 12, 16), (1, 2, 11, 16)], "lengths differ"),
        ({}, [(2, 8, 16), (2, 8, 16), (2, 8, 16)], "must be 4-D"),
        ({}, [(1, 2, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)], "batch/heads must match"),
        ({"causal": True}, [(1, 2, 9, 16), (1, 2, 4, 16), (1, 2, 4, 16)], "no keys"),
        ({"scale": "big"}, None, "scale must be"),
        ({"backend": "fast"}, None, "unknown attention backend"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, shapes, match):
    shapes = shapes or [(1, 2, 8, 16)] * 3
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kwargs)


def test_mixed_dtypes_rejected():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(ValueError, match="dtypes differ"):
        attention(q, k.double(), v)


# ----------------------------------------------------------------------------------------------------
# CUDA paths
# ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("L,w", [(257, 64), (1024, 128), (100, 200)])
def test_flex_on_cuda_matches_reference(L, w):
    from memfit.ops import registry as probes

    q, k, v = _qkv(2, 4, L, 64, device="cuda")
    probes.reset()
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, window=w, backend="flex" if w < L else None), q, k, v)
    assert probes.ran("attention") == {"flex" if w < L else "sdpa": 1}
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w), q, k, v)
    _assert_close(got, want, atol=2e-4, rtol=1e-3)


@pytest.mark.cuda
def test_band_on_cuda_matches_reference():
    q, k, v = _qkv(2, 4, 300, 32, device="cuda")
    got = _fwd_bwd(lambda q, k, v: band_attention(q, k, v, 50), q, k, v)
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=50), q, k, v)
    _assert_close(got, want, atol=2e-4, rtol=1e-3)


@pytest.mark.cuda_kernels("flash")
def test_flash_on_cuda_matches_reference():
    """flash-attn's window kernel (the cuda extra: the kernels CI job builds it) against the reference."""
    from memfit.ops import registry as probes

    assert A.flash_available(), "flash-attn does not import: install the cuda extra (README, GPU)"
    q, k, v = _qkv(2, 4, 513, 64, dtype=torch.bfloat16, device="cuda")
    assert A.select_backend(q, k, v, window=128) == "flash"
    probes.reset()
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, window=128), q, k, v)
    assert probes.ran("attention") == {"flash": 1}
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=128), q32, k32, v32)
    _assert_close(got, want, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------------------------
# CUDA window attention chosen by measurement (the tuning logic, on the CPU with stand-in candidates)
# ----------------------------------------------------------------------------------------------------


TIMED = ["flex", "flex_narrow", "varlen", "triton", "blocks"]


@pytest.fixture
def stand_ins(monkeypatch):
    """A GPU faked for the registry, the timed window records replaced by stand-ins that compute the
    reference and count their calls, and a fresh timing state; tests set ``registry.time_call``."""
    from tests.fake_kernels import fake_gpu

    fake_gpu(monkeypatch)
    calls = dict.fromkeys(TIMED, 0)

    def make(name):
        def fn(q, k, v, window, scale):
            calls[name] += 1
            return attention_ref(q, k, v, window=window, scale=scale)

        fn.record = name
        return fn

    for name in TIMED:
        monkeypatch.setitem(registry._loaded, registry.record_of("attention", name).load, make(name))
    monkeypatch.setattr(registry, "_timed_choice", {})
    monkeypatch.setattr(registry, "_timing_failed", {})
    monkeypatch.setattr(registry, "_said_timing", {"attention"})
    registry.reset()
    return calls


def test_cuda_window_times_each_candidate_once_and_keeps_the_fastest(monkeypatch, stand_ins):
    timed = []
    speed = {"flex": 2.0, "flex_narrow": 1.5, "varlen": 1.0, "triton": 2.5, "blocks": 3.0}

    def clock(fn, args, backward):
        timed.append((fn.record, backward))
        return speed[fn.record]

    monkeypatch.setattr(registry, "time_call", clock)
    q, k, v = _qkv(2, 2, 64, 16, dtype=torch.bfloat16)
    out = attention(q, k, v, window=8)
    assert sorted(timed) == [("blocks", True), ("flex", True), ("flex_narrow", True), ("triton", True),
                             ("varlen", True)]  # fmt: skip
    assert stand_ins["varlen"] == 1 and stand_ins["flex"] == 0
    attention(q, k, v, window=8)
    assert len(timed) == 5 and stand_ins["varlen"] == 2  # kept: no second timing
    with torch.no_grad():  # another key: forward only (the narrow Flex is for training keys)
        attention(q, k, v, window=8)
    assert ("varlen", False) in timed and ("flex_narrow", False) not in timed
    assert A.cuda_window_choices() == {(2, 2, 64, 16, torch.bfloat16, 8, True): "varlen",
                                       (2, 2, 64, 16, torch.bfloat16, 8, False): "varlen"}  # fmt: skip
    assert registry.ran("attention") == {"varlen": 3}
    torch.testing.assert_close(out, attention_ref(q, k, v, window=8))


def test_cuda_window_leaves_out_fp32_for_flash_and_a_failing_candidate(monkeypatch, stand_ins):
    def clock(fn, args, backward):
        if fn.record == "flex":
            raise RuntimeError("no kernel for this GPU")
        return {"varlen": 1.0, "blocks": 3.0, "flex_narrow": 4.0, "triton": 5.0}[fn.record]

    monkeypatch.setattr(registry, "time_call", clock)
    q, k, v = _qkv(1, 2, 32, 16)  # fp32: FlashAttention-2 does not take it
    with pytest.warns(RuntimeWarning, match="candidate flex left out for torch.float32, last dim 16"):
        attention(q, k, v, window=4)
    assert list(A.cuda_window_choices().values()) == ["blocks"]
    assert ("attention", "flex", torch.float32, 16) in registry._timing_failed and stand_ins["blocks"] == 1
    # left out for inputs of that kind only: another head dim still offers it
    assert A.select_backend(*_qkv(1, 2, 32, 32), window=4) == "flex"
    assert A.select_backend(q, k, v, window=4) != "flex"


def test_timing_says_once_per_process_what_the_first_step_of_a_shape_waits_for(
    monkeypatch, stand_ins, capsys
):
    monkeypatch.setattr(registry, "time_call", lambda fn, args, backward: 1.0)
    monkeypatch.setattr(registry, "_said_timing", set())
    q, k, v = _qkv(1, 2, 64, 16, dtype=torch.bfloat16)
    attention(q, k, v, window=8)
    attention(*_qkv(1, 2, 96, 16, dtype=torch.bfloat16), window=8)  # a second shape: timed, not said
    err = capsys.readouterr().err
    assert err.count("[memfit] timing 5 attention kernels once per new shape") == 1, err
    assert "flex_narrow" in err


def test_the_band_kernels_are_offered_for_what_they_take():
    """fp32/fp16/bf16 of one dtype, equal head dims up to attention.triton.MAX_HEAD_DIM."""
    from memfit.ops.attention.triton import MAX_HEAD_DIM, problem

    assert problem(*_qkv(1, 2, 32, 16), 4) is None  # fp32 too (full-precision dots)
    assert problem(*_qkv(1, 2, 32, MAX_HEAD_DIM, dtype=torch.bfloat16), 4) is None
    for q, k, v in (_qkv(1, 2, 32, 16, dtype=torch.float64), _qkv(1, 2, 32, MAX_HEAD_DIM + 8),
                    [*_qkv(1, 2, 32, 16)[:2], torch.zeros(1, 2, 32, 8)]):  # fmt: skip
        assert problem(q, k, v, 4) is not None


def test_the_narrow_flex_candidate_is_timed_for_narrow_windows_in_training_only(monkeypatch, stand_ins):
    timed = []

    def clock(fn, args, backward):
        timed.append((fn.record, args[3]))
        return 1.0

    monkeypatch.setattr(registry, "time_call", clock)
    q, k, v = _qkv(1, 2, 512, 16, dtype=torch.bfloat16)
    for w in (A.FLEX_NARROW_MAX_WINDOW, A.FLEX_NARROW_MAX_WINDOW + 1):
        attention(q, k, v, window=w)
    with torch.no_grad():  # a forward-only key (generation, evaluation): no autotuned compile per length
        attention(q, k, v, window=64)
    narrow = [w for name, w in timed if name == "flex_narrow"]
    assert narrow == [A.FLEX_NARROW_MAX_WINDOW]
    assert [w for name, w in timed if name == "flex"] == [128, 129, 64]


def _candidate(name):
    return registry.resolve(registry.record_of("attention", name).load)


CANDIDATE_CASES = [
    (name, L, w, layout)
    for L, w, layout in [(1024, 64, "BHLD"), (513, 256, "BHLD"), (300, 64, "model")]
    for name in ["flex", "flex_narrow", "varlen", "triton", "blocks"]
    if not (name == "flex_narrow" and w > A.FLEX_NARROW_MAX_WINDOW)  # offered for narrow windows only
]


@pytest.mark.cuda
@pytest.mark.parametrize("name,L,w,layout", CANDIDATE_CASES)
def test_each_cuda_window_candidate_matches_reference(name, L, w, layout):
    """Each candidate against the reference, on contiguous (B, H, L, D) inputs and on the strided views a
    model hands over (q, k, v split from one (B, L, 3 * H * D) projection, heads transposed)."""
    q, k, v = _qkv(2, 4, L, 64, dtype=torch.bfloat16, device="cuda")
    if layout == "model":
        qkv = torch.cat([t.detach().transpose(1, 2).reshape(2, L, 4 * 64) for t in (q, k, v)], -1)
        q, k, v = (t.view(2, L, 4, 64).transpose(1, 2) for t in qkv.split(4 * 64, -1))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # leaves that keep the views' strides
        assert not q.is_contiguous()
    got = _fwd_bwd(lambda q, k, v: _candidate(name)(q, k, v, w, None), q, k, v)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=w), q32, k32, v32)
    _assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
def test_cuda_auto_window_is_tuned_and_matches_reference():
    from memfit.ops import registry

    q, k, v = _qkv(2, 4, 2048, 64, dtype=torch.bfloat16, device="cuda")
    registry.reset()
    got = _fwd_bwd(lambda q, k, v: attention(q, k, v, window=128), q, k, v)
    (name,) = registry.ran("attention")
    assert registry.record_of("attention", name).timed and list(A.cuda_window_choices().values())[-1] == name
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _fwd_bwd(lambda q, k, v: attention_ref(q, k, v, window=128), q32, k32, v32)
    _assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize("autotune,block", [(False, 128), (True, 64)])
def test_the_compiled_flex_wrappers_trace_and_match_the_reference_on_the_cpu(autotune, block):
    """What the CUDA candidates compile (``_flex_default`` / ``_flex_autotuned``, each its own code object),
    compiled here by inductor's CPU template: dynamo follows the wrapper into flex_attention with the
    cached block mask and the kernel options, and the result is the window's (~15 s: a C++ compile)."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 256, 16))
    flex._flex(q, autotune)  # imports flex_attention for the wrappers
    fn = torch.compile(flex._flex_autotuned if autotune else flex._flex_default, dynamic=False)
    options = {"ROWS_GUARANTEED_SAFE": True} if autotune else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(q, k, v, A.window_block_mask(256, 64, "cpu", block), None, options)
    torch.testing.assert_close(out, attention_ref(q, k, v, window=64), atol=2e-5, rtol=0)
