"""`memfit estimate`: any PyTorch model's training-step memory, explained, in seconds, without a GPU.

The step runs under ``FakeTensorMode`` (see ``memfit.memory.estimate_training_step``) with a richer tracker
that records, for every storage the step allocates: the aten op that made it, the module whose forward was
running (forward pre/post hooks on every named module), its shape and dtype, whether autograd saved it for
backward (``torch.autograd.graph.saved_tensors_hooks``), and when it was born and freed (a sequence number
per allocation and free). From that one trace:

- the peak and its split into params / grads / optimizer / activations;
- the tensors alive at the peak, grouped across repeated layers (``decoder.layers.*.attn``) by op, shape
  and dtype, largest first;
- the module tree with each module's share of the activations alive at the peak;
- what-ifs that need no new trace (``memfit.explain``): the timeline is replayed with some storages
  removed or added.

TARGET is ``path/to/file.py:func`` or ``package.module:func``. ``func()`` returns a
``memfit.memory.TrainStep`` (integer keyword arguments such as ``batch`` become knobs for ``--gpu_gib``
and ``--scale``), or, with ``--input``, ``func`` is a module factory fed fake inputs of those shapes
(see ``factory_step``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.flags import hidden_alias
from memfit.memory import (
    _QUERIES,
    CATEGORIES,
    GIB,
    MemoryReport,
    TrainStep,
    _query,
    _StorageTracker,
    default_optimizer,
    estimate_training_step,
)

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


class BadInput(Exception):
    """A user mistake: printed as one line `error: ...`, exit status 2."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------------------------------
# The tracer
# ----------------------------------------------------------------------------------------------------


_PHASE_LABELS = {"input": "(input batch)", "forward": "(outside the model)", "backward": "(backward)"}


