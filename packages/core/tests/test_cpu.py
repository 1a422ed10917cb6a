"""memfit.train.cpu.keep_freed_memory: a training step's large blocks are reused, not page-faulted in
again."""

import subprocess
import sys

import pytest
from memfit.train import cpu

# A Mamba forward + backward whose activations (44 and 89 MiB) are above malloc's largest mmap threshold
# (32 MiB): prints the median minor page faults of steps 4-9 (a step's own: a one-off trim or compaction in
# one step of a run showed up to 30,000 faults in the sum of three), and whether the tuning is on.
_PROBE = """
import sys, torch
from memfit.train import cpu
from memfit.ops.mamba import Mamba, MambaConfig
torch.set_num_threads(1)
on = cpu.keep_freed_memory() if sys.argv[1] == "1" else False
torch.manual_seed(0)
m = Mamba(MambaConfig(128, 16, 4, 1.5))
x = torch.randn(90, 642, 128, requires_grad=True)
faults = []
for _ in range(9):
    before = cpu.minor_page_faults()
    m(x).square().mean().backward()
    faults.append(cpu.minor_page_faults() - before)
print(sorted(faults[3:])[3], on)
"""


def _faults(tuned: bool) -> tuple[int, str]:
    cmd = [sys.executable, "-c", _PROBE, "1" if tuned else "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), out[1]


@pytest.mark.skipif(cpu.minor_page_faults() < 0, reason="needs /proc/self/stat (Linux)")
def test_keep_freed_memory_stops_refaulting_a_training_steps_blocks():
    tuned, on = _faults(True)
    if on != "True":
        pytest.skip("no glibc mallopt here")
    plain, _ = _faults(False)
    # measured (the sum of the last three of six steps): 160,000-810,000 faults plain (0.6-3.2 GiB of pages),
    # 0-32,000 tuned; a step's median: plain about a third of those, tuned 0
    assert plain > 30_000
    assert tuned < 0.2 * plain


def test_keep_freed_memory_can_be_turned_off():
    code = "from memfit.train import cpu; print(cpu.keep_freed_memory())"
    env = {"MEMFIT_KEEP_FREED": "0", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
