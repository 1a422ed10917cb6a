"""One settings tree per system: its model config, its training recipe and memfit's loop settings.

A system's `train` runs on a ``Settings(model, train, loop)``: three frozen dataclasses. The tree is built
once per run, each layer overriding the one before, and never changed after:

    the preset (``--config NAME``; a function of the device, since CPU recipes differ from GPU ones)
    <- ``--config FILE`` (a run's ``config.json``; on ``--resume``, the run's own)
    <- the command-line flags

Every flag is bound to one path in the tree (``--lr`` -> ``train.lr``), so ``--help`` can show each
flag's value in every preset, a run folder's ``config.json`` holds everything that made the run, and an
unknown key in a file or an unknown flag is one line and exit status 2. A system declares its presets and
flags with ``TrainParser``; ``TrainParser.parse(argv)`` returns a ``TrainRun`` with the finished tree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from memfit.errors import UsageError, os_error_message
from memfit.train.config import DECAY, STEPS, check_config
from memfit.train.flags import EXPORTED, BooleanFlag, Parser

CONFIG_NAME = "config.json"  # the settings a run was started with, in its run folder
SETTINGS_FORMAT = 1
RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# A run with a step count warms up over at most this share of it (memfit.train.loop.WarmupCosine)
WARMUP_MAX_FRACTION = 0.1


@dataclass(frozen=True)
class LoopConfig:
    """The loop's own settings (model and data settings belong to each system's part of the tree)."""

    steps: int | None = 1000  # optimizer steps; None: until the --max_minutes budget is spent
    grad_accum: int = 1
    amp: str = "bf16"  # "bf16" | "fp16" | "none"
    grad_clip: float = 1.0  # max gradient norm; 0: off
    compile: bool = False
    log_every: int = 10
    save_every: int = 200  # 0: only at the end
    keep_last: int = 3
    seed: int = 0
    runs_dir: str = "runs"
    run_name: str = "run"  # the run folder is runs_dir/<system>/run_name
    tensorboard: bool = False  # TensorBoard event files beside metrics.jsonl (the optional extra)
    progress: bool = True
    device: str = "auto"
    threads: int | None = None  # torch CPU threads; None: torch's own choice
    # On CPU, tracking every allocation costs time, so the peak is measured over the first steps (the
    # steady state is reached at step 2, once optimizer state exists). On CUDA the whole run is covered.
    measure_memory_steps: int = 3
    # The run's total wall-clock budget in minutes, summed over every resume: the loop stops cleanly
    # (checkpoint saved) once it is spent, and the LR schedule reaches its floor there.
    max_minutes: float | None = None
    # Exponential moving average of the weights (decay per step, warmed up as min(ema, (1 + n) / (10 + n))
    # after n steps; 0: off). Validation scores the average, best.pt and every checkpoint carry it.
    ema: float = 0.0
    # Estimate the step's memory before the first step and refuse a run that will not fit
    # (memfit.estimate.preflight)
    preflight: bool = True
    # every number with both ends (memfit.train.config.check_config): refused at parse time in one line
    RANGES: ClassVar[dict[str, str]] = {
        "seed": "0..2**63-1",  # torch.manual_seed's range
        "steps": "[1, 2**53]",  # 0 would train nothing and save the untrained weights as a run
        "log_every": "[1, 2**53]",
        "save_every": STEPS,
        "grad_accum": "[1, 2**20]",
        "keep_last": "[1, 2**20]",
        "grad_clip": "[0, 1e6]",
        "threads": "[1, 2**16]",
        "measure_memory_steps": "[0, 2**20]",
        "max_minutes": "(0, 1e7]",  # about 19 years
        "ema": DECAY,
    }

    def __post_init__(self) -> None:
        if isinstance(self.ema, (int, float)) and not 0 <= self.ema < 1:  # NaN too; the line says what it is
            raise ValueError(f"ema must be in [0, 1) (a decay per step, e.g. 0.995; 0 = off), got {self.ema}")
        check_config(self)
        if self.steps is None and self.max_minutes is None:
            raise ValueError("steps must be given unless max_minutes is (a run needs an end)")
        if self.amp not in ("bf16", "fp16", "none"):
            raise ValueError(f"amp must be one of bf16, fp16, none; got {self.amp!r}")
        check_run_name(self.run_name)

    def run_dir(self, system: str | None) -> Path:
        return Path(self.runs_dir) / (system or "default") / self.run_name


def check_run_name(name: str) -> None:
    """A run name is one path component of letters, digits, '-', '_' and '.', so a run folder always
    stays inside runs_dir/<system>/ (not '', '.', '..', 'a/b' or an absolute path), and not 'shipped' or
    'exported' (the names eval gives the results of a package's own weights and of exported models)."""
    if not isinstance(name, str) or not RUN_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"run_name must be one folder name of letters, digits, '-', '_' and '.', got {name!r} "
            "(runs live in runs_dir/<system>/<run_name>; use --runs_dir to put them elsewhere)"
        )
    if name == "shipped":  # `--run shipped` names a package's own weights, never a run folder
        raise ValueError(
            "run_name 'shipped' is kept for a package's own weights (`--run shipped`); choose another"
        )
    if name == EXPORTED:  # runs_dir/<system>/exported/ holds the eval results of exported models
        raise ValueError(
            f"run_name {EXPORTED!r} is kept for the eval results of exported models "
            f"(runs_dir/<system>/{EXPORTED}/); choose another"
        )


