"""Device choice and torchrun (DDP) process-group plumbing."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memfit.errors import UsageError


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> CUDA when available, else the CPU; 'cuda' (no index) -> this process's GPU: under
    torchrun each rank takes GPU LOCAL_RANK, never all of them GPU 0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"error: unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("error: --device cuda asked for, but no CUDA GPU is available; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", dist_info().local_rank)
    return device


_OWNED_GROUP = False  # True while a process group init_distributed started is up


def _destroy_process_group() -> None:
    global _OWNED_GROUP
    if _OWNED_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED_GROUP = False


def leave_distributed(finished: bool) -> None:
    """Leave the process group init_distributed joined (a group the caller set up is left alone).

    ``finished``: every rank got here by finishing its work, so they wait for one another first
    and no rank tears its connections down while another still saves or logs. Called with nothing
    left that references the group (drop the DDP wrapper first): gloo's worker threads must stop
    while the interpreter is whole, or the exit can abort the process ("terminate called without an
    active exception", seen under load)."""
    if finished and _OWNED_GROUP and dist.is_initialized():
        dist.barrier()
    _destroy_process_group()


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Rank and world size from torchrun's environment (1 process without it)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); a no-op for one process."""
    global _OWNED_GROUP
    info = dist_info()
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        _OWNED_GROUP = True
        # the Trainer leaves the group when fit ends (leave_distributed); this covers a process
        # that exits before it does
        atexit.register(_destroy_process_group)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    return info
