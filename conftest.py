"""Repository-wide pytest setup: the repo root is importable, so cross-system tests share `tests/systems.py`;
the Triton interpreter runs Triton kernels where there is no GPU; and a selected GPU test FAILS where what
it needs does not work, so a GPU job cannot be green while testing nothing. A `cuda` test needs CUDA; a
`cuda_kernels("mamba_ssm", ...)` test also needs those kernels of the cuda extra (memfit.ops.registry's
record names; no names: all of them) installed and passing their probes. The default
`-m 'not slow and not cuda and not cuda_kernels'` deselects both; `pytest -m cuda` and
`pytest -m cuda_kernels` select them."""

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

# Under pytest-xdist (README's `-n 2`) each worker takes its share of the cores, for its own ops and for the
# processes its tests start: two workers of two threads each on two cores run 4-5x slower, not twice as fast.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _share = max(1, _cores // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


def missing_kernels(names: tuple[str, ...]) -> list[str]:
    """Why each kernel of the cuda extra among `names` (all of them when empty) cannot run on this GPU."""
    from memfit.ops import registry

    device = torch.device("cuda", torch.cuda.current_device())
    wanted = set(names) or registry.extra_kernels()
    unknown = wanted - registry.extra_kernels()
    if unknown:
        raise ValueError(f"cuda_kernels names {sorted(unknown)}: not kernels of the cuda extra")
    problems = []
    for impl in registry.RECORDS:
        if impl.name in wanted and impl.package:
            res = registry.probe(impl, device)
            if not res.ok:
                problems.append(f"{impl.package} ({impl.op}): {res.detail}")
    return problems


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # a wrapper runs before every other setup hook, skipif marks included: a GPU test fails here
    marks = [m for m in ("cuda", "cuda_kernels") if m in item.keywords]
    if marks:
        from memfit.ops.doctor import cuda_state

        ok, why = cuda_state()
        if not ok:
            why = f"a `{marks[-1]}` test needs CUDA: {why} (`uv run memfit doctor` says more)"
            pytest.fail(why, pytrace=False)
    for mark in item.iter_markers("cuda_kernels"):
        if problems := missing_kernels(mark.args):
            pytest.fail(
                "a `cuda_kernels` test needs the cuda extra's kernels (README, GPU: the two-step install): "
                + "; ".join(problems),
                pytrace=False,
            )
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` hands each worker whole files (xdist's loadfile, in place of its default "load"): a file's
    module fixtures (trained runs, exported models, traced estimates) are built once, not once per worker.
    Any other `--dist` mode is left as given."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)
    return None
