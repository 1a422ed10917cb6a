"""Every system's paper-size training step fits its budget, and the estimator agrees with reality.

This is memfit's central promise, enforced in the default suite: each registered (system, variant)
is estimated once (fake tensors, no memory), compared with its budget, and each system's small
calibration step is run for real on CPU and compared with its estimate (within 15%).
"""

import functools

import pytest
from memfit.memory import estimate_training_step, measure_training_step
from memfit.system import available_systems, load_system

SYSTEMS = sorted(available_systems())
ENTRIES = [(s, e.variant) for s in SYSTEMS for e in load_system(s).budgets()]


@functools.cache
def _entry(system, variant):
    return next(e for e in load_system(system).budgets() if e.variant == variant)


@functools.cache
def _estimate(system, variant):
    return estimate_training_step(_entry(system, variant).step)


def test_every_system_registers_budgets_and_a_baseline():
    assert set(SYSTEMS) >= {"ginr-cifar", "moremouse-triplane", "mbsnet-speech", "gpt2-window"}
    for s in SYSTEMS:
        entries = load_system(s).budgets()
        assert any(e.is_baseline for e in entries), f"{s} has no naive baseline"
        assert any(not e.is_baseline and e.budget_gib for e in entries), f"{s} has no budgeted variant"


@pytest.mark.parametrize("system,variant", ENTRIES)
def test_estimate_within_budget_and_below_baseline(system, variant):
    e = _entry(system, variant)
    est = _estimate(system, variant)
    if e.is_baseline:
        ours = [x for x in load_system(system).budgets() if not x.is_baseline]
        assert all(
            est.peak_bytes > _estimate(system, o.variant).peak_bytes for o in ours if o.dtype == e.dtype
        )
    else:
        assert est.peak_gib <= e.budget_gib, f"{system}/{variant}: {est.format()} > budget {e.budget_gib} GiB"


CALIBRATIONS = [(s, v) for s, v in ENTRIES if _entry(s, v).calibration is not None]


@pytest.mark.parametrize("system,variant", CALIBRATIONS)
def test_estimate_matches_measured_small_step(system, variant):
    step = _entry(system, variant).calibration
    est, real = estimate_training_step(step), measure_training_step(step)
    drift = est.peak_bytes / real.peak_bytes - 1
    assert abs(drift) <= 0.15, (
        f"{system}/{variant}: estimate {est.peak_mib:.1f} MiB vs measured {real.peak_mib:.1f}"
    )
