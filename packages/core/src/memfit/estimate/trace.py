"""The traced step behind `memfit estimate`: what a target is, and every storage its step allocates.

The step runs under ``FakeTensorMode`` (see ``memfit.estimate.memory.estimate_training_step``) with a
richer tracker
that records, for every storage the step allocates: the aten op that made it, the module whose forward was
running (forward pre/post hooks on every named module), its shape and dtype, whether autograd saved it for
backward (``torch.autograd.graph.saved_tensors_hooks``), and when it was born and freed (a sequence number
per allocation and free). ``memfit.estimate.explain`` replays that timeline for its what-ifs and
``memfit.estimate``
prints it; both import this module, never each other's.

TARGET is ``path/to/file.py:func`` or ``package.module:func``. ``func()`` returns a
``memfit.estimate.memory.TrainStep`` (integer keyword arguments such as ``batch`` become knobs for
``--gpu_gib``
and ``--scale``), or, with ``--input``, ``func`` is a module factory fed fake inputs of those shapes
(see ``factory_step``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import UsageError, first_line
from memfit.estimate import allocator, child
from memfit.estimate.steps import estimate_training_step
from memfit.estimate.tracker import _QUERIES, CATEGORIES, GIB, MemoryReport, _query, _StorageTracker
from memfit.step import AMP_DTYPES, TrainStep, default_optimizer

# Entry layout of a traced storage (a list, as _StorageTracker wants: [nbytes, category, ...]).
NBYTES, CAT, OP, MODULE, SHAPE, DTYPE, SAVED, BORN, FREED, SRC = range(10)

DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------------------------
# The tracer
# ----------------------------------------------------------------------------------------------------


_PHASE_LABELS = {
    "input": "(input batch)",
    "forward": "(outside the model)",
    "loss": "(loss)",
    "backward": "(backward)",
    "optimizer": "(optimizer)",
}


class TraceTracker(_StorageTracker):
    """A fake-tensor storage tracker that also records op, module path, shape, saved-ness and lifetime."""

    def __init__(self) -> None:
        self.phases: list[tuple[int, str]] = []  # (seq, phase) at each change: the phase's events follow seq
        super().__init__(fake=True)
        self.seq = 0
        self.peak_seq = 0
        self.records: list[list] = []
        self.op = "(input)"
        self.src: list | None = None
        self.path: list[str] = []  # forward module stack; left as is when a forward raises
        self.model_classes: dict[str, str] = {}
        self.owners: dict[int, str] = {}  # id(storage) of a parameter or buffer -> its module's path

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        """Recorded where it changes (``phases``, the timeline's shading) and said to a parent process
        (``memfit.estimate.child``), so that a target that ends the process is named in its phase."""
        if value != getattr(self, "_phase", None):
            child.note(_PHASE_TEXT.get(value, f"in {value}"))
        self._phase = value
        if not self.phases or self.phases[-1][1] != value:
            self.phases.append((self.seq, value))

    def _new_entry(self, st, t: torch.Tensor, category: str) -> list:
        self.seq += 1
        if self.path:
            module = self.path[-1]
        elif self.phase == "build" and id(st) in self.owners:
            module = self.owners[id(st)]
        elif self.category == "optimizer":
            module = "(optimizer)"
        else:
            module = _PHASE_LABELS.get(self.phase, "(build)")
        entry = [self._nbytes(st), category, self.op, module, tuple(t.shape), t.dtype, False, self.seq, None]
        entry.append(self.src)
        self.records.append(entry)
        return entry

    def _extra_entry(self, x) -> list:
        """A CUDA library's allocation (or a CUDA kernel's own temporary) as a record: op "cuBLAS workspace
        (main thread)"..., made in the module that ran the op."""
        self.seq += 1
        module = self.path[-1] if self.path else _PHASE_LABELS.get(self.phase, "(build)")
        entry = [x.nbytes, x.category, x.what, module, (x.nbytes,), torch.uint8, False, self.seq, None, None]
        self.records.append(entry)
        return entry

    def _on_peak(self) -> None:
        self.peak_seq = self.seq

    def _free(self, entry: list) -> None:
        super()._free(entry)
        self.seq += 1
        entry[FREED] = self.seq

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _QUERIES:  # a device/size query makes nothing: keep the label of the last real op
            return _query(func, args, kwargs)
        self.op = func.overloadpacket.__name__.lstrip("_")
        # the storage entry of the first tensor argument: how a softmax is traced back to its matmul
        self.src = None
        for a in args:
            if isinstance(a, torch.Tensor):
                st = self._storage(a)
                self.src = None if st is None else self.entry(st)
                break
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = self._storage(t)
        entry = None if st is None else self.entry(st)
        if entry is not None:
            entry[SAVED] = True
        return t

    def forward_context(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def instrument(self, model: nn.Module) -> list:
        # parameters and buffers are named by the module that holds them (those made outside the
        # tracker, by a model built for real and then faked, get their entries just after this)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            st = self._storage(t)
            if st is None:
                continue
            self.owners[id(st)] = name.rpartition(".")[0]
            entry = self.entry(st)
            if entry is not None and entry[MODULE] == "(build)":
                entry[MODULE] = self.owners[id(st)]
        handles = []
        for name, mod in model.named_modules():
            self.model_classes[name] = type(mod).__name__
            handles.append(mod.register_forward_pre_hook(self._enter(name)))
            handles.append(mod.register_forward_hook(self._leave))
        return handles

    def _enter(self, name: str):
        def hook(module, args):
            self.path.append(name)

        return hook

    def _leave(self, module, args, out):
        if self.path:
            self.path.pop()


@dataclass
class Group:
    """Tensors alive at the peak that share op, module pattern, shape and dtype (e.g. one per layer)."""

    op: str
    module: str
    shape: tuple
    dtype: str
    category: str
    nbytes: int  # each
    count: int
    saved: int  # how many of them autograd saved for backward

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "module": self.module,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "category": self.category,
            "bytes_each": self.nbytes,
            "count": self.count,
            "saved_for_backward": self.saved,
            "total_gib": self.total / GIB,
        }


