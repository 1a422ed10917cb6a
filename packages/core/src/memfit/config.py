"""Config dataclasses as every system uses them: dict round trip, named presets, overrides from flags.

A system's config is a plain dataclass. ``to_dict``/``from_dict`` turn it into the JSON-able dict a
checkpoint stores (unknown keys are ignored, so an older reader can open a newer checkpoint);
``get_config(presets, name, **overrides)`` copies a named preset with fields replaced;
``overrides_from_args(args, {"flag": "field"})`` collects the overrides the user actually gave on the
command line (a flag left at None is not an override; an explicit value, even ``none``, is).
Each package's ``config.get_config(name, **overrides)`` is this function bound to its PRESETS.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any, TypeVar

C = TypeVar("C")


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
    """The dataclass `cls` from a dict; keys that are not fields of cls are ignored."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


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


def overrides_from_args(args: argparse.Namespace, mapping: Mapping[str, str]) -> dict[str, Any]:
    """{field: value} for the flags in mapping ({flag_dest: field}) that the user set (not None, present)."""
    out = {}
    for dest, field_name in mapping.items():
        if hasattr(args, dest) and getattr(args, dest) is not None:
            out[field_name] = getattr(args, dest)
    return out
