"""Fine-tuning flags: ``--lora R[:mod1,mod2]``, ``--freeze REGEX``, ``--optimizer NAME[:k=v,...]``,
``--accumulate N``, applied over any Target's step (a TrainStep file, a factory, a model by name).

- ``--lora R`` wraps the built model with peft's ``LoraConfig(r=R)`` on peft's default target modules for
  its ``model_type`` (``R:q_proj,v_proj`` names them): the base weights frozen, the adapters trained;
- ``--freeze REGEX``: every parameter whose name matches (``re.search``) gets ``requires_grad=False``;
- ``--optimizer``: any ``torch.optim`` class by name, case-insensitive, with its defaults and the given
  keywords (``sgd:momentum=0.9``, ``adamw:betas=(0.9,0.95),weight_decay=0.1``, ``adafactor``);
- ``--accumulate N``: N micro-batches (forward and backward each) per optimizer step
  (``TrainStep.accumulate``).
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.optim import Optimizer

from memfit.errors import UsageError, first_line
from memfit.estimate.trace import Target
from memfit.step import TrainStep


@dataclass
class FineTune:
    """What the fine-tuning flags ask for (all optional)."""

    lora: int | None = None
    lora_modules: list[str] | None = None
    freeze: re.Pattern | None = None
    optimizer: type[Optimizer] | None = None
    optimizer_kwargs: dict | None = None
    accumulate: int | None = None  # None: the step's own (1 unless a TrainStep says otherwise)
    default_modules: list[str] | None = None  # peft's defaults for this model (the setup line names them)

    def describe(self) -> str:
        parts = []
        if self.lora is not None:
            where = ",".join(self.lora_modules or self.default_modules or ["peft's default modules"])
            parts.append(f"LoRA r={self.lora} on {where}")
        if self.freeze is not None:
            parts.append(f"frozen: parameters matching {self.freeze.pattern!r}")
        if self.accumulate is not None and self.accumulate > 1:
            parts.append(f"{self.accumulate} micro-batches per optimizer step")
        return ", ".join(parts)

    def optimizer_text(self) -> str:
        assert self.optimizer is not None
        kw = ",".join(f"{k}={v}" for k, v in (self.optimizer_kwargs or {}).items())
        return f"{self.optimizer.__name__}({kw})"

    @property
    def empty(self) -> bool:
        return (
            self.lora is None and self.freeze is None and self.optimizer is None and self.accumulate is None
        )


def parse(
    lora: str | int | None = None,
    freeze: str | None = None,
    optimizer: str | type[Optimizer] | None = None,
    accumulate: int | str | None = None,
) -> FineTune:
    """The flags' texts (or the Python API's values) -> a FineTune; every bad value is one UsageError.
    ``optimizer`` from Python may also be an Optimizer class (``torch.optim.SGD``): built with its
    defaults, as its name without keywords is."""
    ft = FineTune()
    if lora is not None:
        ft.lora, ft.lora_modules = parse_lora(str(lora))
    if freeze is not None:
        try:
            ft.freeze = re.compile(freeze)
        except re.error as exc:
            raise UsageError(
                f"error: --freeze {freeze!r} is not a regular expression ({exc}); "
                "e.g. 'embed|layers\\.[0-5]\\.'"
            ) from exc
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        ft.optimizer, ft.optimizer_kwargs = usable_optimizer(optimizer), {}
    elif isinstance(optimizer, str):
        ft.optimizer, ft.optimizer_kwargs = parse_optimizer(optimizer)
    elif optimizer is not None:
        raise UsageError(
            f"error: optimizer is an instance of {type(optimizer).__name__}, not a torch.optim class or its "
            "name; give e.g. optimizer=torch.optim.SGD or optimizer='sgd:momentum=0.9'"
        )
    if accumulate is not None:
        try:
            ft.accumulate = int(accumulate)
        except (TypeError, ValueError):
            ft.accumulate = 0
        if ft.accumulate < 1 or str(accumulate).strip() != str(ft.accumulate):
            raise UsageError(
                f"error: --accumulate {accumulate!r}: micro-batches per optimizer step is a whole number "
                ">= 1; e.g. --accumulate 4"
            )
    return ft


def parse_lora(text: str) -> tuple[int, list[str] | None]:
    """``16`` -> (16, None); ``16:q_proj,v_proj`` -> (16, ["q_proj", "v_proj"])."""
    rank, _, mods = text.partition(":")
    try:
        r = int(rank)
    except ValueError:
        r = 0
    if r < 1:
        raise UsageError(
            f"error: --lora {text!r}: the LoRA rank is a whole number >= 1; e.g. --lora 16 or "
            "--lora 16:q_proj,v_proj"
        )
    modules = [m.strip() for m in mods.split(",") if m.strip()] if mods else None
    if mods and not modules:
        raise UsageError(f"error: --lora {text!r} names no module after ':'; e.g. --lora 16:q_proj,v_proj")
    return r, modules


def optimizers() -> dict[str, type[Optimizer]]:
    """torch.optim's optimizer classes by lower-case name."""
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, Optimizer) and cls is not Optimizer
    }