def module_pattern(path: str) -> str:
    """`decoder.layers.3.attn` -> `decoder.layers.*.attn`: repeated layers share one pattern."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def merge_paths(paths: set[str]) -> str:
    """Paths of one pattern -> the pattern with `*` only where they differ (`layers.*.0.fn`)."""
    if len(paths) == 1:
        return next(iter(paths))
    split = [p.split(".") for p in paths]
    return ".".join(parts[0] if len(set(parts)) == 1 else "*" for parts in zip(*split))


@dataclass
class Trace:
    """One traced step: the report, every recorded storage and the sequence number of the peak;
    ``phases`` holds (seq, phase) where each phase began (build, input, forward, loss, backward,
    optimizer, and "done" once the last step is over and the model is let go)."""

    report: MemoryReport
    records: list[list]
    peak_seq: int
    model_classes: dict[str, str] = field(default_factory=dict)
    phases: list[tuple[int, str]] = field(default_factory=list)
    _at_peak: list[list] | None = field(default=None, repr=False)

    def alive_at(self, seq: int) -> list[list]:
        return [r for r in self.records if r[BORN] <= seq and (r[FREED] is None or r[FREED] > seq)]

    def at_peak(self) -> list[list]:
        if self._at_peak is None:
            self._at_peak = self.alive_at(self.peak_seq)
        return self._at_peak

    def activations_high(self) -> tuple[int, int]:
        """(bytes, seq) of the most activation memory alive at once in the step: where the peak of the whole
        step is the optimizer's (a small model's moments outweigh its activations), activations alive at
        that peak are a few input tensors, not what the batch costs."""
        change: dict[int, int] = {}
        for r in self.records:
            if r[CAT] == "activations":
                change[r[BORN]] = change.get(r[BORN], 0) + r[NBYTES]
                if r[FREED] is not None:
                    change[r[FREED]] = change.get(r[FREED], 0) - r[NBYTES]
        alive, best, at = 0, 0, self.peak_seq
        for seq in sorted(change):
            alive += change[seq]
            if alive > best:
                best, at = alive, seq
        return best, at

    def groups(self, category: str | None = "activations", seq: int | None = None) -> list[Group]:
        """Tensors alive at the peak (or at ``seq``), grouped across repeated layers, largest total first."""
        by_key: dict[tuple, Group] = {}
        paths: dict[tuple, set[str]] = {}
        for r in self.at_peak() if seq is None else self.alive_at(seq):
            if category is not None and r[CAT] != category:
                continue
            key = (r[OP], module_pattern(r[MODULE]), r[SHAPE], r[DTYPE], r[CAT], r[NBYTES])
            g = by_key.get(key)
            if g is None:
                name = DTYPE_NAMES.get(r[DTYPE], str(r[DTYPE]).removeprefix("torch."))
                g = by_key[key] = Group(key[0], key[1], r[SHAPE], name, r[CAT], r[NBYTES], 0, 0)
                paths[key] = set()
            g.count += 1
            g.saved += bool(r[SAVED])
            paths[key].add(r[MODULE])
        for key, g in by_key.items():  # only the indices that differ become `*`: layers.*.0.fn
            g.module = merge_paths(paths[key])
        return sorted(by_key.values(), key=lambda g: -g.total)

    def activations_at_peak(self) -> int:
        return sum(r[NBYTES] for r in self.at_peak() if r[CAT] == "activations")

    def module_shares(self) -> dict[str, int]:
        """Module path -> bytes of activations alive at the peak made in it or its children."""
        out: dict[str, int] = {}
        for r in self.at_peak():
            if r[CAT] != "activations":
                continue
            path = r[MODULE]
            if path.startswith("("):
                out[path] = out.get(path, 0) + r[NBYTES]
                continue
            out[""] = out.get("", 0) + r[NBYTES]
            parts = path.split(".") if path else []
            for i in range(1, len(parts) + 1):
                p = ".".join(parts[:i])
                out[p] = out.get(p, 0) + r[NBYTES]
        return out

    def replay(self, drop: Callable[[list], bool] | None = None, add: list[tuple[int, int, int]] = ()):
        """Peak and its split when the storages `drop` selects never existed and `add` (nbytes, born,
        freed) ones did: a what-if on the same timeline, no new trace. A CUDA estimate's peak is the
        caching allocator's (``memfit.estimate.allocator``) over that timeline."""
        events: list[tuple[int, int, str, int]] = []  # (seq, +-nbytes, category, which storage)
        for i, r in enumerate(self.records):
            if drop is not None and drop(r):
                continue
            events.append((r[BORN], r[NBYTES], r[CAT], i))
            if r[FREED] is not None:
                events.append((r[FREED], -r[NBYTES], r[CAT], i))
        for k, (nbytes, born, freed) in enumerate(add):
            events.append((born, nbytes, "activations", -1 - k))
            events.append((freed, -nbytes, "activations", -1 - k))
        events.sort(key=lambda e: (e[0], e[1] < 0))
        if self.report.cuda is not None:
            return _allocator_replay(events)
        live, peak = 0, 0
        cats = dict.fromkeys(CATEGORIES, 0)
        peak_cats = dict(cats)
        for _, n, cat, _ in events:
            live += n
            cats[cat] = cats.get(cat, 0) + n
            if live > peak:
                peak, peak_cats = live, dict(cats)
        return peak, peak_cats


