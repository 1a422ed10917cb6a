"""The estimate itself: ``estimate(target, ...)`` traces a target's step and adds what was asked (what-ifs,
scaling, the per-rank peak, the largest batch), and ``estimate_model(...)``, what ``memfit.estimate(...)``
calls from a notebook."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable

import torch
from torch import nn

from memfit.errors import UsageError
from memfit.estimate import explain, finetune, rules
from memfit.estimate.byname import load_target
from memfit.estimate.fit import MARGIN, MAX_GPU_GIB
from memfit.estimate.result import EstimateResult
from memfit.estimate.target import DeviceTarget
from memfit.estimate.trace import (
    Target,
    copying_factory,
    fmt_bytes,
    make_target,
    trace_target,
)
from memfit.estimate.tracker import GIB

MAX_RANKS = 2**20
MAX_BATCH = 2**31 - 1
SHARDS = ("ddp", "fsdp")  # --shard's choices


def estimate(
    target: Target,
    top: int = 10,
    *,
    what_ifs: bool = False,
    scale: str | None = None,
    gpu_gib: float | None = None,
    margin: float = MARGIN,
    ranks: int = 1,
    shard: str = "ddp",
    max_batch: int = 4096,
    fsdp_units: str | None = None,
) -> EstimateResult:
    """Trace `target` and add what was asked: what-ifs, the scaling over `scale` (a knob; with what-ifs
    the batch by default), the per-rank peak (ranks > 1) and the largest batch under `gpu_gib`.
    `fsdp_units` (a regular expression of module names, ``--fsdp_units``): the modules FSDP wraps, for
    shard "fsdp" (default: the repeated blocks, else the whole model as one unit)."""
    _check_types(gpu_gib, margin, ranks, top, max_batch)
    if shard not in SHARDS:
        raise UsageError(
            f"error: shard {shard!r} is not a way ranks hold the state; one of {', '.join(SHARDS)}"
        )
    if fsdp_units is not None and (shard != "fsdp" or ranks < 2):
        raise UsageError("error: --fsdp_units names FSDP's units; give it with --shard fsdp --ranks N, N > 1")
    if shard == "fsdp" and ranks < 2:  # one rank holds everything: the figure would be the plain estimate
        raise UsageError("error: --shard fsdp splits the state over ranks; give --ranks N, N > 1, with it")
    if gpu_gib is not None and not (math.isfinite(gpu_gib) and 0 < gpu_gib <= MAX_GPU_GIB):
        raise UsageError(
            f"error: --gpu_gib must be a positive number of GiB up to {MAX_GPU_GIB}, got {gpu_gib:g}"
        )
    if not 0 <= margin < 1:
        raise UsageError(f"error: --margin is a fraction in [0, 1), e.g. 0.1; got {margin:g}")
    if ranks < 1 or top < 1 or max_batch < 1:
        raise UsageError("error: --ranks, --top and --max_batch must be at least 1")
    if ranks > MAX_RANKS or max_batch > MAX_BATCH:  # a batch past 2**31 overflows a tensor's storage size
        raise UsageError(f"error: --ranks is at most {MAX_RANKS} and --max_batch at most {MAX_BATCH}; got "
                         f"{ranks} and {max_batch}")  # fmt: skip
    result = EstimateResult(target, trace_target(target), top, ranks=ranks, shard=shard)
    for note in result.trace.report.notes:  # what the estimate assumed: said in the setup line
        if note not in target.describe:
            target.describe = f"{target.describe}; note: {note}"
    if target.device == "cuda":
        result.cuda_kernels = rules.assumed_target().describe(result.trace.report.ran)
    if what_ifs:
        result.what_ifs = explain.what_ifs(target, result.trace)
    knob = scale or ("batch" if what_ifs and "batch" in target.knobs else None)
    if knob is not None:
        result.scaling = explain.scaling(target, knob, result.trace)
    gather = 0
    if ranks > 1:
        if shard == "fsdp":
            units = explain.fsdp_units(target.step(), fsdp_units)
            gather, result.fsdp_units = units.gathered_bytes, units.rule
        result.per_rank_bytes = explain.per_rank_bytes(result.trace, ranks, shard, gather)
    if gpu_gib is not None:
        result.fit = explain.fit_batch(
            target, gpu_gib, margin, ranks, shard, max_batch, result.trace, units=fsdp_units
        )
    if what_ifs and ranks == 1 and (known := capacity(target.device, gpu_gib)) is not None:
        where, nbytes, device = known
        result.fits = explain.check_fits(
            target, result.trace, nbytes, where, device, margin, result.fit, max_batch
        )
    return result


def margin_or_default(margin: float | None, gpu_gib: float | None, what_ifs: bool) -> float:
    """``--margin`` judges a fit: refused where nothing is judged (no ``--gpu_gib``, no ``--explain``),
    where it would be dropped silently; MARGIN when not given."""
    if margin is not None and gpu_gib is None and not what_ifs:
        raise UsageError(
            "error: --margin is the share of the memory kept free when judging a fit; give it with --gpu_gib "
            "(or --explain, which judges the memory this machine has)"
        )
    return MARGIN if margin is None else margin


def _check_types(gpu_gib, margin, ranks, top, max_batch) -> None:
    """A keyword of the wrong type from Python (``gpu_gib="24"``) is one line, as a bad value is (the
    command line's argparse converts them)."""
    if gpu_gib is not None and not _is(gpu_gib, numbers.Real):
        raise UsageError(f"error: gpu_gib={gpu_gib!r} is not a number; give GiB as one, e.g. gpu_gib=24")
    if not _is(margin, numbers.Real):
        raise UsageError(f"error: margin={margin!r} is not a number; give a fraction, e.g. margin=0.1")
    for name, value in (("ranks", ranks), ("top", top), ("max_batch", max_batch)):
        if not _is(value, numbers.Integral):
            raise UsageError(f"error: {name}={value!r} is not a whole number; give one, e.g. {name}=4")


def _is(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def capacity(device: str, gpu_gib: float | None) -> tuple[str, int, str] | None:
    """(what, bytes, device type) of the memory a step is judged against when it is known: ``--gpu_gib``,
    this machine's GPU for a CUDA estimate, the available RAM for a CPU one; None otherwise."""
    if gpu_gib is not None:
        return f"a {gpu_gib:g} GiB GPU", int(gpu_gib * GIB), "cuda"
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        total = torch.cuda.mem_get_info()[1]
        return f"this machine's {torch.cuda.get_device_name()} ({fmt_bytes(total)})", total, "cuda"
    from memfit.estimate.preflight import available_bytes

    have, what = available_bytes(torch.device("cpu"))
    return None if have is None else (f"this machine's {what} ({fmt_bytes(have)})", have, "cpu")


# ----------------------------------------------------------------------------------------------------
# The Python API: memfit.estimate(model_or_factory, inputs, ...)
# ----------------------------------------------------------------------------------------------------


def estimate_model(
    model: nn.Module | Callable[[], nn.Module] | str,
    inputs: str | tuple[int, ...] | torch.Tensor | list | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    loss: str = "classes",
    amp: str | torch.dtype | None = None,
    device: str = "cpu",
    explain: bool = False,
    scale: str | None = None,
    gpu_gib: float | None = None,
    margin: float | None = None,
    ranks: int = 1,
    shard: str = "ddp",
    top: int = 10,
    cuda_kernels: bool | None = None,
    gpu: str | None = None,
    task: str | None = None,
    lora: int | str | None = None,
    freeze: str | None = None,
    optimizer: str | type[torch.optim.Optimizer] | None = None,
    accumulate: int | None = None,
    fsdp_units: str | None = None,
    max_batch: int = 4096,
) -> EstimateResult:
    """``memfit.estimate(...)``: the training-step memory of a model, from a notebook.

    ``model``: an ``nn.Module`` (copied, never changed) or a function that builds one (cheaper: the
    estimate then builds it with fake tensors). ``inputs``: one shape (``"8x3x224x224"``, ``(8, 3, 224,
    224)`` or ``[8, 3, 224, 224]``, a tensor, or ``"8x1024:int64"``) or a list of them, one per positional
    input. ``dtype``
    applies to inputs without one (default: token ids when the first layer is an ``nn.Embedding``, else
    float32); ``loss``: "classes", "same" or "sum" (as ``--target``); ``amp``: None, "bf16" or "fp16";
    ``device``: "cpu" or "cuda" (the kernels a CUDA run takes); ``explain``: the what-ifs (and the batch
    scaling); ``gpu_gib``: the largest batch under that GPU size (the search stops at ``max_batch``);
    ``ranks`` / ``shard``: per-rank figures.
    ``fsdp_units`` (shard "fsdp"): a regular expression naming the modules FSDP wraps (``--fsdp_units``).
    ``cuda_kernels`` (device "cuda"): whether the GPU has the ``cuda`` extra's Mamba kernels (None: what
    this machine's GPU has, or yes without one; ``--no_cuda_kernels`` is False). ``gpu`` (device "cuda"):
    the card, as ``--gpu`` takes it ("h100", "a100", "8.6"; None: this machine's GPU, else an H200).
    ``model`` may also be a name, as the command line takes it: ``"hf:ORG/NAME"`` or ``"hf:path/to/dir"``
    (built from its config.json, no weights; ``task`` overrides the head: causal-lm, masked-lm,
    seq2seq-lm, classification, base), ``"timm:NAME"``, ``"torchvision:NAME"`` (``inputs`` optional for
    those two: their default resolution). Fine-tuning, for any model: ``lora`` (a rank, or
    ``"16:q_proj,v_proj"``), ``freeze`` (a regex of parameter names), ``optimizer`` (``"sgd:momentum=0.9"``,
    ``"adafactor"``: any torch.optim class by name, or the class itself, ``torch.optim.SGD``, with its
    defaults) and ``accumulate`` (micro-batches per optimizer step).
    The result's ``to_dict()`` is what ``memfit estimate --json`` prints; on CUDA its three figures are
    ``allocated_bytes`` (the allocator peak, also ``peak_bytes``), ``reserved_bytes`` and ``total_bytes``.
    Bad input raises ``memfit.errors.UsageError``: one line that names the keyword (``gpu_gib``, not the
    command line's ``--gpu_gib``) and the fix.
    """
    try:  # the shared checks speak the command line's flags: say the keywords here
        # the numbers first, before a model is built (an hf: model takes seconds)
        _check_types(gpu_gib, 0.0 if margin is None else margin, ranks, top, max_batch)
        margin = margin_or_default(margin, gpu_gib, explain)
        ft = finetune.parse(lora, freeze, optimizer, accumulate)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        amp_name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp, amp)  # type: ignore[arg-type]
        if amp_name not in ("none", "bf16", "fp16") or loss not in ("classes", "same", "sum"):
            raise UsageError(
                "error: amp is None, 'bf16' or 'fp16' and loss 'classes', 'same' or 'sum'; got "
                f"{amp!r}, {loss!r}"
            )
        texts = None if inputs is None else _input_texts(inputs)
        if isinstance(model, str):
            target = load_target(model, texts, dtype, loss, amp_name, task=task)
        else:
            if task is not None:
                raise UsageError("error: task picks a Hugging Face model's head: give model as 'hf:ORG/NAME'")
            if texts is None:
                raise UsageError(
                    "error: memfit.estimate(model, inputs) needs the input shape, e.g. '8x3x224x224'"
                )
            target = _module_target(model, texts, dtype, loss, amp_name)
        on = DeviceTarget.from_flags(device, gpu, cuda_kernels)
        target.device = on.device
        target = finetune.apply(target, ft)
        with on.entered():
            return estimate(
                target,
                top,
                what_ifs=explain,
                scale=scale,
                gpu_gib=gpu_gib,
                margin=margin,
                ranks=ranks,
                shard=shard,
                fsdp_units=fsdp_units,
                max_batch=max_batch,
            )
    except UsageError as e:
        raise UsageError(in_python_terms(str(e))) from None


# A flag the command line and memfit.estimate share -> the keyword it is in Python
KEYWORDS = {
    "--input": "inputs",
    "--target": "loss",
    "--explain": "explain=True",
    "--no_cuda_kernels": "cuda_kernels=False",
    **{
        f"--{k}": k
        for k in (
            *("dtype", "amp", "device", "scale", "gpu_gib", "margin", "ranks", "shard", "top", "gpu"),
            *("task", "lora", "freeze", "optimizer", "accumulate", "fsdp_units", "max_batch"),
        )
    },
}
_FLAG = re.compile(
    r"--(?P<flag>[a-z_]+)(?![a-z_])"
    # a value after it: quoted, a number or shape, a placeholder (N, REGEX), or a choice
    r"(?: (?P<value>'[^']*'|\d(?:[^\s;)]*[^\s,;):.])?|[A-Z][A-Z_]*(?:x[A-Z][A-Z_]*)*\b(?![a-z])"
    r"|bf16|fp16|cuda(?::\d+)?|cpu|fsdp|ddp|b?float\d+|u?int\d+)"
    r"(?=[\s,;:.)]|$))?"
)


def in_python_terms(message: str) -> str:
    """An error line of the shared checks with memfit.estimate's keywords for the command line's flags:
    ``--gpu_gib must be`` -> ``gpu_gib must be``, ``--input 8x3x224x224`` -> ``inputs='8x3x224x224'``,
    ``--lora 0`` -> ``lora=0``. Flags the Python API has no keyword for (``--timeline``) stay."""

    def keyword(m: re.Match) -> str:
        name, value = KEYWORDS.get("--" + m["flag"]), m["value"]
        if name is None:
            return m[0]
        if value is None or "=" in name:
            return name + ("" if value is None else " " + value)
        text_only = name in ("gpu", "dtype", "device", "task", "scale")  # gpu="8.6": a string, not a number
        if not (value.startswith("'") or value.isupper() or (_is_number(value) and not text_only)):
            value = repr(value)
        return f"{name}={value}"

    return _FLAG.sub(keyword, message)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _input_texts(inputs: str | tuple[int, ...] | torch.Tensor | list) -> list[str]:
    """The Python API's inputs as --input texts. A list of whole numbers is one shape, as a tuple is
    (``[8, 1024]``); any other list holds one shape per positional input."""
    one_shape = isinstance(inputs, list) and inputs and all(isinstance(s, int) for s in inputs)
    specs = inputs if isinstance(inputs, list) and not one_shape else [inputs]
    texts = []
    for s in specs:
        if isinstance(s, torch.Tensor):
            s = "x".join(map(str, s.shape)) + ":" + str(s.dtype).removeprefix("torch.")
        elif isinstance(s, (tuple, list)):
            s = "x".join(map(str, s))
        texts.append(str(s))
    return texts


def _module_target(
    model: nn.Module | Callable[[], nn.Module], texts: list[str], dtype: str | None, loss: str, amp_name: str
) -> Target:
    """The Target of an nn.Module (copied, never changed) or a function that builds one."""
    if isinstance(model, nn.Module):
        factory, label = copying_factory(model), type(model).__name__
    elif callable(model):
        factory, label = model, getattr(model, "__name__", "model")
    else:
        raise UsageError(
            "error: memfit.estimate needs an nn.Module, a function that builds one, or a name such as "
            f"'hf:ORG/NAME', not {model!r}"
        )
    return make_target(factory, label, texts, dtype, loss, amp_name)
