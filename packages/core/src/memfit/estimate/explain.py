"""`memfit estimate --explain / --scale / --gpu_gib`: what-ifs on one traced step, and the largest batch.

What-ifs (each a row with its saving against the step as given):

- **bf16 autocast**: the step re-traced with ``amp_dtype=bfloat16`` (skipped when it already uses it).
- **activation checkpointing per block**: blocks are found automatically as the repeated children of an
  ``nn.ModuleList`` / ``nn.Sequential`` (children of one class, at least two, that have submodules; the
  outermost such level); each block's forward is wrapped in ``torch.utils.checkpoint`` (non-reentrant)
  and the step re-traced.
- **SDPA in place of softmax(QKᵀ)V**: no new trace. An attention is a ``softmax`` whose input comes, through
  at most four elementwise ops (scale, mask, cast), from a batched matmul (``bmm``/``baddbmm``). Every
  activation with that score shape (same element count, same last two dimensions: the scores, the scaled
  and masked copies, the probabilities, their casts and dropout masks, and their gradients in backward) is
  removed from the traced timeline, and each attention instead keeps SDPA's fp32 log-sum-exp, (..., Lq),
  for as long as its softmax lived. The peak of that replayed timeline is the prediction.
- **batch halved**: re-traced at half the batch (needs a ``batch`` knob).

``scaling()`` re-traces at 1x, 2x and 4x of a knob and fits the exponent of activation memory; above 1.3 it
names the op whose tensors grow fastest. ``fit_batch()`` is the largest batch under a GPU size, per rank
for DDP (each rank holds everything, plus DDP's gradient buckets: one more copy of the gradients) or FSDP
(parameters, gradients and optimizer state divided by the ranks, plus three blocks' parameter bytes: the
block computing, the one prefetched, and the computing block's unsharded gradients); see
``per_rank_bytes``, checked against real two-rank runs by ``measure_per_rank``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import UsageError
from memfit.estimate import finetune
from memfit.estimate.fit import MARGIN, largest_batch, needed_bytes, usable_bytes
from memfit.estimate.trace import (
    BORN,
    CAT,
    FREED,
    OP,
    SHAPE,
    SRC,
    Target,
    Trace,
    fmt_bytes,
    log2_fit,
    merge_paths,
    module_pattern,
    trace_step,
    trace_target,
)
from memfit.estimate.tracker import GIB
from memfit.step import TrainStep

MATMULS = {"bmm", "baddbmm"}  # batched: attention scores; a classifier's addmm -> log_softmax is not one


# ----------------------------------------------------------------------------------------------------
# Blocks and checkpointing
# ----------------------------------------------------------------------------------------------------


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Repeated children of a ModuleList/Sequential (same class, >= 2, with submodules), outermost level."""
    blocks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        kids = list(mod.named_children())
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(c) for _, c in kids)
            repeated = [(n, c) for n, c in kids if counts[type(c)] >= 2 and any(True for _ in c.children())]
            if repeated:
                blocks.extend((prefix + n, c) for n, c in repeated)
                kids = [(n, c) for n, c in kids if (n, c) not in repeated]
        for n, c in kids:
            visit(prefix + n + ".", c)

    visit("", model)
    return blocks


