"""Targets by name: ``hf:ORG/NAME`` or ``hf:path/to/dir``, ``timm:NAME``, ``torchvision:NAME``.

No file of the user's is needed and no weights are read: a Hugging Face model is built from its
``config.json`` alone (``AutoConfig``, then the class the config's ``architectures`` names, or the one
``--task`` picks, through ``_from_config``), a timm model with ``pretrained=False``, a torchvision one with
``weights=None``. The estimator builds them under fake tensors like any other factory.

The step of a Hugging Face language model is its own loss: ``model(input_ids=ids, labels=ids)`` (a
sequence-to-sequence model takes the labels as its decoder targets); a classifier's labels are random
classes; ``--task base`` sums the last hidden state (and a pooler's output). Image models take ``--input``
or their default resolution (timm's ``pretrained_cfg``, torchvision's weights' crop size, else 224), said
in the setup line.

``load_target`` is the one entry: a by-name spec here, anything else ``memfit.estimate.trace``'s.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from memfit.errors import UsageError, first_line
from memfit.estimate.trace import Target, make_target, parse_dtype, parse_input
from memfit.estimate.trace import load_target as load_callable_target
from memfit.step import AMP_DTYPES, TrainStep, default_optimizer

PREFIXES = ("hf:", "timm:", "torchvision:")
IMAGE_BATCH = 8  # the batch an image model is estimated at when --input is not given

# --task -> the transformers Auto class whose mapping picks the model class for the config
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "classification": "AutoModelForSequenceClassification",
    "base": "AutoModel",
}
LM_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")


def is_byname(spec: str) -> bool:
    return spec.startswith(PREFIXES)


def load_target(
    spec: str,
    inputs: list[str] | None = None,
    dtype: str | None = None,
    target: str = "classes",
    amp: str = "none",
    task: str | None = None,
) -> Target:
    """TARGET -> a Target: ``hf:``/``timm:``/``torchvision:`` names here, files and modules in trace."""
    if task is not None and not spec.startswith("hf:"):
        raise UsageError(f"error: --task picks a Hugging Face model's head; {spec!r} is not an hf: target")
    if spec.startswith("hf:"):
        return hf_target(spec, inputs, dtype, amp, task)
    if spec.startswith("timm:"):
        return timm_target(spec, inputs, dtype, target, amp)
    if spec.startswith("torchvision:"):
        return torchvision_target(spec, inputs, dtype, target, amp)
    return load_callable_target(spec, inputs, dtype, target, amp)


def _name(spec: str, prefix: str, example: str) -> str:
    name = spec.removeprefix(prefix).strip()
    if not name:
        raise UsageError(f"error: {spec!r} names no model; write e.g. {prefix}{example}")
    return name


def _require(module: str, install: str):
    """The optional library behind a target kind, or one line saying what to install."""
    try:
        return __import__(module)
    except ImportError as exc:
        raise UsageError(f"error: {module} is not installed; pip install {install}") from exc


# ----------------------------------------------------------------------------------------------------
# Hugging Face transformers
# ----------------------------------------------------------------------------------------------------


def hf_config(name: str):
    """The model's config from a local folder with config.json, or a Hub name (cache or network, as
    transformers does); never the weights."""
    transformers = _require("transformers", "'memfit-core[hf]'")
    path = Path(name).expanduser()
    local = path.is_dir()
    if local and not (path / "config.json").is_file():
        raise UsageError(
            f"error: {name} has no config.json; give a folder holding a model's config.json, or a Hub "
            "name such as hf:Qwen/Qwen2.5-0.5B"
        )
    if not local and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise UsageError(
            f"error: no folder {name}; give a folder holding config.json, or a Hub name ORG/NAME"
        )
    if not local:
        with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
            return transformers.AutoConfig.from_pretrained(name, local_files_only=True)  # the cache
        if (why := hub_unreachable()) is not None:
            raise UsageError(
                f"error: {name} is not a folder here nor in the Hugging Face cache, and {why}; give a folder "
                "holding the model's config.json (written where the Hub can be reached), or check the network"
            )
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return transformers.AutoConfig.from_pretrained(str(path) if local else name)
    except Exception as exc:  # noqa: BLE001 - OSError (not found, offline), ValueError (unknown model_type)
        where = f"{name}/config.json" if local else f"the Hub's {name}"
        fix = (
            "upgrade transformers, or check its model_type"
            if local or "model_type" in str(exc) or "Unrecognized" in str(exc)
            else "check the name (ORG/NAME as on huggingface.co), your network or HF_TOKEN, or give a "
            "local folder holding its config.json"
        )
        raise UsageError(
            f"error: transformers cannot read {where}: {type(exc).__name__}: "
            f"{first_line(exc, 200).rstrip('. ')}; {fix}"
        ) from exc


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub (``HF_ENDPOINT``, else huggingface.co) cannot be reached, from one
    connection attempt of at most ``timeout`` seconds; None when it answers or a proxy is set (the proxy
    decides). huggingface_hub retries an unreachable Hub for about 25 s before it says so."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{host} cannot be reached ({e.strerror or type(e).__name__})"
    return None


def hf_class(config, task: str | None):
    """The model class: the Auto class of ``task``'s choice for this config, else the config's first
    ``architectures`` entry, else a causal LM (or the bare model when the config has no LM head)."""
    import transformers

    kind = type(config).__name__.removesuffix("Config")
    if task is None and getattr(config, "architectures", None):
        arch = config.architectures[0]
        cls = getattr(transformers, arch, None)
        if cls is None:
            raise UsageError(
                f"error: transformers {transformers.__version__} has no {arch} (config.json's "
                f"architectures); upgrade transformers, or pick a head with --task ({', '.join(TASKS)})"
            )
        return cls, _task_of(cls)
    tasks = [task] if task is not None else ["causal-lm", "base"]
    for t in tasks:
        if t not in TASKS:
            raise UsageError(f"error: --task {t!r} is not a head memfit knows; use one of {', '.join(TASKS)}")
        auto = getattr(transformers, TASKS[t])
        try:
            return auto._model_mapping[type(config)], t
        except KeyError:
            continue
    raise UsageError(
        f"error: transformers has no {task or 'causal-lm'} model for {kind} configs; pick another --task "
        f"({', '.join(TASKS)})"
    )


def _task_of(cls) -> str:
    name = cls.__name__
    for suffix, task in (
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
        ("ForConditionalGeneration", "seq2seq-lm"),
        ("ForMaskedLM", "masked-lm"),
        ("ForPreTraining", "masked-lm"),
        ("ForSequenceClassification", "classification"),
        ("ForImageClassification", "classification"),
    ):
        if name.endswith(suffix):
            return task
    return "base"


def hf_target(spec: str, inputs: list[str] | None, dtype: str | None, amp: str, task: str | None) -> Target:
    name = _name(spec, "hf:", "Qwen/Qwen2.5-0.5B")
    config = hf_config(name)
    cls, task = hf_class(config, task)
    if getattr(cls, "main_input_name", "input_ids") != "input_ids":
        raise UsageError(
            f"error: {cls.__name__} takes {cls.main_input_name}, not token ids; by name memfit builds text "
            "models only: give a factory (file.py:func) with --input"
        )
    if not inputs or len(inputs) != 1:
        raise UsageError(f"error: {spec} needs one --input BATCHxTOKENS; e.g. --input 8x1024")
    shape, given = parse_input(inputs[0])
    if len(shape) != 2:
        raise UsageError(f"error: --input {inputs[0]!r}: a language model takes BATCHxTOKENS; e.g. 8x1024")
    ids_dtype = given or (parse_dtype(dtype) if dtype else torch.int64)
    if ids_dtype.is_floating_point and given is None:  # --dtype said it, not --input
        raise UsageError(
            f"error: --dtype {dtype} makes the token ids floats; drop it (ids are int64), or give --amp bf16 "
            "for half-precision compute"
        )
    if ids_dtype.is_floating_point:
        raise UsageError(f"error: --input {inputs[0]!r} says {ids_dtype}; token ids are integers (int64)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", None) or 2)
    labels = int(getattr(config, "num_labels", 2) or 2)
    if getattr(config, "use_cache", None):
        config.use_cache = False
    if task == "classification" and getattr(config, "pad_token_id", None) is None:
        # a decoder classifier pools at the last non-pad token and refuses a batch without a pad id; the
        # random ids are never a pad, so the choice only decides that the last token is pooled
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if eos else 0) if isinstance(eos, list) else (eos or 0)
    if task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # the labels shifted right start the decoder's inputs; a config without the start id (T5's is
        # its pad id) cannot make them
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    amp_dtype = AMP_DTYPES[amp]

    def build() -> nn.Module:
        with quiet_transformers():
            model = cls._from_config(config)
        check_positions(model, shape[1], f"--input {inputs[0]!r}")
        return model

    def make(k: dict[str, int]) -> TrainStep:
        return hf_step(build, (k["batch"], k["input:1"]), ids_dtype, vocab, task, labels, amp_dtype)

    weights = str(getattr(config, "dtype", None) or torch.get_default_dtype()).removeprefix("torch.")
    loss = {
        "classification": f"cross-entropy over {labels} labels",
        "base": "sum of the last hidden state (and pooler output)",
    }
    describe = (
        f"{cls.__name__} from {'config.json' if Path(name).is_dir() else 'the Hub config'} (no weights, "
        f"{weights} parameters), --input {shape[0]}x{shape[1]}:{str(ids_dtype).removeprefix('torch.')} "
        f"(token ids < {vocab}), loss {loss.get(task, 'the model’s own LM loss on the ids')}, AdamW, "
        f"autocast {amp}"
    )
    return Target(spec, make, {"batch": shape[0], "input:1": shape[1]}, describe)


def check_positions(model: nn.Module, tokens: int, given: str) -> None:
    """Refuse a sequence longer than a learned absolute position table (GPT-2's ``wpe``, BERT's
    ``position_embeddings``, OPT's and BART's ``embed_positions``, less their ``offset``): the real step
    indexes past the table and fails, where fake tensors, which hold no values, would trace it. Rotary,
    relative and ALiBi positions have no table and take any length."""
    for name, mod in model.named_modules():
        last = name.rpartition(".")[2]
        if isinstance(mod, nn.Embedding) and (last == "wpe" or "position" in last):
            limit = mod.num_embeddings - int(getattr(mod, "offset", 0) or 0)
            if tokens > limit:
                raise UsageError(
                    f"error: {given}: {tokens} tokens exceed the model's {limit} learned positions "
                    f"(`{name}`); give at most {limit} tokens"
                )


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own warnings off (a config's unset loss_type, ...): the estimate's output is the
    answer."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def hf_step(
    build,
    shape: tuple[int, int],
    ids_dtype: torch.dtype,
    vocab: int,
    task: str,
    num_labels: int,
    amp_dtype: torch.dtype | None,
) -> TrainStep:
    """A Hugging Face model's step: token ids in [0, vocab); an LM's own loss with the ids as labels (a
    seq2seq model's decoder targets), a classifier's on random labels, or the last hidden state's sum."""

    def make_batch(device):
        ids = torch.randint(0, vocab, shape, device=device, dtype=ids_dtype)
        if task in LM_TASKS:
            return {"input_ids": ids, "labels": ids}
        if task == "classification":
            return {"input_ids": ids, "labels": torch.randint(0, num_labels, shape[:1], device=device)}
        return {"input_ids": ids}

    def loss(model, batch):
        with quiet_transformers():  # "loss_type=None ... Using the default loss" on the first call
            out = model(**batch)
        if "labels" in batch:
            return out.loss
        # every floating output (the last hidden state, a pooler's output): each head parameter trains
        outs = [t for t in out.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return sum(t.float().sum() for t in outs)

    return TrainStep(build, make_batch, loss, default_optimizer, amp_dtype)


# ----------------------------------------------------------------------------------------------------
# timm and torchvision
# ----------------------------------------------------------------------------------------------------


def _image_inputs(inputs: list[str] | None, size: tuple[int, ...], source: str) -> tuple[list[str], str]:
    """The --input shapes, or the assumed default (and the words that say so)."""
    if inputs:
        return inputs, ""
    shape = "x".join(map(str, (IMAGE_BATCH, *size)))
    return [shape], f"assumed --input {shape} ({source}; give --input to change it)"


def _close(name: str, known: list[str], where: str) -> str:
    """`did you mean: a, b` from the library's list of names, else where to look."""
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
    return f"did you mean: {', '.join(close)}" if close else f"see {where}.list_models()"


def _say(target: Target, assumed: str) -> Target:
    if assumed:
        target.describe = f"{target.describe}; {assumed}"
    return target


def timm_target(spec: str, inputs, dtype, target: str, amp: str) -> Target:
    name = _name(spec, "timm:", "convnext_tiny")
    timm = _require("timm", "timm")
    if not timm.is_model(name):
        raise UsageError(f"error: timm has no model {name!r}; {_close(name, timm.list_models(), 'timm')}")
    cfg = timm.get_pretrained_cfg(name)
    size = tuple(getattr(cfg, "input_size", None) or (3, 224, 224))
    inputs, assumed = _image_inputs(inputs, size, "timm's pretrained_cfg input_size")

    def factory() -> nn.Module:
        return timm.create_model(name, pretrained=False)

    return _say(make_target(factory, spec, inputs, dtype, target, amp), assumed)


def torchvision_target(spec: str, inputs, dtype, target: str, amp: str) -> Target:
    name = _name(spec, "torchvision:", "resnet50")
    models = _require("torchvision", "torchvision").models
    if name not in models.list_models():
        hint = _close(name, models.list_models(), "torchvision.models")
        raise UsageError(f"error: torchvision has no model {name!r}; {hint}")
    crop, source = 224, "the default 224x224"
    with contextlib.suppress(Exception):  # the weights' evaluation crop, when they say one
        crop = int(models.get_model_weights(name).DEFAULT.transforms.keywords["crop_size"])
        source = "the crop size of its weights' transforms"
    inputs, assumed = _image_inputs(inputs, (3, crop, crop), source)

    def factory() -> nn.Module:
        return models.get_model(name, weights=None)

    factory.__name__ = name
    return _say(make_target(factory, spec, inputs, dtype, target, amp), assumed)