def note_warmup(tree: Any, flags: Mapping[str, Any], flag: str = "--warmup") -> str | None:
    """A warmup given on the command line longer than the run: the schedule warms up over at most a tenth
    of the steps (memfit.train.loop.WarmupCosine, as --help says), so the run is computable and keeps its
    documented rule, but the user hears that their number is not the one used (a note, not a refusal: a
    short test run of a long recipe is common). Returns the note it printed."""
    warmup = getattr(tree.train, "warmup", None) if "train.warmup" in flags else None
    steps = tree.loop.steps
    if warmup is None or steps is None or warmup <= steps:
        return None
    used = min(warmup, int(steps * WARMUP_MAX_FRACTION))
    note = f"[memfit] {flag} {warmup} is longer than the run (--steps {steps}): warming up over {used} steps"
    print(note, file=sys.stderr)
    return note


@dataclass(frozen=True)
class Settings:
    """Everything one `train` run is configured by: the model config, the system's training recipe
    (data, optimizer, schedule, validation) and the loop."""

    model: Any
    train: Any
    loop: LoopConfig


Preset = Callable[[Any], Settings]  # device (torch.device) -> Settings


# ----------------------------------------------------------------------------------------------------
# The tree as dicts: config.json, checkpoints, overrides by dotted path
# ----------------------------------------------------------------------------------------------------


class SettingError(ValueError):
    """A bad key or value at a dotted path of the tree; `problem` follows the name of whatever set it
    (a flag, or the path in a file): "must be > 0, got 0", "is not a setting (...)"."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.path, self.problem = path, problem


def _unknown(path: str, template: Any) -> SettingError:
    names = ", ".join(f.name for f in fields(template))
    return SettingError(path, f"is not a setting (here: {names})")


def tree_dict(obj: Any) -> dict[str, Any]:
    """A settings dataclass (nested) -> a JSON-able dict."""
    return json.loads(json.dumps(asdict(obj)))


def get_path(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = getattr(tree, part)
    return tree


def flatten(d: Mapping[str, Any], template: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}, descending only where the template has a dataclass."""
    out: dict[str, Any] = {}
    names = {f.name for f in fields(template)} if is_dataclass(template) else set()
    for key, value in d.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise _unknown(path, template)
        sub = getattr(template, key)
        if is_dataclass(sub) and isinstance(value, Mapping):
            out.update(flatten(value, sub, path + "."))
        else:
            out[path] = value
    return out


