"""Sliding-window attention training step (forward + backward of attention alone): time and memory, CPU.

    uv run python tools/bench_attention.py                # T 8192, w 256, 12 heads x 64, batch 1, fp32
    uv run python tools/bench_attention.py --quick        # T 2048, 4 heads, scaling over 512..4096: seconds
    uv run python tools/bench_attention.py --json attn.json --threads 2
    uv run python tools/bench_attention.py --grid         # the CPU dispatch rule vs causal SDPA over
                                                          # T 64..8192 and w 16..T/4 (minutes)

Rows: ``window`` = ``memfit.ops.attention.attention(q, k, v, window=w)`` (on CPU: the band path, which
computes only each query block's key band and recomputes it in backward) and ``causal`` = dense causal
``scaled_dot_product_attention`` (``attention(q, k, v, causal=True)``; CPU flash kernel, O(T^2) time,
O(T) memory). Peak = tensor memory allocated during forward + backward beyond the inputs (q, k, v and
the incoming gradient are counted for both paths, as they would be inside a model, then subtracted),
measured with ``memfit.estimate.memory.measure_peak``. Time = best of ``--repeat`` wall-clock runs, with the
process's CPU seconds beside it (less distorted by other processes on a shared machine). Every ratio is
taken within one run. Scaling: a least-squares fit of log(time) and log(peak) against log(T) for the
window path at T = 2k, 4k, 8k, 16k (fixed w).

``--threads`` defaults to 1: on a machine shared with other jobs, multi-threaded kernels stall on
descheduled threads, which punishes the many small ops of the band path far more than one big fused
kernel; on a machine of your own, pass ``--threads`` with your core count.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from memfit.errors import UsageError
from memfit.estimate.steps import measure_peak
from memfit.ops.attention import attention, select_backend
from memfit.train.flags import Parser

MIB = 2**20


def make_inputs(B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(B, H, T, D, generator=g)


def step(fn, q, k, v, g):
    fn(q, k, v).backward(g)
    q.grad = k.grad = v.grad = None


def bench(fn, q, k, v, g, repeat):
    """(best wall s, its process CPU s, peak bytes beyond the inputs) of one forward + backward."""
    step(fn, q, k, v, g)  # warm-up
    best = (math.inf, math.inf)
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        step(fn, q, k, v, g)
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    inputs = [q, k, v, g]
    with measure_peak(existing=inputs) as m:
        step(fn, q, k, v, g)
    return best[0], best[1], m.peak_bytes - sum(t.numel() * t.element_size() for t in inputs)


def grid(args) -> list[dict]:
    """attention(window=w) (the path select_backend picks) vs causal SDPA, fwd+bwd, medians of alternated
    repeats (each the mean of enough steps to last ~25 ms), over T and w; B x H x D = 12 x 4 x 32
    (nanoGPT's CPU model) up to T 256, 1 x 12 x 64 above."""
    import statistics

    rows = []
    head = ("T", "w", "B,H,D", "path", "causal ms", "window ms", "ratio")
    print(" ".join(f"{h:>{n}s}" for h, n in zip(head, (6, 5, 9, 7, 10, 10, 6))))
    for T in [int(t) for t in args.grid_T.split(",")]:
        B, H, D = (12, 4, 32) if T <= 256 else (1, 12, 64)
        ws = sorted({w for w in (16, 64, 256, T // 4) if 1 <= w < T})
        q, k, v, g = make_inputs(B, H, T, D)
        for w in ws:
            fns = {"causal": lambda q, k, v: attention(q, k, v, causal=True),
                   "window": lambda q, k, v, w=w: attention(q, k, v, window=w)}  # fmt: skip
            times = {n: [] for n in fns}
            for fn in fns.values():
                step(fn, q, k, v, g)  # warm-up
            t0 = time.perf_counter()
            step(fns["causal"], q, k, v, g)
            inner = max(1, int(0.025 / (time.perf_counter() - t0)))  # >= ~25 ms per sample: a 2 ms step
            for r in range(args.repeat):  # is below the CPU clock's useful resolution alone
                for n in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                    t0 = time.process_time()
                    for _ in range(inner):
                        step(fns[n], q, k, v, g)
                    times[n].append((time.process_time() - t0) / inner)
            c, wt = statistics.median(times["causal"]), statistics.median(times["window"])
            path = select_backend(q, k, v, window=w)
            rows.append({"T": T, "window": w, "B": B, "H": H, "D": D, "path": path, "causal_s": c,
                         "window_s": wt, "ratio": wt / c})  # fmt: skip
            flag = "" if wt / c <= 1.05 else "  > 1.05"
            print(f"{T:6d} {w:5d} {f'{B},{H},{D}':>9s} {path:>7s} {1e3 * c:10.1f} {1e3 * wt:10.1f} "
                  f"{wt / c:6.2f}{flag}", flush=True)  # fmt: skip
    worst = max(rows, key=lambda r: r["ratio"])
    long = [r["ratio"] for r in rows if r["T"] >= 1024]
    print(f"worst window/causal {worst['ratio']:.2f} (T {worst['T']}, w {worst['window']}; goal <= 1.05); "
          f"T >= 1024: at most {max(long, default=float('nan')):.2f} (goal <= 1.0)")  # fmt: skip
    return rows


def fit_exponent(xs, ys):
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (seconds)")
    p.add_argument("--seq", type=int, default=None, help="headline length T (default 8192; quick 2048)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--heads", type=int, default=None, help="default 12; quick 4")
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--scaling", type=str, default=None, help="comma list of T (default 2048,4096,8192,16384)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=str, default=None, help="write the results here")
    p.add_argument("--grid", action="store_true", help="the dispatch rule vs causal SDPA over T and w")
    p.add_argument("--grid_T", default="64,128,256,512,1024,2048,4096,8192", help="lengths for --grid")
    args = p.parse_args(argv)
    if args.grid:
        torch.set_num_threads(args.threads)
        print(f"fwd+bwd, fp32, CPU threads {args.threads}, CPU seconds, median of {args.repeat} alternated")
        rows = grid(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "grid": rows}, f, indent=2)
        return

    T = args.seq or (2048 if args.quick else 8192)
    H = args.heads or (4 if args.quick else 12)
    default_scaling = "512,1024,2048,4096" if args.quick else "2048,4096,8192,16384"
    Ts = [int(t) for t in (args.scaling or default_scaling).split(",")]
    B, D, w = args.batch, args.head_dim, args.window
    if min(Ts + [T]) <= w:
        raise UsageError(f"error: every length must exceed the window ({w}) for the window path to matter")
    torch.set_num_threads(args.threads)

    def window_fn(q, k, v):
        return attention(q, k, v, window=w)

    def causal_fn(q, k, v):
        return attention(q, k, v, causal=True)

    q, k, v, g = make_inputs(B, H, T, D)
    path = select_backend(q, k, v, window=w)
    print(f"B {B}, H {H}, D {D}, T {T}, window {w}, fp32, CPU threads {args.threads}, window path: {path}")
    rows = {}
    for name, fn in (("causal", causal_fn), ("window", window_fn)):
        wall, cpu, peak = bench(fn, q, k, v, g, args.repeat)
        rows[name] = {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak / MIB}
    del q, k, v, g

    print(f"\n{'path':8s} {'wall s':>9s} {'cpu s':>9s} {'peak MiB':>10s}")
    for name, r in rows.items():
        print(f"{name:8s} {r['wall_s']:9.3f} {r['cpu_s']:9.3f} {r['peak_mib']:10.1f}")
    speed = rows["causal"]["wall_s"] / rows["window"]["wall_s"]
    speed_cpu = rows["causal"]["cpu_s"] / rows["window"]["cpu_s"]
    mem = rows["window"]["peak_mib"] / rows["causal"]["peak_mib"]
    print(f"\nwindow vs causal SDPA: {speed:.2f}x faster (wall), {speed_cpu:.2f}x (CPU s); memory {mem:.2f}x")
    print(
        f"  targets: >= 3x faster [{'met' if speed >= 3 else 'MISSED'}], memory <= 1.0x "
        f"[{'met' if mem <= 1.0 else 'MISSED'}]"
    )

    scaling = []
    print(f"\nscaling of the window path (w {w}):\n{'T':>7s} {'wall s':>9s} {'cpu s':>9s} {'peak MiB':>10s}")
    for t in Ts:
        q, k, v, g = make_inputs(B, H, t, D)
        wall, cpu, peak = bench(window_fn, q, k, v, g, args.repeat)
        scaling.append({"T": t, "wall_s": wall, "cpu_s": cpu, "peak_mib": peak / MIB})
        print(f"{t:7d} {wall:9.3f} {cpu:9.3f} {peak / MIB:10.1f}", flush=True)
        del q, k, v, g
    e_time = fit_exponent(Ts, [r["wall_s"] for r in scaling])
    e_cpu = fit_exponent(Ts, [r["cpu_s"] for r in scaling])
    e_mem = fit_exponent(Ts, [r["peak_mib"] for r in scaling])
    print(f"log-log exponents over T: time {e_time:.2f} (wall), {e_cpu:.2f} (CPU s); memory {e_mem:.2f}")
    print(
        f"  target <= 1.1: time [{'met' if e_time <= 1.1 else 'MISSED'}], "
        f"memory [{'met' if e_mem <= 1.1 else 'MISSED'}]"
    )

    if args.json:
        result = {
            "config": {
                "batch": B,
                "heads": H,
                "head_dim": D,
                "T": T,
                "window": w,
                "dtype": "float32",
                "threads": args.threads,
                "window_path": path,
            },
            "headline": rows,
            "ratios": {"speedup_wall": speed, "speedup_cpu": speed_cpu, "memory_ratio": mem},
            "scaling": scaling,
            "exponents": {"time_wall": e_time, "time_cpu": e_cpu, "memory": e_mem},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("bench_attention", lambda argv: main(argv)))
