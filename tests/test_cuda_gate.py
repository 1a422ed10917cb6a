"""The GPU jobs cannot be green by accident: on a machine without working CUDA, `pytest -m cuda` and
`pytest -m cuda_kernels` fail; on a GPU without the cuda extra, a `cuda_kernels` test fails (conftest.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import missing_kernels
from tests.emulated_cuda import emulated_cuda

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_pytest_m_cuda_fails_without_cuda():
    tests = {
        "cuda": "packages/core/tests/test_cuda.py::test_last_state_gradient_on_cuda",
        "cuda_kernels": "packages/core/tests/test_attention.py::test_flash_on_cuda_matches_reference",
    }
    argv = ["-q", "-p", "no:cacheprovider", "-m", "cuda or cuda_kernels", *tests.values()]
    r = subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout[-2000:]
    for mark in tests:
        assert f"a `{mark}` test needs CUDA" in r.stdout, r.stdout[-2000:]
    assert "2 errors" in r.stdout and "skipped" not in r.stdout


def test_a_cuda_kernels_test_fails_on_a_gpu_without_the_extra():
    """What the setup hook says on a GPU without the cuda extra (emulated: there is no GPU here): each
    kernel the mark names is missing, and a name that is not a kernel of the extra is a mistake."""
    with emulated_cuda():
        (flash,) = missing_kernels(("flash",))
        everything = missing_kernels(())
        with pytest.raises(ValueError, match="not kernels of the cuda extra"):
            missing_kernels(("triton",))
    assert flash.startswith("flash-attn (attention): not installed"), flash
    assert len(everything) == 3 and {p.split()[0] for p in everything} == {
        "mamba-ssm",
        "causal-conv1d",
        "flash-attn",
    }


def _job(ci: str, name: str) -> str:
    """The lines of one job of the workflow (up to the next line indented as little as its name)."""
    return re.search(rf"\n  {name}:\n(.*?)(?=\n  \S|\Z)", ci, re.S).group(1)


def test_gpu_jobs_check_cuda_before_testing():
    """The GPU job tests a GPU as users have it (no build, no extra); the kernels job builds the extra and
    tests its kernels. Each asks `memfit doctor` first."""
    ci = (ROOT / ".github/workflows/ci.yml").read_text()
    gpu, kernels = _job(ci, "gpu"), _job(ci, "kernels")
    assert "--extra cuda" not in gpu and "uv sync --all-packages --frozen\n" in gpu
    assert gpu.index("memfit doctor --require_cuda") < gpu.index("pytest -m cuda\n")
    assert "uv sync --all-packages --frozen --extra cuda\n" in kernels
    assert kernels.index("memfit doctor --require_kernels") < kernels.index("pytest -m cuda_kernels")
    for job in (gpu, kernels):
        assert "if: github.event_name == 'push' && github.ref == 'refs/heads/main'" in job
