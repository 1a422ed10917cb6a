"""tools/ssd_reference.py (the benchmark's Mamba-2 chunked SSD) against its step-by-step recurrence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[3] / "tools"
sys.path.insert(0, str(TOOLS))
ssd_reference = pytest.importorskip("ssd_reference", reason="tools/ssd_reference.py is not in this checkout")


@pytest.mark.parametrize(("shared_bc", "with_h0"), [(True, False), (False, True)])
def test_chunked_ssd_matches_recurrence(shared_bc, with_h0):
    g = torch.Generator().manual_seed(0)
    b, L, H, P, N, chunk = 2, 24, 3, 5, 4, 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    bc = (b, L, N) if shared_bc else (b, L, H, N)
    x, B, C = rnd(b, L, H, P), rnd(*bc), rnd(*bc)
    a = -torch.nn.functional.softplus(rnd(b, L, H)) * torch.rand(H, generator=g, dtype=torch.float64) * 3
    h0 = rnd(b, H, P, N) if with_h0 else None
    leaves = [t.requires_grad_() for t in (x, a, B, C) + ((h0,) if with_h0 else ())]

    def outputs(fn, **kw):
        y, last = fn(x, a, B, C, h0=h0, **kw)
        grads = torch.autograd.grad((y * y.detach().cos()).sum() + last.sum(), leaves)
        return y, last, grads

    y, last, grads = outputs(ssd_reference.ssd_scan, chunk=chunk)
    y_ref, last_ref, grads_ref = outputs(ssd_reference.ssd_recurrence)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, last_ref, rtol=1e-12, atol=1e-12)
    for g_ours, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-10)
    # every chunk matters: the answer is not just the last chunk's
    assert (y[:, chunk:] - ssd_reference.ssd_scan(x[:, chunk:], a[:, chunk:], B[:, chunk:], C[:, chunk:],
                                                   chunk=chunk)[0]).abs().max() > 1e-3  # fmt: skip
