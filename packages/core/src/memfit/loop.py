"""The training loop: ``Trainer`` and the small pieces it is made of.

A package supplies a model, an optimizer, ``loss_fn(model, batch)`` and ``get_batch(step, micro)``;
``Trainer`` adds autocast (bf16, or fp16 with a GradScaler), gradient accumulation, clipping, DDP under
torchrun, a progress bar, JSON-lines metrics, atomic checkpoints and exact resume, and the peak memory.

Resume is exact because everything that varies between steps is a function of the step: batches come
from ``get_batch(step, micro)`` (seeded per step by the package), and the RNG state, optimizer, scheduler
and scaler are restored from the checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import random
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

from memfit.checkpoint import (
    BEST_NAME,
    _rng_state,
    _set_rng_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_atomic,
)
from memfit.distributed import init_distributed, resolve_device
from memfit.flags import LoopConfig
from memfit.memory import MIB, PeakMemory, training_state_tensors
from memfit.metrics_log import MetricsLog


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
