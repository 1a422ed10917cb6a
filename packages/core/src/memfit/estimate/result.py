"""What an estimate gives back: ``EstimateResult`` (the figures, ``to_dict()`` the ``--json`` object,
``format()`` the text, the picture and the snapshot), and the text's pieces (the split line, the CUDA
figures, the module tree)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from memfit.estimate import explain
from memfit.estimate.cuda_memory import CudaFigures
from memfit.estimate.trace import (
    Group,
    Target,
    Trace,
    fmt_bytes,
)
from memfit.estimate.tracker import GIB, WORKSPACES


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
    def batch_helps(self) -> bool:
        """Whether a smaller batch can be the fix: not when the batch search found that not even the
        smallest batch fits."""
        return not (self.fit is not None and self.fit.batch == 0)

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
            best = explain.recommend(base, self.what_ifs, self.batch_helps)
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
            lines += ["", explain.format_what_ifs(base, self.what_ifs, self.fits, self.batch_helps)]
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
