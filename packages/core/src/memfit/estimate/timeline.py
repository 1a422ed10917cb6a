"""The traced step to look at: memory over the step as a picture (``--timeline out.png``), and the step in
PyTorch's memory-snapshot format (``--snapshot out.pickle``), which pytorch.org/memory_viz and
``torch.cuda._memory_viz`` read as they read ``torch.cuda.memory._snapshot()``.

Both show the same timeline: every storage of the trace (``memfit.estimate.trace``) from its birth to its
free, in the order they happened, up to the end of the last step (the teardown after it is left out, so
the snapshot ends as a real one taken after a training step would: parameters and optimizer state alive).
Each storage gets a block of the caching allocator's simulation (``memfit.estimate.allocator``): an
address, a block size and the segments cudaMalloc would hand out. On a CUDA estimate those blocks are what
the allocator peak counts, and the picture stacks them; on a CPU estimate they only place the tensors, and
the picture stacks each storage's own bytes, as the CPU peak counts them.
"""

from __future__ import annotations

import bisect
import io
import os
import pickle
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UsageError, os_error_message
from memfit.estimate import allocator
from memfit.estimate.cuda_memory import allocator_config
from memfit.estimate.trace import (
    BORN,
    CAT,
    DTYPE,
    DTYPE_NAMES,
    FREED,
    MODULE,
    NBYTES,
    OP,
    SAVED,
    SHAPE,
    Trace,
    fmt_bytes,
)
from memfit.estimate.tracker import WORKSPACES

# the picture's layers, bottom up: (label, colour)
LAYERS = (
    ("parameters", "#4e79a7"),
    ("gradients", "#f28e2c"),
    ("optimizer state", "#59a14f"),
    ("activations saved for backward", "#e15759"),
    ("temporaries", "#f1a7a9"),
    ("CUDA library workspaces", "#9c755f"),
)
_LAYER_OF = {"params": 0, "grads": 1, "optimizer": 2, WORKSPACES: 5}
# the phases a step goes through, as shaded: (label, colour); input and loss belong to the forward
_SHADE = {
    "build": ("build", "#bbbbbb"),
    "input": ("forward", "#a0c4e8"),
    "forward": ("forward", "#a0c4e8"),
    "loss": ("forward", "#a0c4e8"),
    "backward": ("backward", "#f4b183"),
    "optimizer": ("optimizer", "#b5d99c"),
}
MAX_POINTS = 4000  # a longer timeline is drawn from the highest point of each of this many stretches


def layer(record: list) -> int:
    """Which of LAYERS a storage is drawn in."""
    i = _LAYER_OF.get(record[CAT])
    if i is None:  # activations: saved for backward or not
        i = 3 if record[SAVED] else 4
    return i


# ----------------------------------------------------------------------------------------------------
# The layout both share: every storage's block, in order
# ----------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """The trace up to the end of its last step, each storage in a block of the caching allocator."""

    trace: Trace
    events: list[tuple[int, int, int]]  # (seq, record index, +1 allocated / -1 freed), in order
    blocks: dict[int, tuple[int, int]]  # record index -> (address, size) of the block it was given
    segments: list[tuple[int, int, int, bool]]  # (record index that asked, address, size, small): cudaMalloc
    sim: allocator.CachingAllocatorSim  # as it stands at the end of the last step
    end: int  # the seq where the last step ended

    @property
    def cuda(self) -> bool:
        return self.trace.report.cuda is not None

    def size(self, i: int) -> int:
        """What storage i counts for in the picture: its block on CUDA, its bytes on the CPU."""
        return self.blocks[i][1] if self.cuda else self.trace.records[i][NBYTES]


def step_end(trace: Trace) -> int:
    """The seq where the last step ended (the tracker's "done"; without it, after the last event)."""
    for seq, phase in trace.phases:
        if phase == "done":
            return seq
    return max((max(r[BORN], r[FREED] or 0) for r in trace.records), default=0) + 1


def layout(trace: Trace) -> Layout:
    """Every allocation and free of the trace up to the end of its last step, run through the caching
    allocator's simulation (PYTORCH_CUDA_ALLOC_CONF as the CUDA estimate reads it): each storage's block
    and the segments. A storage of 0 bytes is no allocation (CUDA hands out none)."""
    end = step_end(trace)
    events = []
    for i, r in enumerate(trace.records):
        if r[NBYTES] <= 0 or r[BORN] > end:
            continue
        events.append((r[BORN], i, 1))
        if r[FREED] is not None and r[FREED] <= end:
            events.append((r[FREED], i, -1))
    events.sort()
    sim = allocator.CachingAllocatorSim(allocator_config()[0])
    held: dict[int, allocator.Block] = {}  # the simulation's own blocks (a freed one merges and moves)
    blocks: dict[int, tuple[int, int]] = {}
    segments = []
    for _, i, sign in events:
        if sign < 0:
            sim.free(held.pop(i))
            continue
        made = sim.stats.num_device_alloc
        b = held[i] = sim.malloc(trace.records[i][NBYTES])
        blocks[i] = (b.addr, b.size)
        if sim.stats.num_device_alloc > made:  # a new segment, the block at its start
            segments.append((i, b.addr, sim.segment_log[-1], b.small))
    return Layout(trace, events, blocks, segments, sim, end)