class TraceTracker(_StorageTracker):
    """A fake-tensor storage tracker that also records op, module path, shape, saved-ness and lifetime."""

    def __init__(self) -> None:
        super().__init__(fake=True)
        self.seq = 0
        self.peak_seq = 0
        self.records: list[list] = []
        self.op = "(input)"
        self.src: list | None = None
        self.path: list[str] = []  # forward module stack; left as is when a forward raises
        self.model_classes: dict[str, str] = {}

    def _new_entry(self, st, t: torch.Tensor, category: str) -> list:
        self.seq += 1
        if self.path:
            module = self.path[-1]
        elif self.category == "optimizer":
            module = "(optimizer)"
        else:
            module = _PHASE_LABELS.get(self.phase, "(build)")
        entry = [st.nbytes(), category, self.op, module, tuple(t.shape), t.dtype, False, self.seq, None]
        entry.append(self.src)
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

    @contextlib.contextmanager
    def forward_context(self):
        self.phase = "forward"
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.phase = "backward"

    def instrument(self, model: nn.Module) -> list:
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
    """One traced step: the report, every recorded storage and the sequence number of the peak."""

    report: MemoryReport
    records: list[list]
    peak_seq: int
    model_classes: dict[str, str] = field(default_factory=dict)
    _at_peak: list[list] | None = field(default=None, repr=False)

    def alive_at(self, seq: int) -> list[list]:
        return [r for r in self.records if r[BORN] <= seq and (r[FREED] is None or r[FREED] > seq)]

    def at_peak(self) -> list[list]:
        if self._at_peak is None:
            self._at_peak = self.alive_at(self.peak_seq)
        return self._at_peak

    def groups(self, category: str | None = "activations") -> list[Group]:
        """Tensors alive at the peak, grouped across repeated layers, largest total first."""
        by_key: dict[tuple, Group] = {}
        paths: dict[tuple, set[str]] = {}
        for r in self.at_peak():
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
        freed) ones did: a what-if on the same timeline, no new trace."""
        events: list[tuple[int, int, str]] = []
        for r in self.records:
            if drop is not None and drop(r):
                continue
            events.append((r[BORN], r[NBYTES], r[CAT]))
            if r[FREED] is not None:
                events.append((r[FREED], -r[NBYTES], r[CAT]))
        for nbytes, born, freed in add:
            events.append((born, nbytes, "activations"))
            events.append((freed, -nbytes, "activations"))
        events.sort(key=lambda e: (e[0], e[1] < 0))
        live, peak = 0, 0
        cats = dict.fromkeys(CATEGORIES, 0)
        peak_cats = dict(cats)
        for _, n, cat in events:
            live += n
            cats[cat] += n
            if live > peak:
                peak, peak_cats = live, dict(cats)
        return peak, peak_cats


def trace_step(step: TrainStep, steps: int = 2) -> Trace:
    """Estimate `step` (two steps under FakeTensorMode) and keep the per-storage record."""
    tracker = TraceTracker()
    try:
        report = estimate_training_step(step, steps, tracker=tracker)
    except Exception as exc:
        exc.memfit_path = tracker.path[-1] if tracker.path else None  # type: ignore[attr-defined]
        exc.memfit_class = tracker.model_classes.get(exc.memfit_path or "")  # type: ignore[attr-defined]
        raise
    return Trace(report, tracker.records, tracker.peak_seq, tracker.model_classes)


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

    def step(self, **overrides: int) -> TrainStep:
        return self.make({**self.knobs, **overrides})


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise BadInput(f"--input {text!r} is not a shape; write sizes joined by x, e.g. --input 64x3x224x224")
    return shape


def _load_callable(spec: str) -> tuple[Callable, str]:
    if ":" not in spec:
        raise BadInput(f"TARGET {spec!r} has no function; write path/to/file.py:func or package.module:func")
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise BadInput(f"no file {where!r}; TARGET is path/to/file.py:func or package.module:func")
        mod_name = f"memfit_target_{abs(hash(str(path.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec_obj)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec_obj.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise BadInput(f"importing {where} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise BadInput(
                f"no module {where!r} ({_first_line(exc)}); install it or give path/to/file.py:func"
            ) from exc
        except Exception as exc:
            raise BadInput(f"importing {where} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise BadInput(f"{where} has no {name!r}")
    if not callable(fn):
        raise BadInput(f"{spec} is not callable")
    return fn, spec


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


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
        raise BadInput(f"{spec}() raised {type(exc).__name__}: {_first_line(exc)}") from exc


def factory_step(
    factory: Callable[[], nn.Module],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    target: str = "classes",
    amp_dtype: torch.dtype | None = None,
) -> TrainStep:
    """A step for a module factory: random inputs of `shapes`, then cross-entropy of the first output
    against random classes (`classes`: the last dimension is the class axis), MSE against a random tensor
    of the output's shape (`same`), or the output's sum (`sum`); fused AdamW."""

    def make_batch(device):
        if dtype.is_floating_point:
            return [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        return [torch.randint(0, 2, s, device=device, dtype=dtype) for s in shapes]

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

    return TrainStep(factory, make_batch, loss, default_optimizer, amp_dtype)


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


def load_target(
    spec: str,
    inputs: list[str] | None = None,
    dtype: str = "float32",
    target: str = "classes",
    amp: str = "none",
) -> Target:
    """TARGET (+ --input shapes) -> a Target. Raises BadInput for every user mistake."""
    fn, spec = _load_callable(spec)
    return make_target(fn, spec, inputs, dtype, target, amp)


def make_target(
    fn: Callable,
    spec: str,
    inputs: list[str] | None = None,
    dtype: str = "float32",
    target: str = "classes",
    amp: str = "none",
) -> Target:
    """A Target from a callable: a TrainStep function, or a module factory when `inputs` are given."""
    knobs, required = _int_knobs(fn)
    if required:
        raise BadInput(
            f"{spec} needs arguments ({', '.join(required)}); point at a function that takes none, e.g. "
            f"def make(): return {getattr(fn, '__name__', 'Model')}(...) in a file of yours"
        )
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    if inputs:
        shapes = [parse_shape(s) for s in inputs]
        try:
            tdtype = getattr(torch, dtype)
            assert isinstance(tdtype, torch.dtype)
        except (AttributeError, AssertionError):
            raise BadInput(f"--dtype {dtype!r} is not a torch dtype; e.g. float32, int64") from None

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
            return factory_step(build, scaled, tdtype, target, amp_dtype)

        def build() -> nn.Module:
            model = fn()
            if not isinstance(model, nn.Module):
                raise BadInput(
                    f"{spec}() returned {type(model).__name__}, not an nn.Module; drop --input "
                    "when it returns a TrainStep"
                )
            return model

        knobs = {"batch": shapes[0][0]}
        for axis in range(1, len(shapes[0])):
            knobs[f"input:{axis}"] = shapes[0][axis]
        shown = " ".join(f"--input {'x'.join(map(str, s))}" for s in shapes)
        describe = f"{shown}, {dtype} inputs, loss {target}, AdamW, autocast {amp}"
        return Target(spec, make, knobs, describe)

    with torch.device("meta"):
        probe = _call(fn, spec)
    if isinstance(probe, nn.Module):
        raise BadInput(f"{spec} returns a module: give its input shape, e.g. --input 8x3x224x224")
    if not isinstance(probe, TrainStep):
        raise BadInput(
            f"{spec}() returned {type(probe).__name__}; it must return a memfit.memory.TrainStep, "
            "or be a module factory used with --input SHAPE"
        )

    def make_step(k: dict[str, int]) -> TrainStep:
        step = _call(fn, spec, **k)
        if not isinstance(step, TrainStep):
            raise BadInput(f"{spec}() returned {type(step).__name__}, not a memfit.memory.TrainStep")
        return step

    amp_name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(probe.amp_dtype, "?")
    knob_text = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "no integer knobs"
    return Target(spec, make_step, knobs, f"TrainStep ({knob_text}), autocast {amp_name}")


def trace_target(target: Target, **overrides: int) -> Trace:
    """Trace the target's step; a failing build/forward becomes one BadInput line with the module path."""
    step = target.step(**overrides)
    try:
        return trace_step(step)
    except BadInput:
        raise
    except Exception as exc:
        path = getattr(exc, "memfit_path", None)
        where = "" if path is None else f" in `{path or '(top)'}` ({getattr(exc, 'memfit_class', '?')})"
        hint = "check --input" if "--input" in target.describe else "check the TrainStep"
        raise BadInput(
            f"the training step failed{where}: {type(exc).__name__}: {_first_line(exc)} ({hint})"
        ) from exc


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------


