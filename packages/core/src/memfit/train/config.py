"""Config dataclasses as every system uses them: dict round trip, named presets, validation.

A system's model config is a plain frozen dataclass. ``to_dict``/``from_dict`` turn it into the JSON-able
dict a checkpoint stores and back (an unknown key is an error naming it: a checkpoint or file written by
another version, or a typo, is never half-read). ``get_config(presets, name, **overrides)`` copies a named
preset with fields replaced; ``check_fields(self, lr=">0")`` validates numbers in ``__post_init__``.
Each package's ``config.get_config(name, **overrides)`` is this function bound to its PRESETS.

Every number a user can give a config is validated in one place, ``check_config``: each field's declared
range with both ends (the class's ``RANGES``, e.g. ``{"channels": "[1, 2**16]", "beta1": "[0, 1)", "seed":
"0..2**63-1"}``; COUNT, STEPS, RATE, DECAY, SHARE and WEIGHT name the common ones), the relations between
fields (``RELATIONS``, e.g. ``(("min_lr", "<=", "lr"),)``) and the rules every number obeys (finite; an
int within 64 bits). It runs wherever values enter a config from outside: flags
and files (``memfit.train.settings.override``, so at parse time), checkpoints and exports (``from_dict``)
and load-time overrides (``with_overrides``); a config whose ``__post_init__`` divides by a size calls it
first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any, TypeVar

from memfit.errors import UsageError, first_line

C = TypeVar("C")

INT64_MAX = 2**63 - 1
_BOUND = r"-?(?:2\*\*\d+(?:-1)?|\d+(?:\.\d*)?(?:e-?\d+)?)"
_RULE = re.compile(
    rf"^(?:(?P<op>>=|>|<=|<)(?P<bound>{_BOUND})|(?P<low>{_BOUND})\.\.(?P<high>{_BOUND})"
    rf"|(?P<open>[\[(])(?P<lo>{_BOUND}),(?P<hi>{_BOUND})(?P<close>[\])]))$"
)

# Ranges with both ends that most settings share (a RANGES entry may also spell its own):
COUNT = "[1, 2**31-1]"  # a size or a count of things (channels, layers, files, a batch)
COUNT0 = "[0, 2**31-1]"  # the same where 0 means none / off
STEPS = "[0, 2**53]"  # a step count or interval (0: off or at the end); 2**53: still exact as a float
RATE = "(0, 10]"  # a learning rate (above 10 no optimizer step is finite for long)
DECAY = "[0, 1)"  # a decay or momentum per step (AdamW's betas, an EMA)
SHARE = "[0, 1]"  # a probability or a share
WEIGHT = "[0, 1e4]"  # a loss weight or a weight decay


def _bound(text: str) -> float:
    if "**" in text:  # 2**63-1: the int64 limits that seeds and sizes live within
        base, _, rest = text.lstrip("-").partition("**")
        exp, _, minus = rest.partition("-")
        value = int(base) ** int(exp) - int(minus or 0)
        return -value if text.startswith("-") else value
    return float(text) if any(c in text for c in ".e") else int(text)


def _rule(rule: str) -> tuple[Callable[[float], bool], Callable[[float], str]]:
    """A range rule -> (test, text of what a value must be): ">0", ">=1", ">=0.0001", "<1", "LOW..HIGH"
    (inclusive; the text names the range) and intervals "[0, 1)", "(0, 10]" (the text names the end a
    value falls outside of: "< 1" for 1e30, "> 0" for 0 and NaN)."""
    m = _RULE.match(rule.replace(" ", ""))
    if m is None:
        raise ValueError(f"not a range rule: {rule!r} (>0, >=1, >=0.0001, 0..2**63-1, [0, 1), (0, 10])")
    if m["op"]:
        b, op = _bound(m["bound"]), m["op"]
        tests = {">": lambda v: v > b, ">=": lambda v: v >= b, "<": lambda v: v < b, "<=": lambda v: v <= b}
        return tests[op], lambda v: f"{op} {m['bound']}"
    if m["low"]:
        low, high = _bound(m["low"]), _bound(m["high"])
        return (lambda v: low <= v <= high), lambda v: f"in {m['low']}..{m['high']}"
    lo, hi = _bound(m["lo"]), _bound(m["hi"])
    lo_ok = (lambda v: v >= lo) if m["open"] == "[" else (lambda v: v > lo)
    hi_ok = (lambda v: v <= hi) if m["close"] == "]" else (lambda v: v < hi)
    lo_text = (">= " if m["open"] == "[" else "> ") + m["lo"]
    hi_text = ("<= " if m["close"] == "]" else "< ") + m["hi"]
    return (lambda v: lo_ok(v) and hi_ok(v)), lambda v: hi_text if lo_ok(v) else lo_text


def rule_ends(rule: str) -> tuple[float, float]:
    """The two ends of a range rule (-inf or inf for a side it leaves open): what a test checks every
    numeric setting declares."""
    m = _RULE.match(rule.replace(" ", ""))
    if m is None:
        raise ValueError(f"not a range rule: {rule!r}")
    if m["op"]:
        b = _bound(m["bound"])
        return (b, math.inf) if m["op"].startswith(">") else (-math.inf, b)
    if m["low"]:
        return _bound(m["low"]), _bound(m["high"])
    return _bound(m["lo"]), _bound(m["hi"])


def check_fields(obj: Any, **rules: str) -> None:
    """check_fields(self, lr=">0", batch_size=">=1") raises ValueError "lr must be > 0, got 0" (rules
    ">0", ">=0", ">=1", any ">x" / ">=x" / "<x" / "<=x", "LOW..HIGH" and intervals "[0, 1)"; a tuple's
    every element is checked; None is skipped; NaN, infinity, bools and strings are refused)."""
    for name, rule in rules.items():
        value = getattr(obj, name, None)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if v is None:
                continue
            ok, text = _rule(rule)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or not math.isfinite(v) or not ok(v):
                shown = f"{v:g}" if number else repr(v)
                raise ValueError(f"{name} must be {text(v) if number else text(0)}, got {shown}")


def check_relations(obj: Any) -> None:
    """The relations a config class declares between its fields (RELATIONS, e.g. (("min_lr", "<=",
    "lr"),)), skipped where either side is None: ValueError "min_lr must be <= lr (0.001), got 1" (the
    field first, as __post_init__ messages)."""
    tests = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b}
    for left, op, right in getattr(type(obj), "RELATIONS", ()):
        a, b = getattr(obj, left), getattr(obj, right)
        if a is not None and b is not None and not tests[op](a, b):
            raise ValueError(f"{left} must be {op} {right} ({b:g}), got {a:g}")


def check_config(obj: Any) -> None:
    """Validate a config dataclass's numbers: every field's declared range (its class's RANGES, {field:
    rule} as check_fields takes), and what every number obeys, declared or not: finite (NaN and infinity
    are never a rate, a weight or a size) and, for an int, within 64 bits (torch's seeds and sizes).
    ValueError "channels must be >= 1, got 0" (the field first, as __post_init__ messages)."""
    check_fields(obj, **getattr(type(obj), "RANGES", {}))
    check_relations(obj)
    for f in fields(obj):
        value = getattr(obj, f.name)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v}")
            if isinstance(v, int) and not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise ValueError(f"{f.name} must fit in 64 bits (|x| < 2**63), got {v:g}")


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
    cfg = cls(**d)
    check_config(cfg)
    return cfg


def with_overrides(cfg: C, overrides: Mapping[str, Any]) -> C:
    """`cfg` with the fields a command's flags replace at load time (e.g. shifts=4); a value the config
    refuses is a UsageError naming the setting, not the checkpoint."""
    if not overrides:
        return cfg
    try:
        new = replace(cfg, **overrides)
        check_config(new)
        return new
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
