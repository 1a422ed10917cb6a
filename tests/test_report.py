"""`memfit-report` writes the table, the JSON of every figure and the plots."""

import json

import pytest
from memfit.errors import UsageError
from memfit.system import available_systems
from memfit_report.main import fit_exponent, main


def test_fit_exponent_recovers_power_laws():
    xs = [1024, 2048, 4096]
    assert fit_exponent(xs, [3 * x**2 for x in xs]) == pytest.approx(2.0)
    assert fit_exponent(xs, [0.5 * x for x in xs]) == pytest.approx(1.0)


def test_report_writes_table_json_and_plots(tmp_path):
    # the quickest system to estimate and calibrate
    system = (
        "moremouse-triplane"
        if "moremouse-triplane" in available_systems()
        else sorted(available_systems())[0]
    )
    assert main(["--system", system, "--no_bench", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    rows = data["rows"]
    assert rows and all(r["system"] == system for r in rows)
    assert any(r["is_baseline"] for r in rows) and any("baseline_ratio" in r for r in rows)
    assert any("calibration" in r for r in rows)
    md = (tmp_path / "report.md").read_text()
    assert system in md and "baseline / ours" in md
    png = (tmp_path / "memory_by_category.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rejects_unknown_system(tmp_path):
    with pytest.raises(UsageError, match="unknown system"):
        main(["--system", "nope", "--out", str(tmp_path)])


def _check_fit(system, gpu_gib, max_batch, variant):
    from memfit.estimate.fit import fit_system, needed_bytes, usable_bytes
    from memfit.estimate.steps import estimate_training_step
    from memfit.estimate.tracker import GIB
    from memfit.system import load_system

    entry = next(e for e in load_system(system).budgets() if e.variant == variant)
    results = fit_system(load_system(system).budgets(), gpu_gib, max_batch=max_batch, variants=[variant])
    assert {r.checkpointing for r in results} == {False, True}
    usable = usable_bytes(gpu_gib * GIB) / GIB  # the margin rule: the card total within 90% of the GPU
    for r in results:
        assert 1 <= r.batch < max_batch
        assert r.allocated_gib <= r.reserved_gib < r.estimated_gib <= usable < r.next_gib
        # the answer is exact: batch+1 does not fit
        over = estimate_training_step(entry.make_step(r.batch + 1, r.checkpointing), device="cuda")
        assert needed_bytes(over, "cuda") / GIB > usable
    plain, ckpt = sorted(results, key=lambda r: r.checkpointing)
    assert ckpt.batch >= plain.batch  # checkpointing never lowers the batch that fits


def test_fit_finder_moremouse():
    _check_fit("moremouse-triplane", gpu_gib=12.0, max_batch=64, variant="sdpa")


@pytest.mark.slow
def test_fit_finder_mbsnet():
    _check_fit("mbsnet-speech", gpu_gib=3.0, max_batch=256, variant="chunked-200f")
