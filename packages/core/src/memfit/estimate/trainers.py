"""``memfit.preflight`` / ``memfit.largest_batch``: the memory pre-flight of your own model, batch, loss and
optimizer, for any training loop (the Hugging Face and Lightning callbacks in ``memfit.integrations`` call
it too).

One training step of the real model on its real first batch is traced on fake tensors
(``memfit.estimate``'s tracer): nothing is moved, changed or computed.

- **The model** is copied with every parameter, buffer and tensor attribute replaced by a fake tensor of
  its shape, dtype and sharing (``model_copy``): a 7B model costs no memory to copy. The copy is put in
  training mode (a training step: dropout on, checkpointed blocks recompute), whatever mode the model is in.
- **The batch**: its tensors are read as shapes and dtypes (``BatchSpec``); integer tensors keep their value
  range (``[max(min, 0), max + 1)``), so a copy drawn for a real measurement indexes embeddings in range.
  The batch size is the first tensor's leading dimension; a larger or smaller batch scales the leading
  dimension of every tensor that shares it.
- **The optimizer**: a real optimizer instance is rebuilt, same class, same param groups and
  hyperparameters (fused/foreach kept), on the copy's parameters (only the ones it holds get state);
  None is fused AdamW, as ``memfit estimate``.
- **The loss**: ``loss_fn(model, batch)`` returns the loss (a tensor, or an output with ``.loss``); None is
  the model's own loss, ``model(**batch).loss`` (a Hugging Face model given labels).

The step fits when what it needs (the card total of a CUDA estimate: reserved peak + CUDA context; on the
CPU the tensors times ``fit.CPU_OVERHEAD``) is within the usable part of the memory (``fit.usable_bytes``:
the one margin ``memfit fit`` and the train pre-flight use). When it does not, ``DoesNotFit`` names the
need, the memory, the largest batch that fits, the largest tensors and the what-if to try first.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memfit.errors import UsageError
from memfit.estimate import EstimateResult, estimate, explain
from memfit.estimate.fit import CPU_OVERHEAD, MARGIN, MAX_GPU_GIB, usable_bytes
from memfit.estimate.target import DeviceTarget
from memfit.estimate.trace import VALUE_READS, Target, fmt_bytes, trace_target
from memfit.estimate.tracker import GIB, WORKSPACES
from memfit.step import TrainStep, default_optimizer


class Untraceable(UsageError):
    """The step could not be traced on fake tensors (data-dependent control flow, a custom kernel without
    a fake implementation, or an error of the step's own): one line naming where; the callbacks then train
    as configured. ``cause`` is the step's exception; ``own`` is True when a real step fails there too
    (a Python error of the step's code, a shape or dtype mismatch), False when it is the fake trace's
    limit or cannot be told."""

    def __init__(self, message: str, cause: BaseException | None = None, own: bool = False) -> None:
        super().__init__(" ".join(message.splitlines()))  # one line, whatever the step's error said
        self.cause, self.own = cause, own


class NoLoss(Exception):
    """The step gave no loss to trace (a Lightning training_step that returned None: a skipped step)."""


# errors of the step's own code: a real step raises them too (the fake trace has shapes, not values)
_OWN_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, NameError, AssertionError)
# what a torch op says of operands that do not match, on fake tensors as on real ones
_MISMATCH = (
    "shape",
    "size of tensor",
    "same dtype",
    "expected scalar type",
    "must match",
    "mat1 and mat2",
    "reduction dim",
    "cannot be multiplied",
)


class OuterModel(Exception):
    """A loss function that ran the model it closes over, not the (fake) model it was given."""


class DoesNotFit(UsageError):
    """The training step will not fit the memory: one line naming the need, the memory, the largest batch
    that fits and what to try first. ``result`` is the estimate (an ``EstimateResult``, with ``fit`` and
    ``what_ifs``), ``batch`` the batch asked for, ``fits_batch`` the largest that fits (0: none)."""

    def __init__(self, message: str, result: EstimateResult, batch: int, fits_batch: int) -> None:
        super().__init__(" ".join(message.splitlines()))  # one line
        self.result = result
        self.batch = batch
        self.fits_batch = fits_batch


# ----------------------------------------------------------------------------------------------------
# The model, copied without its memory
# ----------------------------------------------------------------------------------------------------


def _active_fake_mode() -> FakeTensorMode | None:
    modes = _get_current_dispatch_mode_stack()
    return next((m for m in reversed(modes) if isinstance(m, FakeTensorMode)), None)


def _tensor_like(t: torch.Tensor, mode: FakeTensorMode | None) -> torch.Tensor:
    """t under the active fake mode (a fake tensor on the CPU device, where the estimator runs), on the
    meta device when that is the default, else a real copy on the default device (a measurement)."""
    if mode is not None:
        if t.device.type == "cpu":
            out = mode.from_tensor(t, static_shapes=True)
        else:
            with no_dispatch():
                meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            out = mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu"))
    elif torch.get_default_device().type == "meta":
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    else:
        out = t.detach().to(torch.get_default_device(), copy=True)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if out.is_floating_point() else out


def _tensors_in(x: Any, depth: int = 2) -> list[torch.Tensor]:
    """The tensors of an attribute: itself, or in its lists, tuples and dicts (two levels: a cache of
    tensors, a metric's list state)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if depth and isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors_in(v, depth - 1)]
    if depth and isinstance(x, dict):
        return [t for v in x.values() for t in _tensors_in(v, depth - 1)]
    return []


def model_copy(model: nn.Module, leave_out: Iterable[Any] = ()) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    """A deep copy of `model` whose tensors are fake under the active FakeTensorMode (no memory), meta on
    the meta device, else real copies; in training mode. Returns it and {id(original parameter): copy}.
    The objects in `leave_out` (a trainer the module points back to) are None in the copy."""
    mode = _active_fake_mode()
    memo: dict[int, Any] = {id(o): None for o in leave_out}
    params: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        found = [*mod._parameters.values(), *mod._buffers.values()]
        for name, v in vars(mod).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                found += _tensors_in(v)
        for t in found:
            if t is not None and id(t) not in memo:
                memo[id(t)] = _tensor_like(t, mode)
                if isinstance(t, nn.Parameter):
                    params[id(t)] = memo[id(t)]
    out = copy.deepcopy(model, memo)
    out.train()
    return out, params


def check_model(model: Any) -> None:
    """One line for a model the pre-flight cannot copy: not a module, or weights on the meta device."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"error: the pre-flight needs an nn.Module, not {type(model).__name__}")
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise UsageError(
            f"error: the model's weights are on the meta device ({meta}): nothing to train yet; load them "
            "first (from_pretrained, or to_empty() then load_state_dict)"
        )


# ----------------------------------------------------------------------------------------------------
# The batch, as shapes
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    low: int = 0  # integer tensors: values drawn in [low, high)
    high: int = 2

    def make(self, batch: int, asked: int, device: torch.device) -> torch.Tensor:
        shape = self.shape
        if shape and shape[0] == asked:
            shape = (batch, *shape[1:])
        if self.dtype.is_floating_point or self.dtype.is_complex:
            return torch.randn(shape, dtype=self.dtype, device=device)
        return torch.randint(self.low, self.high, shape, dtype=self.dtype, device=device)


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            shape = "x".join(map(str, x.shape)) or "scalar"
            raise UsageError(
                f"error: the batch holds a tensor on the meta device ({shape}:"
                f"{str(x.dtype).removeprefix('torch.')}), which has no values; pass a real batch (on any "
                "device: it is read as shapes and, for integer tensors, their value range)"
            )
        low, high = 0, 2
        if not (x.is_floating_point() or x.is_complex()) and x.numel() and x.dtype is not torch.bool:
            lo, hi = int(x.min()), int(x.max())
            low = max(lo, 0)
            high = max(hi + 1, low + 1)
        return TensorSpec(tuple(x.shape), x.dtype, low, high)
    if isinstance(x, Mapping):
        return {k: _spec(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [_spec(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _leaves(spec: Any) -> list[TensorSpec]:
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, Mapping):
        return [s for v in spec.values() for s in _leaves(v)]
    if isinstance(spec, (list, tuple)):
        return [s for v in spec for s in _leaves(v)]
    return []


def _build(spec: Any, batch: int, asked: int, device: torch.device) -> Any:
    if isinstance(spec, TensorSpec):
        return spec.make(batch, asked, device)
    if isinstance(spec, Mapping):
        return {k: _build(v, batch, asked, device) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        items = [_build(v, batch, asked, device) for v in spec]
        return type(spec)(*items) if hasattr(spec, "_fields") else type(spec)(items)
    return spec


@dataclass
class BatchSpec:
    """A batch read as shapes: its structure (dicts, tuples, lists), and for each tensor its shape, dtype
    and integer value range. ``size`` is the batch size: the leading dimension of the first tensor that
    has one."""

    tree: Any
    size: int

    @classmethod
    def of(cls, batch: Any) -> BatchSpec:
        tree = _spec(batch)
        leaves = _leaves(tree)
        if not leaves:
            raise UsageError(
                f"error: the batch ({type(batch).__name__}) holds no tensor; pass the batch the model trains "
                "on: a tensor, or a tuple, list or dict of them"
            )
        sized = [leaf for leaf in leaves if leaf.shape]
        if not sized:
            raise UsageError(
                "error: the batch holds only scalars; its first tensor's leading dimension is the batch"
            )
        return cls(tree, sized[0].shape[0])

    def make(self, device: torch.device, batch: int | None = None) -> Any:
        return _build(self.tree, self.size if batch is None else batch, self.size, device)

    def describe(self) -> str:
        shapes = [
            "x".join(map(str, s.shape)) + ":" + str(s.dtype).removeprefix("torch.")
            for s in _leaves(self.tree)
        ]
        return " ".join(shapes[:4]) + (f" (+{len(shapes) - 4})" if len(shapes) > 4 else "")


# ----------------------------------------------------------------------------------------------------
# The optimizer and loss
# ----------------------------------------------------------------------------------------------------


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (accelerate's AcceleratedOptimizer, Lightning's)."""
    while not isinstance(opt, torch.optim.Optimizer) or type(opt).__name__ in (
        "AcceleratedOptimizer",
        "LightningOptimizer",
    ):
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise UsageError(
            f"error: optimizer {type(opt).__name__} is not a torch.optim.Optimizer; pass the optimizer "
            "instance (or None for AdamW)"
        )
    return opt


def optimizer_like(
    opt: torch.optim.Optimizer | None, params: dict[int, torch.Tensor]
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A TrainStep optimizer: `opt`'s class, param groups and hyperparameters on the copies of its
    parameters (``params``: original id -> copy, filled when the copy is built); None: fused AdamW."""
    if opt is None:
        return default_optimizer
    real = unwrap_optimizer(opt)
    cls, defaults = type(real), dict(real.defaults)
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
        for g in real.param_groups
    ]

    def make(_: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        rebuilt = [{**hyper, "params": [params[i] for i in ids if i in params]} for hyper, ids in groups]
        rebuilt = [g for g in rebuilt if g["params"]]
        if not rebuilt:
            raise UsageError("error: the optimizer holds none of the model's parameters; pass this model's")
        try:
            return cls(rebuilt, **defaults)
        except TypeError:  # a constructor that takes fewer keywords than its defaults hold
            return cls(rebuilt)

    return make


def optimizer_name(opt: torch.optim.Optimizer | None) -> str:
    if opt is None:
        return "AdamW (fused)"
    real = unwrap_optimizer(opt)
    how = next((k for k in ("fused", "foreach") if real.defaults.get(k)), None)
    return type(real).__name__ + (f" ({how})" if how else "")


def loss_of(out: Any) -> torch.Tensor:
    """The loss in what a loss function (or a model) returned: a tensor, ``.loss``, or ``["loss"]``."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss function returned {type(out).__name__}, not a loss tensor (nor .loss)")
    return loss


def own_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss: ``model(**batch).loss`` (a Hugging Face model given labels)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    try:
        return loss_of(out)
    except TypeError:
        raise TypeError(
            f"the model returned {type(out).__name__} and no loss: with no loss_fn the step takes the "
            "model's own (a Hugging Face model computes one from a dict batch that holds labels, e.g. "
            "{'input_ids': ids, 'labels': ids}); add the labels, or give a loss_fn(model, batch)"
        ) from None


# ----------------------------------------------------------------------------------------------------
# The step and the pre-flight
# ----------------------------------------------------------------------------------------------------

_AMP = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _amp(amp: str | torch.dtype | None) -> torch.dtype | None:
    if isinstance(amp, torch.dtype) and amp in (torch.bfloat16, torch.float16):
        return amp
    if amp in _AMP:
        return _AMP[amp]
    raise UsageError(f"error: amp is None, 'bf16' or 'fp16' (or torch.bfloat16 / torch.float16), not {amp!r}")


def user_target(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    amp: str | torch.dtype | None = None,
    device: str = "cuda",
    leave_out: Iterable[Any] = (),
    label: str | None = None,
    accumulate: int = 1,
) -> Target:
    """A Target (knob: the batch) for one training step of a real model on its real batch; ``accumulate``
    micro-batches (forward and backward) per optimizer step, as ``memfit estimate --accumulate``."""
    check_model(model)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"error: device {device!r}: the pre-flight models 'cuda' or 'cpu' kernels")
    check_accumulate(accumulate)
    spec = BatchSpec.of(batch)
    amp_dtype = _amp(amp)
    loss = own_loss if loss_fn is None else loss_fn
    leave_out = tuple(leave_out)
    if optimizer is not None:
        unwrap_optimizer(optimizer)  # a wrong object is one line now, not in the trace

    originals = {id(m) for m in model.modules()}

    def outer_called(module: nn.Module, args: Any) -> None:
        if id(module) in originals:
            raise OuterModel(type(module).__name__)

    def run_loss(m: nn.Module, b: Any) -> torch.Tensor:
        hook = torch.nn.modules.module.register_module_forward_pre_hook(outer_called)
        try:
            return loss_of(loss(m, b))
        finally:
            hook.remove()

    def make(k: dict[str, int]) -> TrainStep:
        params: dict[int, torch.Tensor] = {}

        def build() -> nn.Module:
            out, found = model_copy(model, leave_out)
            params.clear()
            params.update(found)
            return out

        return TrainStep(
            build,
            lambda d: spec.make(d, k["batch"]),
            lambda m, b: run_loss(m, b),
            optimizer_like(optimizer, params),
            amp_dtype,
            accumulate=accumulate,
        )

    name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    loss_name = "the model's own" if loss_fn is None else getattr(loss_fn, "__name__", "yours")
    describe = (
        f"{type(model).__name__}, batch {spec.describe()}, loss {loss_name}, "
        f"{optimizer_name(optimizer)}, autocast {name}"
    )
    if accumulate > 1:  # as `memfit estimate --accumulate N` says it
        describe += f", {accumulate} micro-batches per optimizer step"
    target = Target(label or type(model).__name__, make, {"batch": spec.size}, describe)
    target.device = device
    return target


def check_settings(gpu_gib: Any, auto_batch: Any, device: Any, margin: Any) -> None:
    """The callbacks' settings, checked as they are made: one line (UsageError) naming the bad one."""
    if gpu_gib is not None:
        capacity("cuda", gpu_gib)
    if not isinstance(auto_batch, bool):
        raise UsageError(f"error: auto_batch is True or False, not {auto_batch!r}")
    if device not in (None, "cuda", "cpu"):
        raise UsageError(
            f"error: device {device!r}: the pre-flight models 'cuda' or 'cpu' kernels (None: 'cuda' when "
            "gpu_gib is given or the trainer is on a GPU, else 'cpu')"
        )
    check_margin(margin)


def check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise UsageError(
            f"error: margin is the fraction of the memory kept free, in [0, 1), e.g. 0.1; got {margin!r}"
        )


def check_accumulate(accumulate: Any) -> None:
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(
            "error: accumulate is the micro-batches per optimizer step, a whole number >= 1; got "
            f"{accumulate!r}"
        )


def at(target: Target, batch: int, accumulate: int) -> Target:
    """The same step at another batch and gradient accumulation (a new Target; `target` is unchanged)."""

    def make(k: dict[str, int]) -> TrainStep:
        return replace(target.make(k), accumulate=accumulate)

    return replace(target, make=make, knobs={**target.knobs, "batch": batch})


@contextlib.contextmanager
def _assumed(device: str):
    """The kernels and card ``memfit.estimate(...)`` assumes by default: the same figures."""
    with DeviceTarget.from_flags(device).entered(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a model's warnings about its fake copy (self.log, ...)
        yield


def capacity(device: str, gpu_gib: float | None) -> tuple[int, str]:
    """(bytes, what) the step is judged against: ``gpu_gib``, else what this machine's device has for the
    process (``memfit.estimate.preflight.available_bytes``: the train pre-flight's reading)."""
    if gpu_gib is not None:
        if (
            isinstance(gpu_gib, bool)
            or not isinstance(gpu_gib, (int, float))
            or not math.isfinite(gpu_gib)
            or not 0 < gpu_gib <= MAX_GPU_GIB
        ):
            raise UsageError(
                f"error: gpu_gib must be a positive number of GiB up to {MAX_GPU_GIB}, got {gpu_gib!r}"
            )
        what = f"a {gpu_gib:g} GiB GPU" if device == "cuda" else f"{gpu_gib:g} GiB of memory"
        return int(gpu_gib * GIB), what
    from memfit.estimate.preflight import available_bytes

    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "error: no GPU visible to read its memory from; give gpu_gib, the memory of the GPU the run is "
            "for (e.g. gpu_gib=80), or device='cpu'"
        )
    have, what = available_bytes(torch.device(device))
    if have is None:
        raise UsageError(f"error: {what}: give gpu_gib, the memory to judge the step against")
    return have, f"{what} ({fmt_bytes(have)})"


@dataclass
class Check:
    """A pre-flight's answer: the estimate, what the step needs and what the memory has."""

    result: EstimateResult
    batch: int
    needed: int
    capacity: int
    where: str
    margin: float
    seconds: float
    ranks: int = 1  # data-parallel (DDP) processes: each needs one more copy of the gradients

    @property
    def usable(self) -> int:
        return int(usable_bytes(self.capacity, self.margin))

    @property
    def fits(self) -> bool:
        return self.needed <= self.usable

    def line(self, setup: str = "") -> str:
        """The one summary line the callbacks print (``setup``: what was traced, in parentheses)."""
        r = self.result
        peak = "allocator peak" if r.cuda is not None else "peak"
        need = "card total" if r.cuda is not None else f"x{CPU_OVERHEAD:g} malloc overhead"
        verdict = "fits" if self.fits else "does NOT fit"
        setup = f" ({setup})" if setup else ""
        need += f", per rank of {self.ranks} (DDP)" if self.ranks > 1 else ""
        return (
            f"[memfit] pre-flight{setup}: batch {self.batch} {verdict}: {peak} {fmt_bytes(r.peak_bytes)} "
            f"({_split(r.by_category)}), needs {fmt_bytes(self.needed)} ({need}) of {fmt_bytes(self.usable)} "
            f"usable on {self.where} ({100 * self.margin:g}% margin); estimated in {self.seconds:.1f} s"
        )


def _split(cats: dict[str, int]) -> str:
    text = " + ".join(
        f"{k} {fmt_bytes(cats.get(k, 0))}" for k in ("params", "grads", "optimizer", "activations")
    )
    return text + (f" + CUDA library workspaces {fmt_bytes(cats[WORKSPACES])}" if WORKSPACES in cats else "")


def check(target: Target, gpu_gib: float | None = None, margin: float = MARGIN, ranks: int = 1) -> Check:
    """Trace the target's step at its batch and judge it against the memory (no search); with ``ranks``
    > 1 what one DDP rank needs (``explain.per_rank_bytes``: its gradient buckets too)."""
    check_margin(margin)
    if ranks < 1:
        raise UsageError(f"error: ranks is the number of data-parallel processes, at least 1; got {ranks!r}")
    have, where = capacity(target.device, gpu_gib)
    t0 = time.perf_counter()
    try:
        with _assumed(target.device):
            result = estimate(target)
    except UsageError as e:
        if not str(e).startswith("error: the training step failed"):
            raise
        why = str(e).rsplit(" (check", 1)[0].rsplit(" (the step reads", 1)[0]
        cause = e.__cause__
        text = str(cause).lower()
        own = False
        if isinstance(cause, OuterModel):  # the step runs on real weights: nothing to trace
            raise Untraceable(
                f"error: the loss ran the model itself ({cause}), not the model it is given, which is the "
                "fake copy the pre-flight traces: use that argument, e.g. loss_fn=lambda model, batch: "
                "F.cross_entropy(model(batch[0]), batch[1]) (in a Trainer's compute_loss: `model`, not "
                "self.model)"
            ) from None
        if isinstance(cause, NoLoss):
            hint = "the pre-flight traces the step on the first batch, whose loss it needs"
        elif type(cause).__name__ in VALUE_READS or isinstance(cause, NotImplementedError):
            hint = (
                "a branch on a tensor's values, or a kernel without a fake-tensor implementation, cannot be "
                "traced: see docs/will-it-fit.md"
            )
        elif isinstance(cause, _OWN_ERRORS) or (
            isinstance(cause, RuntimeError) and any(m in text for m in _MISMATCH) and "fake" not in text
        ):
            own = True  # the step's own error: a real step fails there too
            hint = "the step fails as written: check the batch, the loss and the model's forward"
        else:  # a torch error that may be the fake trace's alone
            hint = "if a real step runs, the fake trace cannot follow it: see docs/will-it-fit.md"
        raise Untraceable(f"{why} ({hint})", cause, own) from e
    needed = explain.rank_needs(result.trace, ranks, "ddp", 0, target.device)
    got = Check(result, target.knobs["batch"], needed, have, where, margin, time.perf_counter() - t0, ranks)
    result.fits = explain.Fits(where, needed, got.usable, None)
    return got


def fitting_batch(c: Check, target: Target, max_batch: int = 4096) -> int:
    """The largest batch whose step (at the target's gradient accumulation) fits (0: not even 1); stored on
    the result as ``fit``."""
    fit = _fit_batch(c, target, max_batch, c.result.trace)
    c.result.fit = fit
    c.result.fits.batch = fit.batch
    return fit.batch


def _fit_batch(c: Check, target: Target, max_batch: int, base_trace: Any = None) -> explain.BatchFit:
    with _assumed(target.device):
        return explain.fit_batch(
            target,
            c.capacity / GIB,
            c.margin,
            ranks=c.ranks,
            max_batch=max_batch,
            base_trace=base_trace,
            device=target.device,
        )


def accumulated_batch(c: Check, target: Target, total: int, fits: int) -> int:
    """``auto_batch``'s per-step batch: the largest b that divides ``total`` (per-step batch x gradient
    accumulation, the global batch per device) and whose step fits *at the accumulation that keeps it*,
    ``total // b`` micro-batches (whose gradients are kept between them, unlike at accumulation 1); 0 when
    none does. ``fits``: the largest batch that fits at the configured accumulation."""
    upper = fits
    accumulation = total // max(1, c.batch)
    if accumulation == 1 and fits:  # a smaller batch means accumulating: judge it so
        upper = _fit_batch(c, at(target, c.batch, 2), max(1, fits)).batch
    for b in sorted((d for d in range(1, min(total, upper) + 1) if total % d == 0), reverse=True):
        if b == total:  # accumulation 1: the batch asked for, which does not fit
            continue
        with _assumed(target.device):
            trace = trace_target(at(target, b, total // b))
        if explain.rank_needs(trace, c.ranks, "ddp", 0, target.device) <= c.usable:
            return b
    return 0


def does_not_fit(c: Check, target: Target, fits_batch: int) -> DoesNotFit:
    """The DoesNotFit error for a step that does not fit: need, memory, largest batch, what to try first."""
    r = c.result
    with _assumed(target.device):
        r.what_ifs = explain.what_ifs(target, r.trace)
    best = explain.recommend(r.peak_bytes, r.what_ifs, batch_helps=fits_batch > 0)  # batch 1 too big: not it
    cuda = r.cuda is not None
    what = (
        f"of the card (allocator peak {fmt_bytes(r.peak_bytes)}; reserved + CUDA context)"
        if cuda
        else (f"(tensors {fmt_bytes(r.peak_bytes)} x{CPU_OVERHEAD:g})")
    )
    fix = f"batch {fits_batch} fits" if fits_batch else "not even batch 1 fits"
    culprit = ""
    groups = r.trace.groups()
    if groups:
        g = groups[0]
        culprit = f"; largest: {g.op} in {g.module or '(top)'} {g.shape} x{g.count} = {fmt_bytes(g.total)}"
    try_first = f"; try first: {best.name} (-{fmt_bytes(best.saving(r.peak_bytes))})" if best else ""
    message = (
        f"error: the training step needs {fmt_bytes(c.needed)} {what} at batch {c.batch}; {c.where} has "
        f"{fmt_bytes(c.usable)} usable ({100 * c.margin:g}% margin); {fix}{culprit}{try_first}"
    )
    return DoesNotFit(message, r, c.batch, fits_batch)


def preflight(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    gpu_gib: float | None = None,
    device: str = "cuda",
    amp: str | torch.dtype | None = None,
    margin: float = MARGIN,
    ranks: int = 1,
    accumulate: int = 1,
) -> EstimateResult:
    """The memory of one training step of ``model`` on ``batch``, before running it.

    ``loss_fn(model, batch)`` returns the loss (None: ``model(**batch).loss``); ``optimizer`` the optimizer
    you train with (None: fused AdamW); ``amp`` None, "bf16" or "fp16" (autocast); ``device`` "cuda" (what
    a CUDA run keeps, estimated on this CPU) or "cpu"; ``gpu_gib`` the GPU's memory (default: the visible
    GPU's); ``ranks`` the data-parallel (DDP) processes, each needing one more copy of the gradients for
    its buckets; ``accumulate`` the micro-batches per optimizer step (gradient accumulation: the
    gradients are kept between them). Returns the estimate (``peak_bytes``, ``by_category``,
    ``top_tensors``, ``format()``; ``fits`` says what it needs of what); raises ``DoesNotFit`` when the step
    will not fit, naming the largest batch that does, and ``Untraceable`` (a ``UsageError``) when the step
    cannot be traced. The model and batch are not moved or changed."""
    target = user_target(model, batch, loss_fn, optimizer, amp, device, accumulate=accumulate)
    c = check(target, gpu_gib, margin, ranks)
    if not c.fits:
        raise does_not_fit(c, target, fitting_batch(c, target))
    return c.result


def largest_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    gpu_gib: float | None = None,
    device: str = "cuda",
    amp: str | torch.dtype | None = None,
    margin: float = MARGIN,
    ranks: int = 1,
    max_batch: int = 4096,
    accumulate: int = 1,
) -> int:
    """The largest batch (scaling ``batch``'s leading dimension) whose training step fits, as
    ``preflight`` judges it; 0 when not even 1 does."""
    target = user_target(model, batch, loss_fn, optimizer, amp, device, accumulate=accumulate)
    return fitting_batch(check(target, gpu_gib, margin, ranks), target, max_batch)


def shrink_for_accumulation(total: int, fits: int) -> int:
    """The largest per-step batch <= ``fits`` that divides ``total`` (per-device batch x accumulation), so
    raising the accumulation keeps the global batch; 0 when ``fits`` is 0."""
    return max((d for d in range(1, min(total, fits) + 1) if total % d == 0), default=0)


@contextlib.contextmanager
def rng_kept():
    """Python's, torch's (CPU and initialised CUDA) and numpy's random states as they were: drawing the
    first batch (a shuffling sampler, a masking collator) leaves the run's randomness untouched."""
    import random
    import sys

    py, cpu = random.getstate(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if np_state is not None:
            np.random.set_state(np_state)


def _peek_copy(loader: Any) -> Any:
    """A DataLoader to draw the first batch from without touching `loader`'s state: the same dataset,
    batching, collate function and workers, but workers that end with the peek (``persistent_workers``
    would keep the peek's workers, their random state advanced, for training) and a copy of its generator
    (the workers' base seed is drawn from it). Anything else is iterated as it is."""
    from torch.utils.data import DataLoader, IterableDataset

    if type(loader) is not DataLoader:  # a subclass may build its iterator its own way
        return loader
    kw: dict[str, Any] = dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=False,
    )
    if loader.num_workers:
        kw["prefetch_factor"] = 1  # the peek needs one batch per worker at most
    if loader.generator is not None:
        kw["generator"] = torch.Generator().set_state(loader.generator.get_state())
    if isinstance(loader.dataset, IterableDataset):
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:
        kw["batch_sampler"] = loader.batch_sampler
    else:
        kw.update(batch_size=None, sampler=loader.sampler)
    return DataLoader(loader.dataset, **kw)


def first_batch(loader: Any, what: str = "the train dataloader") -> Any:
    """The first batch of a fresh iteration of `loader`, the random states left as they were (Python's,
    torch's, numpy's, the loader's generator, persistent workers'); one line when there is none."""
    if loader is None:
        raise UsageError(
            f"error: {what} is missing: the pre-flight needs the first batch; give a train dataset"
        )
    data = getattr(loader, "dataset", None)
    if isinstance(data, torch.utils.data.IterableDataset) and iter(data) is data:
        raise UsageError(
            f"error: {what} reads a one-shot iterator (its __iter__ returns itself): taking the first batch "
            "would take it from training; make __iter__ start over (a generator function), or call "
            "memfit.preflight with a batch yourself"
        )
    with rng_kept():
        it = iter(_peek_copy(loader))
        try:
            return next(it)
        except StopIteration:
            raise UsageError(
                f"error: {what} gave no batch (an empty dataset, or an IterableDataset that yields nothing); "
                "the pre-flight needs the first batch: check the dataset"
            ) from None
        finally:
            del it
