"""The registry that model packages plug into: how `train`, `eval` and `memfit budget` find systems.

A model package declares, in its pyproject::

    [project.entry-points."memfit.systems"]
    ginr-cifar = "ginr_cifar.system:SYSTEM"

and ``ginr_cifar/system.py`` defines ``SYSTEM = System(...)``. Core never imports a model package by
name; it only loads entry points (or systems ``register()``ed in-process, e.g. by a test).
See docs/adding-a-system.md for the checklist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from memfit.errors import UsageError, console, first_line
from memfit.estimate.memory import TrainStep
from memfit.train.checkpoint import WeightsMismatch, checkpoint_candidates, load_intact, nonfinite_parameter
from memfit.train.config import from_dict, with_overrides
from memfit.train.export import CONFIG, WEIGHTS, is_export, load_export
from memfit.train.run_dir import resolve_run

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


Command = Callable[[list[str] | None], object]


def _resolve(spec: Command | str) -> Command:
    """A command, or "package.module:function" imported on first use (`train --help` stays fast)."""
    if not isinstance(spec, str):
        return spec
    module, _, attr = spec.partition(":")
    return getattr(import_module(module), attr)


@dataclass
class System:
    """A model package as the core sees it. Commands (train, eval, extra ones) take argv (None =
    sys.argv[1:]); each is a function or its "package.module:function" path, imported when first run.

    config_cls and build_model(config) -> nn.Module are what ``load_model`` needs to rebuild a trained
    model from any checkpoint of the system (checkpoint["config"] holds the config as a dict).
    """

    name: str
    summary: str
    train: Command | str
    eval: Command | str
    budgets: Callable[[], list[BudgetEntry]] = field(default=lambda: [])
    extra_commands: dict[str, Command | str] = field(default_factory=dict)
    config_cls: type | None = None
    build_model: Callable[[Any], Any] | None = None

    def run_dir(self, run: str | Path | None = None, runs_dir: str | Path = "runs") -> Path:
        """A run given by name or path: None -> runs_dir/<system>/run; a name -> runs_dir/<system>/<name>."""
        return resolve_run(run, self.name, runs_dir)

    def load_model(
        self,
        run: str | Path | None = None,
        device: str | Any = "cpu",
        which: str = "best",
        runs_dir: str | Path = "runs",
        **overrides: Any,
    ) -> tuple[Any, dict[str, Any]]:
        """(model in eval mode on device, checkpoint with its "path") from a run (name or folder: best.pt,
        else the newest checkpoint), a checkpoint file or an exported folder (from_pretrained); overrides
        replace config fields (e.g. pcs=True). Another system's checkpoint, an old-format one or weights
        that do not fit: UsageError."""
        if self.config_cls is None or self.build_model is None:
            raise TypeError(f"system {self.name} registers no config_cls/build_model; it cannot load models")
        path = self.run_dir(run, runs_dir)
        if is_export(path):
            return self.from_pretrained(path, device, **overrides)
        if path.is_dir():  # best.pt (for which="best"), then the checkpoints newest first: as --resume does
            candidates = checkpoint_candidates(path, which)
            if not candidates:
                raise UsageError(f"error: no checkpoint in {path}; train first (`{self.name} train`)")
        else:
            candidates = [path]

        def build(state: dict[str, Any], file: Path) -> Any:
            if state.get("system") != self.name:
                raise UsageError(
                    f"error: {file} is a {state.get('system')} checkpoint, not {self.name}; "
                    f"pass a {self.name} run (or use `{state.get('system')} eval`)"
                )
            try:
                cfg = from_dict(self.config_cls, state["config"])
                model = self.build_model(with_overrides(cfg, overrides))
            except (TypeError, ValueError) as e:
                why = first_line(e)
                raise UsageError(f"error: {file}: its config does not build a model ({why})") from None
            try:  # a run's weight average if it kept one
                model.load_state_dict(state.get("ema_model") or state["model"])
            except (RuntimeError, ValueError, KeyError) as e:
                raise WeightsMismatch(f"{file}: its weights do not fit its config ({first_line(e)})") from e
            if bad := nonfinite_parameter(model):  # eval would score garbage, enhance write it
                raise ValueError(f"{file}: its weights are not finite ({bad}); the run diverged or the "
                                 "file is damaged")  # fmt: skip
            return model, state

        try:
            (model, state), found, skipped = load_intact(candidates, build)
        except FileNotFoundError as e:
            raise UsageError(f"error: {e}") from None
        except ValueError as e:
            raise UsageError(f"error: {path}: {e}" if path.is_dir() else f"error: {e}") from None
        for bad, why in skipped:
            why = why.split(": ", 1)[-1]
            print(f"[memfit] skipped {bad.name} ({why}); using {found.name}", file=sys.stderr)
        state["path"] = str(found)  # which file was loaded, for eval reports
        return model.to(device).eval(), state

    def from_pretrained(self, path: str | Path, device: str | Any = "cpu", **overrides: Any):
        """(model in eval mode, its config.json as a dict with "path") from a folder `memfit export` wrote:
        safetensors and json alone, no pickle and no trainer."""
        if self.config_cls is None or self.build_model is None:
            raise TypeError(f"system {self.name} registers no config_cls/build_model; it cannot load models")
        if not is_export(path):
            raise UsageError(
                f"error: {path} is not an exported model (no {WEIGHTS} and {CONFIG}); run memfit export"
            )
        return load_export(self, path, device, **overrides)

    def entry(self, kind: str) -> Command:
        """The function of `train`, `eval` or an extra command (imported now if given as a path)."""
        commands = {"train": self.train, "eval": self.eval, **self.extra_commands}
        if kind not in commands:
            raise KeyError(f"{self.name} has no command {kind!r}; it has {', '.join(commands)}")
        return _resolve(commands[kind])

    def command(self, kind: str) -> Callable[..., int]:
        """The console entry point of `train`, `eval` or an extra command (the package's aliases such as
        `mbsnet-train`): exit status 0 on success, 2 with one line on bad input, 130/143 on a signal."""

        def run(argv: list[str] | None = None) -> object:
            return self.entry(kind)(argv)

        run.__name__ = f"{self.name}_{kind}".replace("-", "_")
        return console(run)


_REGISTERED: dict[str, System] = {}


def register(system: System) -> System:
    """Make a System known in this process without an installed package (tests, notebooks, scripts)."""
    if not isinstance(system, System):
        raise TypeError(f"register expects a memfit.system.System, got {type(system).__name__}")
    _REGISTERED[system.name] = system
    return system


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


def available_systems() -> dict[str, object]:
    """Name -> entry point (not loaded) for every installed system, plus the ones register()ed."""
    found: dict[str, object] = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update(_REGISTERED)
    return found


def load_system(name: str) -> System:
    if name in _REGISTERED:
        return _REGISTERED[name]
    eps = available_systems()
    if name not in eps:
        choices = ", ".join(sorted(eps)) or "none installed"
        raise UsageError(f"error: unknown system {name!r}; installed systems: {choices}")
    system = eps[name].load()
    if not isinstance(system, System):
        raise UsageError(f"error: entry point {name!r} does not point at a memfit.system.System")
    return system
