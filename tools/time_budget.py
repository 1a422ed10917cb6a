"""Wall time of every `memfit budget` estimate, in the order `memfit budget` runs them (one process).

    OMP_NUM_THREADS=1 uv run --frozen python tools/time_budget.py [--system S] [--profile OUT.prof]

Prints per entry: wall and process CPU seconds (CPU time is what a busy machine does not inflate), the
estimated peak in bytes (exact, so a speed change that moves a figure shows), and params. Run it on a
quiet machine (or say the load) when the times matter.
"""

from __future__ import annotations

import os
import time

from memfit.train.flags import Parser


def main() -> None:
    ap = Parser()
    ap.add_argument("--system", action="append", help="only these systems (repeatable)")
    ap.add_argument("--variant", action="append", help="only these variants (repeatable)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", help="write a cProfile of the selected estimates here")
    a = ap.parse_args()

    import torch
    from memfit.estimate.steps import estimate_training_step
    from memfit.system import available_systems, load_system

    torch.set_num_threads(a.threads)
    print(f"threads {a.threads}, load {os.getloadavg()[0]:.2f}")
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    total = 0.0
    for name in sorted(available_systems()):
        if a.system and name not in a.system:
            continue
        for e in load_system(name).budgets():
            if a.variant and e.variant not in a.variant:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            if prof:
                prof.enable()
            r = estimate_training_step(e.step)
            if prof:
                prof.disable()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            total += dt
            print(
                f"{name:20s} {e.variant:18s} {dt:7.2f} s wall {cpu:7.2f} s cpu  "
                f"peak {r.peak_bytes:>14d} B  params {r.params}"
            )
    print(f"total {total:.1f} s, load {os.getloadavg()[0]:.2f}")
    if prof:
        prof.dump_stats(a.profile)


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("time_budget", lambda _argv: main()))
