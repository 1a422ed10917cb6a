"""The GPU job cannot be green by accident: on a machine without working CUDA, `pytest -m cuda` fails."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_pytest_m_cuda_fails_without_cuda():
    test = "packages/core/tests/test_cuda.py::test_last_state_gradient_on_cuda"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", test],
                       cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:]
    assert "a `cuda` test needs CUDA" in r.stdout
    assert "1 error" in r.stdout and "skipped" not in r.stdout


def test_gpu_job_checks_cuda_before_testing():
    ci = (ROOT / ".github/workflows/ci.yml").read_text()
    gpu = ci[ci.index("\n  gpu:") :]
    assert gpu.index("memfit doctor --require-cuda") < gpu.index("pytest -m cuda")
