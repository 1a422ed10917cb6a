"""The registry that model packages plug into: how `train`, `eval` and `memfit budget` find systems.

A model package declares, in its pyproject::

    [project.entry-points."memfit.systems"]
    ginr-cifar = "ginr_cifar.system:SYSTEM"

and ``ginr_cifar/system.py`` defines ``SYSTEM = System(...)``. Core never imports a model package by
name; it only loads entry points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from memfit.memory import TrainStep

ENTRY_POINT_GROUP = "memfit.systems"


@dataclass
class Scaling:
    """How a variant's memory grows with its token count (for the report's log-log plots)."""

    label: str  # what is counted, e.g. "query coordinates", "triplane tokens"
    sizes: list[int]
    make_step: Callable[[int], TrainStep]  # the step at that many tokens


@dataclass
class BudgetEntry:
    """One (system, variant) row of `memfit budget`: a paper-size training step and its budget."""

    variant: str  # e.g. "ff", "xattn", "attn", "causal", "window"
    step: TrainStep  # the paper-size step to estimate
    batch: int
    dtype: str  # "bf16" | "fp32" | "fp16"
    budget_gib: float | None  # None for a naive baseline
    is_baseline: bool = False
    config: str = ""  # one line describing the config, for the table
    # A real-size check that the estimator holds for this system: a small step that runs in seconds on CPU.
    calibration: TrainStep | None = None
    # The same variant at another batch size, with or without activation checkpointing (`memfit fit`).
    make_step: Callable[[int, bool], TrainStep] | None = None
    scaling: Scaling | None = None


@dataclass
class System:
    """A model package as the core sees it. train/eval take argv (None = sys.argv[1:])."""

    name: str
    summary: str
    train: Callable[[list[str] | None], object]
    eval: Callable[[list[str] | None], object]
    budgets: Callable[[], list[BudgetEntry]] = field(default=lambda: [])
    extra_commands: dict[str, Callable[[list[str] | None], object]] = field(default_factory=dict)


def available_systems() -> dict[str, object]:
    """Name -> entry point (not loaded) for every installed system."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_system(name: str) -> System:
    eps = available_systems()
    if name not in eps:
        choices = ", ".join(sorted(eps)) or "none installed"
        raise SystemExit(f"memfit: unknown system {name!r}; installed systems: {choices}")
    system = eps[name].load()
    if not isinstance(system, System):
        raise SystemExit(f"memfit: entry point {name!r} does not point at a memfit.system.System")
    return system
