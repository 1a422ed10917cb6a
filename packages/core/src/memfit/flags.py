"""The loop's settings and the command-line flags every `train` shares."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoopConfig:
    """Settings of the loop itself (model and data settings belong to each package's config)."""

    steps: int = 1000
    grad_accum: int = 1
    amp: str = "bf16"  # "bf16" | "fp16" | "none"
    grad_clip: float | None = 1.0
    compile: bool = False
    log_every: int = 10
    save_every: int = 200  # 0: only at the end
    keep_last: int = 3
    seed: int = 0
    run_dir: str = "runs/default/run"
    resume: bool = False
    progress: bool = True
    device: str = "auto"
    # On CPU, tracking every allocation costs time, so the peak is measured over the first steps (the
    # steady state is reached at step 2, once optimizer state exists). On CUDA the whole run is covered.
    measure_memory_steps: int = 3
    # Wall-clock budget: stop cleanly (checkpoint saved, resumable) once this many minutes have passed.
    max_minutes: float | None = None

    def __post_init__(self) -> None:
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.amp not in ("bf16", "fp16", "none"):
            raise ValueError(f"amp must be one of bf16, fp16, none; got {self.amp!r}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


def add_loop_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """Add the loop flags shared by every `train`; keyword arguments override the defaults."""
    d = asdict(LoopConfig())
    d.update(run_name="run", runs_dir="runs")
    d.update(defaults)
    g = parser.add_argument_group("training loop (memfit)")
    g.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps (default %(default)s)")
    g.add_argument("--grad_accum", type=int, default=d["grad_accum"], help="micro-batches per step")
    g.add_argument("--amp", choices=["bf16", "fp16", "none"], default=d["amp"], help="autocast dtype")
    g.add_argument("--grad_clip", type=float, default=d["grad_clip"], help="max grad norm (0 = off)")
    g.add_argument("--compile", action="store_true", default=d["compile"], help="torch.compile the model")
    g.add_argument("--log_every", type=int, default=d["log_every"])
    g.add_argument("--save_every", type=int, default=d["save_every"], help="checkpoint interval (0 = end)")
    g.add_argument("--keep_last", type=int, default=d["keep_last"], help="checkpoints to keep")
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--run_name", default=d["run_name"], help="run folder name under runs_dir/<system>/")
    g.add_argument("--runs_dir", default=d["runs_dir"])
    g.add_argument("--resume", action="store_true", default=d["resume"], help="continue from last checkpoint")
    g.add_argument("--device", default=d["device"], help="auto | cpu | cuda | cuda:N")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--max_minutes",
        type=float,
        default=d["max_minutes"],
        help="stop cleanly after this many minutes (checkpoint saved; continue with --resume)",
    )
    return parser


def loop_config_from_args(args: argparse.Namespace, system: str) -> LoopConfig:
    """LoopConfig from flags added by add_loop_args; run_dir = runs_dir/system/run_name."""
    try:
        return LoopConfig(
            steps=args.steps,
            grad_accum=args.grad_accum,
            amp=args.amp,
            grad_clip=args.grad_clip or None,
            compile=args.compile,
            log_every=args.log_every,
            save_every=args.save_every,
            keep_last=args.keep_last,
            seed=args.seed,
            run_dir=str(Path(args.runs_dir) / system / args.run_name),
            resume=args.resume,
            progress=not args.no_progress,
            device=args.device,
            max_minutes=getattr(args, "max_minutes", None),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