def parse_optimizer(text: str) -> tuple[type[Optimizer], dict]:
    """``sgd:momentum=0.9,nesterov=true`` -> (torch.optim.SGD, {"momentum": 0.9, "nesterov": True})."""
    name, _, rest = text.partition(":")
    known = optimizers()
    cls = known.get(name.strip().lower())
    if cls is None:
        raise UsageError(
            f"error: --optimizer {name.strip()!r} is not a torch.optim class; "
            f"one of {', '.join(sorted(known))}"
        )
    usable_optimizer(cls)
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p not in ("self", "params")]
    kwargs = {}
    for item in _split(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"error: --optimizer {text!r}: write keywords as k=v, e.g. sgd:momentum=0.9")
        if key not in accepted:
            raise UsageError(
                f"error: --optimizer {cls.__name__} has no keyword {key!r}; it takes {', '.join(accepted)}"
            )
        kwargs[key] = _value(value.strip())
    return cls, kwargs


def usable_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """`cls`, unless it cannot run a TrainStep's step: one line saying why."""
    if issubclass(cls, torch.optim.LBFGS):
        raise UsageError(
            "error: --optimizer lbfgs re-runs the step from a closure, which a TrainStep has none of; "
            "write the step yourself or pick another optimizer"
        )
    if issubclass(cls, torch.optim.SparseAdam):
        raise UsageError(
            "error: --optimizer sparseadam takes sparse gradients only (nn.Embedding(sparse=True)), and a "
            "model's other layers give dense ones; pick adam or adamw"
        )
    return cls


def _split(text: str) -> list[str]:
    """Split on commas outside parentheses: ``betas=(0.9,0.95),eps=1e-8`` is two items."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i for i in items if i.strip()]


def _value(text: str):
    """A keyword's value: a number, a bool (true/false, any case), None, a tuple, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


# ----------------------------------------------------------------------------------------------------
# Applying it
# ----------------------------------------------------------------------------------------------------


def apply(target: Target, ft: FineTune) -> Target:
    """The target with every step it makes fine-tuned as `ft` says (the same Target, its make wrapped)."""
    if ft.empty:
        return target
    if ft.lora is not None:
        require_peft()
        if ft.lora_modules is None:  # say which: peft's defaults for the model type, when it builds on meta
            ft = replace(ft, default_modules=_default_modules(target.step()))
    inner = target.make

    def make(k: dict[str, int]) -> TrainStep:
        return finetuned(inner(k), ft, target.device)

    target.make = make
    if ft.optimizer is not None:
        name = ft.optimizer_text()
        target.describe = (
            target.describe.replace(", AdamW,", f", {name},")
            if ", AdamW," in target.describe
            else f"{target.describe}, optimizer {name}"
        )
    if extra := ft.describe():
        target.describe = f"{target.describe}, {extra}"
    return target


