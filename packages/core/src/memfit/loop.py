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
import signal
import sys
import threading
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
    CHECKPOINT_FORMAT,
    _rng_state,
    _set_rng_state,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    write_atomic,
)
from memfit.config import config_dict, config_difference
from memfit.cpu import keep_freed_memory
from memfit.distributed import init_distributed, resolve_device
from memfit.errors import UsageError, os_error_message
from memfit.flags import UNTIL_BUDGET, LoopConfig
from memfit.memory import MIB, PeakMemory, training_state_tensors
from memfit.metrics_log import MetricsLog
from memfit.run_dir import RunFolder


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A CPU generator seeded by (seed, step, micro, rank): batches that do not depend on history."""
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + step) * 1_009 + micro) * 101 + rank)
    return g


def warmup_cosine_lambda(
    total: int, warmup: int, min_ratio: float = 0.1, max_minutes: float | None = None
) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over `warmup` steps, cosine down to `min_ratio` at `total`.

    With max_minutes (a --max_minutes time budget) the cosine follows whichever is further along, the
    steps or the wall clock since this call, so the rate reaches its floor when the budget runs out.
    """
    start = time.monotonic()

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / (warmup + 1)  # nanoGPT's get_lr: never exactly 0, reaches 1 after warmup
        progress = (step - warmup) / max(1, total - warmup)
        if max_minutes:
            progress = max(progress, (time.monotonic() - start) / (60 * max_minutes))
        progress = min(1.0, progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def ema_avg_fn(decay: float) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """AveragedModel's avg_fn for an EMA whose decay warms up as min(decay, (1 + n) / (10 + n)) after n
    updates, so a short run's average is not dominated by its first, untrained weights."""

    def avg(averaged: torch.Tensor, current: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        d = min(decay, (1 + float(n)) / (10 + float(n)))
        return averaged * d + current * (1 - d)

    return avg


def _of_steps(steps: int) -> str:
    """ " of N" for a progress message, nothing for a run that goes until its time budget."""
    return "" if steps >= UNTIL_BUDGET else f" of {steps}"


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    total = None if total >= UNTIL_BUDGET else total  # a budget run: steps and rate, no bogus ETA
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


STOP_NONE, STOP_TIME, STOP_SIGNAL = 0, 1, 2


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
    config: Any = None  # the model config dataclass (or dict): checkpoint["config"], rebuilds the model
    meta: dict[str, Any] | None = None  # what else eval needs to know (data, tokenizer, preset name...)
    items_per_step: int | None = None  # e.g. tokens per optimizer step, for throughput
    best_metric: str | None = None
    best_mode: str = "max"  # "max" | "min"
    system: str | None = None  # the registered system name, saved in checkpoints and checked on resume
    step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.stopped_early = False
        self.device = resolve_device(self.cfg.device)
        if self.device.type == "cpu":
            # reuse freed activation blocks instead of page-faulting them in every step (process-wide and
            # for good: memfit.cpu; MEMFIT_KEEP_FREED=0 leaves malloc alone)
            keep_freed_memory()
        self.dist = init_distributed(self.device)
        self.run_dir = Path(self.cfg.run_dir)
        self.folder = RunFolder(self.run_dir)
        if self.dist.is_main:  # refuse a used folder or a live trainer before anything is written
            self.folder.open(self.cfg.resume, self.cfg.overwrite)
        self.raw_model = self.model  # what is saved; self.model may be wrapped (DDP, compile)
        self.ema_model = (
            torch.optim.swa_utils.AveragedModel(self.raw_model, avg_fn=ema_avg_fn(self.cfg.ema))
            if self.cfg.ema
            else None
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.amp == "fp16")
        self.peak_memory_bytes = 0
        self._signal: int | None = None
        set_seed(self.cfg.seed + self.dist.rank)
        try:
            if self.cfg.resume:
                self._resume()
            self.metrics = MetricsLog(
                self.run_dir / "metrics.jsonl",
                enabled=self.dist.is_main,
                tensorboard=self.cfg.tensorboard,
                purge_step=self.step + 1 if self.cfg.resume else None,
            )
        except BaseException:
            self.folder.release()
            raise
        if self.dist.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if self.cfg.compile:
            self.model = torch.compile(self.model)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "system": self.system,
            "step": self.step,
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "rng": _rng_state(),
            "config": config_dict(self.config),
            "meta": self.meta or {},
            "loop_config": asdict(self.cfg),
            "best": {"metric": self.best_metric, "value": self.best_value, "step": self.best_step},
            **({"ema_model": self.ema_model.module.state_dict(), "ema_n": int(self.ema_model.n_averaged)}
               if self.ema_model is not None else {}),
        }  # fmt: skip

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        try:
            return save_checkpoint(self.run_dir, self.step, self.state_dict(), self.cfg.keep_last)
        except OSError as e:
            raise UsageError(
                f"error: could not save the step-{self.step} checkpoint: {os_error_message(e)}"
            ) from None

    def _resume(self) -> None:
        """Load the newest intact checkpoint of the run (saying which broken ones it skipped)."""
        ckpts = list_checkpoints(self.run_dir)
        if not ckpts:
            if self.dist.is_main:
                print(
                    f"[memfit] --resume: no checkpoint in {self.run_dir}; starting from step 0",
                    file=sys.stderr,
                )
                self.folder.truncate_metrics(0)
            return
        state, path = None, None
        for candidate in reversed(ckpts):
            try:
                state, path = load_checkpoint(candidate, map_location=self.device), candidate
                break
            except ValueError as e:
                if self.dist.is_main:
                    print(
                        f"[memfit] --resume: skipped unreadable {candidate.name} ({e})",
                        file=sys.stderr,
                    )
        if state is None:
            raise UsageError(
                f"error: --resume: no intact checkpoint in {self.run_dir} (all {len(ckpts)} unreadable); "
                "start again with --overwrite or another --run_name"
            )
        saved = state.get("system")
        if self.system is not None and saved is not None and saved != self.system:
            raise UsageError(
                f"error: --resume: {path} is a {saved} checkpoint, not {self.system}; "
                "use another --run_name for this system"
            )
        try:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.ema_model is not None:  # a run without one starts its average at the resumed weights
                self.ema_model.module.load_state_dict(state.get("ema_model", state["model"]))
                self.ema_model.n_averaged.fill_(int(state.get("ema_n", 1)))
        except (RuntimeError, ValueError, KeyError) as e:
            diff = config_difference(state.get("config") or {}, config_dict(self.config))
            why = f"differs in {diff}" if diff else str(e).strip().splitlines()[0][:160]
            raise UsageError(
                f"error: --resume: {path} was trained with another model config ({why}); "
                "pass the same --config and size flags as that run, or use another --run_name"
            ) from None
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        best = state.get("best") or {}
        if best.get("metric") == self.best_metric and best.get("value") is not None:
            self.best_value, self.best_step = float(best["value"]), int(best["step"])
        if self.dist.is_main:
            dropped = self.folder.truncate_metrics(self.step)
            note = f"; dropped {dropped} metrics rows after it" if dropped else ""
            print(f"[memfit] resumed from {path} at step {self.step}{note}", file=sys.stderr)

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
        if self.ema_model is not None:
            self.ema_model.update_parameters(self.raw_model)
        if self.scheduler is not None:
            self.scheduler.step()
        if not math.isfinite(total):
            raise FloatingPointError(
                f"loss became {total} at step {self.step}; lower --lr, use --amp bf16/none, or check the data"
            )
        return total, extra

    def fit(self) -> dict[str, Any]:
        """Train to cfg.steps; returns the last metrics (with peak_memory_mib).

        SIGINT/SIGTERM finish the current step, save a checkpoint and raise SystemExit(128 + signal);
        --max_minutes stops the same way with status 0 (last["stopped_early"]).
        """
        old_handlers = self._catch_signals()
        try:
            return self._fit()
        finally:
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)
            self.metrics.close()
            if self.dist.is_main:
                self.folder.release()

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = _progress(cfg.steps, self.step, cfg.progress and self.dist.is_main)
        last: dict[str, Any] = {"step": self.step}
        t_last, steps_since = time.perf_counter(), 0
        t_start = time.perf_counter()
        start_step = self.step
        stop = STOP_NONE
        try:
            while self.step < cfg.steps:
                if self.step > start_step and (stop := self._stop_reason(t_start)):
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
        if stop == STOP_SIGNAL:
            path = self.save()
            signum = self._signal or signal.SIGINT
            if self.dist.is_main:
                print(
                    f"[memfit] stopped by {signal.Signals(signum).name} at step {self.step}"
                    f"{_of_steps(cfg.steps)}; saved {path}; continue with --resume",
                    file=sys.stderr,
                )
            raise SystemExit(128 + signum)
        self.stopped_early = stop == STOP_TIME
        if self.eval_fn is not None and (not self.eval_every or self.step % self.eval_every):
            self._evaluate(last)
        path = self.save()
        if self.stopped_early and self.dist.is_main:
            print(
                f"[memfit] --max_minutes {cfg.max_minutes:g} reached: stopped at step {self.step}"
                f"{_of_steps(cfg.steps)}; checkpoint {path}; continue with --resume",
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

    def _catch_signals(self) -> dict[int, Any]:
        """SIGINT/SIGTERM set a flag the loop reads after each step; a second one stops at once."""
        self._signal = None
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None:
                raise KeyboardInterrupt
            self._signal = signum
            if self.dist.is_main:
                print(
                    f"\n[memfit] {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                    "(send it again to stop at once)",
                    file=sys.stderr,
                )

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def _stop_reason(self, t_start: float) -> int:
        """STOP_SIGNAL, STOP_TIME (--max_minutes spent) or STOP_NONE; every rank takes the same decision."""
        reason = STOP_SIGNAL if self._signal is not None else STOP_NONE
        minutes = self.cfg.max_minutes
        if not reason and minutes is not None and time.perf_counter() - t_start >= minutes * 60:
            reason = STOP_TIME
        if self.dist.world_size > 1 and dist.is_initialized():
            flag = torch.tensor([reason], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            reason = int(flag.item())
        return reason

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
        model = self.ema_model.module if self.ema_model is not None else self.raw_model
        model.eval()
        with torch.no_grad(), autocast_context(self.cfg.amp, self.device):
            results = self.eval_fn(model)
        model.train()
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
