"""`memfit estimate`: any PyTorch model's training-step memory, explained, in seconds, without a GPU.

One traced step (``memfit.estimate.trace``: every storage with its op, module, shape, dtype, saved-ness and
lifetime) gives:

- the peak and its split into params / grads / optimizer / activations;
- the tensors alive at the peak, grouped across repeated layers (``decoder.layers.*.attn``) by op, shape
  and dtype, largest first;
- the module tree with each module's share of the activations alive at the peak;
- what-ifs, the scaling exponent, the largest batch for a GPU and the per-rank figure
(``memfit.estimate.explain``);
- memory over the step as a picture, and the step as PyTorch's memory snapshot (``--timeline``,
  ``--snapshot``: ``memfit.estimate.timeline``).

``--device cuda`` (the default whenever ``--gpu_gib`` is given) estimates what a CUDA run keeps
(``memfit.estimate.rules``). The same result is the Python API: ``memfit.estimate(model_or_factory, inputs)``
(this module is callable) returns an ``EstimateResult`` whose ``to_dict()`` is the ``--json`` object.
A target may be a model by name (``hf:``, ``timm:``, ``torchvision:``; ``memfit.estimate.byname``) and any
target fine-tuned (``--lora``, ``--freeze``, ``--optimizer``, ``--accumulate``; ``memfit.estimate.finetune``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# The package's names, each imported from its module on first use: `import memfit.estimate` (and the
# flags `memfit estimate --help` reads from memfit.estimate.flags) costs no torch import.
_NAMES = {
    "result": ("EstimateResult", "tree_rows", "split_text", "cuda_lines"),
    "api": ("estimate", "estimate_model", "capacity", "MAX_RANKS", "MAX_BATCH"),
    "command": ("main",),
    "flags": (
        "add_parser", "GPU_HELP", "MAX_BATCH_HELP", "MEASURE_HELP", "NO_CUDA_KERNELS_HELP", "SNAPSHOT_HELP"
    ),
    "byname": ("load_target",),
    "target": ("DeviceTarget",),
    "trace": (
        "BORN", "CAT", "DTYPE_NAMES", "FREED", "MODULE", "NBYTES", "OP", "SAVED", "SHAPE", "SRC", "Group",
        "Target", "Trace", "TraceTracker", "_load_callable", "factory_step", "fmt_bytes", "log2_fit",
        "make_target", "merge_paths", "module_pattern", "parse_shape", "trace_step", "trace_target",
    ),
}  # fmt: skip
_WHERE = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")  # a submodule: memfit.estimate.rules
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


class _CallableModule(types.ModuleType):
    """`memfit.estimate` is this module and, called, the Python API (``api.estimate_model``)."""

    def __call__(self, *args, **kwargs):
        from memfit.estimate.api import estimate_model

        return estimate_model(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