def _allocator_replay(events: list[tuple[int, int, str, int]]) -> tuple[int, dict[str, int]]:
    """The caching allocator's peak and its split over a replayed timeline (Trace.replay's events)."""
    sim = allocator.simulate([("alloc", k, n) if n >= 0 else ("free", k) for _, n, _, k in events])
    cats = {k: cat for _, n, cat, k in events if n >= 0}
    split = dict.fromkeys(CATEGORIES, 0)
    for key, size in sim.block_bytes.items():
        split[cats[key]] = split.get(cats[key], 0) + size
    return sim.peak_allocated, split


def trace_step(step: TrainStep, steps: int = 2, device: str = "cpu") -> Trace:
    """Estimate `step` (two steps under FakeTensorMode) and keep the per-storage record. A failing step's
    exception carries where it failed: ``memfit_phase`` (build, input, forward, loss, backward,
    optimizer), ``memfit_path`` (the innermost module running) and ``memfit_class`` (its class)."""
    tracker = TraceTracker()
    try:
        report = estimate_training_step(step, steps, tracker=tracker, device=device)
    except Exception as exc:
        exc.memfit_phase = tracker.phase  # type: ignore[attr-defined]
        exc.memfit_path = tracker.path[-1] if tracker.path else None  # type: ignore[attr-defined]
        cls = tracker.model_classes.get(exc.memfit_path or "")
        if tracker.phase == "build":
            cls = _constructing(exc)
        exc.memfit_class = cls  # type: ignore[attr-defined]
        raise
    peak_seq = tracker.peak_seq if report.cuda is None else report.cuda.peak_seq  # the allocator's peak
    return Trace(report, tracker.records, peak_seq, tracker.model_classes, tracker.phases)


