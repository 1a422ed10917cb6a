"""On a GPU: the window model matches the reference, and really uses no more memory than causal."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gpt2_window.config import GPTConfig
from gpt2_window.model import GPT
from gpt2_window.system import budget_entries
from memfit.estimate.steps import measure_training_step

pytestmark = pytest.mark.cuda


def test_window_model_matches_reference_on_cuda():
    cfg = GPTConfig(block_size=256, vocab_size=101, n_layer=2, n_head=4, n_embd=128, window=[32, 64])
    torch.manual_seed(0)
    with torch.device("cuda"):
        ours = GPT(cfg)
        ref = GPT(replace(cfg, attn_impl="ref"))
    ref.load_state_dict(ours.state_dict())
    x = torch.randint(0, 101, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, la = ours(x, x)
        b, lb = ref(x, x)
    torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(la, lb, atol=1e-2, rtol=1e-2)


def test_d12_measured_peaks_on_cuda():
    """The budget rows run for real: window <= causal x 1.02 and <= 6 GiB; the seed's baseline costs more."""
    entries = {e.variant: e for e in budget_entries()}
    peak = {}
    for v in ("causal", "window", "window-seed"):
        torch.cuda.empty_cache()
        peak[v] = measure_training_step(entries[v].step, device="cuda").peak_bytes
    assert peak["window"] <= 1.02 * peak["causal"], peak
    assert peak["window"] <= 6 * 2**30, peak
    assert peak["window-seed"] > peak["causal"], peak


def test_generate_in_fp32_on_cuda_compiles_a_few_lengths():
    """fp32 windowed layers take compiled FlexAttention on CUDA; generate() pads contexts to powers of two,
    so 150 new tokens compile a handful of graphs, not one per length."""
    from memfit.ops import registry as probes
    from torch._dynamo.utils import counters

    cfg = GPTConfig(block_size=256, vocab_size=101, n_layer=2, n_head=4, n_embd=128, window=[32, None])
    torch.manual_seed(0)
    model = GPT(cfg).cuda().eval()
    x = torch.randint(0, 101, (2, 5), device="cuda")
    probes.reset()
    counters.clear()
    out = model.generate(x, 150, top_k=1)
    assert out.shape == (2, 155)
    assert any(probes.record_of("attention", name).timed for name in probes.ran("attention"))
    assert counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])
