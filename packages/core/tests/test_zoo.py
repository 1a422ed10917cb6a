"""Models nobody here wrote (torchvision, timm, transformers built from config, an LSTM): the estimate
against a real two-step CPU run, every live storage counted. A fast subset by default; the whole zoo
(tools/estimate_zoo.py, docs/estimate-zoo.md) with -m slow."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("timm")
pytest.importorskip("transformers")
pytest.importorskip("torchvision")

TOOL = Path(__file__).resolve().parents[3] / "tools" / "estimate_zoo.py"


def _zoo():
    spec = importlib.util.spec_from_file_location("estimate_zoo", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


zoo = _zoo()
ENTRIES = {e.name: e for e in zoo.zoo()}


def _check(name: str) -> None:
    row = zoo.run_entry(ENTRIES[name])
    assert row.estimate is not None, row.error
    assert row.measured is not None, row.error
    assert abs(row.rel) <= 0.01, (name, row.estimate, row.measured)


@pytest.mark.parametrize("name", zoo.FAST)
def test_zoo_subset_within_one_percent_of_the_real_peak(name):
    _check(name)


def test_timm_model_with_data_dependent_constructor_builds():
    """timm computes drop-path rates with .item() and RegNet widths with unique(): built for real, then
    swapped for fake tensors, and still exact."""
    _check("timm:regnety_016")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, e in ENTRIES.items() if e.params_hint <= zoo.MEASURE_LIMIT])
def test_whole_zoo_within_one_percent(name):
    _check(name)
