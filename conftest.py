"""Repository-wide pytest setup: the repo root is importable, so cross-system tests share `tests/systems.py`;
the Triton interpreter runs Triton kernels where there is no GPU; and a selected `cuda` test FAILS on a
machine where CUDA does not work, so a GPU job cannot be green while testing nothing. (The default
`-m 'not slow and not cuda'` deselects them; `pytest -m cuda` selects them.)"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a GPU, Triton's interpreter runs memfit's Triton kernels on CPU tensors (tests/test_scan_triton.py);
# triton reads this when a kernel is defined, so it is set before anything imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # a wrapper runs before every other setup hook, skipif marks included: a `cuda` test fails here
    if "cuda" in item.keywords:
        from memfit.ops.doctor import cuda_state

        ok, why = cuda_state()
        if not ok:
            pytest.fail(f"a `cuda` test needs CUDA: {why} (`uv run memfit doctor` says more)", pytrace=False)
    return (yield)
