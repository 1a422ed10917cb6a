"""A GPU emulated on the CPU, so the default suite catches device bugs: ``with emulated_cuda(): ...``.

Inside, ``torch.cuda`` says one GPU is there (an H100-like ``cuda:0``), and every tensor put on it (a factory
with ``device="cuda"``, ``.to("cuda")``, ``.cuda()``, ``Module.to``) is an ``EmulatedCuda`` tensor: its
metadata says ``cuda:0`` (``.device``, ``.is_cuda``), its values live in a CPU tensor (``inner``) that real
CPU kernels compute on. An op that mixes one with a CPU tensor of one or more dimensions raises what CUDA
raises ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"),
so a tensor made on the CPU by mistake and mixed into a step fails here as it would on a GPU. What CUDA
allows stays allowed: 0-dim CPU tensors (CPU scalars), ``copy_`` and ``to`` across devices, CPU indices
in ``x[idx]`` and ``x[idx] = v``, and factories and ``torch.as_tensor`` given ``device=`` (they move).

How: a ``TorchFunctionMode`` sees every torch function, method and property before autograd does, so
autograd runs on the inner CPU tensors (a tensor whose device is ``cuda`` cannot enter autograd without a
driver: its graph nodes ask the CUDA runtime for a stream). The mode unwraps the arguments, checks their
devices, runs the function on the CPU tensors and wraps what a GPU would hold; ``backward`` runs with the
mode on, so what the engine calls back (a checkpoint's recomputation, hooks) is emulated too. Entries that
do not go through torch functions are patched for the duration: ``torch.cuda``'s functions (one GPU,
compute capability 9.0, 80 GiB, memory figures 0; its RNG state is the CPU generator's), ``torch.Generator``
(a CUDA generator is a CPU one), ``torch.autocast`` (autocast on "cuda" is CPU autocast on the inner
tensors), ``autograd.Function.apply`` (a custom function runs on the inner tensors: its body sees CPU
tensors), FlexAttention (SDPA under the block mask: compiled FlexAttention needs a GPU) and
``torch.compile`` (eager). The Triton scan the registry picks on CUDA runs memfit's torch scan (the Triton
interpreter takes a minute per call at these sizes; packages/core/tests/test_scan_triton.py tests the
kernels under it). Saving an ``EmulatedCuda`` tensor saves its CPU tensor: what loading a GPU run's
checkpoint with ``map_location="cpu"`` gives.

Not emulated: speed, memory, streams; device checks inside custom autograd functions' bodies and kernels;
a generator's device (a CPU generator handed to a sampling op on the GPU passes); and 0-dim CPU tensors
pass everywhere (CUDA takes them in elementwise ops).
"""

from __future__ import annotations

import contextlib
import copy
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - imported before torch.cuda is patched (it records torch's functions)
from memfit.ops import registry
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import _NoopSaveInputs

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
GIB = 2**30
MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


class EmulatedCuda(torch.Tensor):
    """A tensor on the emulated ``cuda:0``: the values are ``inner`` (a CPU tensor), the metadata is a GPU's.
    It never requires grad itself; ``inner`` carries autograd (``requires_grad``, ``grad``, ``backward`` are
    answered by it)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmulatedCuda:
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=CUDA0, requires_grad=False,
        )  # fmt: skip
        t.inner = inner
        return t

    def __init__(self, inner: torch.Tensor) -> None:
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"EmulatedCuda({self.inner!r})"

    # the mode (below) handles every torch function on these tensors, before autograd and dispatch
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"an emulated CUDA tensor reached {func} past the emulation: outside emulated_cuda(), or through "
            "a C++ path that bypasses torch functions (tests/emulated_cuda.py must handle it)"
        )

    # traceable-subclass protocol: Module.to swaps a parameter's contents in place for one of these
    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return EmulatedCuda(inner_tensors["inner"])


def _is_cuda_device(d: Any) -> bool:
    if d is None:
        return False
    if isinstance(d, int):
        return True  # a bare index means a CUDA device
    return torch.device(d).type == "cuda"


def _inner(t: Any) -> Any:
    return t.inner if isinstance(t, EmulatedCuda) else t


def _wrap(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and not isinstance(t, EmulatedCuda):
        if t.device.type != "cpu":
            return t
        return EmulatedCuda(t)
    return t


def _check(args: tuple, kwargs: dict) -> bool:
    """Whether any argument is on the GPU; raise CUDA's error when one also is a CPU tensor with dims."""
    gpu = cpu = False
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, EmulatedCuda):
            gpu = True
        elif isinstance(a, torch.Tensor) and a.dim() > 0 and a.device.type == "cpu":
            cpu = True
    if gpu and cpu:
        raise RuntimeError(MIXED)
    return gpu


