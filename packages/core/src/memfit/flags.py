"""The loop's settings and the command-line flags every `train` shares."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UsageError, os_error_message

UNTIL_BUDGET = 10**7
"""``steps`` for a run that trains until its ``--max_minutes`` budget (no step count of its own)."""


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
    overwrite: bool = False  # clear a run folder that already holds a run
    tensorboard: bool = False  # TensorBoard event files beside metrics.jsonl (the optional extra)
    progress: bool = True
    device: str = "auto"
    # On CPU, tracking every allocation costs time, so the peak is measured over the first steps (the
    # steady state is reached at step 2, once optimizer state exists). On CUDA the whole run is covered.
    measure_memory_steps: int = 3
    # Wall-clock budget: stop cleanly (checkpoint saved, resumable) once this many minutes have passed.
    max_minutes: float | None = None
    # Exponential moving average of the weights (decay per step, warmed up as min(ema, (1 + n) / (10 + n))
    # after n steps; 0: off). Validation scores the average, best.pt and every checkpoint carry it
    # ("ema_model"), and load_model uses it.
    ema: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.ema < 1:
            raise ValueError(f"ema must be in [0, 1) (a decay per step, e.g. 0.995; 0 = off), got {self.ema}")
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
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0 (0: only at the end), got {self.save_every}")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0 (0: off), got {self.grad_clip}")


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
    g.add_argument(
        "--overwrite", action="store_true", help="replace the run already in the run folder (deletes it)"
    )
    g.add_argument("--device", default=d["device"], help="auto | cpu | cuda | cuda:N")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard events to <run>/tensorboard (needs the `tensorboard` extra)",
    )
    add_threads_arg(g)
    ema_default = "the recipe's" if d["ema"] is None else d["ema"]
    g.add_argument(
        "--ema",
        type=float,
        default=d["ema"],
        help="decay of an exponential moving average of the weights, which validation, best.pt and "
        f"eval use (0 = off; default {ema_default})",
    )
    g.add_argument(
        "--max_minutes",
        type=float,
        default=d["max_minutes"],
        help="stop cleanly after this many minutes (checkpoint saved; continue with --resume)",
    )
    return parser


def add_threads_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (torch.set_num_threads); default: torch's own choice, all cores",
    )


def apply_threads(args: argparse.Namespace) -> None:
    """torch.set_num_threads(args.threads) when --threads was given (>= 1)."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        check_numbers(args, threads=">=1")
        import torch

        torch.set_num_threads(threads)


def add_eval_args(parser: argparse.ArgumentParser, system: str, out: bool = True) -> argparse.ArgumentParser:
    """The flags every `eval` shares: --run, --runs_dir, --out (a folder), --device, --threads.

    `--run_name` is accepted as a hidden alias of --run (train's spelling of the same name)."""
    g = parser.add_argument_group("run (memfit)")
    g.add_argument(
        "--run",
        default=None,
        help=f"run name (as given to train --run_name; under --runs_dir/{system}/), run folder or .pt file "
        "(default: run); a folder is evaluated at its best.pt, else its newest checkpoint",
    )
    hidden_alias(g, "--run_name", dest="run")
    g.add_argument("--runs_dir", default="runs", help="where train wrote its runs (default %(default)s)")
    if out:
        g.add_argument("--out", default=None, help="output folder (default: <run folder>/eval)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_threads_arg(g)
    return parser


def eval_out_dir(args: argparse.Namespace, run_path: Path) -> Path:
    """--out, or <run folder>/eval; created here so an unwritable location fails before the work."""
    out = Path(args.out) if args.out else (run_path if run_path.is_dir() else run_path.parent) / "eval"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"error: cannot create the output folder: {os_error_message(e)}") from None
    return out


def hidden_alias(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, **kw: Any) -> None:
    """An old spelling of a flag, still accepted but not shown in --help (kept for one release)."""
    parser.add_argument(*names, help=argparse.SUPPRESS, **kw)


def add_model_args(
    parser: argparse.ArgumentParser,
    presets: Any,
    default: str,
    help: str = "model preset",
    attention: list[str] | None = None,
    checkpointing_help: str = "activation checkpointing (default: the preset's)",
) -> argparse._ArgumentGroup:
    """--config PRESET, --checkpointing/--no-checkpointing and (where a system has a choice) --attention:
    the same spelling in every `train`. Flags left unset are None (the preset decides)."""
    g = parser.add_argument_group("model (memfit)")
    choices = list(presets) if default in presets else [default, *presets]
    g.add_argument("--config", default=default, choices=choices, help=f"{help} (default %(default)s)")
    g.add_argument(
        "--checkpointing", action=argparse.BooleanOptionalAction, default=None, help=checkpointing_help
    )
    if attention:
        g.add_argument("--attention", choices=attention, default=None, help="attention implementation")
    return g


def loop_config_from_args(args: argparse.Namespace, system: str) -> LoopConfig:
    """LoopConfig from flags added by add_loop_args; run_dir = runs_dir/system/run_name."""
    apply_threads(args)
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
            overwrite=getattr(args, "overwrite", False),
            tensorboard=getattr(args, "tensorboard", False),
            progress=not args.no_progress,
            device=args.device,
            max_minutes=getattr(args, "max_minutes", None),
            ema=getattr(args, "ema", 0.0),
        )
    except ValueError as e:
        raise UsageError(f"error: --{e}") from None


_RULES = {
    ">0": (lambda v: v > 0, "> 0"),
    ">=0": (lambda v: v >= 0, ">= 0"),
    ">=1": (lambda v: v >= 1, ">= 1"),
}


def fill_from_recipe(args: argparse.Namespace, recipe: Any, keys: tuple[str, ...]) -> None:
    """Set each flag in ``keys`` that the user left unset (None) to the recipe's value; with
    ``--max_minutes`` and no ``--steps`` the run trains until its time budget (``UNTIL_BUDGET``)."""
    if getattr(args, "steps", None) is None and getattr(args, "max_minutes", None):
        args.steps = UNTIL_BUDGET
    for key in keys:
        if getattr(args, key) is None:
            setattr(args, key, getattr(recipe, key))


def check_numbers(args: argparse.Namespace, **rules: str) -> None:
    """Refuse bad numbers in one line, e.g. check_numbers(args, lr=">0", batch_size=">=1").

    Rules: ">0", ">=0", ">=1"; flags left at None are skipped; NaN and infinity are refused too.
    """
    for name, rule in rules.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        ok, text = _RULES[rule]
        if not math.isfinite(value) or not ok(value):
            raise UsageError(f"error: --{name} must be {text}, got {value:g}")