def _hint_ok(value: Any, hint: Any) -> bool:
    """Whether a value read from a file fits a field's annotation (simple types; others pass)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_hint_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (tuple, list) or hint in (tuple, list):
        return isinstance(value, (tuple, list))
    return True


def _coerce(value: Any, hint: Any) -> Any:
    """JSON lists back to tuples where the field is a tuple; ints to floats where it is a float."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if isinstance(value, list) and any(typing.get_origin(h) is tuple or h is tuple for h in options):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool) and float in options and int not in options:
        return float(value)
    return value


def override(tree: Any, changes: Mapping[str, Any], prefix: str = "") -> Any:
    """A copy of a (nested, frozen) dataclass with the fields at dotted paths replaced; each dataclass's
    __post_init__ validates the result. Raises SettingError naming the path."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    names = {f.name for f in fields(tree)}
    hints = typing.get_type_hints(type(tree))
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if head not in names:
            raise _unknown(prefix + head, tree)
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            if is_dataclass(getattr(tree, head)) and isinstance(value, Mapping):
                nested.setdefault(head, {}).update(value)
                continue
            if not _hint_ok(value, hints.get(head, Any)):
                hint = hints.get(head)
                kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
                raise SettingError(prefix + head, f"must be {kind}, got {value!r}")
            direct[head] = _coerce(value, hints.get(head, Any))
    for head, sub in nested.items():
        current = getattr(tree, head)
        if not is_dataclass(current):
            raise SettingError(prefix + head, "is a value, not a group of settings")
        direct[head] = override(current, sub, prefix + head + ".")
    try:
        new = replace(tree, **direct)
        check_config(new)  # the declared ranges and finite numbers: every flag and file key passes here
        return new
    except (ValueError, TypeError) as e:
        if isinstance(e, SettingError):
            raise
        # __post_init__ messages start with the field they are about ("lr must be > 0, got 0")
        text = str(e)
        field = next((n for n in sorted(names, key=len, reverse=True) if text.startswith(n + " ")), None)
        if field is None:
            raise SettingError(prefix.rstrip(".") or "settings", f"are not valid: {text}") from None
        raise SettingError(prefix + field, text[len(field) + 1 :]) from None


def _budget_alone(flags: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The flags with the step count cleared where a time budget is given without one (from the flags or
    the config file): such a run trains until the budget."""
    if "loop.max_minutes" in flags and "loop.steps" not in flags and "loop.steps" not in given:
        return {**flags, "loop.steps": None}
    return flags


def write_run_config(
    run_dir: Path, system: str | None, preset: str | None, model: Any, settings: Settings
) -> Path:
    """run_dir/config.json: what `--config FILE` reads back ({format, system, preset, config, train,
    loop}; "config" is the model config exactly as checkpoints store it)."""
    from memfit.train.checkpoint import write_text_atomic
    from memfit.train.config import config_dict

    doc = {
        "format": SETTINGS_FORMAT,
        "system": system,
        "preset": preset,
        "config": config_dict(model),
        "train": tree_dict(settings.train),
        "loop": tree_dict(settings.loop),
    }
    return write_text_atomic(run_dir / CONFIG_NAME, json.dumps(doc, indent=2) + "\n")