def _call(func, args: tuple, kwargs: dict, wrap_out: bool):
    """func on the inner tensors; with wrap_out, its tensor results on the GPU (an input returned, as an
    in-place op does, is that input)."""
    outer = {id(t.inner): t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, EmulatedCuda)}
    a, k = pytree.tree_map(_inner, (args, kwargs))
    out = func(*a, **k)
    if not wrap_out:
        return out
    return pytree.tree_map(lambda o: outer[id(o)] if id(o) in outer else _wrap(o), out)


T = torch.Tensor
# functions whose tensors may sit on both devices on CUDA too: the result is where the first argument is
# (type_as: where the second is); a GPU tensor indexes with CPU indices, not a CPU tensor with GPU ones
_CROSS_DEVICE = {T.copy_, T.__getitem__, T.__setitem__, T.index_put_, T.index_put, T.expand_as, T.view_as,
                 T.reshape_as, T.type_as, T.new_tensor, torch.as_tensor, torch.tensor}  # fmt: skip
_INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put}
_GETTERS = {
    T.device.__get__: lambda t: CUDA0,
    T.is_cuda.__get__: lambda t: True,
    T.is_cpu.__get__: lambda t: False,
    T.get_device: lambda t: 0,
}


NO_NUMPY = (
    "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
    "first."
)