# ----------------------------------------------------------------------------------------------------
# The picture
# ----------------------------------------------------------------------------------------------------


def series(lay: Layout) -> tuple[list[int], list[list[int]], list[int] | None]:
    """(seq of each event, bytes alive after it per layer, reserved bytes after it on CUDA else None)."""
    records = lay.trace.records
    alive = [0] * len(LAYERS)
    starts = {i: j for j, (i, *_) in enumerate(lay.segments)}
    reserved, held = 0, []
    xs, ys = [], [[] for _ in LAYERS]
    for seq, i, sign in lay.events:
        alive[layer(records[i])] += sign * lay.size(i)
        if sign > 0 and i in starts:
            reserved += lay.segments[starts.pop(i)][2]
        xs.append(seq)
        for k, v in enumerate(alive):
            ys[k].append(v)
        held.append(reserved)
    return xs, ys, (held if lay.cuda else None)


def _thin(xs: list[int], ys: list[list[int]], extra: list[int] | None, limit: int = MAX_POINTS):
    """At most `limit` points: the highest total of each stretch, so no peak is lost."""
    n = len(xs)
    if n <= limit:
        return xs, ys, extra
    totals = [sum(col) for col in zip(*ys)]
    keep = []
    for k in range(limit):
        lo, hi = k * n // limit, (k + 1) * n // limit
        keep.append(max(range(lo, hi), key=totals.__getitem__))

    def pick(values: list[int]) -> list[int]:
        return [values[j] for j in keep]

    return pick(xs), [pick(y) for y in ys], (None if extra is None else pick(extra))


def _unit(peak: int) -> tuple[str, int]:
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= size:
            return name, size
    return "bytes", 1


def _spans(trace: Trace, end: int) -> list[tuple[int, int, str, str, int]]:
    """(start, stop, label, colour, step) of each shaded phase; step 0 is the set-up (build and, on the
    CPU, the optimizer state made without a first forward)."""
    out, step = [], 0
    marks = [(s, p) for s, p in trace.phases if s <= end]
    for (start, phase), (stop, _) in zip(marks, [*marks[1:], (end, "done")]):
        if phase == "input":
            step += 1
        if phase not in _SHADE or stop <= start:
            continue
        label, colour = _SHADE[phase]
        if out and out[-1][2] == label and out[-1][1] == start and out[-1][4] == step:
            out[-1] = (out[-1][0], stop, label, colour, step)
        else:
            out.append((start, stop, label, colour, step))
    return out


def peak_lines(trace: Trace, top: int = 4) -> list[str]:
    """The largest activations alive at the peak (module path, op, shape), one line each."""
    lines = []
    for g in trace.groups()[:top]:
        count = f" x{g.count}" if g.count > 1 else ""
        shape = "x".join(map(str, g.shape)) or "scalar"
        lines.append(f"{fmt_bytes(g.total):>10}  {g.module or '(top)'}  {g.op} {shape} {g.dtype}{count}")
    return lines


