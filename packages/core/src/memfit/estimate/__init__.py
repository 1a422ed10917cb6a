"""`memfit estimate`: any PyTorch model's training-step memory, explained, in seconds, without a GPU.

One traced step (``memfit.estimate.trace``: every storage with its op, module, shape, dtype, saved-ness and
lifetime) gives:

- the peak and its split into params / grads / optimizer / activations;
- the tensors alive at the peak, grouped across repeated layers (``decoder.layers.*.attn``) by op, shape
  and dtype, largest first;
- the module tree with each module's share of the activations alive at the peak;
- what-ifs, the scaling exponent, the largest batch for a GPU and the per-rank figure
(``memfit.estimate.explain``);
- memory over the step as a picture, and the step as PyTorch's memory snapshot (``--timeline``,
  ``--snapshot``: ``memfit.estimate.timeline``).

``--device cuda`` (the default whenever ``--gpu_gib`` is given) estimates what a CUDA run keeps
(``memfit.estimate.rules``). The same result is the Python API: ``memfit.estimate(model_or_factory, inputs)``
(this module is callable) returns an ``EstimateResult`` whose ``to_dict()`` is the ``--json`` object.
A target may be a model by name (``hf:``, ``timm:``, ``torchvision:``; ``memfit.estimate.byname``) and any
target fine-tuned (``--lora``, ``--freeze``, ``--optimizer``, ``--accumulate``; ``memfit.estimate.finetune``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import UsageError, run_command
from memfit.estimate import explain, finetune, rules
from memfit.estimate.byname import load_target
from memfit.estimate.cuda_memory import CudaFigures
from memfit.estimate.fit import MARGIN
from memfit.estimate.target import DeviceTarget
from memfit.estimate.trace import (  # noqa: F401 - re-exported: the names `memfit.estimate` has always had
    BORN,
    CAT,
    DTYPE_NAMES,
    FREED,
    MODULE,
    NBYTES,
    OP,
    SAVED,
    SHAPE,
    SRC,
    Group,
    Target,
    Trace,
    TraceTracker,
    _load_callable,
    factory_step,
    fmt_bytes,
    log2_fit,
    make_target,
    merge_paths,
    module_pattern,
    parse_shape,
    trace_step,
    trace_target,
)
from memfit.estimate.tracker import GIB, WORKSPACES

MAX_RANKS = 2**20
MAX_BATCH = 2**31 - 1

# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------


def tree_rows(trace: Trace, min_share: float = 0.02, max_depth: int = 3) -> list[tuple[str, int, int]]:
    """(indented name, bytes, count) rows of the module tree; children that are numbered repeats of one
    another (layers.0, layers.1, ...) are shown once as `layers.*` with their count and the bytes of one."""
    shares = trace.module_shares()
    total = max(trace.activations_at_peak(), 1)
    rows: list[tuple[str, int, int]] = []

    def children(prefix: str) -> list[str]:
        depth = 0 if prefix == "" else prefix.count(".") + 1
        return [
            k
            for k in shares
            if k
            and not k.startswith("(")
            and k.count(".") == depth
            and (prefix == "" or k.startswith(prefix + "."))
        ]

    def visit(prefix: str, depth: int) -> None:
        if depth >= max_depth:
            return
        kids = children(prefix)
        numbered = [k for k in kids if k.rsplit(".", 1)[-1].isdigit()]
        others = [k for k in kids if k not in numbered]
        for k in sorted(others, key=lambda k: -shares[k]):
            if shares[k] >= min_share * total:
                rows.append(("  " * depth + k.rsplit(".", 1)[-1], shares[k], 1))
                visit(k, depth + 1)
        if numbered:
            biggest = max(numbered, key=lambda k: shares[k])
            sum_all = sum(shares[k] for k in numbered)
            if sum_all >= min_share * total:
                rows.append(("  " * depth + "*", sum_all, len(numbered)))
                visit(biggest, depth + 1)

    rows.append(("(model)", shares.get("", 0), 1))
    visit("", 1)
    for k in sorted(k for k in shares if k.startswith("(") and shares[k] >= min_share * total):
        rows.append((k, shares[k], 1))
    return rows


@dataclass
class EstimateResult:
    """One estimate: the traced step, and what `explain` added (what-ifs, scaling, fit, per-rank peak).

    ``peak_bytes`` / ``peak_gib``, ``by_category`` (bytes), ``top_tensors`` (``Group`` rows) and
    ``what_ifs`` are the figures; ``to_dict()`` is the ``--json`` object, ``format()`` the text."""

    target: Target
    trace: Trace
    top: int = 10
    what_ifs: list[explain.WhatIf] | None = None
    scaling: explain.Scaling | None = None
    fit: explain.BatchFit | None = None
    ranks: int = 1
    shard: str = "ddp"
    per_rank_bytes: int | None = None  # at the given batch, when ranks > 1
    fsdp_units: str | None = None  # with shard fsdp and ranks > 1: the units assumed (FsdpUnits.rule)
    extra: list[str] = field(default_factory=list)  # text sections after the main one
    cuda_kernels: str | None = (
        None  # on --device cuda: the cuda extra's kernels the step used (Target.describe)
    )
    fits: explain.Fits | None = None  # with what-ifs and a known capacity: does the step fit as it is
    _png: bytes | None = field(default=None, init=False, repr=False)  # the timeline, once drawn

    @property
    def peak_bytes(self) -> int:
        """The peak: on --device cuda the allocator peak (``torch.cuda.max_memory_allocated``)."""
        return self.trace.report.peak_bytes

    @property
    def cuda(self) -> CudaFigures | None:
        """On --device cuda: the three figures (allocator peak, reserved peak, card total) and their parts."""
        return self.trace.report.cuda

    @property
    def allocated_bytes(self) -> int | None:
        """The CUDA allocator peak (None for a CPU estimate)."""
        return None if self.cuda is None else self.cuda.allocated

    @property
    def reserved_bytes(self) -> int | None:
        """The CUDA caching allocator's reserved peak (None for a CPU estimate)."""
        return None if self.cuda is None else self.cuda.reserved

    @property
    def total_bytes(self) -> int | None:
        """The card total: reserved peak + CUDA context (None for a CPU estimate)."""
        return None if self.cuda is None else self.cuda.total

    @property
    def peak_gib(self) -> float:
        return self.trace.report.peak_gib

    @property
    def by_category(self) -> dict[str, int]:
        return dict(self.trace.report.by_category)

    @property
    def top_tensors(self) -> list[Group]:
        return self.trace.groups()[: self.top]

    def __repr__(self) -> str:
        return (
            f"<EstimateResult {self.target.label}: peak {fmt_bytes(self.peak_bytes)} ({self.target.device})>"
        )

    def _repr_pretty_(self, p, cycle) -> None:  # IPython / Jupyter shows the full text
        p.text(self.format())

    def timeline(self, path: str | os.PathLike | None = None) -> bytes:
        """Memory over the step as a PNG (``--timeline``): written to `path` when given; the bytes."""
        from memfit.estimate import timeline

        if self._png is None:
            title = f"memfit estimate {self.target.label}: {self.target.describe} ({self.target.device})"
            self._png = timeline.draw(self.trace, title)
        if path is not None:
            timeline.write(path, self._png, "--timeline")
        return self._png

    def snapshot(self, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """The step in PyTorch's memory-snapshot format (``--snapshot``; pytorch.org/memory_viz opens the
        file): pickled to `path` when given; the dict."""
        from memfit.estimate import timeline

        snap = timeline.snapshot(self.trace)
        if path is not None:
            timeline.write(path, timeline.pickled(snap), "--snapshot")
        return snap

    def _repr_png_(self) -> bytes:  # a notebook shows the timeline
        return self.timeline()

    def _repr_html_(self) -> str:  # ... with the text above it
        import base64
        import html

        png = base64.b64encode(self.timeline()).decode()
        return f"<pre>{html.escape(self.format())}</pre><img src='data:image/png;base64,{png}'/>"

    def to_dict(self) -> dict[str, Any]:
        r = self.trace.report
        total = max(self.trace.activations_at_peak(), 1)
        out = {
            "target": self.target.label,
            "setup": self.target.describe,
            "device": self.target.device,
            **({"cuda_kernels": self.cuda_kernels} if self.cuda_kernels else {}),
            "knobs": self.target.knobs,
            "peak_gib": r.peak_gib,
            **(self._cuda_dict() if self.cuda is not None else {}),
            "params": r.params,
            "by_category_gib": r.category_gib(),
            "top_tensors": [g.to_dict() for g in self.trace.groups()[: self.top]],
            "modules": [
                {"module": m, "activation_gib": b / GIB, "share": b / total}
                for m, b in sorted(self.trace.module_shares().items(), key=lambda kv: -kv[1])
            ],
        }
        base = r.peak_bytes
        if self.what_ifs is not None:
            out["what_ifs"] = [w.to_dict(base) for w in self.what_ifs]
            best = explain.recommend(base, self.what_ifs)
            out["try_first"] = None if best is None or self.fits is not None else best.name
            if self.fits is not None:
                out["fits"] = self.fits.to_dict()
        if self.scaling is not None:
            out["scaling"] = self.scaling.to_dict()
        if self.per_rank_bytes is not None:
            out["per_rank"] = {
                "ranks": self.ranks,
                "shard": self.shard,
                "peak_gib": self.per_rank_bytes / GIB,
            }
            if self.fsdp_units is not None:
                out["per_rank"]["fsdp_units"] = self.fsdp_units
        if self.fit is not None:
            out["fit"] = self.fit.to_dict()
        return out

    def _cuda_dict(self) -> dict[str, Any]:
        c = self.cuda
        assert c is not None
        return {
            "allocated_peak_gib": c.allocated / GIB,
            "reserved_peak_gib": c.reserved / GIB,
            "total_gib": c.total / GIB,
            "cuda": c.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        r = self.trace.report
        used = "CPU kernels"
        if self.target.device == "cuda":
            c = self.cuda
            used = "CUDA" + (f" kernels {self.cuda_kernels}" if self.cuda_kernels else "")
            used += f", {c.card.describe()}" if c is not None else ""
        peak = "allocator peak" if self.cuda is not None else "peak"
        lines = [
            f"memfit estimate {self.target.label}: {self.target.describe}, {used}",
            f"{peak} {fmt_bytes(r.peak_bytes)} = {split_text(r.by_category)}"
            f"   ({r.params / 1e6:.2f}M parameters)",
        ]
        if self.cuda is not None:
            lines += cuda_lines(self.cuda)
        lines += ["", "Largest tensors alive at the peak (activations; x N = one per repeated layer):"]
        header = (
            f"  {'op':<22} {'module':<34} {'shape':<24} {'dtype':<5} {'each':>10} {'x N':>5} {'total':>10}"
        )
        lines.append(header)
        for g in self.trace.groups()[: self.top]:
            saved = "" if g.saved == g.count else ("  (temporary)" if g.saved == 0 else "  (some saved)")
            lines.append(
                f"  {g.op[:22]:<22} {(g.module or '(top)')[-34:]:<34} {str(g.shape)[:24]:<24} {g.dtype:<5} "
                f"{fmt_bytes(g.nbytes):>10} {'x' + str(g.count):>5} {fmt_bytes(g.total):>10}{saved}"
            )
        lines += ["", "Module tree (activations alive at the peak made inside each module; * = repeated):"]
        total = max(self.trace.activations_at_peak(), 1)
        for name, nbytes, count in tree_rows(self.trace):
            each = f"  ({count} x {fmt_bytes(nbytes / count)})" if count > 1 else ""
            lines.append(f"  {name:<40} {fmt_bytes(nbytes):>10} {100 * nbytes / total:5.1f}%{each}")
        base = self.peak_bytes
        if self.what_ifs is not None:
            lines += ["", explain.format_what_ifs(base, self.what_ifs, self.fits)]
        if self.scaling is not None:
            lines += ["", self.scaling.format()]
        if self.per_rank_bytes is not None:
            lines += [
                "",
                f"Per rank at batch {self.target.knobs.get('batch', '?')} ({self.ranks} ranks, "
                f"{self.shard}): {fmt_bytes(self.per_rank_bytes)}",
            ]
            if self.fsdp_units is not None:
                lines.append(f"  FSDP units assumed: {self.fsdp_units}")
        if self.fit is not None:
            lines += ["", self.fit.format()]
        return "\n".join(lines)


def split_text(cats: dict[str, int]) -> str:
    """``params A + grads B + optimizer C + activations D [+ workspaces E]``: what is alive at the peak.
    Gradients exist only from their backward op until the optimizer step clears them, so a peak in the
    forward holds none: said instead of a bare "0 B"."""
    grads = cats.get("grads", 0)
    grads_text = fmt_bytes(grads) if grads else "0 B (none alive at the peak)"
    text = (
        f"params {fmt_bytes(cats.get('params', 0))} + grads {grads_text} + optimizer "
        f"{fmt_bytes(cats.get('optimizer', 0))} + activations {fmt_bytes(cats.get('activations', 0))}"
    )
    if WORKSPACES in cats:
        text += f" + CUDA library workspaces {fmt_bytes(cats[WORKSPACES])}"
    return text + ", alive at the peak"


def cuda_lines(c: CudaFigures) -> list[str]:
    """The CUDA target's other two figures and what the libraries allocated."""
    libs = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in c.libraries.items()) or "none"
    lines = [
        f"reserved peak {fmt_bytes(c.reserved)} (the caching allocator's segments: "
        "torch.cuda.max_memory_reserved)",
        f"card total {fmt_bytes(c.total)} = reserved + CUDA context {fmt_bytes(c.context)} "
        f"({c.card.context_note})",
        f"CUDA libraries: {libs}",
    ]
    return lines + [f"note: {n}" for n in c.notes]


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
    if fsdp_units is not None and (shard != "fsdp" or ranks < 2):
        raise UsageError("error: --fsdp_units names FSDP's units; give it with --shard fsdp --ranks N, N > 1")
    if gpu_gib is not None and not (math.isfinite(gpu_gib) and gpu_gib > 0):
        raise UsageError(f"error: --gpu_gib must be a positive number of GiB, got {gpu_gib:g}")
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
    margin: float = MARGIN,
    ranks: int = 1,
    shard: str = "ddp",
    top: int = 10,
    cuda_kernels: bool | None = None,
    gpu: str | None = None,
    task: str | None = None,
    lora: int | str | None = None,
    freeze: str | None = None,
    optimizer: str | None = None,
    accumulate: int | None = None,
    fsdp_units: str | None = None,
) -> EstimateResult:
    """``memfit.estimate(...)``: the training-step memory of a model, from a notebook.

    ``model``: an ``nn.Module`` (copied, never changed) or a function that builds one (cheaper: the
    estimate then builds it with fake tensors). ``inputs``: one shape (``"8x3x224x224"``, ``(8, 3, 224,
    224)``, a tensor, or ``"8x1024:int64"``) or a list of them, one per positional input. ``dtype``
    applies to inputs without one (default: token ids when the first layer is an ``nn.Embedding``, else
    float32); ``loss``: "classes", "same" or "sum" (as ``--target``); ``amp``: None, "bf16" or "fp16";
    ``device``: "cpu" or "cuda" (the kernels a CUDA run takes); ``explain``: the what-ifs (and the batch
    scaling); ``gpu_gib``: the largest batch under that GPU size; ``ranks`` / ``shard``: per-rank figures.
    ``fsdp_units`` (shard "fsdp"): a regular expression naming the modules FSDP wraps (``--fsdp_units``).
    ``cuda_kernels`` (device "cuda"): whether the GPU has the ``cuda`` extra's Mamba kernels (None: what
    this machine's GPU has, or yes without one; ``--no_cuda_kernels`` is False). ``gpu`` (device "cuda"):
    the card, as ``--gpu`` takes it ("h100", "a100", "8.6"; None: this machine's GPU, else an H200).
    ``model`` may also be a name, as the command line takes it: ``"hf:ORG/NAME"`` or ``"hf:path/to/dir"``
    (built from its config.json, no weights; ``task`` overrides the head: causal-lm, masked-lm,
    seq2seq-lm, classification, base), ``"timm:NAME"``, ``"torchvision:NAME"`` (``inputs`` optional for
    those two: their default resolution). Fine-tuning, for any model: ``lora`` (a rank, or
    ``"16:q_proj,v_proj"``), ``freeze`` (a regex of parameter names), ``optimizer`` (``"sgd:momentum=0.9"``,
    ``"adafactor"``: any torch.optim class) and ``accumulate`` (micro-batches per optimizer step).
    The result's ``to_dict()`` is what ``memfit estimate --json`` prints; on CUDA its three figures are
    ``allocated_bytes`` (the allocator peak, also ``peak_bytes``), ``reserved_bytes`` and ``total_bytes``.
    """
    ft = finetune.parse(lora, freeze, optimizer, accumulate)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    amp_name = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp, amp)  # type: ignore[arg-type]
    if amp_name not in ("none", "bf16", "fp16") or loss not in ("classes", "same", "sum"):
        raise UsageError(
            f"error: amp is None, 'bf16' or 'fp16' and loss 'classes', 'same' or 'sum'; got {amp!r}, {loss!r}"
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
        )