def tree_rows(trace: Trace, min_share: float = 0.02, max_depth: int = 3) -> list[tuple[str, int, int]]:
    """(indented name, bytes, count) rows of the module tree; children that are numbered repeats of one
    another (layers.0, layers.1, ...) are shown once as `layers.*` with their count and the bytes of one."""
    shares = trace.module_shares()
    total = max(trace.activations_at_peak(), 1)
    rows: list[tuple[str, int, int]] = []

    def children(prefix: str) -> list[str]:
        depth = 0 if prefix == "" else prefix.count(".") + 1
        return [
            k
            for k in shares
            if k
            and not k.startswith("(")
            and k.count(".") == depth
            and (prefix == "" or k.startswith(prefix + "."))
        ]

    def visit(prefix: str, depth: int) -> None:
        if depth >= max_depth:
            return
        kids = children(prefix)
        numbered = [k for k in kids if k.rsplit(".", 1)[-1].isdigit()]
        others = [k for k in kids if k not in numbered]
        for k in sorted(others, key=lambda k: -shares[k]):
            if shares[k] >= min_share * total:
                rows.append(("  " * depth + k.rsplit(".", 1)[-1], shares[k], 1))
                visit(k, depth + 1)
        if numbered:
            biggest = max(numbered, key=lambda k: shares[k])
            sum_all = sum(shares[k] for k in numbered)
            if sum_all >= min_share * total:
                rows.append(("  " * depth + "*", sum_all, len(numbered)))
                visit(biggest, depth + 1)

    rows.append(("(model)", shares.get("", 0), 1))
    visit("", 1)
    for k in sorted(k for k in shares if k.startswith("(") and shares[k] >= min_share * total):
        rows.append((k, shares[k], 1))
    return rows


