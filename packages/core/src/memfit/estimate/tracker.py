"""The accounting of a step's memory: every tensor storage alive, by category (parameters, gradients,
optimizer state, activations, CUDA library workspaces), for real tensors (the CPU measurement) and fake ones
(the estimate) alike (``_StorageTracker``), with the fast fake-tensor path the estimator runs ops on, and
how any model is built under fake tensors (``build_model``, ``fake_mode``). ``memfit.estimate.steps``
runs steps under it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils._pytree import tree_flatten

from memfit.errors import UsageError
from memfit.estimate import rules, workspaces
from memfit.estimate.cuda_memory import CudaFigures
from memfit.step import TrainStep

GIB = 1024**3
MIB = 1024**2

CATEGORIES = ("params", "grads", "optimizer", "activations")
WORKSPACES = workspaces.WORKSPACES  # the CUDA target's fifth category: what the CUDA libraries allocate


@dataclass
class MemoryReport:
    """Peak bytes of a step, split by category at the moment of the peak and by top-level module."""

    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    params: int = 0
    method: str = ""
    # the CUDA target: the allocator peak (= peak_bytes), the reserved peak and the card total
    cuda: CudaFigures | None = None
    # an estimate: the implementations its op sites chose ({(op, implementation): calls}, registry.traced)
    ran: dict[tuple[str, str], int] = field(default_factory=dict)
    # an estimate: what it had to assume (a value the optimizer step read, which fake tensors lack)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB

    def category_gib(self) -> dict[str, float]:
        """GiB per category at the peak; the CUDA target adds "workspaces" (the CUDA libraries')."""
        extra = (WORKSPACES,) if WORKSPACES in self.by_category else ()
        return {k: self.by_category.get(k, 0) / GIB for k in CATEGORIES + extra}

    def to_dict(self) -> dict[str, Any]:
        out = {
            "peak_gib": self.peak_gib,
            "params": self.params,
            "method": self.method,
            "by_category": self.category_gib(),
            "by_module": {k: v / GIB for k, v in self.by_module.items()},
        }
        if self.cuda is not None:
            out["cuda"] = self.cuda.to_dict()
        return out

    def format(self) -> str:
        cats = ", ".join(f"{k} {v:.3f}" for k, v in self.category_gib().items())
        return f"peak {self.peak_gib:.3f} GiB ({cats} GiB; {self.params / 1e6:.2f}M params; {self.method})"


# ----------------------------------------------------------------------------------------------------
# Real measurement
# ----------------------------------------------------------------------------------------------------


class _StorageTracker(TorchDispatchMode):
    """Counts the bytes of every storage an op creates inside the mode, until that storage is freed.

    Real mode (fake=False) counts real CPU storages and ignores fake ones; fake mode counts the storages
    of FakeTensors, which have sizes but no memory. Each storage carries a category (the phase that made
    it, or a later re-categorisation, e.g. a gradient), and running totals make every op O(1): the peak and
    its split by category are updated as storages come and go.
    """

    def __init__(self, fake: bool = False) -> None:
        super().__init__()
        self.fake = fake
        # the CUDA target sets it: every storage counts what the caching allocator reserves for it
        self.block: Callable[[int], int] | None = None
        self.live = 0
        self.peak = 0
        self.category = "activations"  # category of new storages: set by the phase of the step
        # build | input | forward | loss | backward | optimizer: labels storages and names a failing phase
        self.phase = "build"
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_by_category = dict(self.by_category)
        self.fake_mode: FakeTensorMode | None = None
        self._entries: dict[int, _Ref] = {}  # id(storage) -> a weak reference holding its entry
        # the CUDA target (``cuda_target``): the libraries' extra allocations, decided op by op, and every
        # allocation and free in order, which the caching-allocator simulation replays
        self.libraries: workspaces.CudaLibraries | None = None
        self.events: list[tuple] | None = None
        # fake mode: the values the optimizer step read from tensors (`.item()`, `if tensor:`), assumed
        self.assumed: dict[str, int] = {}

    seq = 0  # a sequence number of allocations and frees (the trace's; 0 here)

    def cuda_target(self, libraries: workspaces.CudaLibraries) -> None:
        """Record what a CUDA run allocates: storages in the caching allocator's 512-byte blocks, the CUDA
        libraries' workspaces (category "workspaces"), and the order of every allocation and free."""
        self.block = rules.cuda_block_bytes
        self.libraries = libraries
        self.events = []
        self.by_category.setdefault(WORKSPACES, 0)
        self.peak_by_category.setdefault(WORKSPACES, 0)

    def _storage(self, t: torch.Tensor):
        cls = type(t)
        if cls is not torch.Tensor and cls is not FakeTensor and cls is not nn.Parameter:
            # a DTensor (FSDP2's sharded parameters and their state) holds memory in its local shard only
            t = getattr(t, "_local_tensor", t)
            cls = type(t)
        fake = True if cls is FakeTensor else (False if cls is torch.Tensor else is_fake(t))
        if fake != self.fake or t.layout is not torch.strided or t.is_nested:
            return None
        if not self.fake and t.device.type != "cpu":
            return None
        try:
            return t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return None

    def entry(self, st) -> list | None:
        """The entry of a tracked storage (None when it is not tracked)."""
        ref = self._entries.get(id(st))
        return None if ref is None else ref.entry

    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        st = self._storage(t)
        if st is None:
            return
        ref = self._entries.get(id(st))
        if ref is None:
            self._add(st, t, category or self.category)
        elif category is not None and ref.entry[1] != category:
            entry = ref.entry
            self.by_category[entry[1]] -= entry[0]
            self.by_category[category] += entry[0]
            entry[1] = category

    def _add(self, st, t: torch.Tensor, category: str) -> None:
        """Count a storage not tracked yet, until it is freed (a weak reference's callback)."""
        entry = self._new_entry(st, t, category)
        self._entries[id(st)] = _Ref(st, self._dead, entry)
        self._count(entry)

    def _count(self, entry: list) -> None:
        self.live += entry[0]
        self.by_category[entry[1]] += entry[0]
        if self.events is not None:  # the entry itself rides along: the simulation reads its category
            self.events.append(("alloc", id(entry), entry[0], entry, self.seq))
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.by_category)
            self._on_peak()

    def _library_extras(self, func, args, kwargs, out) -> None:
        """The CUDA libraries' allocations for this op (a workspace kept for good, or transient ones
        freed again as the op returns), counted as storages of category "workspaces"."""
        extras = self.libraries.after_op(func, args, kwargs, out, self.phase == "backward")
        transient = []
        for x in extras:
            entry = self._extra_entry(x)
            self._count(entry)
            if x.transient:
                transient.append(entry)
        for entry in reversed(transient):
            self._free(entry)

    def _assume_value(self, t: torch.Tensor) -> bool | int | float:
        """A value an optimizer step reads from a fake tensor (Adafactor's step count with `.item()`, a
        branch on a tensor): fake tensors have none, so the step goes on with 1 (True) and says so. What it
        allocates does not depend on the value; only scalar arithmetic and branches see it."""
        value = True if t.dtype is torch.bool else (1.0 if t.dtype.is_floating_point else 1)
        key = f"{value} ({str(t.dtype).removeprefix('torch.')})"
        self.assumed[key] = self.assumed.get(key, 0) + 1
        return value

    def _extra_entry(self, x: workspaces.Extra) -> list:
        return [x.nbytes, x.category]

    def _dead(self, ref: _Ref) -> None:
        del self._entries[ref.key]
        self._free(ref.entry)

    def __enter__(self):
        if self.fake:  # the FakeTensorMode below this one: factory ops are built in it
            modes = _get_current_dispatch_mode_stack()
            self.fake_mode = next((m for m in reversed(modes) if isinstance(m, FakeTensorMode)), None)
        else:  # FSDP2 frees and re-allocates parameter memory by resizing storages in place
            self._resize = torch.UntypedStorage.resize_
            tracker, resize = self, self._resize

            def resize_(st, size):
                out = resize(st, size)
                tracker._resized(st)
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.fake:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def _resized(self, st) -> None:
        entry = self.entry(st)
        if entry is None:
            return
        delta = self._nbytes(st) - entry[0]
        entry[0] += delta
        self.live += delta
        self.by_category[entry[1]] += delta
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.by_category)
            self._on_peak()

    # Extension points (memfit.estimate records what made each storage): an entry is [nbytes, category, ...].
    def _new_entry(self, st, t: torch.Tensor, category: str) -> list:
        return [self._nbytes(st), category]

    def _nbytes(self, st) -> int:
        return st.nbytes() if self.block is None else self.block(st.nbytes())

    def _on_peak(self) -> None:
        pass

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Entered around each forward + loss (memfit.estimate marks the tensors saved for backward)."""
        return contextlib.nullcontext()

    def instrument(self, model: nn.Module) -> list:
        """Hooks on the freshly built model; returns their handles."""
        return []

    def _free(self, entry: list) -> None:
        self.live -= entry[0]
        self.by_category[entry[1]] -= entry[0]
        if self.events is not None:
            self.events.append(("free", id(entry)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE or id(func) in _QUERY_IDS:  # no tensor made; 2/3 of a step's calls
            return _query(func, args, kwargs)
        if self.fake:
            if func is _LOCAL_SCALAR and self.phase == "optimizer":
                return self._assume_value(args[0])
            if id(func) in _SAME_DTYPE_IDS:
                _check_same_dtype(func, args)
            out, made = _fast_fake_call(func, args, kwargs, self.fake_mode)
            fix = rules.cpu_fixes.get(id(func))
            if fix is not None:  # never on the fast path (_op_kind): `made` is None
                out = fix(args, out)
            if made is not None:  # the fast path knows what is new: its built outputs (none for views)
                for t in made:
                    st = t.untyped_storage()
                    if id(st) not in self._entries:
                        self._add(st, t, self.category)
                if self.libraries is not None:
                    self._library_extras(func, args, kwargs, out)
                return out
        else:
            out = func(*args, **(kwargs or {}))
        outs = _tensors(out)
        if not outs:
            if self.libraries is not None:
                self._library_extras(func, args, kwargs, out)
            return out
        # A view (or in-place result) shares an input's storage: nothing new was allocated, even when that
        # input was made before the tracker started and so is not counted.
        shared = set()
        for t in _tensors(args) + (_tensors(list(kwargs.values())) if kwargs else []):
            if (st := self._storage(t)) is not None:
                shared.add(id(st))
        for t in outs:
            st = self._storage(t)
            if st is not None and id(st) not in shared:
                self.track(t)
        if self.libraries is not None:
            self._library_extras(func, args, kwargs, out)
        return out


# ----------------------------------------------------------------------------------------------------
# A faster fake-tensor op for the estimator
# ----------------------------------------------------------------------------------------------------
# FakeTensorMode computes a general cache key for every op (SymInts, constants, views...): most of an
# estimate's time. But what an op returns under fake tensors follows from its inputs' metadata alone for
# the three kinds of op a training step is made of:
#   - "fresh": a new tensor (no mutation, no aliasing output): the first call of a key (the inputs' size,
#     stride, dtype, device and the other arguments) goes through FakeTensorMode, and its outputs' size,
#     stride and dtype are remembered; later calls build the FakeTensors directly;
#   - "view" (slice, transpose, view, select, split, _unsafe_view...): the op's meta kernel is run on the
#     fake inputs and the result wrapped, which is what FakeTensorMode does for them after its checks (no
#     cache: a loop over slices would never hit one);
#   - "inplace" (mul_, copy_, masked_fill_, out= variants, ops that return nothing like _fused_adamw_):
#     remembered per key like "fresh"; later calls return the mutated argument (or nothing), whose size
#     and stride the first call showed unchanged.
# Ops with a data-dependent shape, an in-place view (as_strided_, resize) or constant-folded inputs never
# take this path.

_PRIM_DEVICE = torch.ops.prim.device.default
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default  # tensor.item(), bool(tensor): a value
_QUERIES = {
    _PRIM_DEVICE,
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.storage_offset.default,
}
# per-op tables are keyed by id(op): an OpOverload hashes in Python, and ops live as long as the process
_QUERY_IDS = {id(f) for f in _QUERIES}
# Matrix products whose real CPU and CUDA kernels refuse floating inputs of two dtypes (an fp32 batch into
# bf16 weights: "expected m1 and m2 to have the same dtype") but whose fake (meta) versions return a
# result: checked here, so a step that cannot run is not estimated as if it could. Autocast casts the
# inputs before they reach this level, so an autocast step passes.
_SAME_DTYPE_IDS = {
    id(op)
    for op in (
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.convolution.default,
    )
}


def _check_same_dtype(func, args) -> None:
    kinds = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point}
    if len(kinds) > 1:
        names = " and ".join(sorted(str(d).removeprefix("torch.") for d in kinds))
        raise RuntimeError(
            f"{func.overloadpacket.__name__} of {names} tensors: the real kernel expects the same dtype "
            "(cast the batch to the weights' dtype, or train under autocast)"
        )


class _Ref(weakref.ref):
    """A weak reference to a tracked storage that holds its entry and its key in the tracker."""

    __slots__ = ("key", "entry")

    def __new__(cls, st, callback, entry):
        return super().__new__(cls, st, callback)

    def __init__(self, st, callback, entry) -> None:
        super().__init__(st, callback)
        self.key = id(st)
        self.entry = entry


def _query(func, args, kwargs):
    """What a metadata query returns (FakeTensor answers prim.device itself, outside kernels)."""
    t = args[0]
    if func is _PRIM_DEVICE and type(t) is FakeTensor and not t.fake_mode.in_kernel_invocation:
        return t.fake_device
    return func(*args, **(kwargs or {}))


_OP_KIND: dict[int, str | None] = {}
_OUT_META: dict[tuple, Any] = {}
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_SCALAR_TYPES = frozenset(_SCALARS)
_NO_CACHE_TAGS = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view}
_UNCACHED = False  # a key seen once whose result is not one of the kinds above: always the slow path


def _op_kind(func) -> str | None:
    """ "fresh", "view", "inplace" or None (always through FakeTensorMode) for an aten op."""
    kind = _OP_KIND.get(id(func), "")
    if kind != "":
        return kind
    schema = getattr(func, "_schema", None)
    kind = None
    fixed = id(func) in rules.cpu_fixes  # its fake result is corrected after each call
    if schema is not None and not fixed and not _NO_CACHE_TAGS.intersection(getattr(func, "tags", ())):
        aliases = [r.alias_info for r in schema.returns]
        view = getattr(func, "is_view", False) and bool(schema.returns)
        if view or func is torch.ops.aten._unsafe_view.default:
            kind = "view"  # _unsafe_view has no alias annotation but shares its input's storage
        elif not schema.is_mutable and all(a is None for a in aliases):
            kind = "fresh"
        elif schema.is_mutable and (
            # writes and returns one argument (mul_, out=), or returns nothing (_fused_adamw_, _foreach_add_)
            (len(aliases) == 1 and aliases[0] is not None and aliases[0].is_write) or not aliases
        ):
            kind = "inplace"
    _OP_KIND[id(func)] = kind
    return kind


def _key_of(args, found: list, key: list) -> None:
    """Appends the hashable metadata of a sequence of op arguments to `key` (each item's type first, so the
    flat list is unambiguous) and their fake tensors to `found`; raises KeyError for anything that could
    change the output beyond its metadata (a constant-folded fake tensor, an unknown object)."""
    for x in args:
        cls = type(x)
        if cls is FakeTensor:
            if x.constant is not None or x.layout is not torch.strided:
                raise KeyError
            found.append(x)
            key += (cls, x.shape, x.stride(), x.dtype, x.fake_device)
        elif cls in _SCALAR_TYPES or isinstance(x, _SCALARS):
            key += (cls, x)
        elif cls is list or cls is tuple:
            key += (cls, len(x))
            _key_of(x, found, key)
        else:
            raise KeyError


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)


def _out_meta(out) -> Any:
    if type(out) is FakeTensor:
        return _meta(out)
    if isinstance(out, (list, tuple)) and all(type(o) is FakeTensor or o is None for o in out):
        return (type(out), [None if o is None else _out_meta(o) for o in out])
    return None


def _new_fake(mode, elem: torch.Tensor, device: torch.device) -> FakeTensor:
    """``FakeTensor(mode, elem, device)`` for a CPU device, without its general checks and descriptor
    writes (a third of the time of a built op); the attributes are the ones FakeTensor.__new__ sets."""
    if device.type != "cpu":
        return FakeTensor(mode, elem, device)
    t = torch.Tensor._make_subclass(
        FakeTensor, elem, elem.requires_grad, dispatch_device=True, device_for_backend_keys=device
    )
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    d = t.__dict__
    d.update(_FAKE_ATTRS)
    d["fake_device"] = device
    d["fake_mode"] = mode
    return t


# FakeTensor.__new__'s attributes other than fake_device/fake_mode: no constant, no memos
_FAKE_ATTRS = dict.fromkeys(("constant", "pytype", "dispatch_keys", "real_tensor"))
for _m in ("nonzero", "item", "unique", "unique_consecutive", "nested_int"):
    _FAKE_ATTRS.update(dict.fromkeys((f"_{_m}_memo", f"_{_m}_memo_vc", f"_{_m}_memo_epoch")))


def _build(meta, mode, made: list) -> Any:
    """FakeTensors (or a list/tuple of them) of the metadata _out_meta remembered; appended to `made`."""
    if type(meta[0]) is torch.Size:
        shape, stride, _, dtype, device = meta
        with torch._C._DisableTorchDispatch():
            elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        t = _new_fake(mode, elem, device)
        made.append(t)
        return t
    kind, items = meta
    return kind(None if m is None else _build(m, mode, made) for m in items)


def _fake_view(func, args, kwargs, base: FakeTensor) -> Any:
    """A view op on fake tensors: its meta kernel on the inputs, outputs wrapped on the base's device
    (what in_kernel_invocation_manager does, without its generator)."""
    mode = base.fake_mode
    prev = mode.in_kernel_invocation
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        mode.in_kernel_invocation = True
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            mode.in_kernel_invocation = prev
    device = base.fake_device
    if isinstance(out, torch.Tensor):
        return _new_fake(mode, out, device)
    return type(out)(_new_fake(mode, o, device) for o in out)


# what a remembered in-place op returns: its first argument, its out= argument, or nothing
_INPLACE_RESULT = {"self": lambda a, k: a[0], "out": lambda a, k: k["out"], "none": lambda a, k: None}

FAST_FAKE = True  # off: every op goes through FakeTensorMode (the tests compare both)
_NONE_MADE: list = []  # the fast path's views and in-place ops make no new storage


# Arguments that do not change an op's output metadata, left out of its key: the backward of a select or
# slice is a new zero tensor of the input's size whatever the index (a scan's loop over time steps
# otherwise makes one key, and one slow FakeTensorMode call, per step).
_KEY_IGNORES = {
    id(torch.ops.aten.select_backward.default): (3,),  # index
    id(torch.ops.aten.slice_backward.default): (3, 4, 5),  # start, end, step
}


def _fast_fake_call(func, args, kwargs, mode=None) -> tuple[Any, list | None]:
    """(the op's result, the new tensors it made) on the fast path; (result, None) when FakeTensorMode ran
    it and the caller must find out what is new. `mode`: the active FakeTensorMode, for ops without a fake
    tensor argument (factory ops: zeros, empty...)."""
    kind = _op_kind(func) if FAST_FAKE else None
    if kind is None:
        return func(*args, **(kwargs or {})), None
    found: list = []
    # the default dtype: what a factory op without dtype, or a float scalar with an integer tensor, gives
    key: list = [id(func), torch.get_default_dtype()]
    try:
        ignore = _KEY_IGNORES.get(id(func))
        _key_of([None if i in ignore else a for i, a in enumerate(args)] if ignore else args, found, key)
        if kwargs:
            key.append("kwargs")
            _key_of(sorted(kwargs.items()), found, key)
        key = tuple(key)
    except (KeyError, TypeError):
        return func(*args, **(kwargs or {})), None
    if found:
        mode = found[0].fake_mode
    elif mode is None or kind != "fresh":  # no fake tensor argument and no mode to make one in
        return func(*args, **(kwargs or {})), None
    if kind == "view":
        return _fake_view(func, args, kwargs, found[0]), _NONE_MADE
    meta = _OUT_META.get(key)
    if meta is not None:
        if meta is _UNCACHED:
            return func(*args, **(kwargs or {})), None
        if kind == "fresh":
            made: list = []
            return _build(meta, mode, made), made
        return _INPLACE_RESULT[meta](args, kwargs), _NONE_MADE
    before = [_meta(t) for t in found]
    out = func(*args, **(kwargs or {}))
    if len(_OUT_META) < 200_000:
        _OUT_META[key] = _remember(kind, out, args, kwargs, found, before)
    return out, None


def _remember(kind: str, out, args, kwargs, found: list, before: list) -> Any:
    """What to store for a key after its first (FakeTensorMode) call; _UNCACHED when it does not fit kind."""
    if kind == "inplace":
        # the op may only have written data: every tensor argument keeps its size, stride and offset
        if [_meta(t) for t in found] != before:
            return _UNCACHED
        if out is None:
            return "none"
        if args and out is args[0]:
            return "self"
        return "out" if kwargs and out is kwargs.get("out") else _UNCACHED
    meta = _out_meta(out)
    outs = _tensors(out)
    if meta is None or not outs or any(t.constant is not None or _spare_storage(t) for t in outs):
        # a constant-folded output would lose its value when built from metadata, and an output that views
        # part of a larger storage (hann_window: 401 values, 400 shown) its spare bytes
        return _UNCACHED
    # an output on an input's storage (an op without alias annotation that aliases) is not fresh
    inputs = {id(t.untyped_storage()) for t in found}
    return _UNCACHED if any(id(t.untyped_storage()) in inputs for t in outs) else meta


def _spare_storage(t: torch.Tensor) -> bool:
    """True when t's storage holds more bytes than t reaches (it views part of it)."""
    reach = 0
    if t.numel():
        reach = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() != reach * t.element_size()


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result: a tensor, or lists/tuples of them (a fast tree_flatten:
    this runs for every op of a traced step)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        out = []
        for a in x:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple, dict)):
                out += _tensors(a)
        return out
    if isinstance(x, dict):
        return _tensors(list(x.values()))
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------------------------------
# Building any model under fake tensors
# ----------------------------------------------------------------------------------------------------
# A constructor may read values it computed: timm's drop-path rates (`torch.linspace(...).item()`), a
# RegNet's widths (`unique`), a mask's `nonzero`. Fake tensors have no values, so such a model is built
# for real on the CPU, with the writes into large tensors skipped (initialisers: their values never decide
# the structure, and untouched pages cost no memory or time), and its tensors are then swapped for fake
# ones of the same size, dtype and sharing.

