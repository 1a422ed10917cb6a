"""Memory: paper budgets, attention scaling in the number of triplane tokens, estimator calibration."""

import math

import pytest
import torch
from memfit.estimate.steps import estimate_training_step, measure_training_step
from memfit.estimate.tracker import GIB
from memfit.step import TrainStep
from moremouse_triplane.baselines import NaiveSelfAttention
from moremouse_triplane.model import SelfAttention
from moremouse_triplane.system import budget_entries

SEED_ATTENTION_GIB = 4 * 16 * 12_288**2 * 4 / GIB  # the seed's single failed allocation: 36.0 GiB


def _attention_step(tokens: int, width: int, heads: int, head_dim: int, batch: int, naive: bool) -> TrainStep:
    """One self-attention layer over `tokens` triplane tokens: forward, backward, AdamW."""
    return TrainStep(
        build_model=lambda: (NaiveSelfAttention if naive else SelfAttention)(width, heads, head_dim),
        make_batch=lambda device: torch.randn(batch, tokens, width, device=device, requires_grad=True),
        loss=lambda m, x: m(x).float().square().mean(),
        amp_dtype=None if naive else torch.bfloat16,
    )


def _scaling(peak_of, n_small: int, n_big: int, *layer: int) -> tuple[dict, float, float]:
    """Peak bytes by (naive, tokens) of _attention_step(tokens, *layer, naive) under peak_of
    (estimate_training_step or measure_training_step) at n_small and n_big tokens, then sdpa's and the
    naive layer's exponent of memory in the number of tokens."""
    peaks = {
        (naive, n): peak_of(_attention_step(n, *layer, naive)).peak_bytes
        for naive in (False, True)
        for n in (n_small, n_big)
    }
    sdpa_exp, naive_exp = (
        math.log(peaks[naive, n_big] / peaks[naive, n_small]) / math.log(n_big / n_small)
        for naive in (False, True)
    )
    return peaks, sdpa_exp, naive_exp


def test_attention_memory_linear_for_sdpa_quadratic_for_naive_at_paper_width():
    # estimated with fake tensors: paper width 512, 16 heads x 64, batch 4, 3x32^2 -> 3x64^2 tokens
    n_big = 3 * 64**2
    est, sdpa_exp, naive_exp = _scaling(estimate_training_step, 3 * 32**2, n_big, 512, 16, 64, 4)
    assert sdpa_exp <= 1.1, sdpa_exp
    assert naive_exp >= 1.8, naive_exp
    # the seed's allocation: one materialised layer at 12,288 tokens needs more than its 36 GiB score matrix
    assert est[True, n_big] / GIB >= SEED_ATTENTION_GIB >= 36.0
    assert est[False, n_big] * 20 < est[True, n_big]


@pytest.mark.slow
def test_attention_memory_scaling_measured_on_cpu():
    # real runs (live CPU tensor storage): small width, 3x16^2 -> 3x32^2 tokens
    _, sdpa_exp, naive_exp = _scaling(measure_training_step, 3 * 16**2, 3 * 32**2, 32, 4, 16, 1)
    assert sdpa_exp <= 1.1, sdpa_exp
    assert naive_exp >= 1.7, naive_exp


def _entry(variant: str):
    return next(e for e in budget_entries() if e.variant == variant)


@pytest.mark.parametrize("variant", ["sdpa", pytest.param("naive", marks=pytest.mark.slow)])
def test_calibration_estimate_matches_measured_tiny(variant):
    entry = _entry(variant)
    est = estimate_training_step(entry.calibration).peak_bytes
    meas = measure_training_step(entry.calibration).peak_bytes
    assert abs(est - meas) / meas <= 0.15, (est, meas)


@pytest.mark.slow
def test_paper_budget_fits_16_gib():
    entry = _entry("sdpa")
    report = estimate_training_step(entry.step)
    assert entry.batch == 4 and entry.budget_gib == 16.0
    assert report.peak_gib <= entry.budget_gib, report.format()


@pytest.mark.slow
def test_naive_baseline_needs_at_least_the_seeds_36_gib():
    entry = _entry("naive")
    report = estimate_training_step(entry.step)
    assert entry.is_baseline and entry.budget_gib is None
    assert report.peak_gib >= 36.0, report.format()
