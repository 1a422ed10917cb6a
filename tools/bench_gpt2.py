"""gpt2-window benchmarks: memory of the d12 budget rows, and quality of nanoGPT's CPU char model.

    uv run python tools/bench_gpt2.py memory    # estimated peaks of d12 causal / window / fp32 / seed
                                                # + estimate vs measured for each small calibration step
    uv run python tools/bench_gpt2.py speed     # training-step time at nanoGPT's CPU config: our causal
                                                # and window-16 models vs tools/nanogpt_ref.py (1 thread)
    OMP_NUM_THREADS=1 uv run python tools/bench_gpt2.py side-by-side [--seeds 0,1]
                                                # the quality bar: nanoGPT-equivalent vs our causal
                                                # vs our window-16 (T/4) model, same data, schedule and
                                                # 200-batch evaluation; mean over seeds
    OMP_NUM_THREADS=1 uv run python tools/bench_gpt2.py quality [--data tinyshakespeare.txt]
                                                # 2000 iterations of nanoGPT's shakespeare_char CPU config,
                                                # then validation loss over 200 batches and tokens/s

Every figure printed comes from this run; ratios are taken within the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from memfit.errors import UsageError
from memfit.train.flags import Parser

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / ".." / "shared" / "data" / "text" / "tinyshakespeare.txt"

# nanoGPT README, "I only have a macbook": train_shakespeare_char.py with these CPU overrides.
NANOGPT_CPU = [
    "--model", "tiny", "--batch_size", "12", "--sequence_length", "64", "--num_iterations", "2000",
    "--lr", "1e-3", "--min_lr", "1e-4", "--warmup", "100", "--beta2", "0.99", "--weight_decay", "0.1",
    "--dropout", "0.0", "--grad_clip", "1.0", "--eval_every", "250", "--eval_iters", "20",
]  # fmt: skip


def bench_memory() -> None:
    from gpt2_window.system import budget_entries
    from memfit.estimate.steps import estimate_training_step, measure_training_step

    rows = []
    for e in budget_entries():
        t = time.perf_counter()
        est = estimate_training_step(e.step)
        secs = time.perf_counter() - t
        cal_est = estimate_training_step(e.calibration)
        cal_meas = measure_training_step(e.calibration)
        rows.append((e, est, secs, cal_est.peak_bytes / cal_meas.peak_bytes, cal_meas.peak_mib))
        cats = ", ".join(f"{k} {v:.2f}" for k, v in est.category_gib().items())
        print(
            f"{e.variant:12s} {e.dtype:5s} estimated {est.peak_gib:6.3f} GiB (budget {e.budget_gib}) "
            f"[{cats}] in {secs:.0f} s; calibration estimate/measured = {rows[-1][3]:.4f} "
            f"({cal_meas.peak_mib:.2f} MiB)",
            flush=True,
        )
    peak = {e.variant: est.peak_bytes for e, est, *_ in rows}
    print(f"window / causal = {peak['window'] / peak['causal']:.4f} (goal <= 1.02)")
    print(f"seed baseline / causal = {peak['window-seed'] / peak['causal']:.4f} (must be > 1)")
    print(f"seed baseline - causal = {(peak['window-seed'] - peak['causal']) / 2**20:.0f} MiB")


def bench_speed(threads: int, repeat: int, steps: int, window: int) -> dict:
    """Median seconds per training step (fwd, loss, bwd, AdamW) of three models, rounds alternated."""
    import statistics
    import sys

    import torch
    from gpt2_window.config import get_config
    from gpt2_window.model import GPT

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nanogpt_ref import RefGPT

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    vocab, B, T = 65, 12, 64
    models = {
        "nanoGPT-equivalent (tools/nanogpt_ref.py)": RefGPT(vocab),
        "gpt2-window causal (tiny)": GPT(get_config("tiny", vocab_size=vocab)),
        f"gpt2-window window {window} (tiny_window)": GPT(
            get_config("tiny_window", vocab_size=vocab, window=window)
        ),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (2, B, T), generator=g)

    def run(name: str, n: int) -> float:
        m, opt = models[name], opts[name]
        t = time.perf_counter()
        for _ in range(n):
            _, loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) / n

    names = list(models)
    for n in names:
        run(n, 3)  # warm-up
    times = {n: [] for n in names}
    for r in range(repeat):
        for n in names if r % 2 == 0 else names[::-1]:
            times[n].append(run(n, steps))
    ref = statistics.median(times[names[0]])
    causal = statistics.median(times[names[1]])
    print(f"training step, batch {B} x {T}, 4 layers x 4 heads x 128, fp32, {threads} thread(s), median of "
          f"{repeat} alternated rounds of {steps} steps")  # fmt: skip
    out = {}
    for n in names:
        t = statistics.median(times[n])
        out[n] = {"ms_per_step": 1e3 * t, "vs_nanogpt": t / ref, "vs_causal": t / causal}
        print(f"  {n:45s} {1e3 * t:7.2f} ms/step  {t / ref:5.2f}x nanoGPT  {t / causal:5.2f}x our causal")
    print("  goals: causal <= 1.05x nanoGPT-equivalent, window <= 1.05x nanoGPT-equivalent")
    return out


def train_reference(data_path: Path, seed: int, iterations: int = 2000) -> float:
    """nanoGPT's CPU recipe on tools/nanogpt_ref.py (our own loop, the same schedule as NANOGPT_CPU: AdamW
    lr 1e-3, betas (0.9, 0.99), weight decay 0.1, warmup 100, cosine to 1e-4, clip 1.0, batch 12 x 64),
    the same training batches as gpt2-window's trainer for this seed; returns the 200-batch val loss."""
    import sys

    import torch
    from gpt2_window.data import load_data
    from gpt2_window.eval import estimate_loss
    from memfit.train.loop import Progress, WarmupCosine, step_generator

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nanogpt_ref import RefGPT, make_optimizer

    data = load_data(data_path, tokenizer="char")
    torch.manual_seed(seed)
    model = RefGPT(data.vocab_size)
    opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    schedule = WarmupCosine(100, 0.1)
    for step in range(iterations):
        for group in opt.param_groups:  # nanoGPT's get_lr(step)
            group["lr"] = 1e-3 * schedule(Progress(step, 0.0, iterations, None))
        x, y = data.batch("train", 12, 64, step_generator(seed, step))
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return estimate_loss(model, data, "val", 12, 64, 200, "cpu")