def _input_texts(inputs: str | tuple[int, ...] | torch.Tensor | list) -> list[str]:
    """The Python API's inputs as --input texts."""
    specs = inputs if isinstance(inputs, list) else [inputs]
    texts = []
    for s in specs:
        if isinstance(s, torch.Tensor):
            s = "x".join(map(str, s.shape)) + ":" + str(s.dtype).removeprefix("torch.")
        elif isinstance(s, tuple):
            s = "x".join(map(str, s))
        texts.append(str(s))
    return texts


def _module_target(
    model: nn.Module | Callable[[], nn.Module], texts: list[str], dtype: str | None, loss: str, amp_name: str
) -> Target:
    """The Target of an nn.Module (copied, never changed) or a function that builds one."""
    if isinstance(model, nn.Module):
        instance = model

        def factory() -> nn.Module:  # a fake copy is made from a real copy by build_model's fallback
            return copy.deepcopy(instance)

        label = type(model).__name__
    elif callable(model):
        factory, label = model, getattr(model, "__name__", "model")
    else:
        raise UsageError(
            "error: memfit.estimate needs an nn.Module, a function that builds one, or a name such as "
            f"'hf:ORG/NAME', not {model!r}"
        )
    return make_target(factory, label, texts, dtype, loss, amp_name)


