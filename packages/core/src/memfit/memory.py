"""Measure the real peak memory of code, and estimate the peak of a whole training step without running it.

Two tools that answer the same question by different means, so each can check the other:

* ``measure_peak()`` / ``measure_training_step()`` run for real. On CUDA they read the caching allocator's
  peak; on CPU they track every tensor storage allocated inside the context (a TorchDispatchMode plus a
  weakref finaliser per storage), which is what a GPU allocator would have to hold, without RSS noise.
* ``estimate_training_step()`` builds the model, runs forward, loss, backward and the optimizer step
  twice (the second step is the steady state, with optimizer state present) under ``FakeTensorMode`` on
  the CPU device. No real compute or memory is used, so a paper-size step is estimated on a laptop. The
  accounting is PyTorch's own ``MemTracker``, which splits the peak into parameters, gradients,
  optimizer state and activations/temporaries, and per top-level module.

Both take the same ``TrainStep`` so calibration tests can compare them directly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 1024**3
MIB = 1024**2

CATEGORIES = ("params", "grads", "optimizer", "activations")


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW as the systems train with it (fused: no per-step temporaries the size of the model)."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


@dataclass
class TrainStep:
    """Everything needed to run (or fake) one training step.

    build_model() -> nn.Module on the current default device; make_batch(device) -> any batch;
    loss(model, batch) -> scalar tensor; optimizer(params) -> Optimizer; amp_dtype: autocast dtype or None.
    """

    build_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    amp_dtype: torch.dtype | None = torch.bfloat16


@dataclass
class MemoryReport:
    """Peak bytes of a step, split by category at the moment of the peak and by top-level module."""

    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    params: int = 0
    method: str = ""

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB

    def category_gib(self) -> dict[str, float]:
        return {k: self.by_category.get(k, 0) / GIB for k in CATEGORIES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_gib": self.peak_gib,
            "params": self.params,
            "method": self.method,
            "by_category": self.category_gib(),
            "by_module": {k: v / GIB for k, v in self.by_module.items()},
        }

    def format(self) -> str:
        cats = ", ".join(f"{k} {v:.3f}" for k, v in self.category_gib().items())
        return f"peak {self.peak_gib:.3f} GiB ({cats} GiB; {self.params / 1e6:.2f}M params; {self.method})"


# ----------------------------------------------------------------------------------------------------
# Real measurement
# ----------------------------------------------------------------------------------------------------


class _LiveStorageTracker(TorchDispatchMode):
    """Counts bytes of every storage created by an op inside the mode, until the storage is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_sparse or getattr(t, "is_nested", False):
            return
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        if st.device.type == "meta" or is_fake(t):  # fake tensors have no memory to count
            return
        if st in self._seen:
            return
        nbytes = st.nbytes()
        self._seen[st] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class PeakMemory:
    """Context manager: the real peak of tensor memory allocated inside it (``.peak_bytes``).

    CUDA: ``torch.cuda.max_memory_allocated`` relative to the memory allocated on entry.
    CPU: live tensor storages created inside the context (not RSS, which allocator caching blurs).
    """

    def __init__(self, device: str | torch.device = "cpu", existing: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device)
        self.existing = list(existing)  # CPU: tensors alive before entry that count (params, optimizer state)
        self.peak_bytes = 0
        self._tracker: _LiveStorageTracker | None = None
        self._cuda_base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _LiveStorageTracker()
            for t in self.existing:
                self._tracker._track(t)
            self.existing = []
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        else:
            assert self._tracker is not None
            self._tracker.__exit__(*exc)
            self.peak_bytes = self._tracker.peak

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB


def measure_peak(device: str | torch.device = "cpu", existing: Iterable[torch.Tensor] = ()) -> PeakMemory:
    """``with measure_peak() as m: ...`` then ``m.peak_bytes``; on CPU ``existing`` tensors count too."""
    return PeakMemory(device, existing)


def training_state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what a step holds before its forward starts."""
    out = [*model.parameters(), *model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for st in optimizer.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _run_step(step: TrainStep, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    batch = step.make_batch(device)
    ctx = (
        torch.autocast(device_type=device.type, dtype=step.amp_dtype)
        if step.amp_dtype is not None
        else contextlib.nullcontext()
    )
    with ctx:
        loss = step.loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_training_step(
    step: TrainStep, device: str | torch.device = "cpu", steps: int = 2
) -> MemoryReport:
    """Really run model build + ``steps`` training steps and return the measured peak."""
    device = torch.device(device)
    with measure_peak(device) as m, torch.device(device):
        model = step.build_model()
        opt = step.optimizer(model.parameters())
        for _ in range(steps):
            _run_step(step, model, opt, device)
        n_params = sum(p.numel() for p in model.parameters())
        del model, opt
    return MemoryReport(peak_bytes=m.peak_bytes, params=n_params, method=f"measured ({device.type})")


# ----------------------------------------------------------------------------------------------------
# Estimation with fake tensors
# ----------------------------------------------------------------------------------------------------


def _category_map() -> dict[Any, str]:
    from torch.distributed._tools.mem_tracker import _MemRefType

    return {
        _MemRefType.PARAM: "params",
        _MemRefType.BUFFER: "params",
        _MemRefType.GRAD: "grads",
        _MemRefType.OPT: "optimizer",
        _MemRefType.ACT: "activations",
        _MemRefType.TEMP: "activations",
        _MemRefType.OTH: "activations",
    }


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """FakeTensorMode on the CPU device: shapes, dtypes and allocations without storage or compute."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


def estimate_training_step(step: TrainStep, steps: int = 2) -> MemoryReport:
    """Estimate the peak of model build + ``steps`` training steps at full size, with fake tensors on CPU.

    Handles SDPA, custom autograd Functions and ``torch.utils.checkpoint`` (they run as usual on fake
    tensors). Two steps by default: the first allocates optimizer state lazily, the second is the steady
    state a real run repeats.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    device = torch.device("cpu")
    cats = _category_map()
    with fake_mode():
        model = step.build_model()
        opt = step.optimizer(model.parameters())
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for i in range(steps):
                if i:
                    tracker.reset_mod_stats()  # per-module stats are per iteration; the global peak stays
                _run_step(step, model, opt, device)
        snap = tracker.get_tracker_snapshot("peak")[device]
        by_category = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in snap.items():
            if key != "Total":
                by_category[cats[key]] += nbytes
        by_module = {}
        for name, child in model.named_children():
            stats = tracker.memory_tracking.get(child)
            if stats is None:
                continue
            by_module[name] = max(stats.local_peak.values(), default=0)
        n_params = sum(p.numel() for p in model.parameters())
    return MemoryReport(
        peak_bytes=snap["Total"],
        by_category=by_category,
        by_module=by_module,
        params=n_params,
        method="estimated (FakeTensorMode, MemTracker)",
    )