def read_config_file(path: str | Path, system: str) -> dict[str, Any]:
    """A run's (or an exported model's) config.json as {"preset", "model", "train", "loop"} sections;
    one-line errors for a missing, unreadable or foreign file."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_NAME
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"error: --config {path}: no such file; give a preset name or a run's config.json"
        ) from None
    except OSError as e:
        raise UsageError(f"error: --config: {os_error_message(e)}") from None
    except ValueError as e:
        raise UsageError(f"error: --config {path}: not valid JSON ({e}); give a run's config.json") from None
    except RecursionError:
        raise UsageError(f"error: --config {path}: JSON nested too deeply to be a config; give a run's "
                         "config.json") from None  # fmt: skip
    if not isinstance(doc, dict):
        raise UsageError(f"error: --config {path}: expected a JSON object (a run's config.json)")
    if doc.get("system") not in (None, system):
        raise UsageError(
            f"error: --config {path} holds {doc['system']} settings, not {system}; use "
            f"`memfit train {doc['system']}`"
        )
    unknown = sorted(set(doc) - {"format", "system", "preset", "config", "train", "loop", "meta"})
    if unknown:
        raise UsageError(
            f"error: --config {path}: unknown key {unknown[0]!r}; the keys are config, train, loop"
        )
    return {"preset": doc.get("preset"), "model": doc.get("config") or {}, "train": doc.get("train") or {},
            "loop": doc.get("loop") or {}}  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainRun:
    """What `TrainParser.parse` gives a system's train: the finished tree, the device (resolved once, here)
    and how to open the run. ``Trainer(model, optimizer, loss_fn, get_batch, run)`` takes it whole."""

    settings: Settings | None  # None: a loop without a system's settings tree (``TrainRun.of``)
    preset: str | None
    device: Any  # torch.device
    resume: bool
    overwrite: bool
    given: frozenset[str]  # the paths set by a file or a flag (not by the preset)
    system: str | None = None  # the registered system name, saved in checkpoints and checked on resume
    loop_config: LoopConfig | None = None  # only with settings None
    flags: frozenset[str] = frozenset()  # the paths set by a flag on this command line (not by a file)
    # a system's own flags that are not settings (ginr's --profile, --cache_dir): {dest: value}
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def loop(self) -> LoopConfig:
        return self.settings.loop if self.settings is not None else self.loop_config

    @classmethod
    def of(cls, loop: LoopConfig, system: str | None = None, resume: bool = False, overwrite: bool = False):
        """A run of ``loop`` alone (scripts, tests): its device resolved from ``loop.device``, no settings
        tree (no config.json)."""
        from memfit.train.distributed import resolve_device

        return cls(None, None, resolve_device(loop.device), resume, overwrite, frozenset(), system, loop)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return " ".join(_fmt(v) for v in value)
    return "none" if value is None else str(value)


def _from_annotation(hint: Any, flag: str) -> dict[str, Any]:
    """argparse keywords for a field's annotation: bool -> --x/--no_x (flags.BooleanFlag), int/float ->
    type, str (or X | None of these) -> as given, Literal -> choices. Other types need the flag's own
    `type`."""
    options = [h for h in typing.get_args(hint) if h is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(options) == 1:
        hint = options[0]
    if hint is bool:
        return {"action": BooleanFlag}
    if hint in (int, float):
        return {"type": hint}
    if hint is str:
        return {}
    if typing.get_origin(hint) is typing.Literal:
        return {"choices": list(typing.get_args(hint))}
    raise TypeError(f"flag {flag}: its field's type {hint} has no flag form; give type=")


@dataclass(frozen=True)
class HelpDevice:
    """What presets are shown for in --help when torch is not loaded (it takes seconds to import): a
    stand-in for torch.device with its `type`, all a preset reads."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type


def help_device() -> Any:
    """The device whose presets --help shows: torch's own answer when torch is loaded already, else cuda
    where an NVIDIA driver is present and CUDA_VISIBLE_DEVICES hides no GPU from us (a guess that only
    --help's defaults rest on; a run resolves its device with torch)."""
    import os

    if "torch" in sys.modules:
        from memfit.train.distributed import resolve_device

        return resolve_device("auto")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    gpu = Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir())
    return HelpDevice("cuda" if gpu and not hidden else "cpu")


