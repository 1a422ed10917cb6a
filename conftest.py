"""Repository-wide pytest setup: the repo root is importable, so cross-system tests share `tests/systems.py`;
and a selected `cuda` test FAILS on a machine where CUDA does not work, so a GPU job cannot be green while
testing nothing. (The default `-m 'not slow and not cuda'` deselects them; `pytest -m cuda` selects them.)"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cuda_problem() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        if torch.cuda.is_available():
            return None
    except Exception as e:  # noqa: BLE001 - a broken driver can raise
        return f"CUDA failed to start: {e}"
    return f"torch is built for CUDA {torch.version.cuda} but finds no usable GPU (driver too old, or none)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # a wrapper runs before every other setup hook, skipif marks included: a `cuda` test fails here
    if "cuda" in item.keywords and (problem := _cuda_problem()) is not None:
        pytest.fail(f"a `cuda` test needs CUDA: {problem} (`uv run memfit doctor` says more)", pytrace=False)
    return (yield)
