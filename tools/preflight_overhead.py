"""How much process memory a training step takes per byte of tensors memfit estimates, on the CPU.

    uv run python tools/preflight_overhead.py            (1 thread; each system at a large batch)

For each system's CPU recipe (at a batch large enough that the step dwarfs the process), prints the
estimated tensor peak (memfit.estimate.memory.estimate_training_step), the growth of the process's peak RSS
over
two real steps, and their ratio, with malloc's defaults and with the Trainer's keep_freed_memory. The
largest ratio is memfit.estimate.fit.CPU_OVERHEAD's evidence. Each case runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = [("mbsnet-speech", 39), ("mbsnet-speech", 100), ("ginr-cifar", 512), ("gpt2-window", 512),
         ("moremouse-triplane", 16)]  # fmt: skip


def one(system: str, batch: int) -> None:
    """Run in a child: estimate, then two real steps; print 'estimate growth' in bytes."""
    import torch
    from memfit.estimate.steps import _run_step, estimate_training_step
    from memfit.train.cpu import keep_freed_memory

    if os.environ.get("KEEP_FREED") == "1":
        keep_freed_memory()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    if system == "mbsnet-speech":
        from mbsnet_speech.config import SETTINGS
        from mbsnet_speech.system import train_step

        step = train_step(SETTINGS["cpu"](cpu).model, batch, 16000, None)
    elif system == "ginr-cifar":
        from ginr_cifar.config import SETTINGS
        from ginr_cifar.system import ginr_step

        step = ginr_step(SETTINGS["cpu"](cpu).model, batch, 256, torch.bfloat16)
    elif system == "gpt2-window":
        from dataclasses import replace

        from gpt2_window.config import SETTINGS
        from gpt2_window.system import gpt_step

        step = gpt_step(replace(SETTINGS["tiny"](cpu).model, vocab_size=96), batch, 64, torch.bfloat16)
    else:
        from dataclasses import replace

        from moremouse_triplane.config import SETTINGS
        from moremouse_triplane.system import train_step

        step = train_step(replace(SETTINGS["cpu"](cpu).model, carve=0.0), batch, None)
    estimate = estimate_training_step(step).peak_bytes

    def hwm() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
        return int(line.split()[1]) * 1024

    base = hwm()
    model = step.build_model()
    opt = step.optimizer(model.parameters())
    for _ in range(2):
        _run_step(step, model, opt, cpu)
    print(estimate, hwm() - base)


def main() -> None:
    if len(sys.argv) == 3:
        one(sys.argv[1], int(sys.argv[2]))
        return
    print(f"{'system':<20} {'batch':>5} {'estimate GiB':>12} {'RSS growth GiB (defaults / keep freed)':>40}")
    worst = 0.0
    for system, batch in CASES:
        cells = []
        for keep in ("0", "1"):
            env = {**os.environ, "KEEP_FREED": keep, "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, __file__, system, str(batch)], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()  # fmt: skip
            estimate, growth = int(out[-2]), int(out[-1])
            worst = max(worst, growth / estimate)
            cells.append(f"{growth / 2**30:.3f} ({growth / estimate:.2f}x)")
        print(f"{system:<20} {batch:>5} {estimate / 2**30:>12.3f} {' / '.join(cells):>40}")
    print(f"largest ratio: {worst:.2f}x (memfit.estimate.fit.CPU_OVERHEAD must be at least this)")


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("preflight_overhead", lambda _argv: main()))