class _Mode(TorchFunctionMode):
    """The emulated GPU; ``ops`` counts the functions that ran on it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._handle(func, args, kwargs or {})

    def _handle(self, func, args, kwargs):
        self_gpu = bool(args) and isinstance(args[0], EmulatedCuda)
        if self_gpu and func in _GETTERS:
            return _GETTERS[func](args[0])
        if self_gpu and func in (T.numpy, T.__array__):
            raise TypeError(NO_NUMPY)
        if func in (T.backward, torch.autograd.backward, torch.autograd.grad):
            return self._backward(func, args, kwargs)
        if func in (T.to, T.cuda, T.cpu):
            return self._to(func, args, kwargs)
        if func is torch._has_compatible_shallow_copy_type:  # Module.to: swap, never `param.data =`
            return not any(isinstance(a, EmulatedCuda) for a in args) and func(*args)
        if func in (T.pin_memory,):
            return args[0]
        if func is T.is_pinned:
            return False
        if func is T.record_stream:
            return None
        if func is T.__deepcopy__:  # the memo may hold GPU tensors beside a CPU one: no device check
            return self._deepcopy(args[0], args[1]) if self_gpu else func(*args, **kwargs)
        if func is T.__iter__ and self_gpu:
            return iter(self._handle(T.unbind, (args[0], 0), {}))
        if func is T.__reduce_ex__ and self_gpu:  # saved as its CPU tensor
            return args[0].inner.__reduce_ex__(*args[1:])
        device = kwargs.get("device")
        if device is not None:  # a factory or converter: its device says where the result is
            if not _is_cuda_device(device):
                return _call(func, args, kwargs, wrap_out=False)
            self.ops += 1
            return _call(func, args, {**kwargs, "device": CPU}, wrap_out=True)
        if func in _CROSS_DEVICE:
            return self._cross_device(func, args, kwargs)
        gpu = _check(args, kwargs)
        if not gpu:
            return func(*args, **kwargs)
        self.ops += 1
        return _call(func, args, kwargs, wrap_out=True)

    def _cross_device(self, func, args, kwargs):
        if not any(isinstance(a, EmulatedCuda) for a in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        first = args[0] if args else None
        if func in _INDEXING and not isinstance(first, EmulatedCuda) and _check(args[1:2], {}):
            raise RuntimeError(MIXED)  # GPU indices into a CPU tensor
        where = args[1] if func is T.type_as else first
        self.ops += 1
        return _call(func, args, kwargs, wrap_out=isinstance(where, EmulatedCuda))

    def _backward(self, func, args, kwargs):
        """Backward on the inner tensors, with the mode back on for what the engine calls back (a
        checkpoint's recomputation, custom functions' backward, hooks): the engine is run directly, as
        torch.autograd.backward/grad do past their torch-function check."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        bound = _bind(func, args, kwargs)
        _check((), bound)
        b = pytree.tree_map(_inner, bound)
        outer = {id(t.inner): t for t in pytree.tree_leaves(bound) if isinstance(t, EmulatedCuda)}
        if func is torch.autograd.grad:
            outputs, inputs = _as_tuple(b["outputs"]), _as_tuple(b["inputs"])
            grads, accumulate = b.get("grad_outputs"), False
        else:
            outputs = _as_tuple(b["tensors"] if func is torch.autograd.backward else b["self"])
            grads = b.get("grad_tensors" if func is torch.autograd.backward else "gradient")
            inputs, accumulate = _as_tuple(b.get("inputs") or ()), True
        create_graph = bool(b.get("create_graph"))
        retain = b.get("retain_graph")
        with self:
            grads = _tensor_or_tensors_to_tuple(grads, len(outputs))
            grads = _make_grads(outputs, grads, is_grads_batched=False)
            result = _engine_run_backward(
                outputs, grads, create_graph if retain is None else retain, create_graph, inputs,
                bool(b.get("allow_unused")) or accumulate, accumulate_grad=accumulate,
            )  # fmt: skip
        if accumulate:
            return None
        return tuple(outer[id(r)] if id(r) in outer else _wrap_like(r, bound["inputs"], i)
                     for i, r in enumerate(result))  # fmt: skip

    def _to(self, func, args, kwargs):
        """to / cuda / cpu: a move between the GPU and another device copies, as CUDA does; a tensor that
        stays off the GPU is torch's business."""
        t, rest = args[0], args[1:]
        if func is T.cpu:
            device, dtype, fmt = CPU, None, kwargs.get("memory_format")
        elif func is T.cuda:
            device, dtype, fmt = CUDA0, None, kwargs.get("memory_format")
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, fmt = torch._C._nn._parse_to(*rest, **parse)
            if rest and isinstance(rest[0], EmulatedCuda):  # to(other): other's device and dtype
                device, dtype = CUDA0, rest[0].dtype
        on_gpu, to_gpu = isinstance(t, EmulatedCuda), _is_cuda_device(device)
        if not on_gpu and not to_gpu:
            return func(*args, **kwargs)
        fmt = {} if fmt is None else {"memory_format": fmt}
        src, dtype = _inner(t), dtype or t.dtype
        if on_gpu and (device is None or to_gpu):  # stays on the GPU
            out = src.to(dtype=dtype, copy=bool(kwargs.get("copy", False)), **fmt)
            return t if out is src else _wrap(out)
        out = src.to(device=CPU if to_gpu else device, dtype=dtype, copy=True, **fmt)
        return _wrap(out) if to_gpu else out

    def _deepcopy(self, t: EmulatedCuda, memo: dict) -> EmulatedCuda:
        if id(t) in memo:
            return memo[id(t)]
        new = EmulatedCuda(copy.deepcopy(t.inner, memo))
        for k, v in t.__dict__.items():  # a Parameter's _is_param, hooks' state
            if k != "inner":
                setattr(new, k, copy.deepcopy(v, memo))
        memo[id(t)] = new
        return new


