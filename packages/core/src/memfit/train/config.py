"""Config dataclasses as every system uses them: dict round trip, named presets, validation.

A system's model config is a plain frozen dataclass. ``to_dict``/``from_dict`` turn it into the JSON-able
dict a checkpoint stores and back (an unknown key is an error naming it: a checkpoint or file written by
another version, or a typo, is never half-read). ``get_config(presets, name, **overrides)`` copies a named
preset with fields replaced; ``check_fields(self, lr=">0")`` validates numbers in ``__post_init__``.
Each package's ``config.get_config(name, **overrides)`` is this function bound to its PRESETS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any, TypeVar

from memfit.errors import UsageError, first_line

C = TypeVar("C")

_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    ">0": (lambda v: v > 0, "> 0"),
    ">=0": (lambda v: v >= 0, ">= 0"),
    ">=1": (lambda v: v >= 1, ">= 1"),
}


def check_fields(obj: Any, **rules: str) -> None:
    """check_fields(self, lr=">0", batch_size=">=1") raises ValueError "lr must be > 0, got 0" (rules
    ">0", ">=0", ">=1"; None is skipped; NaN, infinity, bools and strings are refused)."""
    for name, rule in rules.items():
        value = getattr(obj, name, None)
        if value is None:
            continue
        ok, text = _RULES[rule]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not ok(value):
            shown = f"{value:g}" if number else repr(value)
            raise ValueError(f"{name} must be {text}, got {shown}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass -> a plain dict (what checkpoints store)."""
    if not is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return asdict(cfg)


def config_dict(cfg: Any) -> dict[str, Any]:
    """to_dict for a dataclass, a copy for a dict, {} for None (what a checkpoint's "config" holds)."""
    if cfg is None:
        return {}
    return dict(cfg) if isinstance(cfg, Mapping) else to_dict(cfg)


def config_difference(old: Mapping[str, Any], new: Mapping[str, Any], limit: int = 4) -> str:
    """'channels 32 -> 24, num_layers 2 -> 4': the fields two config dicts disagree on ('' if none)."""
    keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]
    text = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:limit])
    return text + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
    """The dataclass `cls` from a dict (validated by its __post_init__); ValueError naming an unknown key."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")
    return cls(**d)


def with_overrides(cfg: C, overrides: Mapping[str, Any]) -> C:
    """`cfg` with the fields a command's flags replace at load time (e.g. shifts=4); a value the config
    refuses is a UsageError naming the setting, not the checkpoint."""
    if not overrides:
        return cfg
    try:
        return replace(cfg, **overrides)
    except (TypeError, ValueError) as e:
        asked = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise UsageError(f"error: {asked} does not fit this model: {first_line(e)}") from None


def get_config(presets: Mapping[str, Any], name: str, **overrides: Any) -> Any:
    """A copy of presets[name] (a dataclass, or a function returning one) with fields replaced.

    Raises ValueError naming the choices for an unknown preset, and the field for an unknown override.
    """
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(presets)}")
    base = presets[name]
    base = base() if callable(base) and not is_dataclass(base) else base
    names = {f.name for f in fields(base)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"{type(base).__name__} has no field {', '.join(unknown)}")
    return replace(base, **overrides)
