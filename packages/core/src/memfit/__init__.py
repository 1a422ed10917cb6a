"""memfit: measure, estimate and cut the memory of a training step.

``memfit.estimate(model_or_factory, inputs, ...)`` is the Python API of ``memfit estimate`` (see
``memfit.estimate.estimate_model``); it is imported on first use, so ``import memfit`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["estimate"]


def __getattr__(name: str) -> Any:
    if name == "estimate":  # the callable module memfit.estimate (importing it also sets the attribute)
        return importlib.import_module("memfit.estimate")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
