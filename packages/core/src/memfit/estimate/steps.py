"""One training step run for real (measured: ``measure_training_step``, ``measure_peak``) or on fake
tensors (estimated: ``estimate_training_step``), both counted by the same tracker
(``memfit.estimate.tracker``) so that each checks the other. PyTorch's ``MemTracker`` is an independent
check in the tests (``memtracker_peak``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from memfit.estimate import cuda_memory, rules, workspaces
from memfit.estimate.tracker import (
    MIB,
    MemoryReport,
    _old_objects_frozen,
    _StorageTracker,
    build_model,
    fake_mode,
)
from memfit.ops import registry
from memfit.step import TrainStep

#: micro-batches an estimate traces of a step's ``accumulate`` (the real steps run them all). From the
#: second on, each starts where the one before it started (parameters, the gradients the first one made,
#: the optimizer state; no activation left), so it allocates and frees the same tensors in the same order:
#: the same peak, and a caching allocator that reached its steady state in the second stays in it. The
#: figures of any larger count equal these (tested), and --accumulate 1000000 takes no longer than 3.
TRACED_MICRO_BATCHES = 3


class PeakMemory:
    """Context manager: the real peak of tensor memory allocated inside it (``.peak_bytes``).

    CUDA: ``torch.cuda.max_memory_allocated`` relative to the memory allocated on entry.
    CPU: live tensor storages created inside the context (not RSS, which allocator caching blurs).
    """

    def __init__(self, device: str | torch.device = "cpu", existing: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device)
        self.existing = list(existing)  # CPU: tensors alive before entry that count (params, optimizer state)
        self.peak_bytes = 0
        self._tracker: _StorageTracker | None = None
        self._cuda_base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _StorageTracker()
            for t in self.existing:
                self._tracker.track(t)
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


def _autocast(step: TrainStep, device: torch.device) -> contextlib.AbstractContextManager:
    if step.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=step.amp_dtype)


def _run_step(step: TrainStep, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    for _ in range(step.accumulate):
        batch = step.make_batch(device)
        with _autocast(step, device):
            loss = step.loss(model, batch)
        loss.backward()
        del batch, loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def _prime_optimizer(model: nn.Module, opt: torch.optim.Optimizer, tracker: _StorageTracker) -> bool:
    """Create the optimizer state the first step would create, without running that step's forward and
    backward: zero gradients, one optimizer step, gradients freed. The next step is then the steady state
    (its peak is the peak of two full steps: the first step's forward and backward run without the state,
    its optimizer step holds the same params, grads and state as the second's). False when a parameter is
    still uninitialised (lazy modules need a real first forward)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
        return False
    tracker.category = "grads"
    for p in params:
        p.grad = torch.zeros_like(p)
    tracker.category = "optimizer"
    opt.step()
    opt.zero_grad(set_to_none=True)
    return True


def _tracked_steps(
    step: TrainStep,
    steps: int,
    fake: bool,
    device: torch.device,
    tracker: _StorageTracker | None = None,
    prime: bool = False,
) -> MemoryReport:
    """Build the model and run `steps` training steps under a _StorageTracker (real or fake tensors).
    prime: the first step is replaced by `_prime_optimizer` (same peak, half the work). The tracker's
    `phase` says where a failing step failed (build, input, forward, loss, backward, optimizer)."""
    tracker = tracker or _StorageTracker(fake=fake)
    retained: dict[str, int] = {}

    def before(name):
        def hook(module, args):
            retained[name + "@start"] = tracker.live

        return hook

    def after(name):
        def hook(module, args, out):
            kept = tracker.live - retained.pop(name + "@start")
            retained[name] = max(retained.get(name, 0), kept)

        return hook

    def model_done(module, args, out):  # what runs after the model's own forward is the loss
        tracker.phase = "loss"

    # a device context puts a Python __torch_function__ layer under every torch call: only when needed
    on_device = contextlib.nullcontext() if torch.get_default_device() == device else torch.device(device)
    with tracker, on_device, contextlib.ExitStack() as later:
        tracker.category, tracker.phase = "params", "build"
        model = build_model(step, tracker) if fake else step.build_model()
        try:
            opt = step.optimizer(model.parameters())
        except Exception as exc:
            exc.memfit_optimizer = True  # type: ignore[attr-defined]  # its own words, not "building the model"
            raise
        handles = tracker.instrument(model)
        handles.append(model.register_forward_hook(model_done))
        for name, child in model.named_children():
            handles.append(child.register_forward_pre_hook(before(name)))
            handles.append(child.register_forward_hook(after(name)))
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda p: tracker.track(p.grad, "grads")))
        for t in [*model.parameters(), *model.buffers()]:
            tracker.track(t, "params")
        tracker.phase = "optimizer"
        if prime and steps > 1 and _prime_optimizer(model, opt, tracker):
            steps -= 1
        # entered once the model is built: its library is imported by then
        if fake:
            later.enter_context(rules.real_run_paths())
        micro = min(step.accumulate, TRACED_MICRO_BATCHES) if fake else step.accumulate
        for _ in range(steps):
            for _ in range(micro):  # micro-batches: the gradients add up between them
                tracker.category, tracker.phase = "activations", "input"
                batch = step.make_batch(device)
                tracker.phase = "forward"
                with _autocast(step, device), tracker.forward_context():
                    loss = step.loss(model, batch)
                tracker.phase = "backward"
                loss.backward()
                del loss
            tracker.category, tracker.phase = "optimizer", "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
        tracker.phase = "done"  # what is freed from here on is the teardown, no part of a step
        for h in handles:
            h.remove()
        n_params = sum(p.numel() for p in model.parameters())
        del model, opt, batch
    notes = []
    if tracker.assumed:
        values = ", ".join(f"{v} ({n} reads)" for v, n in tracker.assumed.items())
        notes.append(
            "the optimizer step reads tensor values (.item() or a branch on a tensor) that an estimate does "
            f"not have: assumed {values}; its state and temporaries are counted in full"
        )
    if micro < step.accumulate:
        notes.append(
            f"{micro} of the {step.accumulate} micro-batches per step traced (each one after the first "
            "repeats the last: the same figures); a timeline or snapshot shows those"
        )
    return MemoryReport(
        peak_bytes=tracker.peak,
        by_category=dict(tracker.peak_by_category),
        by_module=retained,
        params=n_params,
        notes=notes,
    )