class _CallableModule(types.ModuleType):
    """`memfit.estimate` is this module and, called, the Python API (`estimate_model`)."""

    def __call__(self, *args, **kwargs) -> EstimateResult:
        return estimate_model(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


# ----------------------------------------------------------------------------------------------------
# `memfit estimate`
# ----------------------------------------------------------------------------------------------------


GPU_HELP = (
    "the card a CUDA estimate is for, by name (h100, h200, a100, l4, ...) or compute capability (9.0, "
    "sm86): it sets the cuBLAS workspace size; default this machine's GPU, else h200"
)
MEASURE_HELP = (
    "on a machine with a GPU: also run the real steps there and print estimate and measurement side by "
    "side (allocated, reserved, total, by category)"
)
NO_CUDA_KERNELS_HELP = (
    "with --device cuda: a GPU without the cuda extra's mamba_ssm and causal-conv1d (the Mamba torch-op "
    "path); default: what this machine's GPU has, or the extra installed when there is no GPU"
)


SNAPSHOT_HELP = (
    "write the step in PyTorch's memory-snapshot format to this file (open it at pytorch.org/memory_viz); "
    "with --measure, the real step's snapshot too, beside it (NAME.measured.pickle)"
)


def add_parser(sub) -> None:
    """Register `memfit estimate` on the `memfit` subparsers."""
    p = sub.add_parser(
        "estimate",
        help="training-step memory of any model: peak, culprits, what-ifs, largest batch",
        description="Estimate the peak memory of one training step (forward, loss, backward, AdamW) of any "
        "PyTorch model under FakeTensorMode on the CPU, and say what holds it.",
    )
    p.add_argument(
        "target",
        help="path/to/file.py:func or package.module:func (func() returns a memfit.memory.TrainStep, or is "
        "a module factory: then give --input); or a model by name: hf:ORG/NAME or hf:path/to/dir (its "
        "config.json, no weights), timm:NAME, torchvision:NAME",
    )
    p.add_argument(
        "--input",
        action="append",
        help="input shape, e.g. 64x3x224x224, or 8x1024:int64 with its dtype (repeatable, one per input)",
    )
    p.add_argument(
        "--dtype",
        help="dtype of inputs given without one (default: int64 token ids when the model's first layer is "
        "an nn.Embedding, else float32)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="whose kernels to model: cuda = what a CUDA run keeps (fused attention, CUDA autocast, 512-byte "
        "allocator blocks); default cuda with --gpu_gib, else cpu",
    )
    p.add_argument("--no_cuda_kernels", action="store_true", help=NO_CUDA_KERNELS_HELP)
    p.add_argument(
        "--target",
        dest="loss_target",
        choices=["classes", "same", "sum"],
        default="classes",
        help="loss: cross-entropy over the output's last axis (classes), MSE to a tensor of the output's "
        "shape (same), or the output's sum",
    )
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="autocast (factories)")
    p.add_argument(
        "--task",
        help="an hf: model's head instead of config.json's architectures: causal-lm, masked-lm, seq2seq-lm, "
        "classification, base",
    )
    p.add_argument(
        "--lora",
        help="fine-tune with peft's LoRA of rank R on peft's default modules for the model (R:mod1,mod2 "
        "names them); needs memfit-core[finetune]",
    )
    p.add_argument("--freeze", help="freeze the parameters whose names match this regular expression")
    p.add_argument(
        "--optimizer",
        help="any torch.optim class by name with keywords, e.g. sgd:momentum=0.9, adafactor, "
        "adamw:betas=(0.9,0.95) (default: fused AdamW, or the TrainStep's)",
    )
    p.add_argument("--accumulate", help="micro-batches (forward + backward each) per optimizer step")
    p.add_argument("--top", type=int, default=10, help="how many tensor groups to list")
    p.add_argument("--explain", action="store_true", help="what-ifs: SDPA, bf16, checkpointing, half batch")
    p.add_argument("--scale", help="fit the activation exponent over 1x-4x of: batch, input:AXIS, or a knob")
    p.add_argument("--gpu_gib", type=float, help="largest batch that fits a GPU of this many GiB")
    p.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help="the share of --gpu_gib kept free (default %(default)g: the one margin memfit fit and the train "
        "pre-flight keep too)",
    )
    p.add_argument("--gpu", help=GPU_HELP)
    p.add_argument("--measure", action="store_true", help=MEASURE_HELP)
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks: the per-rank peak (and fit)")
    p.add_argument("--shard", choices=["ddp", "fsdp"], default="ddp", help="how ranks hold the state")
    p.add_argument(
        "--fsdp_units",
        metavar="REGEX",
        help="with --shard fsdp: the modules fully_shard wraps, by name matched whole (e.g. "
        "'layers\\.\\d+', or '\\d+' for the children of a Sequential); default: the repeated blocks, else "
        "the whole model as one unit (the report says which)",
    )
    p.add_argument("--max_batch", type=int, default=4096)
    p.add_argument("--json", action="store_true", help="everything as one JSON object")
    p.add_argument("--timeline", metavar="PNG", help="draw memory over the step to this PNG file")
    p.add_argument("--snapshot", metavar="PICKLE", help=SNAPSHOT_HELP)
    p.set_defaults(func=main)


