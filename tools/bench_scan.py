"""Selective scan training step (forward + backward of the scan alone): memory and time, CPU.

    uv run python tools/bench_scan.py                 # batch 60, L 200, dim 256, N 16, fp32 (issue's size)
    uv run python tools/bench_scan.py --quick         # batch 8, L 64: seconds
    uv run python tools/bench_scan.py --seed          # also the seed's (B, L, D, N) scan (minutes: its
                                                      # per-step indexing makes backward quadratic in L)
    uv run python tools/bench_scan.py --chunks 8,16,32,64 --json scan.json

Rows: ``selective_scan`` (chunked, recomputing; one row per chunk size), ``selective_scan_ref``
(mamba_ssm's reference: materialises (B, D, L, N)), and optionally ``seed`` (the MBS-Net seed's
materialising scan in (B, L, D, N) layout, stepping with ``A_bar[:, t]``). Peak = tensor memory
allocated inside forward + backward (``memfit.memory.measure_peak``: output, saved tensors,
temporaries, the input gradients and the inputs themselves). Time = best of ``--repeat``
wall-clock runs (CPU seconds of this process beside it, which load from other processes distorts less).
Every ratio is taken within the run, against ``selective_scan_ref``. Mamba's setting: B/C per step,
D, z, delta_bias and softplus.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from memfit.memory import measure_peak
from memfit.ssm import auto_chunk_size, selective_scan, selective_scan_ref


def seed_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The seed's materialising scan: (batch, L, dim, N) A_bar and B_bar, one indexed step at a time."""
    x, dt = u.transpose(1, 2), delta.transpose(1, 2)  # (batch, L, dim)
    if delta_bias is not None:
        dt = dt + delta_bias
    if delta_softplus:
        dt = F.softplus(dt)
    B_ssm, C_ssm = B.transpose(1, 2), C.transpose(1, 2)  # (batch, L, N)
    dt_A = dt.unsqueeze(-1) * A  # (batch, L, dim, N)
    A_bar = torch.exp(dt_A)
    B_bar = dt.unsqueeze(-1) * B_ssm.unsqueeze(2)
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        h = A_bar[:, t] * h + B_bar[:, t] * x[:, t].unsqueeze(-1)
        ys.append((h * C_ssm[:, t].unsqueeze(1)).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z.transpose(1, 2))
    return y.transpose(1, 2)


def make_inputs(batch: int, dim: int, L: int, N: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, dim, L, generator=g)
    delta = torch.randn(batch, dim, L, generator=g) * 0.5 - 1.0
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(dim, 1)  # Mamba's S4D-real init
    B = torch.randn(batch, N, L, generator=g)
    C = torch.randn(batch, N, L, generator=g)
    D = torch.ones(dim)
    z = torch.randn(batch, dim, L, generator=g)
    delta_bias = torch.rand(dim, generator=g) * -4
    return [t.requires_grad_() for t in (u, delta, A, B, C, D, z, delta_bias)]


def train_step(fn, inputs) -> None:
    u, delta, A, B, C, D, z, delta_bias = inputs
    out = fn(u, delta, A, B, C, D, z, delta_bias, True)
    out.square().mean().backward()
    for t in inputs:
        t.grad = None


def bench(name, fn, inputs, repeat: int) -> dict:
    train_step(fn, inputs)  # warm-up
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        train_step(fn, inputs)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    with measure_peak("cpu", existing=inputs) as m:
        train_step(fn, inputs)
    return {"name": name, "peak_mib": m.peak_mib, "time_s": min(wall), "cpu_s": min(cpu)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=60)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--chunks", default="auto", help="comma-separated chunk sizes; auto = the default")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--quick", action="store_true", help="batch 8, L 64, one repeat")
    p.add_argument("--seed", action="store_true", help="also the seed's (B, L, D, N) scan (slow)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.length, args.repeat = 8, 64, 1
        if args.chunks == "auto":  # auto picks 64 at this small size (memory does not matter there)
            args.chunks = "auto,8"
    try:
        auto = auto_chunk_size(args.batch, args.dim, args.length, args.state)
        chunks = [auto if c == "auto" else int(c) for c in args.chunks.split(",")]
    except ValueError:
        raise SystemExit(f"--chunks must be comma-separated integers, got {args.chunks!r}") from None
    if args.threads:
        torch.set_num_threads(args.threads)

    inputs = make_inputs(args.batch, args.dim, args.length, args.state)
    print(
        f"selective scan fwd+bwd: batch {args.batch}, L {args.length}, dim {args.dim}, N {args.state}, fp32, "
        f"CPU, {torch.get_num_threads()} threads"
    )
    rows = [bench("selective_scan_ref", selective_scan_ref, inputs, args.repeat)]
    for c in chunks:
        fn = lambda *a, c=c: selective_scan(*a, chunk_size=c)  # noqa: E731
        label = f"selective_scan chunk={c}" + (" (auto)" if c == auto else "")
        rows.append(bench(label, fn, inputs, args.repeat))
    if args.seed:
        rows.append(bench("seed (B, L, D, N)", seed_scan, inputs, args.repeat))
    ref = rows[0]
    print(f"{'scan':33s} {'peak MiB':>9s} {'time s':>8s} {'cpu s':>8s} {'ref/peak':>9s} {'time/ref':>9s}")
    for r in rows:
        r["memory_ratio"] = ref["peak_mib"] / r["peak_mib"]
        r["time_ratio"] = r["time_s"] / ref["time_s"]
        r["cpu_ratio"] = r["cpu_s"] / ref["cpu_s"]
        print(
            f"{r['name']:33s} {r['peak_mib']:9.1f} {r['time_s']:8.3f} {r['cpu_s']:8.3f} "
            f"{r['memory_ratio']:8.2f}x {r['time_ratio']:8.2f}x"
        )
    print("targets: selective_scan >= 6x less memory than selective_scan_ref, time <= 1.0x")
    if args.json:
        cfg = {k: getattr(args, k) for k in ("batch", "length", "dim", "state")}
        with open(args.json, "w") as f:
            json.dump({"config": {**cfg, "threads": torch.get_num_threads()}, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