def draw(trace: Trace, title: str = "") -> bytes:
    """Memory over the step as a PNG: the layers stacked, the phases shaded, the peak marked with its
    largest activations; on CUDA also the reserved memory (the caching allocator's segments)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's own backend is left as it is

    lay = layout(trace)
    xs, ys, reserved = _thin(*series(lay))
    peak = trace.report.peak_bytes
    top = max([*(reserved or []), *(sum(c) for c in zip(*ys)), peak, 1])
    unit, size = _unit(top)
    fig = Figure(figsize=(13, 5.2))
    ax = fig.subplots()
    for start, stop, _, colour, _ in _spans(trace, lay.end):
        ax.axvspan(start, stop, color=colour, alpha=0.25, lw=0)
    shown = [k for k, y in enumerate(ys) if any(y)]
    ax.stackplot(
        xs,
        *[[v / size for v in ys[k]] for k in shown],
        labels=[LAYERS[k][0] for k in shown],
        colors=[LAYERS[k][1] for k in shown],
        step="post",
    )
    if reserved is not None:
        label = "reserved (the caching allocator's segments)"
        ax.step(xs, [v / size for v in reserved], where="post", color="black", lw=1, ls="--", label=label)
    ax.set_xlim(min(xs, default=0), max(lay.end, 1))
    ax.set_ylim(0, 1.3 * top / size)
    _label_phases(ax, trace, lay.end, 1.3 * top / size)
    ax.axvline(trace.peak_seq, color="black", lw=0.8)
    ax.plot([trace.peak_seq], [peak / size], "o", color="black", ms=4)
    what = "allocator peak" if trace.report.cuda is not None else "peak"
    acts = [i for i in alive_at(lay, trace.peak_seq) if trace.records[i][CAT] == "activations"]
    size_text = fmt_bytes(sum(lay.size(i) for i in acts))
    head = f"{what} {fmt_bytes(peak)}: activations {size_text} in {len(acts)} tensors, the largest:"
    note = "\n".join([head, *peak_lines(trace)])
    right = trace.peak_seq > (ax.get_xlim()[0] + ax.get_xlim()[1]) / 2
    ax.annotate(
        note,
        xy=(trace.peak_seq, peak / size),
        xytext=(-8 if right else 8, 0),
        textcoords="offset points",
        ha="right" if right else "left",
        va="bottom",
        multialignment="left",
        fontsize=7.5,
        family="monospace",
        bbox={"boxstyle": "round", "fc": "white", "ec": "0.6", "alpha": 0.9},
    )
    ax.set_xlabel("allocations and frees, in order")
    ax.set_ylabel(unit)
    ax.set_title(textwrap.fill(title or "memfit estimate", 160), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def alive_at(lay: Layout, seq: int) -> list[int]:
    """The storages (record indices) alive just after event `seq`, in the order they were made."""
    out = []
    for i in lay.blocks:
        r = lay.trace.records[i]
        if r[BORN] <= seq and (r[FREED] is None or r[FREED] > seq):
            out.append(i)
    return out


def _label_phases(ax, trace: Trace, end: int, ymax: float) -> None:
    """Each phase's name over its band, where the band is wide enough to hold it."""
    width = max(end, 1)
    for start, stop, label, _, step in _spans(trace, end):
        if (stop - start) / width < 0.04:
            continue
        text = {"optimizer": "optimizer state (set-up)"}.get(label, label) if step == 0 else f"{label} {step}"
        ax.text((start + stop) / 2, ymax * 0.985, text, ha="center", va="top", fontsize=7.5, color="0.3")


# ----------------------------------------------------------------------------------------------------
# PyTorch's memory snapshot
# ----------------------------------------------------------------------------------------------------


def _phase_at(trace: Trace) -> tuple[list[int], list[tuple[str, int]]]:
    """The seq of the last event before each phase, and (phase, step) from there on (for bisect)."""
    seqs, names, step = [], [], 0
    for seq, phase in trace.phases:
        step += phase == "input"
        seqs.append(seq)
        names.append((phase, step))
    return seqs, names


def frames(trace: Trace, i: int, cache: dict, phases: tuple[list[int], list[tuple[str, int]]]) -> list:
    """A storage's stack as the snapshot viewer shows it, innermost first: the op that made it (shape,
    dtype, category), the module running then and each module around it up to the model, and the phase
    and step of the traced step. Equal stacks are one list (the pickle stores it once)."""
    r = trace.records[i]
    seqs, names = phases
    k = bisect.bisect_left(seqs, r[BORN]) - 1  # a phase begins after the event at its seq
    phase, step = names[k] if k >= 0 else ("build", 0)
    key = (r[OP], r[MODULE], r[SHAPE], r[DTYPE], r[CAT], r[SAVED], phase, step)
    found = cache.get(key)
    if found is not None:
        return found
    path = r[MODULE]
    dtype = DTYPE_NAMES.get(r[DTYPE], str(r[DTYPE]).removeprefix("torch."))
    shape = "x".join(map(str, r[SHAPE])) or "scalar"
    kind = {"activations": "saved for backward" if r[SAVED] else "temporary"}.get(r[CAT], r[CAT])
    out = [{"filename": path or "(model)", "line": 0, "name": f"{r[OP]} {shape} {dtype} ({kind})"}]
    if path and not path.startswith("("):
        parts = path.split(".")
        for n in range(len(parts), -1, -1):
            p = ".".join(parts[:n])
            out.append({"filename": p or "(model)", "line": 0, "name": trace.model_classes.get(p, "?")})
    where = "set-up" if step == 0 else f"step {step}"
    out.append({"filename": "memfit estimate", "line": step, "name": f"{phase} ({where})"})
    cache[key] = out
    return out