_LARGE_WRITE = 1 << 16  # elements; smaller tensors are written for real (a linspace, a mask)


class _SkipLargeWrites(TorchDispatchMode):
    """Runs every op except in-place writes into tensors of at least _LARGE_WRITE elements."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        big = args and isinstance(args[0], torch.Tensor) and args[0].numel() >= _LARGE_WRITE
        if schema.is_mutable and big:
            ret = schema.returns
            if not ret:
                return None
            if len(ret) == 1 and ret[0].alias_info is not None and ret[0].alias_info.is_write:
                return args[0] if schema.arguments[0].alias_info is not None else kwargs.get("out", args[0])
        return func(*args, **(kwargs or {}))


def build_model(step: TrainStep, tracker: _StorageTracker) -> nn.Module:
    """step.build_model() under the active fake mode; when the constructor needs real values, built for
    real (see above) and converted to fake tensors. Raises the constructor's own error if both fail."""
    try:
        return step.build_model()
    except Exception as exc:  # noqa: BLE001 - retried for real below; a real error raises again there
        first = exc
    with _disable_current_modes(), torch.device("cpu"), _SkipLargeWrites():
        try:
            model = step.build_model()
        except UsageError:  # ours, one line (a --lora peft refuses): the fake attempt's error was a symptom
            raise
        except Exception:
            raise first from None
    return _to_fake(model, tracker.fake_mode)