def _bind(func, args, kwargs) -> dict:
    import inspect

    target = torch.autograd.backward if func is T.backward else func
    params = inspect.signature(target).parameters
    if func is T.backward:
        names = ["self", "gradient", "retain_graph", "create_graph"]
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return bound
    return dict(inspect.signature(target).bind(*args, **kwargs).arguments) if params else {}


def _as_tuple(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x)


def _wrap_like(r, inputs, i):
    """A gradient is where its input is."""
    ins = _as_tuple(inputs)
    return _wrap(r) if r is not None and isinstance(ins[i], EmulatedCuda) else r


# ----------------------------------------------------------------------------------------------------
# What is patched for the duration
# ----------------------------------------------------------------------------------------------------


class _GeneratorMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _REAL_GENERATOR)


_REAL_GENERATOR = torch.Generator


class _Generator(metaclass=_GeneratorMeta):
    """``torch.Generator(device="cuda")`` is a CPU generator: the emulated GPU's random ops run there."""

    def __new__(cls, device: Any = "cpu"):
        return _REAL_GENERATOR("cpu" if _is_cuda_device(device) else device)


_REAL_AUTOCAST = torch.amp.autocast


class _Autocast(_REAL_AUTOCAST):
    """Autocast on "cuda" is CPU autocast: the emulated GPU's ops run on CPU tensors."""

    def __init__(self, device_type: str, *args, **kwargs) -> None:
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(name="Emulated GPU (memfit tests)", major=9, minor=0, total_memory=80 * GIB,
                                 multi_processor_count=132, is_integrated=False, uuid="emulated")  # fmt: skip


class _Device(contextlib.nullcontext):
    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.idx = 0


def _cuda_functions() -> dict[str, Any]:
    cpu_rng = torch.get_rng_state
    set_cpu_rng = torch.set_rng_state
    zero = lambda *a, **k: 0  # noqa: E731
    nothing = lambda *a, **k: None  # noqa: E731
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": nothing,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": nothing,
        "device": _Device,
        "get_device_name": lambda *a: _properties().name,
        "get_device_properties": _properties,
        "get_device_capability": lambda *a: (9, 0),
        "is_bf16_supported": lambda *a, **k: True,
        "synchronize": nothing,
        "Event": _Event,
        "is_current_stream_capturing": lambda: False,
        "empty_cache": nothing,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "reset_peak_memory_stats": nothing,
        "reset_max_memory_allocated": nothing,
        "mem_get_info": lambda *a: (80 * GIB, 80 * GIB),
        # the GPU's random numbers come from the CPU generator: its ops run there
        "get_rng_state": lambda *a: cpu_rng(),
        "set_rng_state": lambda state, *a: set_cpu_rng(state.to("cpu", torch.uint8)),
        "get_rng_state_all": lambda: [cpu_rng()],
        "set_rng_state_all": lambda states: set_cpu_rng(states[0].to("cpu", torch.uint8)),
        "manual_seed": nothing,
        "manual_seed_all": nothing,
        "seed": nothing,
        "seed_all": nothing,
        "initial_seed": lambda: torch.initial_seed(),
    }


class _Event:
    """torch.cuda.Event on the host clock (the GPU's work runs on the CPU, synchronously)."""

    def __init__(self, enable_timing: bool = False, **kwargs) -> None:
        self.at = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3


