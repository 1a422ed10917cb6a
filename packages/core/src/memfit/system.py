"""The registry that model packages plug into: how `train`, `eval` and `memfit budget` find systems.

A model package declares, in its pyproject::

    [project.entry-points."memfit.systems"]
    ginr-cifar = "ginr_cifar.system:SYSTEM"

and ``ginr_cifar/system.py`` defines ``SYSTEM = System(...)``. Core never imports a model package by
name; it only loads entry points (or systems ``register()``ed in-process, e.g. by a test).
See docs/adding-a-system.md for the checklist.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import ModelFileError, ModelFileMissing, UsageError, console, exit_at_once, first_line

if TYPE_CHECKING:  # torch and the estimator load on first use: `memfit systems` and `--help` stay fast
    from memfit.estimate.tracker import MemoryReport
    from memfit.step import TrainStep

ENTRY_POINT_GROUP = "memfit.systems"
SHIPPED = "shipped"  # `--run shipped`: the weights a system ships in its package


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

    def row(self, system: str, report: MemoryReport, digits: int | None = None) -> dict[str, Any]:
        """This entry's row for ``report`` (the estimate of ``step``), as `memfit budget --json` and
        memfit-report write it; GiB rounded to ``digits`` places when given (the fit uses the exact peak)."""

        def gib(x: float) -> float:
            return x if digits is None else round(x, digits)

        peak = report.peak_gib
        return {
            "system": system,
            "variant": self.variant,
            "config": self.config,
            "batch": self.batch,
            "dtype": self.dtype,
            "params": report.params,
            "estimated_gib": gib(peak),
            "budget_gib": None if self.is_baseline else self.budget_gib,
            "is_baseline": self.is_baseline,
            "fits": None if self.is_baseline or self.budget_gib is None else peak <= self.budget_gib,
            "by_category": {k: gib(v) for k, v in report.category_gib().items()},
        }


Command = Callable[[list[str] | None], object]


def _resolve(spec: Any) -> Any:
    """A command (or class), or its "package.module:name" imported on first use (`train --help` stays
    fast)."""
    if not isinstance(spec, str):
        return spec
    module, _, attr = spec.partition(":")
    return getattr(import_module(module), attr)


def parse_then_run(parse: Command | str, run: Callable[[Any], Any] | str) -> Command:
    """A command whose flags are read before its work is imported: ``parse(argv) -> args`` lives in a
    module that imports no torch (a system's ``flags.py``), ``run(args)`` in the one that does the work;
    each may be its "package.module:function" path. `--help` and a refused flag then answer in a fraction
    of a second instead of after torch's import (tests/test_cli_speed.py)."""

    def work() -> Callable[[Any], Any]:
        """The work's function, imported under exit_at_once: a Ctrl-C during torch's import is one line, as
        for every command's start-up."""
        with exit_at_once(os.path.basename(sys.argv[0]) or "memfit"):
            return _resolve(run)

    def command(argv: list[str] | None = None) -> object:
        args = _resolve(parse)(argv)  # --help and a refused flag end here, before the work is imported
        return work()(args)

    # both halves imported now (tests import every command before they patch torch)
    command.load = lambda: (_resolve(parse), work())  # type: ignore[attr-defined]
    return command


@dataclass
class System:
    """A model package as the core sees it. Commands (train, eval, extra ones) take argv (None =
    sys.argv[1:]); each is a function or its "package.module:function" path, imported when first run.

    config_cls and build_model(config) -> nn.Module (each may be its "package.module:name") are what
    ``load_model`` needs to rebuild a trained model from any checkpoint of the system (checkpoint["config"]
    holds the config as a dict). ``shipped``: the folder (`memfit export` format) of weights the package
    ships; they are the model wherever no run is named, and `--run shipped` names them.
    """

    name: str
    summary: str
    train: Command | str
    eval: Command | str
    budgets: Callable[[], list[BudgetEntry]] = field(default=lambda: [])
    extra_commands: dict[str, Command | str] = field(default_factory=dict)
    config_cls: type | str | None = None
    build_model: Callable[[Any], Any] | str | None = None
    shipped: str | Path | None = None
    tags: tuple[str, ...] = ()  # the model card's tags beside memfit's and the system's name (task, domain)

    def run_dir(self, run: str | Path | None = None, runs_dir: str | Path = "runs") -> Path:
        """The model a `--run` names: None -> the shipped weights, else runs_dir/<system>/run; "shipped" ->
        the shipped weights; an existing path as it is; a name -> runs_dir/<system>/<name>."""
        from memfit.train.run_dir import resolve_run

        if self.shipped is not None and (run is None or str(run) == SHIPPED):
            return Path(self.shipped)
        if str(run) == SHIPPED:
            raise ModelFileMissing(
                f"error: {self.name} ships no weights; pass --run RUN_NAME or a run folder"
            )
        return resolve_run(run, self.name, runs_dir)

    def is_shipped(self, path: str | Path) -> bool:
        """Whether `path` is the folder of the weights this system ships."""
        return self.shipped is not None and Path(path).resolve() == Path(self.shipped).resolve()

    def _builders(self) -> tuple[type, Callable[[Any], Any]]:
        if self.config_cls is None or self.build_model is None:
            raise TypeError(f"system {self.name} registers no config_cls/build_model; it cannot load models")
        return _resolve(self.config_cls), _resolve(self.build_model)

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
        replace config fields (e.g. pcs=True); run None: the shipped weights where the system has them.
        Another system's checkpoint, an old-format one or weights that do not fit: ModelFileError (a
        ValueError); no such run or checkpoint: ModelFileMissing (a FileNotFoundError); each one line.
        The dict has "settings" (how the model was trained, None where unknown) for exports too."""
        from memfit.train.checkpoint import (
            WeightsMismatch,
            checkpoint_candidates,
            load_intact,
            nonfinite_parameter,
        )
        from memfit.train.config import from_dict, with_overrides
        from memfit.train.export import is_export, load_export

        config_cls, build_model = self._builders()
        path = self.run_dir(run, runs_dir)
        if is_export(path):
            return load_export(self, path, device, **overrides)
        if path.is_dir():  # best.pt (for which="best"), then the checkpoints newest first: as --resume does
            candidates = checkpoint_candidates(path, which)
            if not candidates:
                raise ModelFileMissing(
                    f"error: no checkpoint in {path}; train first (`memfit train {self.name}`)"
                )
        else:
            candidates = [path]

        def build(state: dict[str, Any], file: Path) -> Any:
            if state.get("system") != self.name:  # UsageError, not ValueError: load_intact lets it through
                raise UsageError(
                    f"error: {file} is a {state.get('system')} checkpoint, not {self.name}; "
                    f"pass a {self.name} run (or use `memfit eval {state.get('system')}`)"
                )
            try:
                cfg = from_dict(config_cls, state["config"])
                model = build_model(with_overrides(cfg, overrides))
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
        except UsageError as e:  # build's refusals: another system's checkpoint, a config that builds nothing
            raise ModelFileError(str(e)) from None
        except FileNotFoundError as e:
            raise ModelFileMissing(f"error: {e}") from None
        except ValueError as e:
            raise ModelFileError(f"error: {path}: {e}" if path.is_dir() else f"error: {e}") from None
        for bad, why in skipped:
            why = why.split(": ", 1)[-1]
            print(f"[memfit] skipped {bad.name} ({why}); using {found.name}", file=sys.stderr)
        state["path"] = str(found)  # which file was loaded, for eval reports
        return model.to(device).eval(), state

    def from_pretrained(self, path: str | Path | None = None, device: str | Any = "cpu", **overrides: Any):
        """The model, in eval mode on `device`, from a folder `memfit export` wrote (None or "shipped": the
        weights the package ships): safetensors and json alone, no pickle and no trainer. Errors are one
        line: FileNotFoundError for a missing folder, ValueError for one that is not this system's export
        (both memfit.errors.UsageError too, so a command prints just the line)."""
        from memfit.train.export import CONFIG, WEIGHTS, is_export, load_export

        self._builders()
        if path is None or str(path) == SHIPPED:
            path = self.run_dir(path)
        if not Path(path).exists():
            raise ModelFileMissing(f"error: {path} does not exist; pass a folder that `memfit export` wrote")
        if not is_export(path):
            raise ModelFileError(
                f"error: {path} is not an exported model (no {WEIGHTS} and {CONFIG}); run memfit export"
            )
        return load_export(self, path, device, **overrides)[0]

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


def lazy_exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that imports each public name from its module on first use:
    ``names`` maps a name to the submodule defining it (a name that is the submodule itself, e.g. a
    callable module, maps to itself). A system's package then imports no torch until a model is used, so
    `memfit systems` and `--help`, which load the package, stay fast."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = import_module(f"{package}.{names[name]}")
        return module if names[name] == name else getattr(module, name)

    return __getattr__


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
