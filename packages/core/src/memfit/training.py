"""The training loop's parts, shared by the four systems: a toolkit, not a framework.

A package supplies a model, an optimizer, ``loss_fn(model, batch)`` and ``get_batch(step, micro)``;
``Trainer`` adds autocast (bf16, or fp16 with a GradScaler), gradient accumulation, clipping, DDP under
torchrun, a progress bar, JSON-lines metrics, atomic checkpoints and exact resume, and the peak memory.

Resume is exact because everything that varies between steps is a function of the step: batches come
from ``get_batch(step, micro)`` (seeded per step by the package), and the RNG state, optimizer, scheduler
and scaler are restored from the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from memfit.memory import MIB, PeakMemory, training_state_tensors

CKPT_PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")
BEST_NAME = "best.pt"


# ----------------------------------------------------------------------------------------------------
# Configuration and command-line flags
# ----------------------------------------------------------------------------------------------------


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


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> the local CUDA device under torchrun, cuda if available, else cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_info().local_rank)
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"error: unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda asked for, but no CUDA GPU is available; use --device cpu")
    return device


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A CPU generator seeded by (seed, step, micro, rank): batches that do not depend on history."""
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + step) * 1_009 + micro) * 101 + rank)
    return g


def warmup_cosine_lambda(total: int, warmup: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over `warmup` steps, cosine down to `min_ratio` at `total`."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / (warmup + 1)  # nanoGPT's get_lr: never exactly 0, reaches 1 after warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def checkpointed(fn: Callable[..., Any], *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
    """Run fn(*args), keeping only its inputs for backward and recomputing its inside (when enabled)."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Distributed (torchrun)
# ----------------------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Rank and world size from torchrun's environment (1 process without it)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); a no-op for one process."""
    info = dist_info()
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    return info


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[2]],
        "python_version": random.getstate()[0],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((state["python_version"], tuple(py[:-1]), py[-1]))
    np.random.set_state(("MT19937", state["numpy"]["keys"].numpy().astype(np.uint32), state["numpy"]["pos"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoints in run_dir, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def write_atomic(path: Path, state: dict[str, Any]) -> Path:
    """torch.save to path atomically: a temp file, fsync, rename (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half
    return path


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write run_dir/ckpt_<step>.pt atomically (temp file, fsync, rename) and keep the newest keep_last."""
    path = write_atomic(Path(run_dir) / f"ckpt_{step:07d}.pt", state)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def find_checkpoint(run_dir: str | Path, which: str = "best") -> Path | None:
    """The checkpoint to use from a run folder.

    which="best": run_dir/best.pt if the run tracked a best metric, else the newest intact step
    checkpoint; which="latest": the newest intact step checkpoint. None when there is none.
    """
    if which not in ("best", "latest"):
        raise ValueError(f"which must be 'best' or 'latest', got {which!r}")
    run_dir = Path(run_dir)
    if which == "best" and (run_dir / BEST_NAME).is_file():
        return run_dir / BEST_NAME
    return latest_checkpoint(run_dir)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint file, or the newest one in a run folder (weights_only=True: no code runs)."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint (ckpt_*.pt) in {path}; train first or pass a .pt file")
        path = found
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and why, not a pickle traceback
        raise ValueError(f"could not read checkpoint {path}: {e}") from e


# ----------------------------------------------------------------------------------------------------
# Progress and metrics
# ----------------------------------------------------------------------------------------------------


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step")


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def autocast_context(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for 'bf16' / 'fp16'; nothing for 'none'."""
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class Trainer:
    """Runs `cfg.steps` optimizer steps of `loss_fn(model, get_batch(step, micro))`; see module docstring.

    loss_fn returns a scalar loss or (loss, {name: float}); get_batch must be deterministic in
    (step, micro) for exact resume; eval_fn(model) -> {name: float} runs every eval_every steps (rank 0).
    With best_metric, every evaluation that improves results[best_metric] (higher with best_mode="max",
    lower with "min") writes run_dir/best.pt (the same schema as the step checkpoints) and the metrics
    carry best/<metric> and best_step.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module, Any], Any]
    get_batch: Callable[[int, int], Any]
    cfg: LoopConfig
    scheduler: Any = None
    eval_fn: Callable[[nn.Module], dict[str, float]] | None = None
    eval_every: int = 0
    model_config: dict[str, Any] | None = None
    items_per_step: int | None = None  # e.g. tokens per optimizer step, for throughput
    best_metric: str | None = None
    best_mode: str = "max"  # "max" | "min"
    step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.stopped_early = False
        self.device = resolve_device(self.cfg.device)
        self.dist = init_distributed(self.device)
        self.run_dir = Path(self.cfg.run_dir)
        self.raw_model = self.model  # what is saved; self.model may be wrapped (DDP, compile)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.amp == "fp16")
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.dist.is_main)
        self.peak_memory_bytes = 0
        set_seed(self.cfg.seed + self.dist.rank)
        if self.cfg.resume:
            self._resume()
        if self.dist.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if self.cfg.compile:
            self.model = torch.compile(self.model)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "rng": _rng_state(),
            "model_config": self.model_config or {},
            "loop_config": asdict(self.cfg),
            "best": {"metric": self.best_metric, "value": self.best_value, "step": self.best_step},
        }

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        return save_checkpoint(self.run_dir, self.step, self.state_dict(), self.cfg.keep_last)

    def _resume(self) -> None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            print(
                f"[memfit] --resume: no checkpoint in {self.run_dir}; starting from step 0", file=sys.stderr
            )
            return
        state = load_checkpoint(path, map_location=self.device)
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        best = state.get("best") or {}
        if best.get("metric") == self.best_metric and best.get("value") is not None:
            self.best_value, self.best_step = float(best["value"]), int(best["step"])
        if self.dist.is_main:
            print(f"[memfit] resumed from {path} at step {self.step}", file=sys.stderr)

    # -- one optimizer step -----------------------------------------------------------------------
    def _train_step(self) -> tuple[float, dict[str, float]]:
        self.model.train()
        total = 0.0
        extra: dict[str, float] = {}
        accum = self.cfg.grad_accum
        for micro in range(accum):
            batch = self.get_batch(self.step, micro)
            is_last = micro == accum - 1
            sync = (
                self.model.no_sync()
                if (not is_last and isinstance(self.model, nn.parallel.DistributedDataParallel))
                else contextlib.nullcontext()
            )
            with sync:
                with autocast_context(self.cfg.amp, self.device):
                    out = self.loss_fn(self.model, batch)
                loss, metrics = out if isinstance(out, tuple) else (out, {})
                self.scaler.scale(loss / accum).backward()
            total += loss.detach().float().item() / accum
            for k, v in metrics.items():
                extra[k] = extra.get(k, 0.0) + float(v) / accum
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            extra["grad_norm"] = float(nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if not math.isfinite(total):
            raise FloatingPointError(
                f"loss became {total} at step {self.step}; lower --lr, use --amp bf16/none, or check the data"
            )
        return total, extra

    def fit(self) -> dict[str, Any]:
        """Train to cfg.steps; returns the last metrics (with peak_memory_mib)."""
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = _progress(cfg.steps, self.step, cfg.progress and self.dist.is_main)
        last: dict[str, Any] = {"step": self.step}
        t_last, steps_since = time.perf_counter(), 0
        t_start = time.perf_counter()
        start_step = self.step
        try:
            while self.step < cfg.steps:
                if self.step > start_step and self._out_of_time(t_start):
                    self.stopped_early = True
                    break
                measure = self.device.type == "cpu" and self.step - start_step < cfg.measure_memory_steps
                if measure:
                    held = training_state_tensors(self.raw_model, self.optimizer)
                    with PeakMemory("cpu", existing=held) as pm:
                        loss, extra = self._train_step()
                    self.peak_memory_bytes = max(self.peak_memory_bytes, pm.peak_bytes)
                else:
                    loss, extra = self._train_step()
                self.step += 1
                steps_since += 1
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    dt = time.perf_counter() - t_last
                    last = {
                        "step": self.step,
                        "loss": loss,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        **extra,
                    }
                    last["steps_per_s"] = steps_since / dt
                    if self.items_per_step:
                        last["items_per_s"] = self.items_per_step * self.dist.world_size * steps_since / dt
                    t_last, steps_since = time.perf_counter(), 0
                    postfix = {"loss": f"{loss:.4f}"}
                    if "items_per_s" in last:
                        postfix["items/s"] = f"{last['items_per_s']:.0f}"
                    bar.set_postfix(postfix)
                    self.metrics.write(last)
                if self.eval_fn is not None and self.eval_every and self.step % self.eval_every == 0:
                    self._evaluate(last)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
        finally:
            bar.close()
        if self.eval_fn is not None and (not self.eval_every or self.step % self.eval_every):
            self._evaluate(last)
        path = self.save()
        if self.stopped_early and self.dist.is_main:
            print(
                f"[memfit] --max_minutes {cfg.max_minutes:g} reached: stopped at step {self.step} of "
                f"{cfg.steps}; checkpoint {path}; continue with --resume",
                file=sys.stderr,
            )
        last["stopped_early"] = self.stopped_early
        if self.device.type == "cuda":
            self.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
        last["peak_memory_mib"] = self.peak_memory_bytes / MIB
        if self.dist.is_main:
            where = (
                "" if self.device.type == "cuda" else f", CPU tensors, first {cfg.measure_memory_steps} steps"
            )
            print(f"peak memory consumption: {last['peak_memory_mib']:.0f} MiB ({self.device.type}{where})")
            self.metrics.write({"step": self.step, "peak_memory_mib": last["peak_memory_mib"]})
        return last

    def _out_of_time(self, t_start: float) -> bool:
        """Whether the --max_minutes budget is spent (every rank takes rank 0's decision)."""
        if self.cfg.max_minutes is None:
            return False
        over = time.perf_counter() - t_start >= self.cfg.max_minutes * 60
        if self.dist.world_size > 1 and dist.is_initialized():
            flag = torch.tensor([float(over)], device=self.device if self.device.type == "cuda" else "cpu")
            dist.broadcast(flag, src=0)
            over = bool(flag.item())
        return over

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        return value > self.best_value if self.best_mode == "max" else value < self.best_value

    def _evaluate(self, last: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        assert self.eval_fn is not None
        self.raw_model.eval()
        with torch.no_grad(), autocast_context(self.cfg.amp, self.device):
            results = self.eval_fn(self.raw_model)
        self.raw_model.train()
        record = {"step": self.step, **{f"eval/{k}": v for k, v in results.items()}}
        if self.best_metric is not None:
            if self.best_metric not in results:
                raise KeyError(
                    f"best_metric {self.best_metric!r} is not among the eval results {sorted(results)}"
                )
            value = float(results[self.best_metric])
            if self._improved(value):
                self.best_value, self.best_step = value, self.step
                write_atomic(self.run_dir / BEST_NAME, self.state_dict())
            record[f"best/{self.best_metric}"] = self.best_value
            record["best_step"] = self.best_step
        last.update(record)
        self.metrics.write(record)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