def _function_apply():
    real = torch.autograd.Function.apply.__func__

    def apply(cls, *args, **kwargs):
        if cls is _NoopSaveInputs:  # a checkpoint keeps its inputs as they are, to recompute from them
            return real(cls, *args, **kwargs)
        if not any(isinstance(a, EmulatedCuda) for a in pytree.tree_leaves((args, kwargs))):
            return real(cls, *args, **kwargs)
        return _call(lambda *a, **k: real(cls, *a, **k), args, kwargs, wrap_out=True)

    return classmethod(apply)


def _flex_patches() -> list[tuple[Any, str, Any]]:
    """FlexAttention on the emulated GPU is SDPA under the block mask's dense mask: compiled FlexAttention
    needs a GPU, and its eager path has no backward on the CPU (and vmaps the mask over index tensors,
    which functorch would wrap around an EmulatedCuda tensor and hand to CUDA kernels)."""
    from torch.nn.attention import flex_attention as flex

    real_mask, real_flex = flex.create_block_mask, flex.flex_attention

    def create_block_mask(*args, device="cuda", **kwargs):
        if not _is_cuda_device(device):
            return real_mask(*args, device=device, **kwargs)
        return real_mask(*args, device="cpu", **kwargs).to(CUDA0)

    def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, **kwargs):
        if not isinstance(query, EmulatedCuda):
            return real_flex(query, key, value, score_mod, block_mask=block_mask, scale=scale, **kwargs)
        if score_mod is not None or kwargs.get("return_lse") or kwargs.get("enable_gqa"):
            raise NotImplementedError("the emulated GPU's FlexAttention takes a block mask only")
        mask = None
        if block_mask is not None:
            q_idx = torch.arange(query.shape[-2], device=query.device)[:, None]
            kv_idx = torch.arange(key.shape[-2], device=key.device)[None, :]
            zero = torch.zeros((), dtype=torch.long, device=query.device)
            mask = block_mask.mask_mod(zero, zero, q_idx, kv_idx)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(query, key, value, attn_mask=mask, scale=scale)

    return [(flex, "create_block_mask", create_block_mask), (flex, "flex_attention", flex_attention)]


# The Triton interpreter takes a minute per scan call at the systems' test sizes: where the registry
# chooses the Triton scan (what a GPU without the cuda extra runs), memfit's torch scan stands in for it
# (ran() still says "triton").
SCAN_STAND_INS = {registry.record_of("scan", "triton").load: "memfit.ops.scan.chunked:chunked_scan"}


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    saved = {spec: registry._loaded.get(spec) for spec in SCAN_STAND_INS}
    for spec, stand_in in SCAN_STAND_INS.items():
        registry._loaded[spec] = registry.resolve(stand_in)
    registry.reset(probes=True)
    try:
        yield
    finally:
        for spec, fn in saved.items():
            if fn is None:
                registry._loaded.pop(spec, None)
            else:
                registry._loaded[spec] = fn
        registry._probes.clear()  # the stand-in's verdicts (ran() keeps what ran, for the test to read)


@contextlib.contextmanager
def emulated_cuda() -> Iterator[_Mode]:
    """Run the block on an emulated GPU (see the module docstring); yields the mode (``ops``: how many
    functions ran on the GPU)."""
    patches: list[tuple[Any, str, Any]] = [(torch.cuda, k, v) for k, v in _cuda_functions().items()]
    patches += _flex_patches()
    patches += [
        (torch, "Generator", _Generator),
        (torch, "autocast", _Autocast),
        (torch.amp, "autocast", _Autocast),
        (torch.autograd.Function, "apply", _function_apply()),
        (torch, "compile", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f)),
        # the registry's kernel race times each candidate once after its first call, not three times: an
        # emulated GPU's timings are the host's (the Triton window kernel's, under Triton's interpreter,
        # took 50 s of one gpt2 test)
        (registry, "TUNE_REPEATS", 1),
    ]
    saved = [(obj, name, obj.__dict__.get(name, getattr(obj, name))) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        with torch.autograd.set_multithreading_enabled(False), _stand_ins(), _Mode() as mode:
            yield mode
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
