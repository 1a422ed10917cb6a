"""A training step as memfit runs, measures and estimates it: ``TrainStep``, what every system's budget rows
and every ``memfit estimate FILE.py:func`` target return, with the default optimizer and the autocast
dtypes by name. The ground floor: torch and nothing of memfit's, so a system or a user file imports it
without the estimator. ``memfit.memory`` is the public name users import it by; this is where it lives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

AMP_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW as the systems train with it (fused: no per-step temporaries the size of the model)."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


@dataclass
class TrainStep:
    """Everything needed to run (or fake) one training step; what ``memfit estimate file.py:func`` wants.

    - ``build_model()`` -> the ``nn.Module``, built on the current default device (do not pass a device:
      the estimator builds it under ``FakeTensorMode``, the measurement on the real device);
    - ``make_batch(device)`` -> any batch (tensors, tuples, dicts) made on ``device``;
    - ``loss(model, batch)`` -> a scalar tensor; it runs under autocast when ``amp_dtype`` is set;
    - ``optimizer(params)`` -> an ``Optimizer`` (default: fused AdamW);
    - ``amp_dtype``: the autocast dtype (default bf16) or None for full precision;
    - ``accumulate``: micro-batches per optimizer step (gradient accumulation; default 1).

    A step is: ``loss(model, make_batch(device)).backward()`` ``accumulate`` times (the gradients add up
    between micro-batches), then ``opt.step(); opt.zero_grad(set_to_none=True)``.
    Example::

        def step(batch: int = 32) -> TrainStep:   # a `batch` keyword lets `--gpu_gib` / `--scale` vary it
            return TrainStep(
                build_model=lambda: torchvision.models.resnet18(),
                make_batch=lambda d: (torch.randn(batch, 3, 224, 224, device=d),
                                      torch.randint(0, 1000, (batch,), device=d)),
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
            )
    """

    build_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    amp_dtype: torch.dtype | None = torch.bfloat16
    accumulate: int = 1