def main(args) -> int:
    """`memfit estimate`; every user mistake is one `error:` line and exit status 2."""
    return run_command("memfit estimate", lambda _: _main(args), None)


def _main(args) -> int:
    """The command, its user's code run in a child process (memfit.estimate.child): a target that exits or
    kills itself is one line naming how and when, not a silent exit 7 or 137."""
    from memfit.estimate.child import in_child

    return in_child(lambda: _estimate_command(args))


def _estimate_command(args) -> int:
    if args.measure:
        from memfit.estimate.measure import require_gpu

        require_gpu()
        if args.device == "cpu":
            raise UsageError("error: --measure compares a CUDA estimate with the GPU: drop --device cpu")
    cuda_default = args.gpu_gib is not None or args.measure
    on = DeviceTarget.from_flags(
        args.device or ("cuda" if cuda_default else "cpu"), args.gpu, False if args.no_cuda_kernels else None
    )
    for flag, path in (("--timeline", args.timeline), ("--snapshot", args.snapshot)):
        if path:  # refused before the work
            from memfit.estimate.timeline import check_path

            check_path(path, flag)
    ft = finetune.parse(args.lora, args.freeze, args.optimizer, args.accumulate)
    target = load_target(args.target, args.input, args.dtype, args.loss_target, args.amp, task=args.task)
    target.device = on.device
    target = finetune.apply(target, ft)
    with on.entered():
        result = estimate(
            target,
            args.top,
            what_ifs=args.explain,
            scale=args.scale,
            gpu_gib=args.gpu_gib,
            margin=args.margin,
            ranks=args.ranks,
            shard=args.shard,
            fsdp_units=args.fsdp_units,
            max_batch=args.max_batch,
        )
    fit = result.fit
    if fit is not None and fit.batch == 0:
        needs = "of the card (reserved + CUDA context)" if fit.cuda else "per rank"
        raise UsageError(
            f"error: nothing fits {args.gpu_gib:g} GiB ({100 * args.margin:g}% margin): batch 1 needs "
            f"{fmt_bytes(fit.peak_bytes)} {needs}; try --explain for what would shrink it"
        )
    if args.timeline:
        result.timeline(args.timeline)
        print(f"memfit estimate: wrote the timeline to {args.timeline}", file=sys.stderr)
    if args.snapshot:
        result.snapshot(args.snapshot)
        where = f"memfit estimate: wrote the snapshot to {args.snapshot}"
        print(f"{where} (open it at pytorch.org/memory_viz)", file=sys.stderr)
    if args.measure:
        from memfit.estimate.measure import estimate_measure, format_rows, measured_snapshot_path

        real = measured_snapshot_path(args.snapshot) if args.snapshot else None
        row = estimate_measure(target.step(), target.label, False if args.no_cuda_kernels else None, real)
        if real is not None and "skipped" not in row:
            print(f"memfit estimate: wrote the measured step's snapshot to {real}", file=sys.stderr)
        if args.json:
            print(json.dumps({**result.to_dict(), "measure": row}, indent=2))
        else:
            print(result.format() + "\n\n" + format_rows([row]))
        return 0
    print(result.to_json() if args.json else result.format())
    return 0