def measure_training_step(
    step: TrainStep, device: str | torch.device = "cpu", steps: int = 2
) -> MemoryReport:
    """Really run model build + ``steps`` training steps and return the measured peak.

    CPU: every live storage is counted, split by category as in the estimate. CUDA: the allocator's peak.
    """
    device = torch.device(device)
    if device.type == "cpu":
        report = _tracked_steps(step, steps, fake=False, device=device)
        report.method = "measured (cpu, live tensor storages)"
        return report
    with measure_peak(device) as m, torch.device(device):
        model = step.build_model()
        opt = step.optimizer(model.parameters())
        for _ in range(steps):
            _run_step(step, model, opt, device)
        n_params = sum(p.numel() for p in model.parameters())
        del model, opt
    return MemoryReport(peak_bytes=m.peak_bytes, params=n_params, method=f"measured ({device.type})")


def estimate_training_step(
    step: TrainStep,
    steps: int = 2,
    tracker: _StorageTracker | None = None,
    prime: bool | None = None,
    device: str = "cpu",
) -> MemoryReport:
    """Estimate the peak of model build + ``steps`` training steps at full size, with fake tensors on CPU.

    The step runs as usual on FakeTensors (SDPA, custom autograd Functions and ``torch.utils.checkpoint``
    included), so every allocation happens with its real size but no storage and no compute. Two steps by
    default: the first allocates optimizer state lazily, the second is the steady state a run repeats.
    With ``prime`` (the CPU target's default) the first step's forward and backward are skipped and the
    optimizer state is made directly (``_prime_optimizer``): the same peak in half the time. The CUDA
    target runs both steps (``prime`` False by default): the caching allocator's reserved peak depends on
    the order blocks come and go in, and a real run makes its optimizer state after the first backward
    (primed, the recorded GRU step's reserved peak read +12%; run, +3.5%).
    ``by_module`` holds, per top-level module, the bytes its forward leaves alive (saved for backward).

    ``device="cuda"``: what a CUDA run keeps (``memfit.estimate.rules``: CUDA's SDPA backends and autocast
    policy,
    the caching allocator's 512-byte blocks; the Mamba kernels ``rules.assume_kernels`` says the GPU
    has, by default mamba_ssm's and causal-conv1d's); the trace itself still runs on fake CPU tensors.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    cuda = device == "cuda"
    prime = not cuda if prime is None else prime
    tracker = tracker or _StorageTracker(fake=True)
    card = workspaces.assumed_card()
    if cuda:
        tracker.cuda_target(workspaces.CudaLibraries(card))
    on_cuda = rules.cuda_rules() if cuda else contextlib.nullcontext()
    before = registry.traced()
    with fake_mode(), _old_objects_frozen(), on_cuda, workspaces.noting() as notes:
        report = _tracked_steps(
            step, steps, fake=True, device=torch.device("cpu"), tracker=tracker, prime=prime
        )
    report.ran = {k: n - before.get(k, 0) for k, n in registry.traced().items() if n > before.get(k, 0)}
    extra = ""
    if cuda:
        used = rules.assumed_target().describe(report.ran)
        extra = f", CUDA{' kernels ' + used if used else ''}, {card.describe()}"
        assert tracker.events is not None and tracker.libraries is not None
        figs = cuda_memory.figures(tracker.events, card, tracker.libraries.summary(), report.peak_bytes)
        figs.notes += notes.values()  # what the trace left out or extrapolated (cuDNN's workspaces)
        tracker.events = None  # the entries it holds are no longer needed
        report.cuda = figs
        report.peak_bytes = figs.allocated
        report.by_category = figs.by_category
    report.method = f"estimated (FakeTensorMode on CPU{extra})"
    return report


def memtracker_peak(step: TrainStep) -> int:
    """The peak of two steps of `step` under PyTorch's own MemTracker with fake tensors (as its docs run
    it): an accounting independent of ours, which tests and tools/compare_estimators.py check against."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with fake_mode():
        model = step.build_model()
        opt = step.optimizer(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for i in range(2):
                if i:
                    mt.reset_mod_stats()
                step.loss(model, step.make_batch(torch.device("cpu"))).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
