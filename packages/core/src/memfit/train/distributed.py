"""Device choice and torchrun (DDP) process-group plumbing."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

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


def destroy_group_quietly() -> None:
    """Leave the process group after a peer is gone or the ranks disagree: nothing to wait for, and an
    error in the teardown says nothing new."""
    try:
        _destroy_process_group()
    except Exception:  # the group is broken already; the caller says why in one line
        global _OWNED_GROUP
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
    local_world_size: int = 1  # ranks on this machine (all of them: one machine)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Rank and world size from torchrun's environment (1 process without it)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))),
    )


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); a no-op for one process."""
    global _OWNED_GROUP
    info = dist_info()
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend=backend)
        except Exception as e:  # the rendezvous failed: a rank missing, a port taken, a timeout
            if (cause := collective_failure(e)) is None:
                raise
            raise UsageError(
                f"error: rank {info.rank} of {info.world_size} could not join the other ranks ({cause}); "
                "check MASTER_ADDR / MASTER_PORT and that every rank was started"
            ) from None
        _OWNED_GROUP = True
        # the Trainer leaves the group when fit ends (leave_distributed); this covers a process
        # that exits before it does
        atexit.register(_destroy_process_group)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    return info


# Words of the errors a collective raises when a peer rank is gone or the connection broke (gloo's TCP
# pairs, NCCL); a bare RuntimeError is what gloo raises, so its text is what tells (the store's and
# NCCL's timeouts are DistErrors)
_LOST = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "gloo/transport",
    "nccl error",
    "ncclremoteerror",
)


def collective_failure(e: BaseException) -> str | None:
    """The cause, in one line, when `e` is a failed collective (a peer rank that died or was stopped, a
    broken connection or rendezvous); None for any other error."""
    text = str(e)
    if not (isinstance(e, dist.DistError) or any(w in text.lower() for w in _LOST)):
        return None
    line = next((t.strip() for t in text.splitlines() if t.strip()), type(e).__name__)
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)[:200]  # gloo's "[.../pair.cc:538] "


def same_everywhere(payload: dict[str, Any]) -> tuple[int, str] | None:
    """Compare `payload` (this rank's settings) across the ranks: None when every rank holds the same,
    else (the first rank that differs from rank 0, what differs: 'model.channels 24 -> 32'). Every rank
    gets the same answer; a hash is exchanged first, the payloads only when the hashes differ."""
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return None
    payloads: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(payloads, payload)
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    return rank, _difference(payloads[0], payloads[rank])


def _difference(a: Any, b: Any, path: str = "") -> str:
    """'model.channels 24 -> 32' for the first place two nested payloads differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _difference(a.get(k), b.get(k), f"{path}{k}.")
    return f"{path.rstrip('.') or 'settings'} {a!r} -> {b!r}"