def _to_fake(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """The model's parameters, buffers and tensor attributes replaced by fake tensors (ties and shared
    storages kept)."""
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            f = mode.from_tensor(t, static_shapes=True)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            memo[id(t)] = f
        return memo[id(t)]

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = fake(p)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = fake(b)
        for name, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and not is_fake(v):
                setattr(mod, name, fake(v))
    return model


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """FakeTensorMode on the CPU device: shapes, dtypes and allocations without storage or compute."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # copy.deepcopy of a FakeTensor (nn.TransformerEncoder clones its layer this way) lands in a new fake mode
    # that the optimizer step then refuses to mix with ours: clone in the current mode instead.
    old = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = _fake_deepcopy  # type: ignore[method-assign]
    # FakeTensorMode logs a traceback when an op's meta kernel raises (a shape that does not fit the
    # model): the error itself reaches the caller, which reports it in one line.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            # FakeTensorMode's op cache is shared by every mode in the process, and a hit returns a tensor
            # without the spare bytes of its storage (hann_window(400) lives in 401 values): with it, an
            # estimate depended by a few bytes on what ran before it in the process. Our own fast path
            # memoises the hot ops, so the cache buys no measurable speed here.
            mode.cache_enabled = False
            yield mode
    finally:
        log.setLevel(level)
        if old is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = old  # type: ignore[method-assign]


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """The objects made before the estimate are left out of the cyclic garbage collector's passes
    (gc.freeze): a step of small ops triggers full collections that would walk every object of the
    process (0.5 s of the 7 s mbsnet seed-materialise estimate, more in a test session). The step's own
    objects are collected as before, and its tensors die by reference counting (none of that step sits
    in a reference cycle), so every storage is freed at the same moment."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _fake_deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        out = self.clone()
    if isinstance(self, nn.Parameter):
        out = nn.Parameter(out, self.requires_grad)
    else:
        out.requires_grad_(self.requires_grad)
    memo[id(self)] = out
    return out
