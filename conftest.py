"""Repository-wide pytest setup: `cuda` tests skip with a reason on machines without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run on a GPU machine with `pytest -m cuda`")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
