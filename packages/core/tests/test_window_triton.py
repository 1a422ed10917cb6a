"""memfit's Triton window-attention kernels against attention_ref: on the CPU under Triton's interpreter
(conftest sets TRITON_INTERPRET=1 where there is no CUDA), on a GPU compiled (the `cuda` tests)."""

from __future__ import annotations

import pytest
import torch
from memfit.ops import attention as A
from memfit.ops import registry
from memfit.ops.attention import attention, attention_ref
from memfit.ops.attention import triton as W

interpreted = pytest.mark.skipif(
    not W._interpreted(), reason="Triton's interpreter is off here (a CUDA machine): the cuda tests cover it"
)
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 4e-2}


def _qkv(B, H, L, D, dtype=torch.float32, device="cpu", layout="BHLD", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "model":  # views of one (B, L, 3 * H * D) projection, heads transposed, as a model has them
        qkv = torch.randn(B, L, 3 * H * D, generator=g).to(device, dtype)
        views = [t.view(B, L, H, D).transpose(1, 2) for t in qkv.split(H * D, -1)]
        return [t.detach().requires_grad_() for t in views]
    return [torch.randn(B, H, L, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


def _check(B, H, L, D, w, dtype=torch.float32, layout="BHLD", device="cpu", scale=None):
    q, k, v = _qkv(B, H, L, D, dtype, device, layout)
    out = W.window_attention_triton(q, k, v, w, scale)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out.backward(gout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q32, k32, v32, window=w, scale=scale)
    ref.backward(gout.float())
    assert out.dtype == dtype and out.shape == (B, H, L, D)
    for got, want, what in ((out, ref, "out"), (q.grad, q32.grad, "dq"), (k.grad, k32.grad, "dk"),
                            (v.grad, v32.grad, "dv")):  # fmt: skip
        err = (got.float() - want).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), (what, err)


@interpreted
@pytest.mark.parametrize(
    "B,H,L,D,w",
    [
        (1, 2, 100, 16, 7),  # one partial block
        (2, 2, 200, 32, 64),  # the window a tile wide, L not a multiple of it
        (1, 1, 300, 16, 100),  # a window reaching over two tiles, five query blocks
        (1, 2, 130, 16, 1),  # each query sees only itself
        (1, 1, 90, 24, 200),  # a window longer than the sequence: causal; a head dim not a power of two
    ],
)
def test_forward_and_every_gradient_match_the_reference_fp32(B, H, L, D, w):
    _check(B, H, L, D, w)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precisions_match_the_fp32_reference(dtype):
    _check(1, 2, 150, 64, 64, dtype)


@interpreted
def test_strided_views_a_model_hands_over_and_a_scale():
    _check(2, 2, 120, 16, 40, layout="model", scale=0.3)


@interpreted
def test_the_attention_entry_point_forces_it_by_name():
    q, k, v = (t.detach() for t in _qkv(1, 2, 80, 16))
    torch.testing.assert_close(
        attention(q, k, v, window=20, backend="triton"), attention_ref(q, k, v, window=20), atol=2e-5, rtol=0
    )
    assert registry.record_of("attention", "triton").timed and "triton" in A.BACKENDS


@interpreted
def test_the_ops_pass_opcheck():
    q, k, v = (t.detach() for t in _qkv(1, 2, 70, 16))
    torch.library.opcheck(torch.ops.memfit.window_attn_fwd.default, (q, k, v, 9, 0.25))
    out, lse = torch.ops.memfit.window_attn_fwd(q, k, v, 9, 0.25)
    bwd = (q, k, v, out, lse, torch.randn_like(out), 9, 0.25)
    torch.library.opcheck(torch.ops.memfit.window_attn_bwd.default, bwd)


def test_the_fakes_allocate_what_the_kernels_write():
    """Under fake tensors (the estimator, torch.compile) the ops make what the real ops return: the output,
    the fp32 log-sum-exp, the gradients and the backward's row sums (the kernels allocate nothing else)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 3, 4096, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out, lse = torch.ops.memfit.window_attn_fwd(q, k, v, 64, 0.125)
        dq, dk, dv, delta = torch.ops.memfit.window_attn_bwd(q, k, v, out, lse, out, 64, 0.125)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == delta.shape == (2, 3, 4096) and lse.dtype == delta.dtype == torch.float32
    assert [t.shape for t in (dq, dk, dv)] == [q.shape] * 3


def test_bad_arguments_are_refused_in_one_line():
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="alike"):
        W.window_attention_triton(q, torch.zeros(1, 1, 9, 16), q, 4)
    with pytest.raises(TypeError, match="one dtype"):
        W.window_attention_triton(q, q.double(), q, 4)
    with pytest.raises(ValueError, match=f"head dim up to {W.MAX_HEAD_DIM}"):
        big = torch.zeros(1, 1, 8, 2 * W.MAX_HEAD_DIM)
        W.window_attention_triton(big, big, big, 4)
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            W.window_attention_triton(q, q, q, window)


@pytest.mark.cuda
@pytest.mark.parametrize("L,w,layout", [(1024, 64, "BHLD"), (4096, 256, "model"), (1000, 100, "BHLD")])
def test_cuda_matches_the_reference_at_real_sizes(L, w, layout):
    _check(2, 4, L, 64, w, torch.bfloat16, layout, device="cuda")
    _check(1, 2, L, 64, w, torch.float16, layout, device="cuda")
    _check(1, 2, L, 64, w, torch.float32, layout, device="cuda")  # full-precision dots (ieee)
    _check(1, 2, L, W.MAX_HEAD_DIM, w, torch.bfloat16, layout, device="cuda")  # the widest heads taken
    _check(1, 2, L, W.MAX_HEAD_DIM, w, torch.float32, layout, device="cuda")


def test_the_old_module_names_still_import():
    """Moved into the op packages; the old names stay for code written against them."""
    from memfit.ops import window_triton

    assert window_triton.window_attention_triton is W.window_attention_triton
    assert window_triton.MAX_HEAD_DIM == W.MAX_HEAD_DIM
