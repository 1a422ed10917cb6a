"""What every implementation of an op needs and nothing more, so that none imports the registry that names it
(``memfit.ops.registry`` imports implementations by their "module:attribute" strings; an implementation that
imported it back would close a circle at run time): which device a tensor's ops run for (a fake tensor
inside an estimate's trace stands for its target's), the switches in the environment, and torch.compile's
marks made without importing the compiler.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# torch.compile's marks, without importing the compiler: `torch.compiler.disable` and
# `assume_constant_result` import torch._dynamo (with sympy and inductor: about 1 s here, 5 s on a busy
# core) the moment a module that uses them is imported, though most runs never compile.


def constant_result(fn):
    """``torch.compiler.assume_constant_result``: the attribute it sets (torch/_dynamo/decorators.py),
    set here so that importing the module that uses it does not import torch._dynamo."""
    fn._dynamo_marked_constant = True
    return fn


def outside_compile(fn, wrapping: bool = True):
    """``torch.compiler.disable(fn)``, made on the first call that can be inside a compile: while
    torch._dynamo was never imported nothing is being compiled, and ``fn`` runs as it is. ``wrapping``:
    torch._dynamo.disable's own flag (False where torch wraps the result itself: ``defer_compiler``)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            import torch._dynamo

            disabled = torch._dynamo.disable(fn, True, wrapping=wrapping)
        return disabled(*args, **kwargs)

    return call


def defer_compiler(*ops) -> None:
    """A custom op's kernels, as ``torch.library.custom_op`` wraps them, import torch._dynamo on their
    first call (``torch._disable_dynamo``, to keep the compiler out of them): 1 s of an `enhance` that never
    compiles. That wrapper first looks for a ready-made ``__dynamo_disable`` on the function it wraps
    (torch/_compile.py); give it one that runs the kernel as it is while torch._dynamo was never imported,
    and otherwise what torch would have made. A torch without these internals keeps its own behaviour."""
    for op in ops:
        for wrapper in getattr(op, "_backend_fns", {}).values():
            fn = getattr(wrapper, "__wrapped__", None)
            if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
                continue
            setattr(fn, "__dynamo_disable", outside_compile(fn, wrapping=False))


def channels_last(x: torch.Tensor) -> bool:
    """causal-conv1d's own test: is_channel_last = x.stride(1) == 1 && x.stride(2) > 1 (the wrapper makes
    any x with neither stride 1 contiguous, i.e. L-contiguous)."""
    return x.stride(1) == 1 and x.stride(2) > 1


def disabled() -> frozenset[str]:
    """Implementations switched off by the environment (MEMFIT_DISABLE)."""
    if "MEMFIT_SCAN_KERNEL" in os.environ and not _said_old_switch:
        _say_old_switch()
    return frozenset(n.strip() for n in os.environ.get("MEMFIT_DISABLE", "").split(",") if n.strip())


_said_old_switch = False


def _say_old_switch() -> None:
    global _said_old_switch
    _said_old_switch = True
    warnings.warn(
        "memfit: MEMFIT_SCAN_KERNEL is no longer read; to switch the fused CPU kernel off, set "
        "MEMFIT_DISABLE=cpu_kernel",
        RuntimeWarning,
        stacklevel=3,
    )


# the estimator's target while a trace runs (registry.traced_as sets it: a registry.Target)
_target = contextvars.ContextVar[Any]("memfit_target", default=None)


def current_target() -> Any:
    """The target fake tensors stand for now (None: outside an estimate's trace, or not set)."""
    return None if torch.compiler.is_compiling() else _target.get()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def device_type(t: torch.Tensor) -> str:
    """The device type ``t``'s ops run for: its own, but for a fake tensor inside ``traced_as`` the
    target's."""
    if _is_fake(t) and (target := current_target()) is not None:
        return target.device
    return t.device.type


def is_cuda(t: torch.Tensor) -> bool:
    """Whether t lives on a real CUDA device (a fake tensor never does: an estimate traces on the CPU)."""
    return t.device.type == "cuda" and not _is_fake(t)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``, e.g. (8, 0) for an A100."""
    return torch.cuda.get_device_capability(device)


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def own_graph() -> Iterator[None]:
    """Gradients on, and a graph that keeps its own saved tensors (saved-tensor hooks of its own): for the
    trial calls a dispatch makes (a probe, a timing) in the middle of a model's forward, which may run
    inside activation checkpointing, whose hooks would otherwise take the trial's tensors."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
        yield
