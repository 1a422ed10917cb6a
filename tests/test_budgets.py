"""Every system's paper-size training step fits its budget, and the estimator agrees with reality.

This is memfit's central promise, enforced in the default suite: each registered (system, variant)
is estimated once (fake tensors, no memory), compared with its budget, and each system's small
calibration step is run for real on CPU and compared with its estimate (within 15%).
"""

import functools

import pytest
from memfit.estimate.steps import estimate_training_step, measure_training_step
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


# What each naive baseline must show (README "Memory budgets"): the seeds' out-of-memory reproduced.
BASELINE_FLOOR_GIB = {("ginr-cifar", "attn"): 25.0, ("moremouse-triplane", "naive"): 36.0}


@pytest.mark.parametrize("system,variant", sorted(BASELINE_FLOOR_GIB))
def test_naive_baseline_reproduces_the_seed_oom(system, variant):
    assert _estimate(system, variant).peak_gib >= BASELINE_FLOOR_GIB[(system, variant)]


def test_mbsnet_materialising_scan_at_batch_2_costs_3x_ours_at_batch_6():
    ours = _estimate("mbsnet-speech", "chunked-200f")
    seed = _estimate("mbsnet-speech", "seed-materialise")
    assert (
        _entry("mbsnet-speech", "seed-materialise").batch == 2
        and _entry("mbsnet-speech", "chunked-200f").batch == 6
    )
    assert seed.peak_bytes >= 3 * ours.peak_bytes
    assert 2.4e6 <= ours.params <= 2.8e6


def test_gpt2_window_never_costs_more_than_causal():
    causal, window = _estimate("gpt2-window", "causal"), _estimate("gpt2-window", "window")
    assert window.peak_bytes <= 1.02 * causal.peak_bytes
    assert _estimate("gpt2-window", "window-seed").peak_bytes > causal.peak_bytes


def test_a_cuda_budget_of_window_attention_needs_no_gpu(capsys):
    """`memfit budget --device cuda` on a machine without a GPU: the flash-attn record's capability rule
    reads the card the estimate is for, not a CUDA device that is not there: on an H200 (sm90) flash-attn's
    window is traced, on a T4 (sm75) the timed records' stand-in."""
    import json

    from memfit import cli
    from memfit.ops import registry

    took = {}
    for gpu in ("h200", "t4"):
        before = registry.traced("attention")
        with pytest.raises(SystemExit) as e:
            cli.main(["budget", "--system", "gpt2-window", "--device", "cuda", "--gpu", gpu, "--json"])
        assert e.value.code == 0
        assert all(r["estimated_gib"] > 0 for r in json.loads(capsys.readouterr().out))
        took[gpu] = {k for k, n in registry.traced("attention").items() if n > before.get(k, 0)}
    assert "flash" in took["h200"] and "flash" not in took["t4"]
    assert any(registry.record_of("attention", name).timed for name in took["t4"])
