"""Memory: the d12 budget rows, their calibration against real CPU runs, and the bounded Flex mask cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gpt2_window.config import GPTConfig
from gpt2_window.model import GPT
from gpt2_window.system import SYSTEM, budget_entries
from memfit.estimate.steps import estimate_training_step, measure_training_step

ENTRIES = {e.variant: e for e in budget_entries()}


def test_system_registration():
    assert SYSTEM.name == "gpt2-window"
    assert set(ENTRIES) == {"causal", "window", "window-fp32", "window-seed"}
    assert [e.variant for e in ENTRIES.values() if e.is_baseline] == ["window-seed"]
    assert all(e.batch == 4 and e.calibration is not None for e in ENTRIES.values())
    assert "generate" in SYSTEM.extra_commands


@pytest.mark.parametrize("variant", ["window", "window-seed"])
def test_calibration_estimate_matches_measured_cpu_peak(variant):
    """The fake-tensor estimate of the same small step agrees with a real CPU run within 15%."""
    step = ENTRIES[variant].calibration
    est = estimate_training_step(step)
    real = measure_training_step(step)
    assert real.peak_bytes > 1 << 20
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.15, (est.peak_mib, real.peak_mib)


@pytest.mark.slow
def test_d12_budgets():
    """d12 (124M), batch 4 x 1024: window <= causal x 1.02 and <= 6 GiB; fp32 <= 10.5 GiB; seed > causal."""
    est = {v: estimate_training_step(e.step) for v, e in ENTRIES.items()}
    for v, r in est.items():
        assert r.params == 124_475_904, v
        if ENTRIES[v].budget_gib is not None:
            assert r.peak_gib <= ENTRIES[v].budget_gib, (v, r.format())
    assert est["window"].peak_bytes <= 1.02 * est["causal"].peak_bytes
    assert est["window-seed"].peak_bytes > est["causal"].peak_bytes
    assert est["window-seed"].peak_bytes > est["window"].peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["causal", "window-fp32"])
def test_calibration_other_variants(variant):
    step = ENTRIES[variant].calibration
    est, real = estimate_training_step(step), measure_training_step(step)
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.15, (est.peak_mib, real.peak_mib)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_block_mask_cache_stays_bounded_over_20_lengths():
    """Through the model: 20 sequence lengths on the Flex path keep at most max_entries block masks."""
    from memfit.ops import attention as A

    before = A.block_mask_cache_info()["max_entries"]
    A.clear_block_mask_cache()
    A.set_block_mask_cache_size(4)
    try:
        cfg = GPTConfig(block_size=64, vocab_size=50, n_layer=1, n_head=2, n_embd=32, window=8)
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        ref = GPT(replace(cfg, attn_impl="ref")).eval()
        ref.load_state_dict(model.state_dict())
        seen = []
        with torch.no_grad(), A.force_backend("flex"):
            for T in range(20, 40):
                x = torch.randint(0, 50, (1, T))
                torch.testing.assert_close(model(x, x)[1], ref(x, x)[1], atol=1e-5, rtol=1e-5)
                info = A.block_mask_cache_info()
                assert info["entries"] <= 4
                seen.append(info["bytes"])
        assert info["entries"] == 4 and info["bytes"] > 0
        print(f"block-mask cache after 20 lengths: {info['entries']} entries, {info['bytes']} bytes")
    finally:
        A.clear_block_mask_cache()
        A.set_block_mask_cache_size(before)