class TrainParser:
    """The `train` command line of one system: its presets, and flags each bound to a settings path.

        p = TrainParser("mbsnet-speech", __doc__, SETTINGS, auto=("default", "cpu"))
        g = p.group("model")
        p.flag(g, "--layers", path="model.num_layers", type=int, help="encoder layers")
        run = p.parse(argv)          # -> TrainRun(settings, preset, device, resume, overwrite, given)

    The loop's flags (--steps, --amp, --run_name, --max_minutes, ...) are added for every system.
    """

    def __init__(
        self,
        system: str,
        description: str,
        presets: Mapping[str, Preset | Settings],
        *,
        auto: tuple[str, str] | None = None,
        default: str | None = None,
    ) -> None:
        """auto: the presets `--config auto` picks (on a GPU, on a CPU); without it, `default` (else the
        first preset) is the default."""
        self.system = system
        self.presets = {k: (v if callable(v) else (lambda _d, s=v: s)) for k, v in presets.items()}
        self.auto = auto
        self.default = "auto" if auto else (default or next(iter(presets)))
        self.parser = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.paths: dict[str, str] = {}  # argparse dest -> settings path
        self.expand: set[str] = set()  # dests whose value is a {field: value} dict under the path
        self.files: dict[str, tuple[str, ...]] = {}  # dests naming a file or folder -> their non-path words
        self.flag_names: dict[str, str] = {}  # settings path -> the flag's name (for messages)
        self.dest_flags: dict[str, str] = {}  # argparse dest -> the flag's name (for messages)
        self.given_names: dict[str, str] = {}  # settings path -> the spelling typed on this command line
        self._help_presets: dict[str, Settings] | None = None
        g = self.group("run (memfit)")
        choices = ", ".join(["auto", *presets] if auto else presets)
        g.add_argument(
            "--config",
            default=self.default,
            metavar="PRESET|FILE",
            help=f"a preset ({choices}; default {self.default}) or a run's config.json, whose settings the "
            "flags then override; on --resume the run's own config.json is the default",
        )
        g.add_argument(
            "--resume",
            action="store_true",
            help="continue the run in the run folder (a --run_name that holds no run is refused, naming "
            "those that do; without --run_name, a run not started yet starts)",
        )
        g.add_argument(
            "--overwrite",
            action="store_true",
            help="start again in a folder that holds a run (the old one moves to <run_name>.old-<time>/)",
        )
        self._loop_added = False

    def _absolute(self, dest: str, value: Any) -> Any:
        """A file flag's value as an absolute path (``~`` expanded); its words (``synthetic``), None and
        "" as they are."""
        if not isinstance(value, str) or not value or value in self.files[dest]:
            return value
        return os.path.abspath(os.path.expanduser(value))

    # -- declaring flags ---------------------------------------------------------------------------
    def group(self, title: str) -> argparse._ArgumentGroup:
        return self.parser.add_argument_group(title)

    def flag(
        self,
        group: argparse._ArgumentGroup,
        *names: str,
        path: str,
        help: str = "",
        hidden: tuple[str, ...] = (),
        expand: bool = False,
        show_default: bool = True,
        file: bool | tuple[str, ...] = False,
        **kwargs: Any,
    ) -> None:
        """A flag that sets the settings at `path`; `hidden` are old spellings (accepted, not shown);
        with expand the flag's value is a dict of fields under `path` (e.g. --loss mag=0.9). Without a
        `type`, `action` or `choices`, the field's annotation gives them (`_from_annotation`). `file`: the
        value is a file or folder, stored absolute (``~`` expanded) so that config.json and the
        checkpoints name the same data from any working directory (an eval or a --resume started
        elsewhere); a tuple names the values that are words, not paths (``("synthetic",)``)."""
        dest = kwargs.pop("dest", names[0].lstrip("-").replace("-", "_"))
        if not {"type", "action", "choices"} & kwargs.keys():
            kwargs.update(_from_annotation(self._field_hint(path), f"{names[0]} ({path})"))
        text = help + (f" ({self._defaults_text(path)})" if show_default else "")
        group.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=text, **kwargs)
        for old in hidden:
            group.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.paths[dest] = path
        self.dest_flags[dest] = names[0]
        if file is not False:
            self.files[dest] = () if file is True else tuple(file)
        if expand:
            self.expand.add(dest)
        self.flag_names.setdefault(path, names[0])

    def optimizer_flags(
        self, group: argparse._ArgumentGroup, warmup: str = "linear warmup steps before the cosine decay"
    ) -> None:
        """--lr, --weight_decay and --warmup (help text `warmup`), bound to train.lr, train.weight_decay and
        train.warmup: the AdamW + WarmupCosine recipe's three numbers, spelt the same in every system."""
        self.flag(group, "--lr", path="train.lr", help="peak learning rate")
        self.flag(group, "--weight_decay", path="train.weight_decay", help="AdamW weight decay")
        self.flag(group, "--warmup", path="train.warmup", help=warmup)

    def _loop_flags(self) -> None:
        g = self.group("training loop (memfit)")
        f = self.flag
        f(g, "--steps", path="loop.steps", help="optimizer steps (none with --max_minutes: until it)")
        f(
            g,
            "--max_minutes",
            path="loop.max_minutes",
            help="the run's total time budget: stop cleanly when spent (checkpoint saved); on --resume, the "
            "minutes already trained count against it; alone, it trains until the budget",
        )
        f(g, "--grad_accum", path="loop.grad_accum", help="micro-batches per optimizer step")
        f(g, "--amp", path="loop.amp", choices=["bf16", "fp16", "none"], help="autocast dtype")
        f(g, "--grad_clip", path="loop.grad_clip", help="max gradient norm (0 = off)")
        f(g, "--compile", path="loop.compile", help="torch.compile")
        f(g, "--log_every", path="loop.log_every", help="steps between metrics rows")
        f(g, "--save_every", path="loop.save_every", help="steps between checkpoints (0 = at the end)")
        f(g, "--keep_last", path="loop.keep_last", help="checkpoints to keep")
        f(g, "--seed", path="loop.seed", help="random seed (weights, batches)")
        f(g, "--run_name", path="loop.run_name", help="run folder name, under runs_dir/<system>/")
        f(g, "--runs_dir", path="loop.runs_dir", help="where run folders live")
        f(g, "--device", path="loop.device", help="auto | cpu | cuda | cuda:N")
        f(
            g,
            "--threads",
            path="loop.threads",
            help="CPU threads of every pool (torch, BLAS); at most the CPU count (none: torch's choice)",
        )
        f(
            g,
            "--ema",
            path="loop.ema",
            help="decay of a moving average of the weights that validation, best.pt and eval use (0 = off)",
        )
        f(
            g,
            "--tensorboard",
            path="loop.tensorboard",
            help="TensorBoard events beside metrics.jsonl (needs the `tensorboard` extra)",
        )
        f(g, "--progress", path="loop.progress", help="progress bar")
        f(
            g,
            "--no_preflight",
            path="loop.preflight",
            action="store_false",
            show_default=False,
            help="skip the memory pre-flight (the step's peak estimated before the first step; a run "
            "that will not fit the device is refused, naming the batch that fits)",
        )

    def _preset_trees(self) -> dict[str, Settings]:
        """Every preset's tree on this machine's device (built once: --help's defaults, flag types)."""
        if self._help_presets is None:
            device = help_device()
            self._help_presets = {name: fn(device) for name, fn in self.presets.items()}
        return self._help_presets

    def _field_hint(self, path: str) -> Any:
        """The annotation of the field at a dotted settings path ('train.lr' -> float)."""
        *parents, name = path.split(".")
        owner = next(iter(self._preset_trees().values()))
        for part in parents:
            owner = getattr(owner, part)
        return typing.get_type_hints(type(owner))[name]

    def _defaults_text(self, path: str) -> str:
        """'default 0.003' or 'default: cpu 0.003, default 0.0005': the value in every preset."""
        values: dict[str, list[str]] = {}
        for name, s in self._preset_trees().items():
            values.setdefault(_fmt(get_path(s, path)), []).append(name)
        common = max(values, key=lambda v: len(values[v]))
        others = "".join(f"; --config {', '.join(names)}: {v}" for v, names in values.items() if v != common)
        return f"default {common}{others}"

    # -- building the tree -------------------------------------------------------------------------
    def _auto_preset(self, device: Any) -> str:
        """The preset `--config auto` picks on `device` (the GPU one on CUDA)."""
        return (self.auto[0] if device.type == "cuda" else self.auto[1]) if self.auto else self.default

    def _preset_loop(self, config: str, flags: dict[str, Any]) -> LoopConfig:
        """The loop settings of the preset `--config` names (auto: the one it picks on the device the flags
        name), for --resume to find the run it continues (a preset may name its own run folder)."""
        from memfit.train.distributed import resolve_device

        device = resolve_device(flags.get("loop.device", "auto"))
        preset = self._auto_preset(device) if config == "auto" else config
        return self.presets[preset](device).loop if preset in self.presets else LoopConfig()

    def _named(self, path: str, source: str) -> str:
        """The flag that sets `path` ('--loss mag' for train.loss.mag), or 'path in FILE'."""
        if source != "flags":
            return f"{path} in {source}"
        head, rest = path, ""
        while head not in self.flag_names and "." in head:
            head, _, last = head.rpartition(".")
            rest = f"{last} {rest}".strip()
        name = self.given_names.get(head) or self.flag_names.get(head, head)
        return f"{name} {rest}".strip()

    def _apply(self, tree: Settings, changes: dict[str, Any], source: str) -> Settings:
        try:
            return override(tree, changes)
        except SettingError as e:
            raise UsageError(f"error: {self._named(e.path, source)} {e.problem}") from None

    def _refuse_before_torch(self, config: str, flags: dict[str, Any]) -> None:
        """Flags that every tree the run could start from refuses (`--lr 0`) are refused before torch is
        imported (about 2 s): the line comes in a tenth of the time. Only where the tree is a preset (no
        config file), and only when every preset it can be, on either kind of device, refuses the flags
        with one and the same line: the one the full parse would print."""
        if config == "auto":
            names = set(self.auto) if self.auto else {self.default}
        elif config in self.presets:
            names = {config}
        else:
            return
        lines = set()
        for name in sorted(names):
            for kind in ("cpu", "cuda"):
                try:
                    self._apply(self.presets[name](HelpDevice(kind)), _budget_alone(flags, set()), "flags")
                    return
                except UsageError as e:
                    lines.add(str(e))
        if len(lines) == 1:
            raise UsageError(lines.pop())

    def parse(self, argv: list[str] | None = None) -> TrainRun:
        """The run's settings: preset <- file <- flags (one line, exit 2, for anything bad). Also caps the
        thread pools at loop.threads, so data preparation runs on the same threads as training."""
        if not self._loop_added:  # last, so --help lists a system's own flags first
            self._loop_flags()
            self._loop_added = True
        args = self.parser.parse_args(argv)  # --help ends here, before torch is imported
        set_by: dict[str, list[str]] = {}  # path -> the flags that set it (default SUPPRESS: given ones only)
        for dest, path in self.paths.items():
            if hasattr(args, dest):
                set_by.setdefault(path, []).append(self.dest_flags[dest])
        for path, names in set_by.items():
            if len(names) > 1:  # two spellings of one setting (--steps and the seed's --num_iterations)
                raise UsageError(f"error: {' and '.join(names)} both set {path}; give one of them")
        self.given_names = {path: names[0] for path, names in set_by.items()}
        flags: dict[str, Any] = {}
        for dest, path in self.paths.items():
            if hasattr(args, dest):
                value = getattr(args, dest)
                if dest in self.expand:
                    flags.update({f"{path}.{k}": v for k, v in value.items()})
                elif dest in self.files:
                    flags[path] = self._absolute(dest, value)
                else:
                    flags[path] = value
        if not args.resume:
            self._refuse_before_torch(args.config, flags)
        from memfit.train.distributed import dist_info, resolve_device

        file = None
        config = args.config
        if config not in self.presets and config != "auto":
            if not (config.endswith(".json") or Path(config).exists()):
                choices = ", ".join(["auto", *self.presets] if self.auto else self.presets)
                raise UsageError(
                    f"error: --config {config!r} is neither a preset ({choices}) nor a file; "
                    "pass a preset name or a run's config.json"
                )
            file = read_config_file(config, self.system)
        elif args.resume and config == self.default:  # resume: the run's own settings, then the flags
            loop = self._preset_loop(config, flags)
            runs_dir = flags.get("loop.runs_dir", loop.runs_dir)
            run_name = flags.get("loop.run_name", loop.run_name)
            try:
                check_run_name(run_name)
            except ValueError as e:
                raise UsageError(f"error: --{e}") from None
            saved = Path(runs_dir) / self.system / run_name / CONFIG_NAME
            if saved.is_file():
                file = read_config_file(saved, self.system)
        file_changes: dict[str, Any] = {}
        if file is not None:
            for section in ("model", "train", "loop"):
                if file[section]:
                    file_changes[section] = file[section]
            for dest in self.files:  # a path in a config file is opened from here too: stored absolute
                *parents, key = self.paths[dest].split(".")
                where = file_changes
                for name in parents:
                    where = where.get(name) if isinstance(where, dict) else None
                if isinstance(where, dict) and isinstance(where.get(key), str):
                    where[key] = self._absolute(dest, where[key])
        device_name = flags.get("loop.device", (file or {}).get("loop", {}).get("device", "auto"))
        device = resolve_device(device_name)
        preset = (file or {}).get("preset") or (config if file is None else None) or self.default
        if preset == "auto":
            preset = self._auto_preset(device)
            if dist_info().is_main:
                where = "a GPU" if device.type == "cuda" else "no GPU"
                note = f"[memfit] --config auto: {where}, so the {preset!r} preset (--config NAME: another)"
                print(note, file=sys.stderr)
        if preset not in self.presets:
            choices = ", ".join(self.presets)
            raise UsageError(f"error: --config: unknown preset {preset!r}; choose one of {choices}")
        tree = self.presets[preset](device)
        source = "the run's config.json" if config == self.default else f"--config {config}"
        if file_changes:
            tree = self._apply(tree, file_changes, source)
        given = set(flatten(file_changes, tree)) if file_changes else set()
        flags = _budget_alone(flags, given)
        tree = self._apply(tree, flags, "flags")
        if dist_info().is_main:
            note_warmup(tree, flags, self._named("train.warmup", "flags"))
        if args.resume and args.overwrite:
            raise UsageError("error: --resume and --overwrite contradict each other; pick one")
        if args.resume and "loop.run_name" in given | set(flags):  # a name given that holds no run: a typo
            from memfit.train.run_dir import refuse_missing_run

            refuse_missing_run(tree.loop.run_dir(self.system), CONFIG_NAME)
        if tree.loop.threads is not None:  # before data and model are built, not only once training starts
            from memfit.train.cpu import set_threads

            set_threads(tree.loop.threads)
        settings_dests = {*self.paths, "config", "resume", "overwrite"}
        return TrainRun(
            tree,
            preset,
            device,
            args.resume,
            args.overwrite,
            frozenset(given | set(flags)),
            self.system,
            flags=frozenset(flags),
            extras={k: v for k, v in vars(args).items() if k not in settings_dests},
        )