def checkpointed(step: TrainStep) -> TrainStep:
    """The same step with every automatically found block run under non-reentrant checkpointing; a
    transformers model uses its own switch (``gradient_checkpointing_enable``), which knows its blocks'
    keyword arguments (masks, position embeddings) and turns the key/value cache off."""

    def build():
        model = step.build_model()
        if getattr(model, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
                return model
            if hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
                return model
        for _, block in find_blocks(model):
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        return model

    return replace(step, build_model=build)


def _meta_model(step: TrainStep) -> nn.Module:
    """The step's model built on the meta device (no memory), else under fake tensors."""
    try:
        with torch.device("meta"):
            return step.build_model()
    except Exception:  # a model that cannot be built on meta: look for blocks under fake tensors instead
        from memfit.estimate.tracker import fake_mode

        with fake_mode():
            return step.build_model()


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def block_param_bytes(step: TrainStep) -> tuple[int, int]:
    """(largest block's parameter bytes, number of blocks), built on the meta device (no memory)."""
    model = _meta_model(step)
    sizes = [_param_bytes(b) for _, b in find_blocks(model)]
    if not sizes:
        return _param_bytes(model), 0
    return max(sizes), len(sizes)


@dataclass(frozen=True)
class FsdpUnits:
    """The modules FSDP2's ``fully_shard`` wraps before the root: each a unit whose parameters are gathered
    whole while it computes. ``rule`` says how they were chosen (the report shows it)."""

    names: tuple[str, ...]  # () : the whole model is one unit
    largest_bytes: int  # the largest unit's parameter bytes
    rule: str

    @property
    def gathered_bytes(self) -> int:
        """What is held unsharded beside the sharded state at a rank's peak (per_rank_bytes): three units'
        parameter bytes with two or more units, else two copies of the one unit (parameters and grads)."""
        return (3 if len(self.names) >= 2 else 2) * self.largest_bytes


def unit_modules(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """The modules to wrap: those whose name (``layers.3``, ``0``) `pattern` matches whole, outermost only;
    without a pattern, the repeated blocks (find_blocks). UsageError for a pattern that matches nothing."""
    if pattern is None:
        return find_blocks(model)
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UsageError(f"error: --fsdp_units {pattern!r} is not a regular expression ({e})") from None
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and rx.fullmatch(name) and not any(name.startswith(u + ".") for u, _ in units):
            units.append((name, module))
    if not units:
        # the model's names, repeated layers once, written as patterns that match them (`layers.\d+`)
        names = list(
            dict.fromkeys(module_pattern(n).replace("*", r"\d+") for n, _ in model.named_modules() if n)
        )
        if not names:
            raise UsageError(f"error: --fsdp_units {pattern!r}: the model has no submodules; leave it out")
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise UsageError(
            f"error: --fsdp_units {pattern!r} matches no module name (whole); give one that does, e.g. one "
            f"of {shown}"
        )
    return units


def fsdp_units(step: TrainStep, pattern: str | None = None) -> FsdpUnits:
    """The FSDP units of the step's model: those `pattern` names (``--fsdp_units``), else its repeated
    blocks, else the whole model as one unit; built on the meta device."""
    model = _meta_model(step)
    units = unit_modules(model, pattern)
    if not units:
        rule = ("the whole model is one unit (no repeated blocks with submodules found; --fsdp_units REGEX "
                "names the modules to wrap)")  # fmt: skip
        return FsdpUnits((), _param_bytes(model), rule)
    names = tuple(n for n, _ in units)
    sizes = [_param_bytes(m) for _, m in units]
    which = f"modules matching --fsdp_units '{pattern}'" if pattern is not None else "repeated blocks"
    rule = f"{len(names)} {which} ({merge_paths(set(names))}), largest {fmt_bytes(max(sizes))}, then the root"
    return FsdpUnits(names, max(sizes), rule)


def fsdp_gathered_bytes(step: TrainStep, pattern: str | None = None) -> int:
    """FsdpUnits.gathered_bytes of the step's model (``fsdp_units``)."""
    return fsdp_units(step, pattern).gathered_bytes


# ----------------------------------------------------------------------------------------------------
# Attention found in the graph
# ----------------------------------------------------------------------------------------------------


SOFTMAXES = {"softmax", "safe_softmax"}  # safe_softmax: F.scaled_dot_product_attention's math path


def attention_softmaxes(trace: Trace, hops: int = 4) -> list[list]:
    """Forward softmax records whose input comes from a matmul within `hops` ops: materialised attention
    (written out, or F.scaled_dot_product_attention falling back to its math path)."""
    found = []
    for r in trace.records:
        if r[OP] not in SOFTMAXES or len(r[SHAPE]) < 3 or r[SHAPE][-1] < 2:
            continue
        src = r[SRC]
        for _ in range(hops):
            if src is None:
                break
            if src[OP] in MATMULS:
                found.append(r)
                break
            src = src[SRC]
    return found


def sdpa_replay(trace: Trace) -> tuple[int, int, list[tuple]] | None:
    """Peak when every materialised attention is SDPA instead; None if the graph shows none.
    Returns (peak bytes, attention count, [(score shape, dtype name)])."""
    soft = attention_softmaxes(trace)
    if not soft:
        return None
    keys = {(math.prod(r[SHAPE]), r[SHAPE][-2], r[SHAPE][-1]) for r in soft}

    def is_score(r: list) -> bool:
        s = r[SHAPE]
        return r[CAT] == "activations" and len(s) >= 2 and (math.prod(s), s[-2], s[-1]) in keys

    end = max(r[FREED] or r[BORN] for r in trace.records) + 1
    lse = [(math.prod(r[SHAPE]) // r[SHAPE][-1] * 4, r[BORN], r[FREED] or end) for r in soft]
    peak, _ = trace.replay(drop=is_score, add=lse)
    shapes = sorted({r[SHAPE] for r in soft})
    return peak, len(soft), shapes


# ----------------------------------------------------------------------------------------------------
# What-ifs
# ----------------------------------------------------------------------------------------------------


@dataclass
class WhatIf:
    name: str
    peak_bytes: int | None  # None: not applicable (see note)
    note: str = ""

    def saving(self, base: int) -> int:
        return 0 if self.peak_bytes is None else base - self.peak_bytes

    def to_dict(self, base: int) -> dict[str, Any]:
        return {
            "what_if": self.name,
            "peak_gib": None if self.peak_bytes is None else self.peak_bytes / GIB,
            "saving_gib": self.saving(base) / GIB,
            "saving_fraction": self.saving(base) / base if base else 0.0,
            "note": self.note,
        }


def _retrace(step: TrainStep, device: str = "cpu") -> int | str:
    try:
        return trace_step(step, device=device).report.peak_bytes
    except Exception as exc:  # a what-if the model does not support is a row, not a crash
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def what_ifs(target: Target, trace: Trace) -> list[WhatIf]:
    step = target.step()
    rows = []
    sd = sdpa_replay(trace)
    if sd is None:
        rows.append(WhatIf("SDPA in place of softmax(QK^T)V", None, "no materialised attention in the graph"))
    else:
        peak, n, shapes = sd
        fallback = sum(r[OP] == "safe_softmax" for r in attention_softmaxes(trace))
        note = (
            f"{n} softmax(QK^T) of shape {', '.join(map(str, shapes[:3]))} (cross-attention to "
            "fewer keys or a feed-forward block would also remove them)"
        )
        if fallback:
            # on the CPU target the math path may be the CPU's choice; the CUDA target already takes CUDA's
            why = (
                "CUDA's choice for these inputs: fp32 with grouped heads, or a head size or dtypes its fused "
                "kernels do not take"
                if target.device == "cuda"
                else "dropout, a mask or the CPU's kernels"
            )
            where = "" if target.device == "cuda" else " (--device cuda models a CUDA run's choice)"
            note = (
                f"{fallback} of {n} are F.scaled_dot_product_attention on its math path ({why}), shape "
                f"{', '.join(map(str, shapes[:3]))}: a fused kernel keeps none{where}"
            )
        rows.append(WhatIf("SDPA in place of softmax(QK^T)V", peak, note))
    if step.amp_dtype is None:
        rows.append(
            _retraced("bf16 autocast", _retrace(replace(step, amp_dtype=torch.bfloat16), target.device))
        )
    else:
        rows.append(WhatIf("bf16 autocast", None, f"already autocast to {step.amp_dtype}"))
    nblocks = block_param_bytes(step)[1]
    if nblocks:
        got = _retrace(checkpointed(step), target.device)
        note = "blocks: repeated children of a ModuleList/Sequential"
        rows.append(_retraced(f"checkpoint each of {nblocks} blocks", got, note))
    else:
        rows.append(WhatIf("checkpoint each block", None, "no repeated blocks (ModuleList/Sequential) found"))
    if "batch" in target.knobs and target.knobs["batch"] >= 2:
        b = target.knobs["batch"] // 2
        rows.append(_retraced(f"batch halved ({b})", _retrace(target.step(batch=b), target.device)))
    else:
        rows.append(WhatIf("batch halved", None, "no batch knob"))
    return rows + finetune_what_ifs(step, target.device)


def finetune_what_ifs(step: TrainStep, device: str) -> list[WhatIf]:
    """LoRA r=16 (peft's default modules; when peft knows the model and it has no LoRA yet) and plain SGD
    (when the optimizer keeps Adam's two moments): rows only where they apply."""
    rows = []
    if finetune.lora_applies(step):
        lora = finetune.FineTune(lora=16)
        note = "peft's default target modules; base weights frozen"
        rows.append(_retraced("LoRA r=16", _retrace(finetune.finetuned(step, lora, device), device), note))
    if (adam := finetune.adam_like(step)) is not None:
        sgd = finetune.FineTune(optimizer=torch.optim.SGD, optimizer_kwargs={})
        note = "plain SGD keeps no state (with momentum: one buffer per parameter)"
        rows.append(
            _retraced(f"SGD instead of {adam}", _retrace(finetune.finetuned(step, sgd, device), device), note)
        )
    return rows


def _retraced(name: str, got: int | str, note: str = "") -> WhatIf:
    """A what-if row from _retrace's answer: a peak in bytes, or the reason the variant failed."""
    return WhatIf(name, got, note) if isinstance(got, int) else WhatIf(name, None, got)


def recommend(base: int, rows: list[WhatIf], batch_helps: bool = True) -> WhatIf | None:
    """The fix to try first. A materialised attention that holds >= 10% of the peak comes first even when
    checkpointing would save more: SDPA removes it at no extra compute (checkpointing adds a forward).
    Otherwise the row with the largest saving. `batch_helps` False (not even batch 1 fits): a smaller
    batch is never the fix."""
    useful = [
        w
        for w in rows
        if w.peak_bytes is not None
        and w.saving(base) > 0
        and (batch_helps or not w.name.startswith("batch "))
    ]
    sdpa = [w for w in useful if w.name.startswith("SDPA") and w.saving(base) >= 0.1 * base]
    if sdpa:
        return sdpa[0]
    return max(useful, key=lambda w: w.saving(base), default=None)


def format_what_ifs(base: int, rows: list[WhatIf], fits: Fits | None = None, batch_helps: bool = True) -> str:
    lines = ["What-ifs (the same step re-estimated; largest saving first):"]
    lines.append(f"  {'what-if':<34} {'peak':>10} {'saving':>10} {'':>6}  note")
    ordered = sorted(rows, key=lambda w: (w.peak_bytes is None, -w.saving(base)))
    for w in ordered:
        if w.peak_bytes is None:
            lines.append(f"  {w.name:<34} {'-':>10} {'-':>10} {'':>6}  {w.note}")
        else:
            pct = 100 * w.saving(base) / base if base else 0
            lines.append(
                f"  {w.name:<34} {fmt_bytes(w.peak_bytes):>10} {fmt_bytes(w.saving(base)):>10} "
                f"{pct:5.1f}%  {w.note}"
            )
    best = recommend(base, rows, batch_helps)
    if fits is not None and fits.fits:  # nothing needs cutting
        lines.append(f"The step {fits.format()}")
    elif best is not None:
        lines.append(
            f"Try first: {best.name} (-{fmt_bytes(best.saving(base))}, peak {fmt_bytes(best.peak_bytes)})"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Scaling
# ----------------------------------------------------------------------------------------------------


@dataclass
class Scaling:
    knob: str
    sizes: list[int]
    activations: list[int]
    exponent: float
    culprit: dict[str, Any] | None  # the op whose tensors grow fastest, when exponent > 1.3

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["activation_bytes"] = out.pop("activations")
        return out

    def format(self) -> str:
        pts = ", ".join(f"{s}: {fmt_bytes(a)}" for s, a in zip(self.sizes, self.activations))
        line = f"Scaling of activations with {self.knob} ({pts}): exponent {self.exponent:.2f}"
        if self.culprit:
            c = self.culprit
            line += (
                f"\n  SUPER-LINEAR (> 1.3): `{c['op']}` in `{c['module']}` grows with exponent "
                f"{c['exponent']:.2f} ({fmt_bytes(c['bytes'][0])} -> {fmt_bytes(c['bytes'][-1])}, "
                f"shape {tuple(c['shape'])} at {self.sizes[-1]})"
            )
        return line


def scaling(target: Target, knob: str, base_trace: Trace | None = None, factors=(1, 2, 4)) -> Scaling:
    if knob not in target.knobs:
        names = ", ".join(target.knobs) or "none"
        raise UsageError(f"error: --scale {knob!r} is not a knob of this target; its knobs: {names}")
    base = target.knobs[knob]
    sizes = [base * f for f in factors]
    traces = [
        base_trace if (f == 1 and base_trace is not None) else trace_target(target, **{knob: s})
        for f, s in zip(factors, sizes)
    ]
    highs = [t.activations_high() for t in traces]  # the activations' own high-water mark at each size
    acts = [b for b, _ in highs]
    k = log2_fit(sizes, acts)
    culprit = None
    if k > 1.3:
        per_key = []
        for t, (_, seq) in ((traces[0], highs[0]), (traces[-1], highs[-1])):
            totals: dict[tuple, list] = {}
            for g in t.groups(seq=seq):
                e = totals.setdefault((g.op, g.module), [0, g.shape])
                e[0] += g.total
            per_key.append(totals)
        best = None
        for key, (b4, shape) in per_key[1].items():
            b1 = per_key[0].get(key, [0])[0]
            if b1 <= 0:
                continue
            grow = b4 - b1
            if best is None or grow > best[0]:
                best = (grow, key, b1, b4, shape)
        if best is not None:
            _, (op, module), b1, b4, shape = best
            culprit = {
                "op": op,
                "module": module,
                "shape": list(shape),
                "bytes": [b1, b4],
                "exponent": math.log(b4 / b1) / math.log(sizes[-1] / sizes[0]),
            }
    return Scaling(knob, sizes, acts, k, culprit)


# ----------------------------------------------------------------------------------------------------
# Largest batch on a GPU, per rank
# ----------------------------------------------------------------------------------------------------


def per_rank_bytes(trace: Trace, ranks: int, shard: str, gathered_bytes: int = 0) -> int:
    """One rank's peak from the single-process trace.

    DDP: everything, plus its gradient buckets (one more copy of the gradients, the size of the
    parameters). FSDP2 (``fully_shard`` on every block, then the root): parameters, gradients and optimizer
    state divided by the ranks, plus ``gathered_bytes`` (``fsdp_gathered_bytes``): three blocks' worth
    of parameter bytes (the block computing in backward with its gathered parameters, the next block's
    prefetched, and the block's unsharded gradients until they are reduce-scattered). Checked against
    real two-rank gloo runs on CPU (``measure_per_rank``; tests/test_estimate.py): DDP equal to the byte
    over the single-process measurement, FSDP within 5%.
    """
    cats = trace.report.by_category
    peak = trace.report.peak_bytes
    if ranks <= 1 or shard == "none":
        return peak
    if shard == "ddp":
        return peak + cats.get("params", 0)  # gradient buckets: one more copy of the gradients
    state = cats.get("params", 0) + cats.get("grads", 0) + cats.get("optimizer", 0)
    return peak - state + math.ceil(state / ranks) + gathered_bytes


def sharded(step: TrainStep, shard: str, units: str | None = None) -> TrainStep:
    """The step with its model wrapped as `shard` says: DDP, or FSDP2's fully_shard on every unit
    (unit_modules: those `units` names, else the blocks find_blocks finds) and then on the root (the
    process group must be up)."""

    def build():
        model = step.build_model()
        if shard == "ddp":
            return nn.parallel.DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        for _, block in unit_modules(model, units):
            fully_shard(block)
        return fully_shard(model)

    return replace(step, build_model=build)


def measure_per_rank(
    spec: str,
    inputs: list[str] | None,
    shard: str,
    ranks: int = 2,
    loss_target: str = "classes",
    units: str | None = None,
) -> list[int]:
    """Each rank's real peak of `memfit estimate SPEC --input ...`'s step under DDP or FSDP2 (its units:
    `units` as --fsdp_units names them, else the repeated blocks): `ranks` processes (torch.multiprocessing
    spawn, gloo on CPU), each measured as measure_training_step does."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (ranks, port, spec, inputs, loss_target, shard, queue, units)
    procs = [ctx.Process(target=_rank_worker, args=(r, *args)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
    bad = {r: v for r, v in results.items() if isinstance(v, str)}
    if bad:
        raise RuntimeError(f"rank failed: {bad}")
    return [results[r] for r in range(ranks)]


def _rank_worker(rank, ranks, port, spec, inputs, loss_target, shard, queue, units=None) -> None:
    import os

    import torch.distributed as dist

    from memfit.estimate.steps import measure_training_step
    from memfit.estimate.trace import load_target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        step = load_target(spec, inputs, target=loss_target).step()
        queue.put((rank, measure_training_step(sharded(step, shard, units)).peak_bytes))
    except Exception as exc:  # reported by the parent
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@dataclass
class BatchFit:
    gpu_gib: float
    margin: float
    ranks: int
    shard: str
    batch: int  # 0 when not even the smallest batch fits
    peak_bytes: int  # what one rank needs at `batch` (at `smallest` when nothing fits): a CUDA card total
    next_bytes: int | None  # at the first batch that does not fit; None: the search's cap (max_batch) fits
    probes: int
    cuda: bool = False  # the figures are a CUDA estimate's card totals
    smallest: int = 1  # the smallest batch searched: 2 where the step cannot train at 1 (BatchNorm)

    @property
    def capped(self) -> bool:
        """The search stopped at its cap (``max_batch``), which fits: the largest batch is at least this."""
        return self.batch > 0 and self.next_bytes is None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["capped"] = self.capped
        out["peak_gib_per_rank"] = out.pop("peak_bytes") / GIB
        nxt = out.pop("next_bytes")
        out["next_gib_per_rank"] = None if nxt is None else nxt / GIB
        return out

    def format(self) -> str:
        usable = usable_bytes(self.gpu_gib, self.margin)
        what = "the card total" if self.cuda else "the peak"
        where = (
            f"{self.gpu_gib:g} GiB GPU ({100 * self.margin:g}% margin: {usable:.2f} GiB usable for {what})"
        )
        if self.ranks > 1:
            where += f" x {self.ranks} ranks ({self.shard}, per rank)"
        parts = [f"{what} {fmt_bytes(self.peak_bytes)}" if self.cuda else fmt_bytes(self.peak_bytes)]
        if self.next_bytes is not None:
            parts.append(f"batch {self.batch + 1} needs {fmt_bytes(self.next_bytes)}")
        if self.capped:
            parts.append("--max_batch stops the search there")
        if self.smallest > 1:
            parts.append(f"batch 1 cannot train, so the search started at {self.smallest}")
        batch = f"at least {self.batch}" if self.capped else self.batch
        return f"Largest batch that fits a {where}: {batch} ({'; '.join(parts)})"


def rank_needs(trace: Trace, ranks: int, shard: str, gather: int = 0, device: str = "cuda") -> int:
    """What one rank needs of its device (the margin rule's ``fit.needed_bytes``): its peak
    (``per_rank_bytes``) plus what ``needed_bytes`` adds to the peak (a CUDA estimate's reserved segments
    and CUDA context; on the CPU malloc's overhead)."""
    report = trace.report
    return per_rank_bytes(trace, ranks, shard, gather) + needed_bytes(report, device) - report.peak_bytes


def fit_batch(
    target: Target,
    gpu_gib: float,
    margin: float = MARGIN,
    ranks: int = 1,
    shard: str = "ddp",
    max_batch: int = 4096,
    base_trace: Trace | None = None,
    device: str = "cuda",
    units: str | None = None,
) -> BatchFit:
    """The largest batch whose step fits a GPU of ``gpu_gib`` under the margin rule (``memfit.estimate.fit``):
    a CUDA estimate's card total per rank, a CPU estimate's peak (``device="cpu"``: ``gpu_gib`` is the
    CPU's memory, and the step needs its tensors times ``fit.CPU_OVERHEAD``)."""
    if "batch" not in target.knobs:
        raise UsageError(
            "error: --gpu_gib needs a batch knob: give your function a `batch` keyword argument, "
            "e.g. def step(batch: int = 32) -> TrainStep"
        )
    gather = fsdp_gathered_bytes(target.step(), units) if shard == "fsdp" and ranks > 1 else 0
    base_b = target.knobs["batch"]

    def needs_gib(b: int) -> float:
        t = base_trace if (b == base_b and base_trace is not None) else trace_target(target, batch=b)
        return rank_needs(t, ranks, shard, gather, device) / GIB

    b, gib, nxt, probes, first = largest_batch(needs_gib, usable_bytes(gpu_gib, margin), max_batch)
    nxt_bytes = None if nxt is None else round(nxt * GIB)
    cuda = target.device == "cuda"
    return BatchFit(gpu_gib, margin, ranks, shard, b, round(gib * GIB), nxt_bytes, probes, cuda, first)


@dataclass
class Fits:
    """Whether the step as given fits a device whose memory is known (``--gpu_gib``, this machine's GPU
    for a CUDA estimate, its available RAM for a CPU one), and the largest batch that does."""

    where: str  # "a 24 GiB GPU", "this machine's available RAM (22.3 GiB)"
    needed_bytes: int
    usable_bytes: int
    batch: int | None  # the largest batch that fits (None: the step has no batch knob)
    capped: bool = False  # `batch` is the search's cap (max_batch), which fits: the largest is at least it

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "fits": self.fits,
            "needed_gib": self.needed_bytes / GIB,
            "usable_gib": self.usable_bytes / GIB,
            "largest_batch": self.batch,
            "largest_batch_capped": self.capped,
        }

    def format(self) -> str:
        batch = f"largest batch {self.batch}" if self.batch is not None else "no batch knob to grow"
        if self.capped:
            batch = f"largest batch at least {self.batch}, where --max_batch stops the search"
        return (
            f"fits; {batch} (needs {fmt_bytes(self.needed_bytes)} of {fmt_bytes(self.usable_bytes)} "
            f"usable on {self.where})"
        )


def check_fits(
    target: Target,
    trace: Trace,
    capacity: int,
    where: str,
    device: str,
    margin: float = MARGIN,
    fit: BatchFit | None = None,
    max_batch: int = 4096,
) -> Fits:
    """The margin rule on the step as given; when it fits, the largest batch (``fit``'s when the caller
    already searched, else a search here)."""
    needed = needed_bytes(trace.report, device)
    usable = int(usable_bytes(capacity, margin))
    batch = None
    if needed <= usable and "batch" in target.knobs:
        if fit is None:
            fit = fit_batch(
                target, capacity / GIB, margin, max_batch=max_batch, base_trace=trace, device=device
            )
        batch = fit.batch
    return Fits(where, needed, usable, batch, fit is not None and fit.capped)
