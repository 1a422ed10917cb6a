"""memfit: measure, estimate and cut the memory of a training step; the shared layers and training loop.

``memfit.estimate(model_or_factory, inputs, ...)`` is the Python API of ``memfit estimate`` (see
``memfit.estimate.estimate_model``); it is imported on first use, so ``import memfit`` stays cheap.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("memfit-core")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "estimate", "preflight", "largest_batch", "DoesNotFit", "Untraceable"]
_PREFLIGHT = ("preflight", "largest_batch", "DoesNotFit", "Untraceable")


def __getattr__(name: str) -> Any:
    if name == "estimate":  # the callable module memfit.estimate (importing it also sets the attribute)
        return importlib.import_module("memfit.estimate")
    if name in _PREFLIGHT:
        return getattr(importlib.import_module("memfit.estimate.trainers"), name)
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