def ours_val_loss(data: Path, runs_dir: str, model: str, seed: int) -> float:
    """gpt2-window's trainer on NANOGPT_CPU (fp32) with the given preset; the 200-batch val loss."""
    from gpt2_window.eval import main as eval_run
    from gpt2_window.train import run as train_run

    name = f"side-{model}-seed{seed}"
    argv = [*NANOGPT_CPU, "--data", str(data), "--runs_dir", runs_dir, "--run_name", name,
            "--seed", str(seed), "--amp", "none", "--no_progress", "--log_every", "500"]  # fmt: skip
    argv[argv.index("tiny")] = model
    train_run(argv)
    run = Path(runs_dir) / "gpt2-window" / name
    return eval_run(["--run", str(run), "--eval_iters", "200", "--batch_size", "12", "--json"])["loss"]


def side_by_side(data: Path, runs_dir: str, seeds: list[int]) -> dict:
    """The quality bar: mean val loss of our causal model <= nanoGPT-equivalent's + 0.01, and the window
    model's (window 16 = T/4) <= our causal model's + 0.02 (one-sided: a better window model passes)."""
    import statistics

    if not data.exists():
        raise UsageError(f"error: {data} not found; pass --data path/to/tinyshakespeare.txt")
    rows = {"nanogpt_ref": [], "causal": [], "window16": []}
    for seed in seeds:
        t = time.perf_counter()
        rows["nanogpt_ref"].append(train_reference(data, seed))
        rows["causal"].append(ours_val_loss(data, runs_dir, "tiny", seed))
        rows["window16"].append(ours_val_loss(data, runs_dir, "tiny_window", seed))
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in rows.items())
              + f" ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    mean = {k: statistics.mean(v) for k, v in rows.items()}
    out = {"seeds": seeds, "val_loss": rows, "mean": mean,
           "causal_minus_ref": mean["causal"] - mean["nanogpt_ref"],
           "window_minus_causal": mean["window16"] - mean["causal"]}  # fmt: skip
    print(json.dumps(out, indent=1))
    print(f"causal - nanoGPT-equivalent {out['causal_minus_ref']:+.4f} (goal <= +0.01); "
          f"window - causal {out['window_minus_causal']:+.4f} (goal <= +0.02)")  # fmt: skip
    return out


