"""What only a GPU can tell, in one command: scan speed, each system's step, window attention, the paths.

    uv run python tools/bench_gpu.py --out gpu.json          # any CUDA machine, no build
    uv run python tools/bench_gpu.py --quick --out gpu.json  # fewer shapes and repeats
    uv run python tools/bench_gpu.py --parts scan,attention  # some of the parts (a)-(e) below

It prints one table per part and writes everything as JSON (after each part, so a run cut short keeps
what it measured):

(a) the selective scan, fwd+bwd at batch 4, dim 1536, N 16, fp32 (the Mamba paper's size) and L 512 /
    2048 / 8192: every CUDA implementation the registry has here (memfit's Triton kernel; mamba_ssm when
    installed), memfit's torch-op chunked scan, a materialising parallel scan (Hillis-Steele over
    (batch, dim, L, N) tensors, as pure-PyTorch Mamba ports do) and Mamba-2's SSD reference
    (tools/ssd_reference.py, a scalar decay per head: less work than Mamba-1's scan); median ms of
    alternated repeats and the allocator peak above the inputs;
(b) each system's paper-size training step (its budget entries): median ms per step, allocator and
    reserved peaks of a steady-state step, beside `memfit budget --device cuda`'s estimate for the kernels
    this GPU has;
(c) window against causal attention: the attention op alone (bf16, head dim 64; each CUDA candidate and
    the tuned choice, against causal SDPA), and GPT-2 d12's training step at T 1024 and 4096, causal and
    window 64;
(d) the implementation each call site took (``memfit.ops.registry.ran()``) and the window attention
    candidate tuned for each shape;
(e) `memfit estimate --device cuda` against this GPU (tools/gpu_memory_set.py): sixteen third-party steps,
    recurrent steps (GRU/LSTM taggers and a conv + LSTM model, batch 4 x about 100 steps at hidden 256 up
    to 3 layers x hidden 1024 x 1000 steps) and fp32 LLaMA-style decoders (with and without grouped
    key/value heads, 2 x 256 to 4 x 512 tokens), and every budget row of the four systems, naive baselines
    included, each from an empty allocator: allocated peak, reserved peak and card total, estimated and
    measured.

Timings are CUDA-event medians after warm-up (Triton compiles, Flex compiles); every figure names the GPU.
``--smoke`` runs every part at toy sizes on the CPU (the test suite's check that this script runs).
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from memfit.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memfit.train.flags import Parser
from ssd_reference import ssd_scan  # noqa: E402

SYSTEMS = {"ginr-cifar": "ginr_cifar", "gpt2-window": "gpt2_window", "mbsnet-speech": "mbsnet_speech",
           "moremouse-triplane": "moremouse_triplane"}  # fmt: skip
MIB = 2**20


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, repeats: int) -> tuple[float, int]:
    """(median ms of ``fn()`` over ``repeats`` after ``warmup`` calls, allocator peak in bytes above what
    was allocated before the timed calls; 0 on the CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return statistics.median(times), peak


def alternated(fns: dict, device: torch.device, warmup: int, repeats: int, rounds: int) -> dict:
    """{name: (median ms, peak bytes)}: each fn timed in ``rounds`` alternated rounds (a slow clock or a
    neighbour's load then hits all alike); the median over rounds of each round's median."""
    got: dict[str, list[float]] = {n: [] for n in fns}
    peaks: dict[str, int] = {}
    for r in range(rounds):
        for name, fn in fns.items():
            try:
                ms, peak = timed(fn, device, warmup if r == 0 else 1, repeats)
            except torch.OutOfMemoryError:
                ms, peak = math.inf, -1
                torch.cuda.empty_cache()
            got[name].append(ms)
            peaks[name] = max(peaks.get(name, 0), peak)
    return {n: (statistics.median(v), peaks[n]) for n, v in got.items()}


# ----------------------------------------------------------------------------------------------------
# (a) the scan
# ----------------------------------------------------------------------------------------------------


def pscan_reference(u, delta, A, B, C, D, z, delta_bias):
    """A materialising parallel scan: deltaA and deltaB*u as (batch, dim, L, N) tensors, then a
    Hillis-Steele inclusive scan of the affine maps h -> a*h + b in log2(L) doubling steps."""
    dt = F.softplus(delta + delta_bias[:, None])
    a = torch.exp(dt.unsqueeze(-1) * A[:, None, :])  # (b, d, L, N)
    b = (dt * u).unsqueeze(-1) * B.unsqueeze(1).transpose(2, 3)  # per-step B (b, N, L)
    step = 1
    L = u.shape[2]
    while step < L:
        a_prev = F.pad(a[:, :, :-step], (0, 0, step, 0), value=1.0)
        b_prev = F.pad(b[:, :, :-step], (0, 0, step, 0))
        b = a * b_prev + b
        a = a * a_prev
        step *= 2
    y = (b * C.unsqueeze(1).transpose(2, 3)).sum(-1)
    return (y + u * D[:, None]) * F.silu(z)


def scan_inputs(batch, dim, L, N, device):
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    # a Mamba block's layout: u, delta, z are (batch, L, dim) tensors seen transposed
    u, delta, z = (r(batch, L, dim, scale=s).transpose(1, 2) for s in (1.0, 0.5, 1.0))
    A = -torch.exp(torch.rand(dim, N, generator=g) * 2).to(device)
    B, C = r(batch, N, L), r(batch, N, L)
    return {
        "u": u,
        "delta": delta,
        "A": A,
        "B": B,
        "C": C,
        "D": r(dim),
        "z": z,
        "delta_bias": r(dim, scale=0.1),
    }


def scan_fns(leaves: dict, gout: torch.Tensor, device: torch.device) -> dict:
    """{label: fwd+bwd of one scan implementation} on these inputs."""
    from memfit.ops import registry

    fns = {}
    for impl in registry.records("scan"):
        fn = registry.resolve(impl.load)
        if impl.device not in (device.type, "any") or fn is None or registry.why_not_ready(impl) is not None:
            continue

        def run(fn=fn):
            fn(*leaves.values(), True, False, None).backward(gout)

        fns["memfit torch-op chunked" if impl.name == "torch" else impl.name] = run

    def pscan():
        pscan_reference(*leaves.values()).backward(gout)

    def ssd():  # Mamba-2's layer on the same data: heads of 64 channels, one decay per head
        u = leaves["u"]
        heads = u.shape[1] // 64
        dt = F.softplus(leaves["delta"][:, ::64].transpose(1, 2) + leaves["delta_bias"][::64])
        xs = (u.transpose(1, 2).unflatten(2, (heads, -1)) * dt.unsqueeze(-1)).contiguous()
        a = dt * leaves["A"][::64, 0]
        y, _ = ssd_scan(xs, a, leaves["B"].transpose(1, 2), leaves["C"].transpose(1, 2), chunk=64)
        y = y.flatten(2).transpose(1, 2)
        ((y + u * leaves["D"][:, None]) * F.silu(leaves["z"])).backward(gout)

    fns["parallel scan (materialising)"] = pscan
    if leaves["u"].shape[1] % 64 == 0 and leaves["u"].shape[2] % 64 == 0:
        fns["SSD reference (Mamba-2)"] = ssd
    return fns


def scan_part(sizes, device, warmup, repeats, rounds) -> list[dict]:
    rows = []
    for batch, dim, L, N in sizes:
        leaves = {
            k: v.detach().requires_grad_(True) for k, v in scan_inputs(batch, dim, L, N, device).items()
        }
        gout = torch.randn(batch, dim, L, device=device)
        res = alternated(scan_fns(leaves, gout, device), device, warmup, repeats, rounds)
        for name, (ms, peak) in res.items():
            rows.append({"batch": batch, "dim": dim, "L": L, "N": N, "impl": name, "ms": ms,
                         "peak_mib": peak / MIB})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------------
# (b) each system's paper-size step, and (c) the d12 steps
# ----------------------------------------------------------------------------------------------------


def step_runner(step, device):
    """(one training step as a function, the model): the step as ``memfit.estimate.memory`` runs it."""
    from memfit.step import default_optimizer

    with torch.device(device):
        model = step.build_model()
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = step.optimizer(params) if step.optimizer is not None else default_optimizer(params)
    batch = step.make_batch(device)

    def run():
        with torch.autocast(device.type, dtype=step.amp_dtype, enabled=step.amp_dtype is not None):
            loss = step.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, model


def measure_step(step, device, warmup, repeats) -> dict:
    """ms per step and the allocator/reserved peaks of steady-state steps (after ``warmup`` steps). The
    allocator's cache is emptied first: blocks an earlier part left cached would count as this step's
    reserved memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run, model = step_runner(step, device)
    for _ in range(warmup):
        run()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms, _ = timed(run, device, 0, repeats)
    out = {"ms": ms, "params": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        out["allocated_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["reserved_peak_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    del run, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def estimate_gib(step, device) -> dict:
    """`memfit budget --device cuda`'s figures for this step on this GPU's kernels: the allocator peak, and
    (where the estimator models them) the reserved peak and the card total."""
    from memfit.estimate.rules import assume_kernels
    from memfit.estimate.steps import estimate_training_step
    from memfit.ops import registry

    kernels = registry.kernels_on(device) if device.type == "cuda" else frozenset()
    with assume_kernels(kernels):
        report = estimate_training_step(step, device="cuda")
    out = {"estimate_gib": report.peak_bytes / 2**30}
    if getattr(report, "cuda", None) is not None:
        out["estimate_reserved_gib"] = report.cuda.reserved / 2**30
        out["estimate_total_gib"] = report.cuda.total / 2**30
    return out


def system_part(systems, device, warmup, repeats, smoke=False) -> list[dict]:
    rows = []
    for name in systems:
        system = importlib.import_module(f"{SYSTEMS[name]}.system").SYSTEM
        for entry in system.budgets():
            if entry.is_baseline:
                continue
            step = entry.calibration if smoke else entry.step
            if step is None:
                continue
            row = {"system": name, "variant": entry.variant, "batch": entry.batch}
            try:
                row |= measure_step(step, device, warmup, repeats)
                row |= estimate_gib(step, device)
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0][:120]}"
                torch.cuda.empty_cache()
            rows.append(row)
    return rows


def d12_part(lengths, device, warmup, repeats, smoke=False) -> list[dict]:
    from dataclasses import replace

    from gpt2_window.config import get_config
    from gpt2_window.system import gpt_step

    rows = []
    for T, batch in lengths:
        for label, window in (("causal", None), ("window 64", 64)):
            cfg = get_config("d12", block_size=max(T, 1024), window=window)
            if smoke:
                cfg = replace(cfg, n_layer=1, n_head=2, n_embd=64, vocab_size=256)
            step = gpt_step(cfg, batch, T, torch.bfloat16)
            rows.append(
                {"T": T, "batch": batch, "attention": label, **measure_step(step, device, warmup, repeats)}
            )
    return rows


def attention_fns(q, k, v, gout, windows, device) -> dict:
    """{label: fwd+bwd}: causal SDPA, each window candidate, and memfit's attention() (timed)."""
    from memfit.ops import attention as A
    from memfit.ops import registry

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(gout)

    fns = {"SDPA causal": causal}
    for w in windows:
        # on a GPU, what the registry times for a training key of this shape (registry.timed_candidates)
        names = (
            registry.timed_candidates("attention", q, k, v, w, None) if device.type == "cuda" else ["blocks"]
        )
        for name in names:
            fn = registry.resolve(registry.record_of("attention", name).load)

            def cand(fn=fn, w=w):
                fn(q, k, v, w, None).backward(gout)

            fns[f"window {w}: {name}"] = cand

        def auto(w=w):
            A.attention(q, k, v, window=w).backward(gout)

        fns[f"window {w}: memfit attention()"] = auto
    return fns


def attention_part(shapes, windows, device, warmup, repeats, rounds) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for B, H, T in shapes:
        g = torch.Generator().manual_seed(0)
        # the layout a model hands over: q, k, v split from one (B, T, 3H * 64) projection, heads transposed
        qkv = torch.randn(B, T, 3 * H * 64, generator=g).to(device, dtype)
        q, k, v = (
            t.view(B, T, H, 64).transpose(1, 2).detach().requires_grad_() for t in qkv.split(H * 64, -1)
        )
        gout = torch.randn(B, H, T, 64, generator=g).to(device, dtype)
        res = alternated(attention_fns(q, k, v, gout, windows, device), device, warmup, repeats, rounds)
        base = res["SDPA causal"][0]
        for name, (ms, peak) in res.items():
            rows.append({"B": B, "H": H, "T": T, "path": name, "ms": ms, "x_causal": ms / base,
                         "peak_mib": peak / MIB})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "inf" if math.isinf(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_gpu.json", help="the JSON file to write (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks that the script runs")
    p.add_argument(
        "--parts", default="scan,systems,attention,d12,memory", help="comma-separated parts to run"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems for part (b)")
    args = p.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise UsageError("error: no CUDA GPU here (uv run memfit doctor says why); --smoke runs on the CPU")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    from memfit.ops import attention as A
    from memfit.ops import registry

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    report: dict = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "quick": args.quick}  # fmt: skip
    out = Path(args.out)
    parts = args.parts.split(",")
    warmup, repeats, rounds = (1, 2, 1) if args.smoke else (2, 5, 2) if args.quick else (3, 10, 3)
    registry.reset()

    def save():
        report["paths"] = {f"{s}/{p}": n for (s, p), n in registry.ran().items()}
        report["window_choices"] = {str(k): v for k, v in A.cuda_window_choices().items()}
        out.write_text(json.dumps(report, indent=1, default=str))

    print(f"bench_gpu on {gpu}, torch {torch.__version__}")
    if "scan" in parts:
        if args.smoke:
            sizes = [(2, 128, 64, 16)]
        elif args.quick:
            sizes = [(4, 1536, 2048, 16)]
        else:
            sizes = [(4, 1536, L, 16) for L in (512, 2048, 8192)]
        report["scan"] = scan_part(sizes, device, warmup, repeats, rounds)
        print(
            "\n(a) selective scan, fwd+bwd, fp32\n" + table(report["scan"], ["L", "impl", "ms", "peak_mib"])
        )
        save()
    if "systems" in parts:
        report["systems"] = system_part(args.systems.split(","), device, warmup, repeats, smoke=args.smoke)
        cols = ["system", "variant", "batch", "ms", "allocated_peak_gib", "estimate_gib", "reserved_peak_gib",
                "estimate_reserved_gib", "error"]  # fmt: skip
        print("\n(b) paper-size training steps\n" + table(report["systems"], cols))
        save()
    if "attention" in parts:
        if args.smoke:
            shapes, windows = [(1, 2, 128)], [16]
        else:
            shapes, windows = [(8, 12, 1024), (2, 12, 4096)], [64, 256]
        report["attention"] = attention_part(shapes, windows, device, warmup, repeats, rounds)
        cols = ["B", "T", "path", "ms", "x_causal", "peak_mib"]
        print("\n(c) attention op, fwd+bwd\n" + table(report["attention"], cols))
        save()
    if "d12" in parts:
        lengths = [(64, 2)] if args.smoke else [(1024, 8), (4096, 2)]
        report["d12"] = d12_part(lengths, device, warmup, repeats, smoke=args.smoke)
        print("\n(c) GPT-2 d12 training step\n" + table(report["d12"], ["T", "batch", "attention", "ms"]))
        save()
    if "memory" in parts:
        import gpu_memory_set  # tools/, beside this script

        if args.smoke:
            report["memory"] = gpu_memory_set.smoke(
                ["resnet50-fp32", "gru-3x512", "gru-tagger-4x100", "llama-fp32-gqa-2x256"]
            )
        else:
            from memfit.estimate.measure import format_rows

            report["memory"] = gpu_memory_set.run()
            print("\n(e) memfit estimate --device cuda against this GPU\n" + format_rows(
                [r for r in report["memory"] if "card" in r]))  # fmt: skip
            print(gpu_memory_set.summary(report["memory"]))
        save()
    save()
    print("\n(d) paths taken: " + ", ".join(f"{k} x{v}" for k, v in report["paths"].items()))
    if report["window_choices"]:
        print(
            "    window attention, timed by the registry: "
            + "; ".join(f"{k} -> {v}" for k, v in report["window_choices"].items())
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("bench_gpu", main))