@dataclass
class EstimateResult:
    target: Target
    trace: Trace
    top: int = 10

    def to_dict(self) -> dict[str, Any]:
        r = self.trace.report
        total = max(self.trace.activations_at_peak(), 1)
        return {
            "target": self.target.label,
            "setup": self.target.describe,
            "knobs": self.target.knobs,
            "peak_gib": r.peak_gib,
            "params": r.params,
            "by_category_gib": r.category_gib(),
            "top_tensors": [g.to_dict() for g in self.trace.groups()[: self.top]],
            "modules": [
                {"module": m, "activation_gib": b / GIB, "share": b / total}
                for m, b in sorted(self.trace.module_shares().items(), key=lambda kv: -kv[1])
            ],
        }

    def format(self) -> str:
        r = self.trace.report
        cats = r.by_category
        lines = [
            f"memfit estimate {self.target.label}: {self.target.describe}",
            f"peak {fmt_bytes(r.peak_bytes)} = params {fmt_bytes(cats.get('params', 0))} + grads "
            f"{fmt_bytes(cats.get('grads', 0))} + optimizer {fmt_bytes(cats.get('optimizer', 0))} + "
            f"activations {fmt_bytes(cats.get('activations', 0))}   ({r.params / 1e6:.2f}M parameters)",
            "",
            "Largest tensors alive at the peak (activations; x N = one per repeated layer):",
        ]
        header = (
            f"  {'op':<22} {'module':<34} {'shape':<24} {'dtype':<5} {'each':>10} {'x N':>5} {'total':>10}"
        )
        lines.append(header)
        for g in self.trace.groups()[: self.top]:
            saved = "" if g.saved == g.count else ("  (temporary)" if g.saved == 0 else "  (some saved)")
            lines.append(
                f"  {g.op[:22]:<22} {(g.module or '(top)')[-34:]:<34} {str(g.shape)[:24]:<24} {g.dtype:<5} "
                f"{fmt_bytes(g.nbytes):>10} {'x' + str(g.count):>5} {fmt_bytes(g.total):>10}{saved}"
            )
        lines += ["", "Module tree (activations alive at the peak made inside each module; * = repeated):"]
        total = max(self.trace.activations_at_peak(), 1)
        for name, nbytes, count in tree_rows(self.trace):
            each = f"  ({count} x {fmt_bytes(nbytes / count)})" if count > 1 else ""
            lines.append(f"  {name:<40} {fmt_bytes(nbytes):>10} {100 * nbytes / total:5.1f}%{each}")
        return "\n".join(lines)


def estimate(target: Target, top: int = 10) -> EstimateResult:
    return EstimateResult(target, trace_target(target), top)


def amp_variant(step: TrainStep, dtype: torch.dtype | None) -> TrainStep:
    return replace(step, amp_dtype=dtype)


