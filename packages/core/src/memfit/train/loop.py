"""The training loop: ``Trainer`` and the small pieces it is made of.

A package supplies a model, an optimizer, ``loss_fn(model, batch)`` and ``get_batch(step, micro)``;
``Trainer`` adds autocast (bf16, or fp16 with a GradScaler), gradient accumulation, clipping, DDP under
torchrun, a progress bar, JSON-lines metrics, atomic checkpoints and exact resume, and the peak memory.

The Trainer owns the run's progress: the steps done and the training seconds spent, over every resume of
the run (both are saved in each checkpoint). ``--max_minutes`` is a budget for the whole run, and the
learning rate is a function of that progress (``lr_schedule(Progress) -> multiplier``), so a run that is
interrupted and resumed follows the same schedule as one that never stopped.

Resume is exact because everything that varies between steps is a function of the step: batches come
from ``get_batch(step, micro)`` (seeded per step by the package), and the RNG state, optimizer, progress
and scaler are restored from the checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from memfit.errors import UsageError, first_line, os_error_message, out_of_memory
from memfit.estimate.preflight import MemoryStep, preflight
from memfit.estimate.steps import PeakMemory, training_state_tensors
from memfit.estimate.tracker import MIB
from memfit.step import AMP_DTYPES
from memfit.train.checkpoint import (
    BEST_NAME,
    CHECKPOINT_FORMAT,
    RESUME_KEYS,
    WeightsMismatch,
    _rng_state,
    _set_rng_state,
    list_checkpoints,
    load_intact,
    memfit_version,
    save_checkpoint,
    write_atomic,
)
from memfit.train.config import config_dict, config_difference
from memfit.train.cpu import keep_freed_memory, set_threads
from memfit.train.distributed import (
    collective_failure,
    destroy_group_quietly,
    init_distributed,
    leave_distributed,
    same_everywhere,
)
from memfit.train.metrics_log import MetricsLog
from memfit.train.run_dir import RunFolder
from memfit.train.settings import (
    WARMUP_MAX_FRACTION,
    LoopConfig,
    TrainRun,
    tree_dict,
    write_run_config,
)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    """A CPU generator seeded by (seed, step, micro, rank): batches that do not depend on history. (Taken
    modulo 2**64, torch's seed range, so a large --seed cannot overflow it; smaller values are unchanged.)"""
    g = torch.Generator()
    g.manual_seed((((seed * 1_000_003 + step) * 1_009 + micro) * 101 + rank) % 2**64)
    return g


def now() -> float:
    """The Trainer's clock (monotonic seconds), read once per step boundary; tests replace it."""
    return time.monotonic()


@dataclass(frozen=True)
class Progress:
    """How far a run is: optimizer steps done and training seconds spent (over every resume), against
    its step target and time budget (either may be None)."""

    step: int
    seconds: float
    steps: int | None
    budget_s: float | None

    def fraction(self, warmup: int = 0, total_steps: int | None = None) -> float:
        """In [0, 1]: the further along of the steps after warmup and the time budget."""
        steps = total_steps or self.steps
        parts = []
        if steps:
            parts.append((self.step - warmup) / max(1, steps - warmup))
        if self.budget_s:
            parts.append(self.seconds / self.budget_s)
        return min(1.0, max(0.0, *parts)) if parts else 0.0


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier: linear warmup to 1 over `warmup` steps (nanoGPT's get_lr: never exactly 0), then a
    cosine down to `min_ratio` at the end of the run: its steps (or `total_steps`) or its time budget,
    whichever comes first. A run with a step count warms up over at most a tenth of it
    (``WARMUP_MAX_FRACTION``), so a short run is not all warmup; one that runs until its time budget takes
    `warmup` whole. The one warmup rule of every system: each sets `warmup` in its settings (`--warmup`)."""

    warmup: int = 0
    min_ratio: float = 0.1
    total_steps: int | None = None

    def steps_of_warmup(self, p: Progress) -> int:
        total = self.total_steps or p.steps
        return self.warmup if total is None else min(self.warmup, int(total * WARMUP_MAX_FRACTION))

    def __call__(self, p: Progress) -> float:
        warmup = self.steps_of_warmup(p)
        if warmup > 0 and p.step < warmup:
            return (p.step + 1) / (warmup + 1)
        x = p.fraction(warmup, self.total_steps)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * x))


def ema_avg_fn(decay: float) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """AveragedModel's avg_fn for an EMA whose decay warms up as min(decay, (1 + n) / (10 + n)) after n
    updates, so a short run's average is not dominated by its first, untrained weights."""

    def avg(averaged: torch.Tensor, current: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        d = min(decay, (1 + float(n)) / (10 + float(n)))
        return averaged * d + current * (1 - d)

    return avg


def _of_steps(steps: int | None) -> str:
    """ " of N" for a progress message, nothing for a run that goes until its time budget."""
    return "" if steps is None else f" of {steps}"


def _progress(total: int | None, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step")


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def autocast_context(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for 'bf16' / 'fp16'; nothing for 'none'."""
    if AMP_DTYPES[amp] is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


STOP_NONE, STOP_DONE, STOP_TIME, STOP_SIGNAL = 0, 1, 2, 3


# A repeated SIGINT/SIGTERM within this many seconds of the first is the same request (uv and shells
# forward a terminal's Ctrl-C to the whole process group, so one key press can arrive twice).
DUPLICATE_SIGNAL_S = 1.0


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (inside tuples, lists and dicts) on ``device``; a tensor already
    there is returned as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)  # no copy when it is there already
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@dataclass
class Trainer:
    """Runs `cfg.steps` optimizer steps (or until `cfg.max_minutes`) of `loss_fn(model, get_batch(step,
    micro))`; see the module docstring.

    ``run`` is the parsed run (``memfit.train.settings.TrainRun``, from ``TrainParser.parse`` or
    ``TrainRun.of(loop)``): its settings, preset, device, system and whether to resume or overwrite. The
    Trainer owns the device from there: it moves the model to ``run.device`` (an optimizer made on the
    model's parameters before keeps them: ``Module.to`` moves them in place) and every batch ``get_batch``
    returns (tensors already there are not copied), so model and batches are never on two devices.
    loss_fn returns a scalar loss or (loss, {name: float}); get_batch must be deterministic in
    (step, micro) for exact resume; lr_schedule(Progress) -> a multiplier of each param group's lr as the
    optimizer was built; eval_fn(model) -> {name: float} runs every eval_every steps (rank 0).
    With best_metric, every evaluation that improves results[best_metric] (higher with best_mode="max",
    lower with "min") writes run_dir/best.pt (the same schema as the step checkpoints) and the metrics
    carry best/<metric> and best_step. With settings, the run folder gets config.json at start (what
    `train --config FILE` and `--resume` read back). The run folder is `run_dir`, else
    cfg.runs_dir/<system>/cfg.run_name; `resume` continues the run there, `overwrite` replaces it.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module, Any], Any]
    get_batch: Callable[[int, int], Any]
    run: TrainRun
    lr_schedule: Callable[[Progress], float] | None = None
    eval_fn: Callable[[nn.Module], dict[str, float]] | None = None
    eval_every: int = 0
    config: Any = None  # the model config dataclass (or dict): checkpoint["config"], rebuilds the model
    meta: dict[str, Any] | None = None  # what else eval needs to know (data, tokenizer...)
    items_per_step: int | None = None  # e.g. tokens per optimizer step, for throughput
    best_metric: str | None = None
    best_mode: str = "max"  # "max" | "min"
    run_dir: str | Path | None = None
    # (batch size, checkpointing) -> the step as memfit.estimate.memory.TrainStep, and the batch size the
    # run uses:
    # the memory pre-flight estimates it and refuses a run that will not fit (cfg.preflight)
    memory_step: MemoryStep | None = None
    batch_size: int | None = None
    step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.stopped_early = False
        self.seconds = 0.0  # training time spent by the run, over every resume
        run = self.run
        self.cfg: LoopConfig = run.loop
        self.system, self.settings, self.preset = run.system, run.settings, run.preset
        self.resume, self.overwrite = run.resume, run.overwrite
        self.device = run.device
        self.model = self.model.to(self.device)
        if self.cfg.threads is not None:
            set_threads(self.cfg.threads)
        if self.device.type == "cpu":
            # reuse freed activation blocks instead of page-faulting them in every step (process-wide and
            # for good: memfit.train.cpu; MEMFIT_KEEP_FREED=0 leaves malloc alone)
            keep_freed_memory()
        self.dist = init_distributed(self.device)
        self.run_dir = Path(self.run_dir) if self.run_dir is not None else self.cfg.run_dir(self.system)
        self.folder = RunFolder(self.run_dir)
        if self.dist.world_size > 1:  # before anything is written: ranks that differ train nothing
            self._check_ranks_agree()
        if self.dist.is_main:  # a folder that holds a run is refused before the pre-flight's estimate
            self.folder.check(self.resume, self.overwrite)
        if self.cfg.preflight and self.memory_step is not None and self.batch_size is not None:
            # one estimate (seconds, more where the batch does not fit): a bar on a terminal says it runs
            from tqdm.auto import tqdm

            with tqdm(total=1, desc="[memfit] memory pre-flight", leave=False, disable=None) as bar:
                checked = preflight(self.memory_step, self.batch_size,
                                    getattr(self.config, "checkpoint", None), self.device)  # fmt: skip
                bar.update()
            if checked is not None and self.dist.is_main:
                print(checked.line(), file=sys.stderr)
        if self.dist.is_main:  # refuse a used folder or a live trainer before anything is written
            self.folder.open(self.resume, self.overwrite)
        self.raw_model = self.model  # what is saved; self.model may be wrapped (DDP, compile)
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        self.ema_model = (
            torch.optim.swa_utils.AveragedModel(self.raw_model, avg_fn=ema_avg_fn(self.cfg.ema))
            if self.cfg.ema
            else None
        )
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.cfg.amp == "fp16")
        self.peak_memory_bytes = 0
        self._signal: int | None = None
        self._signal_at = 0.0
        set_seed(self.cfg.seed + self.dist.rank)
        try:
            if self.resume:
                self._resume()
            if self.dist.is_main and self.settings is not None:
                write_run_config(self.run_dir, self.system, self.preset, self.config, self.settings)
            self.metrics = MetricsLog(
                self.run_dir / "metrics.jsonl",
                enabled=self.dist.is_main,
                tensorboard=self.cfg.tensorboard,
                purge_step=self.step + 1 if self.resume else None,
            )
        except BaseException:
            self.folder.release()
            raise
        if self.dist.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if self.cfg.compile:  # after the DDP wrap (DDPOptimizer); accumulation uses self.ddp.no_sync
            self.model = torch.compile(self.model)

    # -- DDP: ranks that agree, and a peer that is gone ----------------------------------------------
    def _rank_settings(self) -> dict[str, Any]:
        """What every rank must hold alike: the system, the resolved settings (or the loop's alone), the
        model config and the model's parameter names, shapes and dtypes (self.model: not wrapped yet)."""
        settings = tree_dict(self.settings) if self.settings is not None else {"loop": tree_dict(self.cfg)}
        params = {n: "x".join(map(str, p.shape)) + f" {p.dtype}" for n, p in self.model.named_parameters()}
        return {"system": self.system, "settings": settings, "config": config_dict(self.config),
                "parameter": params}  # fmt: skip

    def _check_ranks_agree(self) -> None:
        """Ranks started with other flags or files (another preset, another size) would fail in DDP's own
        check with a traceback each, or train apart: they compare a hash of their settings and parameter
        shapes first, and refuse a difference in one line (rank 0 says it; the others exit with 2)."""
        try:
            differs = same_everywhere(self._rank_settings())
        except Exception as e:
            if (cause := collective_failure(e)) is None:
                raise
            raise UsageError(
                f"error: rank {self.dist.rank} of {self.dist.world_size} could not compare settings with the "
                f"other ranks ({cause}); start every rank again"
            ) from None
        if differs is None:
            return
        rank, what = differs
        destroy_group_quietly()
        if not self.dist.is_main:
            raise SystemExit(2)
        raise UsageError(
            f"error: rank {rank} was started with other settings than rank 0 ({what}); start every rank "
            "with the same flags and files"
        )

    def _lost_peers(self, cause: str) -> UsageError:
        """A collective that failed mid-run (a peer rank died or was stopped): every rank stops. Stop
        signals are ignored from here on (torchrun sends SIGTERM to the survivors: they are stopping
        already); a lock left by a rank 0 that died is removed by the survivors (same machine)."""
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)
        if not self.dist.is_main and self.dist.local_world_size == self.dist.world_size:
            self.folder.release_dead()
        return UsageError(
            f"error: rank {self.dist.rank} of {self.dist.world_size} lost its peers in step {self.step + 1} "
            f"({cause}): another rank died or was stopped; every rank stops, no checkpoint of this step; "
            f"{self._last_saved()}"
        )

    # -- progress ---------------------------------------------------------------------------------
    def progress(self) -> Progress:
        budget = self.cfg.max_minutes * 60 if self.cfg.max_minutes else None
        return Progress(self.step, self.seconds, self.cfg.steps, budget)

    def _apply_lr(self) -> None:
        if self.lr_schedule is None:
            return
        factor = self.lr_schedule(self.progress())
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    # -- checkpoints ------------------------------------------------------------------------------
    def _last_saved(self) -> str:
        """Where a run that stops on an error can continue from, for its message."""
        ckpts = list_checkpoints(self.run_dir)
        if not ckpts:
            return "no checkpoint was saved yet"
        return f"the last checkpoint, {ckpts[-1]}, is intact (--resume)"

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "memfit_version": memfit_version(),  # the writer: named when a memfit that cannot read it refuses
            "system": self.system,
            "step": self.step,
            "progress": {"seconds": self.seconds},
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": _rng_state(),
            "config": config_dict(self.config),
            "settings": {"preset": self.preset, "train": tree_dict(self.settings.train),
                         "loop": tree_dict(self.settings.loop)} if self.settings is not None else None,
            "meta": self.meta or {},
            "best": {"metric": self.best_metric, "value": self.best_value, "step": self.best_step},
            **({"ema_model": self.ema_model.module.state_dict(), "ema_n": int(self.ema_model.n_averaged)}
               if self.ema_model is not None else {}),
        }  # fmt: skip

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        try:
            return save_checkpoint(self.run_dir, self.step, self.state_dict(), self.cfg.keep_last)
        except (OSError, UsageError) as e:
            why = os_error_message(e) if isinstance(e, OSError) else str(e).removeprefix("error: ")
            raise UsageError(f"error: could not save the step-{self.step} checkpoint: {why}") from None

    def _restore(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Restore the weights, optimizer and EMA of one checkpoint (load_intact's `use`): UsageError for a
        checkpoint of another system or model config, WeightsMismatch (a ValueError: fall back to an older
        checkpoint) for weights that do not fit a model of the same config."""
        saved = state.get("system")
        if self.system is not None and saved is not None and saved != self.system:
            raise UsageError(
                f"error: --resume: {path} is a {saved} checkpoint, not {self.system}; "
                "use another --run_name for this system"
            )
        # fields that change how the model runs (recompute, a kernel), not what it computes, may change
        runtime = set(getattr(type(self.config), "RUNTIME_FIELDS", ("checkpoint",)))
        old, new = ({k: v for k, v in c.items() if k not in runtime}
                    for c in (state.get("config") or {}, config_dict(self.config)))  # fmt: skip
        if diff := config_difference(old, new):
            raise UsageError(
                f"error: --resume: {path} was trained with another model config ({diff}); pass the same "
                "--config and size flags as that run (a bare --resume reads them), or use another --run_name"
            )
        try:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.ema_model is not None:  # a run without one starts its average at the resumed weights
                self.ema_model.module.load_state_dict(state.get("ema_model", state["model"]))
                self.ema_model.n_averaged.fill_(int(state.get("ema_n", 1)))
            self.scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise WeightsMismatch(f"{path}: its weights do not fit the model ({first_line(e)})") from None
        return state

    def _resume(self) -> None:
        """Load the newest intact checkpoint of the run, saying which broken ones it skipped; those newer
        than the one loaded are removed (a save that never finished), so pruning keeps intact ones."""
        ckpts = list_checkpoints(self.run_dir)
        if not ckpts:
            if self.dist.is_main:
                print(
                    f"[memfit] --resume: no checkpoint in {self.run_dir}; starting from step 0",
                    file=sys.stderr,
                )
                self.folder.truncate_metrics(0)
            return
        try:  # on the CPU: the RNG states must stay CPU ByteTensors; load_state_dict moves the rest
            state, path, skipped = load_intact(list(reversed(ckpts)), self._restore, RESUME_KEYS)
        except WeightsMismatch as e:
            raise UsageError(
                f"error: --resume: {e}; pass the same --config and size flags as that run, or use another "
                "--run_name"
            ) from None
        except ValueError as e:
            raise UsageError(
                f"error: --resume: {self.run_dir} has {e}; start again with --overwrite or another --run_name"
            ) from None
        for bad, why in skipped:
            if self.dist.is_main:
                print(f"[memfit] --resume: skipped {bad.name}: {why.split(': ', 1)[-1]}", file=sys.stderr)
                bad.unlink(missing_ok=True)  # newer than `path`, and broken: never a fallback again
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.seconds = float((state.get("progress") or {}).get("seconds", 0.0))
        best = state.get("best") or {}
        if best.get("metric") == self.best_metric and best.get("value") is not None:
            self.best_value, self.best_step = float(best["value"]), int(best["step"])
        if self.dist.is_main:
            dropped = self.folder.truncate_metrics(self.step)
            note = f"; dropped {dropped} metrics rows after it" if dropped else ""
            spent = f", {self.seconds / 60:.1f} min trained" if self.seconds else ""
            print(f"[memfit] resumed from {path} at step {self.step}{spent}{note}", file=sys.stderr)

    # -- one optimizer step -----------------------------------------------------------------------
    def _train_step(self) -> tuple[float, dict[str, float]]:
        self.model.train()
        self._apply_lr()
        total = 0.0
        extra: dict[str, float] = {}
        accum = self.cfg.grad_accum
        for micro in range(accum):
            batch = to_device(self.get_batch(self.step, micro), self.device)
            # DDP averages gradients in the last micro-batch's backward only
            last_micro = self.ddp is None or micro == accum - 1
            sync = contextlib.nullcontext() if last_micro else self.ddp.no_sync()
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
        if not math.isfinite(total):
            raise UsageError(
                f"error: the loss became {total} in step {self.step + 1}; {self._last_saved()}; "
                "lower --lr, use --amp none, or check the data for NaN/Inf values"
            )
        return total, extra

    def fit(self) -> dict[str, Any]:
        """Train to cfg.steps (or until cfg.max_minutes); returns the last metrics (with peak_memory_mib).

        SIGINT/SIGTERM finish the current step, save a checkpoint and raise SystemExit(128 + signal);
        --max_minutes stops the same way with status 0 (last["stopped_early"]).
        """
        old_handlers = self._catch_signals()
        finished = False
        lost = None
        try:
            last = self._fit()
            finished = True
            return last
        except Exception as e:  # a peer rank gone: one line naming this rank and the cause
            if self.dist.world_size == 1 or (lost := collective_failure(e)) is None:
                raise
            raise self._lost_peers(lost) from None
        finally:
            if lost is None:
                for signum, handler in old_handlers.items():
                    signal.signal(signum, handler)
            self.metrics.close()
            if self.dist.is_main:
                self.folder.release()
            self._leave_ddp(finished, lost is not None)

    def _leave_ddp(self, finished: bool, lost: bool = False) -> None:
        """A Trainer fits once: after it, the model is the plain module again and the process group
        is left (see leave_distributed), all ranks together when they all finished; `lost` (a peer is
        gone): as far as it can be, quietly."""
        if self.ddp is None:
            return
        self.ddp = None
        self.model = self.raw_model
        gc.collect()  # the wrapper's reducer holds the group; it must go before the group does
        if lost:
            destroy_group_quietly()
        else:
            leave_distributed(finished)

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = _progress(cfg.steps, self.step, cfg.progress and self.dist.is_main)
        last: dict[str, Any] = {"step": self.step}
        t_last, steps_since = time.perf_counter(), 0
        start_step = self.step
        clock = now()  # one reading per step boundary: the run's seconds and every decision follow it
        stop = STOP_NONE
        try:
            while not (stop := self._stop_reason()):
                measure = self.device.type == "cpu" and self.step - start_step < cfg.measure_memory_steps
                if measure:
                    held = training_state_tensors(self.raw_model, self.optimizer)
                    with PeakMemory("cpu", existing=held) as pm:
                        loss, extra = self._train_step()
                    self.peak_memory_bytes = max(self.peak_memory_bytes, pm.peak_bytes)
                else:
                    loss, extra = self._train_step()
                self.step += 1
                t = now()
                self.seconds += t - clock
                clock = t
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
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step != cfg.steps:
                    self.save()
        except Exception as e:
            if not out_of_memory(e):
                raise
            raise UsageError(
                f"error: out of memory in step {self.step + 1} ({first_line(e)}); {self._last_saved()}; "
                "use a smaller --batch_size (the memory pre-flight names one that fits) or --checkpointing"
            ) from None
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
        if self.step == start_step and self.resume:  # nothing left to train: the run was already done
            if self.dist.is_main:
                why = (f"its --max_minutes {cfg.max_minutes:g} budget is spent" if self.stopped_early
                       else f"it is at step {self.step}{_of_steps(cfg.steps)}")  # fmt: skip
                print(
                    f"[memfit] --resume: nothing to train, {why}; raise --steps or --max_minutes (the run's "
                    "total) to train on",
                    file=sys.stderr,
                )
            return {**last, "stopped_early": self.stopped_early, "peak_memory_mib": 0.0}
        if self.eval_fn is not None and (not self.eval_every or self.step % self.eval_every):
            self._evaluate(last)
        path = self.save()
        if self.stopped_early and self.dist.is_main:
            print(
                f"[memfit] --max_minutes {cfg.max_minutes:g} spent ({self.seconds / 60:.1f} min trained): "
                f"stopped at step {self.step}{_of_steps(cfg.steps)}; checkpoint {path}; to train on, "
                "--resume with a larger --max_minutes (the run's total)",
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
        """SIGINT/SIGTERM set a flag the loop reads after each step. A repeat within DUPLICATE_SIGNAL_S of
        the first is the same request (uv forwards Ctrl-C to the process group); a later one stops at once."""
        self._signal = None
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            t = time.monotonic()
            if self._signal is not None:
                if t - self._signal_at < DUPLICATE_SIGNAL_S:
                    return
                raise KeyboardInterrupt
            self._signal, self._signal_at = signum, t
            if self.dist.is_main:
                saving = ("saving a checkpoint if every rank finishes it" if self.dist.world_size > 1
                          else "saving a checkpoint")  # fmt: skip
                print(
                    f"\n[memfit] {signal.Signals(signum).name}: finishing this step and {saving} "
                    "(send it again to stop at once)",
                    file=sys.stderr,
                )

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def _stop_reason(self) -> int:
        """At a step boundary: STOP_SIGNAL, STOP_TIME (the run's --max_minutes spent), the step target
        reached (STOP_DONE) or STOP_NONE; every rank takes the same decision."""
        reason = STOP_NONE
        if self._signal is not None:
            reason = STOP_SIGNAL
        elif self.cfg.steps is not None and self.step >= self.cfg.steps:
            reason = STOP_DONE
        elif self.cfg.max_minutes is not None and self.seconds >= self.cfg.max_minutes * 60:
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
        nan = [k for k, v in results.items() if isinstance(v, float) and math.isnan(v)]
        if nan:  # nothing to choose best.pt by, and the numbers after it would mean nothing: stop, saying so
            self.metrics.write({"step": self.step, **{f"eval/{k}": v for k, v in results.items()}})
            raise UsageError(
                f"error: validation at step {self.step} scored nan ({', '.join(nan)}); the run stops rather "
                f"than train on unscored; {self._last_saved()}; check that the validation files can be "
                "scored and the loss is falling (a lower --lr)"
            )
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
