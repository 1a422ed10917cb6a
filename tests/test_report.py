"""`memfit-report` writes the table, the JSON of every figure and the plots."""

import json

import pytest
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
    main(["--system", system, "--no-bench", "--out", str(tmp_path)])
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
    with pytest.raises(SystemExit, match="unknown system"):
        main(["--system", "nope", "--out", str(tmp_path)])