def bench_quality(data: Path, runs_dir: str, amp: str, model: str, seed: int) -> None:
    from gpt2_window.eval import main as eval_run
    from gpt2_window.train import run as train_run

    if not data.exists():
        raise UsageError(f"error: {data} not found; pass --data path/to/tinyshakespeare.txt")
    name = f"nanogpt-cpu-{model}-seed{seed}"
    argv = [
        *NANOGPT_CPU,
        "--data",
        str(data),
        "--runs_dir",
        runs_dir,
        "--run_name",
        name,
        "--seed",
        str(seed),
    ]
    argv[argv.index("tiny")] = model
    argv += ["--amp", amp, "--save_every", "500", "--no_progress", "--log_every", "100", "--overwrite"]
    t = time.perf_counter()
    result = train_run(argv)
    wall = time.perf_counter() - t
    run = Path(runs_dir) / "gpt2-window" / name
    final = eval_run(["--run", str(run), "--eval_iters", "200", "--batch_size", "12", "--json"])
    summary = {
        "model": model,
        "seed": seed,
        "amp": amp,
        "val_loss_200_batches": final["loss"],
        "val_loss_in_training_20_batches": result.get("eval/val_loss"),
        "train_loss_20_batches": result.get("eval/train_loss"),
        "tokens_per_s": result.get("tokens_per_s"),
        "wall_s": wall,
        "goal": "val loss <= 1.88 (nanoGPT README)",
    }
    print(json.dumps(summary, indent=1))


def main() -> None:
    p = Parser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("memory")
    sp = sub.add_parser("speed")
    sp.add_argument("--threads", type=int, default=1)
    sp.add_argument("--repeat", type=int, default=7, help="alternated rounds (median)")
    sp.add_argument("--steps", type=int, default=10, help="steps per round")
    sp.add_argument("--window", type=int, default=16)
    sb = sub.add_parser("side-by-side")
    sb.add_argument("--data", type=Path, default=SHAKESPEARE)
    sb.add_argument("--runs_dir", default="runs")
    sb.add_argument("--seeds", default="0,1")
    sb.add_argument("--threads", type=int, default=1, help="torch threads for every run (default 1)")
    q = sub.add_parser("quality")
    q.add_argument("--data", type=Path, default=SHAKESPEARE)
    q.add_argument("--runs_dir", default="runs")
    q.add_argument("--amp", default="none", choices=["none", "bf16"], help="nanoGPT on CPU trains in fp32")
    q.add_argument("--model", default="tiny", choices=["tiny", "tiny_window"])
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    if getattr(args, "threads", 1) < 1:
        raise UsageError("error: --threads must be >= 1")
    if args.what in ("side-by-side", "quality"):
        import torch

        torch.set_num_threads(args.threads)  # the trainers leave it alone without their own --threads
    if args.what == "memory":
        bench_memory()
    elif args.what == "speed":
        bench_speed(args.threads, args.repeat, args.steps, args.window)
    elif args.what == "side-by-side":
        side_by_side(args.data, args.runs_dir, [int(s) for s in args.seeds.split(",")])
    else:
        bench_quality(args.data, args.runs_dir, args.amp, args.model, args.seed)


if __name__ == "__main__":  # one line, exit 2, for bad input (memfit.errors.run_command)
    from memfit.errors import run_command

    raise SystemExit(run_command("bench_gpt2", lambda _argv: main()))