def log2_fit(xs: list[float], ys: list[float]) -> float:
    """Slope of log y against log x (least squares): the scaling exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ----------------------------------------------------------------------------------------------------
# `memfit estimate`
# ----------------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    """Register `memfit estimate` on the `memfit` subparsers."""
    p = sub.add_parser(
        "estimate",
        help="training-step memory of any model: peak, culprits, what-ifs, largest batch",
        description="Estimate the peak memory of one training step (forward, loss, backward, AdamW) of any "
        "PyTorch model under FakeTensorMode on the CPU, and say what holds it.",
    )
    p.add_argument(
        "target",
        help="path/to/file.py:func or package.module:func; func() returns a memfit.memory.TrainStep, or is "
        "a module factory (then give --input)",
    )
    p.add_argument("--input", action="append", help="input shape, e.g. 64x3x224x224 (repeatable)")
    p.add_argument("--dtype", default="float32", help="dtype of the inputs, e.g. int64 for token ids")
    p.add_argument(
        "--target",
        dest="loss_target",
        choices=["classes", "same", "sum"],
        default="classes",
        help="loss: cross-entropy over the output's last axis (classes), MSE to a tensor of the output's "
        "shape (same), or the output's sum",
    )
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="autocast (factories)")
    p.add_argument("--top", type=int, default=10, help="how many tensor groups to list")
    p.add_argument("--explain", action="store_true", help="what-ifs: SDPA, bf16, checkpointing, half batch")
    p.add_argument("--scale", help="fit the activation exponent over 1x-4x of: batch, input:AXIS, or a knob")
    p.add_argument("--gpu_gib", type=float, help="largest batch that fits a GPU of this many GiB")
    hidden_alias(p, "--gpu-gib", dest="gpu_gib", type=float)  # the old spelling
    p.add_argument("--margin", type=float, default=0.1, help="allocator margin for --gpu_gib (0.1 = 10%%)")
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (with --gpu_gib)")
    p.add_argument("--shard", choices=["ddp", "fsdp"], default="ddp", help="how ranks hold the state")
    p.add_argument("--max_batch", type=int, default=4096)
    hidden_alias(p, "--max-batch", dest="max_batch", type=int)
    p.add_argument("--json", action="store_true", help="everything as one JSON object")
    p.set_defaults(func=main)


def main(args) -> int:
    """`memfit estimate`; every user mistake is one `error:` line and exit status 2."""
    import json

    try:
        return _main(args, json)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(args, json) -> int:
    from memfit import explain

    if args.gpu_gib is not None and args.gpu_gib <= 0:
        raise BadInput(f"--gpu_gib must be positive, got {args.gpu_gib:g}")
    if not 0 <= args.margin < 1:
        raise BadInput(f"--margin is a fraction in [0, 1), e.g. 0.1; got {args.margin:g}")
    if args.ranks < 1 or args.top < 1 or args.max_batch < 1:
        raise BadInput("--ranks, --top and --max_batch must be at least 1")
    target = load_target(args.target, args.input, args.dtype, args.loss_target, args.amp)
    result = estimate(target, args.top)
    out: dict[str, Any] = result.to_dict()
    text = [result.format()]
    base = result.trace.report.peak_bytes
    if args.explain:
        rows = explain.what_ifs(target, result.trace)
        out["what_ifs"] = [w.to_dict(base) for w in rows]
        best = explain.recommend(base, rows)
        out["try_first"] = None if best is None else best.name
        text += ["", explain.format_what_ifs(base, rows)]
    if args.explain or args.scale:
        knob = args.scale or ("batch" if "batch" in target.knobs else None)
        if knob is not None:
            sc = explain.scaling(target, knob, result.trace)
            out["scaling"] = sc.to_dict()
            text += ["", sc.format()]
    status = 0
    if args.gpu_gib is not None:
        fit = explain.fit_batch(
            target, args.gpu_gib, args.margin, args.ranks, args.shard, args.max_batch, result.trace
        )
        out["fit"] = fit.to_dict()
        if fit.batch == 0:
            raise BadInput(
                f"nothing fits {args.gpu_gib:g} GiB ({100 * args.margin:g}% margin): batch 1 needs "
                f"{fmt_bytes(fit.peak_bytes)} per rank; try --explain for what would shrink it"
            )
        text += ["", fit.format()]
    print(json.dumps(out, indent=2) if args.json else "\n".join(text))
    return status