def _constructing(exc: BaseException) -> str | None:
    """The class of the innermost nn.Module whose __init__ was running when `exc` was raised."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            found = type(frame.f_locals["self"]).__name__
        tb = tb.tb_next
    return found


# ----------------------------------------------------------------------------------------------------
# Targets: what the user points us at
# ----------------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A step that can be rebuilt with other values of its integer knobs (batch, an input axis, ...)."""

    label: str
    make: Callable[[dict[str, int]], TrainStep]
    knobs: dict[str, int]  # default values; "batch" when the batch can vary
    describe: str = ""
    device: str = "cpu"  # the device whose kernels the estimate models: "cpu" or "cuda"

    def step(self, **overrides: int) -> TrainStep:
        return self.make({**self.knobs, **overrides})


def parse_shape(text: str) -> tuple[int, ...]:
    """`64x3x224x224` -> (64, 3, 224, 224) (a `:dtype` suffix is read by parse_input)."""
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(
            f"error: --input {text!r} is not a shape; write sizes joined by x, e.g. --input 64x3x224x224 "
            "(or 8x1024:int64 for token ids)"
        )
    return shape


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    dtype = getattr(torch, name.strip(), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"error: {flag} {name!r} is not a torch dtype; e.g. float32, bfloat16, int64")
    return dtype


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """`8x1024:int64` -> ((8, 1024), torch.int64); without a suffix the dtype is None (decided later)."""
    shape, _, dtype = text.partition(":")
    return parse_shape(shape), (parse_dtype(dtype, f"--input {text!r}:") if dtype else None)


def first_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's first module with parameters when it is an nn.Embedding (a token model), else None."""
    for mod in model.modules():
        if next(mod.parameters(recurse=False), None) is not None:
            return mod if isinstance(mod, nn.Embedding) else None
    return None


def token_vocab(fn: Callable) -> int | None:
    """The vocabulary of a factory's model whose first layer is an nn.Embedding (built on the meta device,
    no memory); None when it is not, or does not build there."""
    try:
        with torch.device("meta"):
            model = fn()
    except Exception:  # noqa: BLE001 - a model that needs real values to build: no inference
        return None
    emb = first_embedding(model) if isinstance(model, nn.Module) else None
    return None if emb is None else emb.num_embeddings


def _load_callable(spec: str) -> tuple[Callable, str]:
    if ":" not in spec:
        raise UsageError(
            f"error: TARGET {spec!r} has no function; write path/to/file.py:func or package.module:func"
        )
    where, _, name = spec.rpartition(":")
    path = Path(where)
    if where.endswith(".py") or "/" in where or "\\" in where or path.is_file():
        if not path.is_file():
            raise UsageError(
                f"error: no file {where!r}; TARGET is path/to/file.py:func or package.module:func"
            )
        if path.suffix != ".py":
            raise UsageError(
                f"error: {where!r} is not a Python file; "
                "TARGET is path/to/file.py:func or package.module:func"
            )
        mod_name = f"memfit_target_{abs(hash(str(path.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec_obj)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec_obj.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise UsageError(
                f"error: importing {where} failed: {type(exc).__name__}: {first_line(exc, 300)}"
            ) from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise UsageError(
                f"error: no module {where!r} ({first_line(exc, 300)}); install it or give "
                "path/to/file.py:func"
            ) from exc
        except Exception as exc:
            raise UsageError(
                f"error: importing {where} failed: {type(exc).__name__}: {first_line(exc, 300)}"
            ) from exc
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UsageError(f"error: {where} has no {name!r}")
    if not callable(fn):
        raise UsageError(f"error: {spec} is not callable")
    return fn, spec


