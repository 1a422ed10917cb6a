"""Shared layers against hand-written references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from memfit.ops.layers import CrossAttention, FeedForward, FourierFeatures, PreNorm


def _ref_cross_attention(m: CrossAttention, x, context, window=None):
    """Plain einsum/softmax multi-head attention with m's weights."""
    B, N, _ = x.shape
    h, d = m.heads, m.dim_head
    q = (x @ m.to_q.weight.T).view(B, N, h, d)
    kv = context @ m.to_kv.weight.T
    k, v = kv[..., : h * d], kv[..., h * d :]
    k = k.reshape(B, -1, h, d)
    v = v.reshape(B, -1, h, d)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(d)
    if window is not None:
        i = torch.arange(N)[:, None]
        j = torch.arange(N)[None, :]
        scores = scores.masked_fill((j > i) | (j <= i - window), float("-inf"))
    out = torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v).reshape(B, N, h * d)
    return m.to_out(out)


def test_cross_attention_matches_einsum_reference_forward_and_grad():
    torch.manual_seed(0)
    m = CrossAttention(query_dim=24, context_dim=10, heads=3, dim_head=8)
    x = torch.randn(2, 7, 24, requires_grad=True)
    ctx = torch.randn(2, 13, 10, requires_grad=True)
    out = m(x, ctx)
    assert out.shape == (2, 7, 24)
    ref = _ref_cross_attention(m, x, ctx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, ctx, m.to_q.weight), g)
    want = torch.autograd.grad(ref, (x, ctx, m.to_q.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_self_attention_when_context_is_none_and_windowed():
    torch.manual_seed(1)
    m = CrossAttention(query_dim=16, heads=2, dim_head=8)
    x = torch.randn(2, 40, 16)
    torch.testing.assert_close(m(x), _ref_cross_attention(m, x, x), atol=1e-5, rtol=0)
    torch.testing.assert_close(m(x, window=6), _ref_cross_attention(m, x, x, window=6), atol=1e-5, rtol=0)


def test_cross_attention_rejects_batch_mismatch():
    m = CrossAttention(query_dim=8, heads=2, dim_head=4)
    with pytest.raises(ValueError, match="batch"):
        m(torch.randn(2, 5, 8), torch.randn(3, 5, 8))


def test_feedforward_is_geglu():
    torch.manual_seed(2)
    ff = FeedForward(12, mult=3)
    x = torch.randn(4, 5, 12)
    lin1, lin2 = ff.net[0], ff.net[3]
    assert lin1.out_features == 2 * 36 and lin2.in_features == 36
    h = x @ lin1.weight.T + lin1.bias
    a, gate = h[..., :36], h[..., 36:]
    gelu = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
    want = (a * gelu) @ lin2.weight.T + lin2.bias
    torch.testing.assert_close(ff(x), want, atol=1e-5, rtol=0)


def test_prenorm_norms_input_and_context():
    torch.manual_seed(3)
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, context=None):
            seen["x"], seen["context"] = x, context
            return x

    pn = PreNorm(6, Probe(), context_dim=4)
    x, ctx = torch.randn(2, 3, 6) * 5 + 2, torch.randn(2, 9, 4) * 3 - 1
    pn(x, context=ctx)
    for t in (seen["x"], seen["context"]):
        torch.testing.assert_close(t.mean(-1), torch.zeros(t.shape[:-1]), atol=1e-5, rtol=0)
        torch.testing.assert_close(t.var(-1, unbiased=False), torch.ones(t.shape[:-1]), atol=1e-3, rtol=0)
    seen.clear()
    pn(x, ctx)  # context given positionally
    torch.testing.assert_close(seen["context"].mean(-1), torch.zeros(2, 9), atol=1e-5, rtol=0)
    # Without context_dim the context is passed through untouched.
    pn2 = PreNorm(6, Probe())
    pn2(x, context=ctx)
    assert seen["context"] is ctx


def test_prenorm_with_cross_attention_shapes():
    block = PreNorm(16, CrossAttention(16, context_dim=8, heads=2, dim_head=4), context_dim=8)
    assert block(torch.randn(3, 11, 16), context=torch.randn(3, 5, 8)).shape == (3, 11, 16)


def test_fourier_features_known_values():
    ff = FourierFeatures(in_dim=2, num_bands=3, max_freq=6)  # freqs 1, 2, 3
    assert ff.out_dim == 2 * (2 * 3 + 1)
    x = torch.tensor([[0.5, -1.0], [0.0, 1.0 / 3.0]])
    y = ff(x)
    assert y.shape == (2, ff.out_dim)
    freqs = torch.tensor([1.0, 2.0, 3.0])
    for row in range(2):
        want = [x[row]]
        phase = math.pi * x[row][:, None] * freqs  # (in_dim, bands)
        want += [phase.sin().flatten(), phase.cos().flatten()]
        torch.testing.assert_close(y[row], torch.cat(want), atol=1e-6, rtol=0)
    # Spot values: sin(pi * 0.5 * 1) = 1, cos(pi * 0.5 * 2) = -1, sin(pi * (-1) * f) = 0.
    torch.testing.assert_close(y[0, 2], torch.tensor(1.0))
    torch.testing.assert_close(y[0, 8 + 1], torch.tensor(-1.0))
    torch.testing.assert_close(y[0, 5:8], torch.zeros(3), atol=1e-6, rtol=0)


def test_fourier_features_without_input_and_batched_shape():
    ff = FourierFeatures(in_dim=3, num_bands=4, max_freq=10, include_input=False)
    assert ff.out_dim == 3 * 8
    y = ff(torch.rand(2, 5, 7, 3) * 2 - 1)
    assert y.shape == (2, 5, 7, 24)
    assert y.abs().max() <= 1.0
    with pytest.raises(ValueError, match="last dim"):
        ff(torch.rand(4, 2))