def snapshot(trace: Trace) -> dict[str, Any]:
    """The traced step as ``torch.cuda.memory._snapshot()`` returns a recorded one: ``device_traces``
    (device 0: segment_alloc, alloc, free_requested and free_completed, each with its address, size,
    stream 0 and frames) and ``segments`` as the allocator holds them at the end of the last step. An
    event's size is the storage's bytes (the CUDA estimate's are rounded to 512); a block's size is the
    allocator's."""
    lay = layout(trace)
    records, cache, phases = trace.records, {}, _phase_at(trace)
    starts = {i: (addr, size) for i, addr, size, _ in lay.segments}
    events: list[dict[str, Any]] = []
    for _, i, sign in lay.events:
        f = frames(trace, i, cache, phases)
        addr, nbytes = lay.blocks[i][0], records[i][NBYTES]
        if sign > 0:
            if i in starts:
                seg_addr, seg_size = starts.pop(i)
                events.append(_event("segment_alloc", seg_addr, seg_size, f))
            events.append(_event("alloc", addr, nbytes, f))
        else:
            events.append(_event("free_requested", addr, nbytes, f))
            events.append(_event("free_completed", addr, nbytes, f))
    return {"segments": _segments(lay, cache, phases), "device_traces": [events]}


def _event(action: str, addr: int, size: int, frames: list) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames}


def _segments(lay: Layout, cache: dict, phases) -> list[dict[str, Any]]:
    """The segments at the end of the last step, each with its blocks in address order."""
    trace = lay.trace
    alive = alive_at(lay, lay.end)
    live = {lay.blocks[i][0]: i for i in alive}  # block address -> the storage in it
    cached = [*lay.sim.small.blocks.values(), *lay.sim.large.blocks.values()]
    blocks = sorted([*((*lay.blocks[i], True) for i in alive), *((b.addr, b.size, False) for b in cached)])
    addrs = [b[0] for b in blocks]
    out = []
    for i, addr, size, small in sorted(lay.segments, key=lambda s: s[1]):
        lo, hi = bisect.bisect_left(addrs, addr), bisect.bisect_left(addrs, addr + size)
        seg_blocks, allocated_size, requested = [], 0, 0
        for b_addr, b_size, allocated in blocks[lo:hi]:
            j = live[b_addr] if allocated else None
            block = {"address": b_addr, "size": b_size, "requested_size": 0, "state": "inactive"}
            block["frames"] = []
            if j is not None:
                nbytes = trace.records[j][NBYTES]
                allocated_size, requested = allocated_size + b_size, requested + nbytes
                block.update(requested_size=nbytes, state="active_allocated")
                block["frames"] = frames(trace, j, cache, phases)
            seg_blocks.append(block)
        out.append(
            {
                "device": 0,
                "address": addr,
                "total_size": size,
                "stream": 0,
                "segment_type": "small" if small else "large",
                "allocated_size": allocated_size,
                "active_size": allocated_size,
                "requested_size": requested,
                "is_expandable": False,
                "frames": frames(trace, i, cache, phases),
                "blocks": seg_blocks,
            }
        )
    return out


def pickled(snap: dict[str, Any]) -> bytes:
    """The snapshot as ``torch.cuda.memory._dump_snapshot`` writes it (protocol 4: the viewer's own
    unpickler reads protocols 2 to 4)."""
    return pickle.dumps(snap, protocol=4)


# ----------------------------------------------------------------------------------------------------
# Writing them
# ----------------------------------------------------------------------------------------------------


def check_path(path: str | Path, flag: str) -> Path:
    """The file `path` can be written (an existing file is replaced); else one line naming why: a folder,
    a timeline not named .png, a missing folder, or a location this user cannot write."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"error: {flag} {path} is a folder; give a file name, e.g. {p / default_name(flag)}")
    if flag == "--timeline" and p.suffix.lower() != ".png":  # the picture is drawn as a PNG only
        raise UsageError(
            f"error: {flag} {path}: the timeline is a PNG image; name it {p.with_suffix('.png')}"
        )
    if not p.parent.is_dir():
        raise UsageError(f"error: {flag} {path}: no folder {p.parent}; create it or give another path")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"error: {flag} {path} cannot be written here; give a writable location")
    return p


def default_name(flag: str) -> str:
    return "timeline.png" if flag == "--timeline" else "snapshot.pickle"


def write(path: str | Path, data: bytes, flag: str) -> Path:
    """`data` to `path` whole or not at all (a temporary file beside it, then renamed)."""
    p = check_path(path, flag)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"error: {flag}: {os_error_message(e)}") from None
    return p
