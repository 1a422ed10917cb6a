"""Repository-wide pytest setup: `cuda` tests skip with a reason on machines without a GPU; the repo root
is importable, so cross-system tests share `tests/systems.py`."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run on a GPU machine with `pytest -m cuda`")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