def _int_knobs(fn: Callable) -> tuple[dict[str, int], list[str]]:
    """Integer keyword defaults of fn (its knobs) and its parameters that have no default."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, []
    knobs, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            required.append(p.name)
        elif isinstance(p.default, int) and not isinstance(p.default, bool):
            knobs[p.name] = p.default
    return knobs, required


def _call(fn: Callable, spec: str, **kwargs):
    try:
        return fn(**kwargs)
    except Exception as exc:
        raise UsageError(f"error: {spec}() raised {type(exc).__name__}: {first_line(exc, 300)}") from exc


def factory_step(
    factory: Callable[[], nn.Module],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype | list[torch.dtype] = torch.float32,
    target: str = "classes",
    amp_dtype: torch.dtype | None = None,
    high: int = 2,
) -> TrainStep:
    """A step for a module factory: random inputs of `shapes` (`dtype`: one for all or one per input;
    integer inputs drawn in [0, high)), then cross-entropy of the first output against random classes
    (`classes`: the last dimension is the class axis), MSE against a random tensor of the output's shape
    (`same`), or the output's sum (`sum`); fused AdamW. A model with a `config.use_cache` (transformers)
    trains with it off, as a training step does: no key/value cache is kept."""
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)

    def make_batch(device):
        return [
            torch.randn(s, device=device, dtype=d)
            if d.is_floating_point
            else torch.randint(0, high, s, device=device, dtype=d)
            for s, d in zip(shapes, dtypes)
        ]

    def build():
        model = factory()
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
        return model

    def loss(model, inputs):
        out = model(*inputs)
        out = _first_tensor(out)
        if target == "classes" and out.dim() >= 2:
            logits = out.reshape(-1, out.shape[-1]).float()
            labels = torch.randint(0, out.shape[-1], logits.shape[:1], device=out.device)
            return F.cross_entropy(logits, labels)
        if target == "same":
            return F.mse_loss(out.float(), torch.randn(out.shape, device=out.device))
        return out.float().sum()

    return TrainStep(build, make_batch, loss, default_optimizer, amp_dtype)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for o in out:
            with contextlib.suppress(TypeError):
                return _first_tensor(o)
    for name in ("logits", "last_hidden_state", "sample"):
        if isinstance(getattr(out, name, None), torch.Tensor):
            return getattr(out, name)
    raise TypeError(f"the model returned {type(out).__name__}, not a tensor")


def load_target(spec: str, *args, **kwargs) -> Target:
    """TARGET (+ --input shapes) -> a Target: the callable `spec` names, then make_target with the rest of
    the arguments. Raises UsageError for every user mistake."""
    child.note("while importing the target")
    fn, spec = _load_callable(spec)
    if isinstance(fn, nn.Module):  # built at import (MODEL = Net()): taken as memfit.estimate takes it
        inputs = args[0] if args else kwargs.get("inputs")
        if not inputs:  # nothing to call it with: a built model is not a TrainStep function
            raise UsageError(
                f"error: {spec} is a model already built ({type(fn).__name__}): give its input shape, "
                "e.g. --input 8x3x224x224"
            )
        fn = copying_factory(fn)
    child.note("while building the model")
    return make_target(fn, spec, *args, **kwargs)


def copying_factory(model: nn.Module) -> Callable[[], nn.Module]:
    """A factory of a model already built: a copy each call, the model itself never changed (the fake copy
    the estimate needs is made from a real copy by build_model's fallback)."""

    def factory() -> nn.Module:
        return copy.deepcopy(model)

    return factory


def make_target(
    fn: Callable,
    spec: str,
    inputs: list[str] | None = None,
    dtype: str | None = None,
    target: str = "classes",
    amp: str = "none",
) -> Target:
    """A Target from a callable: a TrainStep function, or a module factory when `inputs` are given."""
    knobs, required = _int_knobs(fn)
    if required:
        raise UsageError(
            f"error: {spec} needs arguments ({', '.join(required)}); point at a function that takes none, "
            "e.g. "
            f"def make(): return {getattr(fn, '__name__', 'Model')}(...) in a file of yours"
        )
    amp_dtype = AMP_DTYPES[amp]
    if inputs:
        parsed = [parse_input(s) for s in inputs]
        shapes = [p[0] for p in parsed]
        default = parse_dtype(dtype) if dtype is not None else None
        vocab = token_vocab(fn)
        # no dtype given: token ids for a model whose first layer is an nn.Embedding, else float32
        guess = torch.int64 if vocab is not None else torch.float32
        tdtype = [d or default or guess for _, d in parsed]
        high = vocab or 2

        def make(k: dict[str, int]) -> TrainStep:
            scaled = []
            for s in shapes:
                s = list(s)
                s[0] = k["batch"]
                for name, value in k.items():
                    if name.startswith("input:"):
                        axis = int(name.split(":")[1])
                        if axis < len(s) and s[axis] == shapes[0][axis]:
                            s[axis] = value
                scaled.append(tuple(s))
            return factory_step(build, scaled, tdtype, target, amp_dtype, high)

        def build() -> nn.Module:
            model = fn()
            if not isinstance(model, nn.Module):
                raise UsageError(
                    f"error: {spec}() returned {type(model).__name__}, not an nn.Module; drop --input "
                    "when it returns a TrainStep"
                )
            return model

        knobs = {"batch": shapes[0][0]}
        for axis in range(1, len(shapes[0])):
            knobs[f"input:{axis}"] = shapes[0][axis]
        shown = " ".join(
            f"--input {'x'.join(map(str, s))}:{str(d).removeprefix('torch.')}" for s, d in zip(shapes, tdtype)
        )
        ids = (
            f" (token ids < {vocab}: the first layer is an nn.Embedding)" if vocab and guess in tdtype else ""
        )
        describe = f"{shown}{ids}, loss {target}, AdamW, autocast {amp}"
        return Target(spec, make, knobs, describe)

    with torch.device("meta"):
        probe = _call(fn, spec)
    if isinstance(probe, nn.Module):
        raise UsageError(f"error: {spec} returns a module: give its input shape, e.g. --input 8x3x224x224")
    if not isinstance(probe, TrainStep):
        raise UsageError(
            f"error: {spec}() returned {type(probe).__name__}; it must return a memfit.memory.TrainStep, "
            "or be a module factory used with --input SHAPE"
        )
    if amp != "none":  # as --input: what a factory's step is made with, a TrainStep says itself
        raise UsageError(
            f"error: --amp sets a module factory's autocast and {spec}() returns a TrainStep; drop --amp, "
            "or set the TrainStep's amp_dtype"
        )

    def make_step(k: dict[str, int]) -> TrainStep:
        step = _call(fn, spec, **k)
        if not isinstance(step, TrainStep):
            raise UsageError(
                f"error: {spec}() returned {type(step).__name__}, not a memfit.estimate.memory.TrainStep"
            )
        return step

    amp_name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(probe.amp_dtype, "?")
    knob_text = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "no integer knobs"
    return Target(spec, make_step, knobs, f"TrainStep ({knob_text}), autocast {amp_name}")


_PHASE_TEXT = {
    "build": "while building the model",
    "input": "while making the input batch",
    "forward": "in the forward",
    "loss": "in the loss",
    "backward": "in backward",
    "optimizer": "in the optimizer step",
}


def trace_target(target: Target, **overrides: int) -> Trace:
    """Trace the target's step; a failing step becomes one UsageError line naming the phase and module."""
    step = target.step(**overrides)
    try:
        return trace_step(step, device=target.device)
    except (SystemExit, UsageError):
        raise
    except Exception as exc:
        raise UsageError(f"error: {failure_text(exc)} ({_hint(target, exc)})") from exc


def failure_text(exc: BaseException) -> str:
    """`the training step failed in the forward of `lin` (Linear): RuntimeError: ...` for an exception
    that trace_step labelled."""
    phase = getattr(exc, "memfit_phase", None)
    path, cls = getattr(exc, "memfit_path", None), getattr(exc, "memfit_class", None)
    where = f" {_PHASE_TEXT.get(phase, '')}" if phase else ""
    if phase == "forward" and path is not None:
        where = (
            f" in the forward of `{path}` ({cls or '?'})"
            if path
            else f" in the forward of the model itself ({cls or '?'})"
        )
    elif phase == "build" and getattr(exc, "memfit_optimizer", False):
        where = " while building the optimizer"
    elif phase == "build" and cls:
        where += f" (in {cls}.__init__)"
    return f"the training step failed{where}: {type(exc).__name__}: {first_line(exc, 300)}"


# what fake tensors raise where a step reads a tensor's value (a branch on it, .item(), nonzero's size)
VALUE_READS = ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode")


def _hint(target: Target, exc: BaseException) -> str:
    if getattr(exc, "memfit_optimizer", False):
        return "check the optimizer's settings: build it yourself on the model's parameters"
    if getattr(exc, "memfit_phase", None) == "build":
        return "check that the model builds: call the factory yourself"
    if type(exc).__name__ in VALUE_READS:
        return (
            "the step reads a tensor's value (a branch on it, .item(), nonzero): the estimate's fake "
            "tensors have shapes but no values; make the step depend on shapes only"
        )
    return "check --input" if "--input" in target.describe else "check the TrainStep"


def log2_fit(xs: list[float], ys: list[float]) -> float:
    """Slope of log y against log x (least squares): the scaling exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