def finetuned(step: TrainStep, ft: FineTune, device: str = "cpu") -> TrainStep:
    """`step` with LoRA / frozen parameters / another optimizer / micro-batches."""
    build = step.build_model

    def build_model() -> nn.Module:
        model = build()
        if ft.lora is not None:
            model = with_lora(model, ft.lora, ft.lora_modules)
        if ft.freeze is not None:
            hit = 0
            for name, p in model.named_parameters():
                if ft.freeze.search(name):
                    p.requires_grad_(False)
                    hit += 1
            if not hit:
                raise UsageError(
                    f"error: --freeze {ft.freeze.pattern!r} matches no parameter; names look like "
                    f"{next(iter(dict(model.named_parameters())), '?')!r}"
                )
            if not any(p.requires_grad for p in model.parameters()):  # backward would fail on the loss
                raise UsageError(
                    f"error: --freeze {ft.freeze.pattern!r} freezes every parameter, so nothing would train; "
                    "match only some names, e.g. 'embed|layers\\.[0-5]\\.'"
                )
        return model

    opt = step.optimizer if ft.optimizer is None else optimizer_factory(ft, device)
    return replace(step, build_model=build_model, optimizer=opt, accumulate=ft.accumulate or step.accumulate)


def optimizer_factory(ft: FineTune, device: str) -> Callable:
    """params -> the optimizer; on a CUDA target the foreach implementation torch picks for CUDA
    parameters (the fake parameters are CPU tensors, whose default is the per-parameter loop)."""
    assert ft.optimizer is not None
    kwargs = dict(ft.optimizer_kwargs or {})
    takes = inspect.signature(ft.optimizer.__init__).parameters
    if device == "cuda" and "foreach" in takes and not {"foreach", "fused"} & kwargs.keys():
        kwargs["foreach"] = True

    def make(params):
        try:
            return ft.optimizer(params, **kwargs)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"error: --optimizer {ft.optimizer_text()}: {first_line(exc, 200)}") from exc

    return make


def require_peft():
    try:
        import peft
    except ImportError as exc:
        raise UsageError("error: --lora needs peft; pip install 'memfit-core[finetune]' (or peft)") from exc
    return peft


def _default_modules(step: TrainStep) -> list[str] | None:
    """peft's default LoRA modules for the step's model (built on the meta device); None when it does not
    build there or peft has none for it (with_lora then says so in the trace)."""
    try:
        with torch.device("meta"):
            model = step.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real values to build: named in the trace
        return None
    return lora_modules(model)


def lora_modules(model: nn.Module) -> list[str] | None:
    """peft's default LoRA target modules for the model's ``config.model_type``, when it has them and the
    model has such modules; else None."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as MAPPING
    except ImportError:
        return None
    kind = getattr(getattr(model, "config", None), "model_type", None)
    mods = MAPPING.get(kind) if kind else None
    if not mods:
        return None
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return list(mods) if set(mods) & names else None


def with_lora(model: nn.Module, r: int, modules: list[str] | None) -> nn.Module:
    """peft's LoRA over `model`: ``LoraConfig(r=r)`` on `modules` or peft's defaults for its model type."""
    peft = require_peft()
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    named = f"its Linear layers: {', '.join(linear[:8]) or 'none'}"
    if modules is None and lora_modules(model) is None:
        raise UsageError(
            f"error: peft has no default LoRA modules for {type(model).__name__}; name them, e.g. --lora "
            f"{r}:{','.join(linear[:2]) or 'NAME'} ({named})"
        )
    try:
        with warnings.catch_warnings():  # transformers' deprecation of what peft asks it
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=modules))
    except ValueError as exc:
        raise UsageError(
            f"error: --lora {r}: peft says: {first_line(exc, 200).rstrip('. ')}; name modules it has "
            f"({named})"
        ) from exc


# ----------------------------------------------------------------------------------------------------
# For the what-ifs (memfit.estimate.explain)
# ----------------------------------------------------------------------------------------------------

ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


def lora_applies(step: TrainStep) -> bool:
    """True when peft is installed, the model has no LoRA yet and peft knows its target modules (the model
    built on the meta device: no memory)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    try:
        with torch.device("meta"):
            model = step.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real values to build: no LoRA row
        return False
    if any("lora_" in name for name, _ in model.named_modules()):
        return False
    return lora_modules(model) is not None


def adam_like(step: TrainStep) -> str | None:
    """The class name of the step's optimizer when it keeps Adam's two moments per parameter, else None."""
    try:
        opt = step.optimizer([nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - an optimizer that wants something else: no SGD row
        return None
    name = type(opt).__name__
    return name if name in ADAM_LIKE else None
