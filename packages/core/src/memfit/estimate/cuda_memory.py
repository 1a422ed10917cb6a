"""The three figures of a CUDA estimate, from the traced step's allocations and frees in order:

* **allocator peak** (what ``torch.cuda.max_memory_allocated`` reports): the tensors in the caching
  allocator's blocks (512-byte rounding, and the up to 1 MiB a large block keeps unsplit) plus the CUDA
  libraries' workspaces (``memfit.estimate.workspaces``);
* **reserved peak** (``torch.cuda.max_memory_reserved``): the segments the caching allocator took from
  the driver (``memfit.estimate.allocator``: 2 MiB and 20 MiB segments, large requests rounded to 2 MiB,
  best-fit reuse of cached blocks), over the same sequence;
* **card total**: the reserved peak plus the CUDA context (``Card.context_bytes``), which is what a job
  runs out of memory against.

``memfit fit``, ``memfit estimate --gpu_gib`` and the train pre-flight judge fit on the card total.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from memfit.estimate import allocator
from memfit.estimate.workspaces import Card

GIB = 1024**3


@dataclass
class CudaFigures:
    card: Card
    allocated: int  # the allocator peak, bytes
    reserved: int  # the reserved peak
    traced: int  # the same step's peak as the trace sums it: live storages and workspaces, no blocks
    by_category: dict[str, int]  # blocks held at the allocator peak, per category (workspaces included)
    libraries: dict[str, int]  # the CUDA libraries' allocations: what -> bytes
    peak_seq: int = 0  # the trace's sequence number at the allocator peak
    notes: list[str] = field(default_factory=list)

    @property
    def context(self) -> int:
        return self.card.context_bytes

    @property
    def total(self) -> int:
        """What the step needs of the card: reserved peak + CUDA context."""
        return self.reserved + self.context

    def to_dict(self) -> dict[str, Any]:
        return {
            "card": self.card.name,
            "compute_capability": f"{self.card.capability[0]}.{self.card.capability[1]}",
            "allocated_peak_gib": self.allocated / GIB,
            "reserved_peak_gib": self.reserved / GIB,
            "context_gib": self.context / GIB,
            "total_gib": self.total / GIB,
            "context_note": self.card.context_note,
            "libraries_gib": {k: v / GIB for k, v in self.libraries.items()},
            "notes": list(self.notes),
        }


def allocator_config(capacity: int | None = None) -> tuple[allocator.AllocatorConfig, list[str]]:
    """The allocator settings of PYTORCH_CUDA_ALLOC_CONF (2.11's defaults without it); a setting the
    simulation does not model falls back to the defaults, with a note saying so."""
    text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    try:
        return allocator.AllocatorConfig.from_env(text, capacity), []
    except (allocator.UnsupportedConfig, ValueError) as e:
        note = f"PYTORCH_CUDA_ALLOC_CONF={text!r}: {e}; the reserved peak is the default allocator's"
        return allocator.AllocatorConfig(capacity=capacity), [note]


def figures(events: list[tuple], card: Card, libraries: dict[str, int], traced: int) -> CudaFigures:
    """Simulate the caching allocator over a traced step's events (``("alloc", key, nbytes, entry, seq)``
    and ``("free", key)``, as the tracker's CUDA target records them)."""
    config, notes = allocator_config()
    sim = allocator.simulate(events, config)
    entries = {ev[1]: ev[3] for ev in events if ev[0] == "alloc"}
    by_category: dict[str, int] = {}
    for key, size in sim.block_bytes.items():
        cat = entries[key][1]
        by_category[cat] = by_category.get(cat, 0) + size
    peak_seq = events[sim.peak_allocated_at][4] if sim.peak_allocated_at >= 0 else 0
    return CudaFigures(
        card, sim.peak_allocated, sim.peak_reserved, traced, by_category, libraries, peak_seq, notes
    )
