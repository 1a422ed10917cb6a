"""What an estimate is for, as one object: the device whose kernels it models, and on CUDA the card (its
cuBLAS workspace and CUDA context) and the ``cuda`` extra's kernels the run has.

Made once, from the commands' flags (``DeviceTarget.from_flags``: ``--device``, ``--gpu``,
``--no_cuda_kernels``) or from a GPU at hand (``DeviceTarget.of_device``: the pre-flight and ``--measure``),
and entered once: inside ``with target.entered():`` every estimate is for it (``rules.cuda_rules`` reads the
kernels, ``workspaces`` the card).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from memfit.errors import UsageError
from memfit.estimate import rules, workspaces
from memfit.ops import registry


@dataclass(frozen=True)
class DeviceTarget:
    """``device``: "cpu" or "cuda"; ``card``: the card (None: this machine's GPU, else an H200);
    ``kernels``: the cuda extra's kernels the run has (None: what is assumed around it, by default all)."""

    device: str = "cpu"
    card: workspaces.Card | None = None
    kernels: frozenset[str] | None = None

    @classmethod
    def from_flags(cls, device: str = "cpu", gpu: str | None = None, cuda_kernels: bool | None = None):
        """The target the commands' flags name: ``--device``, ``--gpu`` (a card's name or capability) and
        ``--no_cuda_kernels`` (``cuda_kernels=False``; None: what this machine's GPU has, or every kernel
        of the extra without one). A flag that only means something for a CUDA estimate is refused on the
        CPU in one line."""
        if device not in ("cpu", "cuda"):
            raise UsageError(f"error: --device {device!r}: estimates model 'cpu' or 'cuda' kernels")
        if gpu is not None and device != "cuda":
            raise UsageError(
                "error: --gpu names the card of a CUDA estimate: give --device cuda (or --gpu_gib)"
            )
        if cuda_kernels is False and device != "cuda":
            raise UsageError(
                "error: --no_cuda_kernels is about a CUDA run: give --device cuda (or --gpu_gib)"
            )
        card = None if gpu is None else workspaces.card(gpu)
        if cuda_kernels is False:
            kernels = frozenset()
        else:
            kernels = registry.kernels_assumed_here() if device == "cuda" else registry.extra_kernels()
        return cls(device, card, kernels)

    @classmethod
    def of_device(cls, device: torch.device, cuda_kernels: bool | None = None) -> DeviceTarget:
        """A run on ``device`` as it is: on CUDA its card and the extra's kernels that pass their probes
        there (none with ``cuda_kernels=False``); on the CPU the CPU's kernels."""
        if device.type != "cuda":
            return cls("cpu")
        kernels = frozenset() if cuda_kernels is False else registry.kernels_on(device)
        return cls("cuda", workspaces.card_of_device(device), kernels)

    @contextlib.contextmanager
    def entered(self) -> Iterator[DeviceTarget]:
        """Estimates made inside are for this target (its kernels and card; None keeps what is assumed
        around it)."""
        with contextlib.ExitStack() as stack:
            if self.kernels is not None:
                stack.enter_context(rules.assume_kernels(self.kernels))
            stack.enter_context(workspaces.assume_card(self.card))
            yield self

    def kernels_used(self, ran: Iterable[tuple[str, str]] | None = None) -> str:
        """How a report names the extra's kernels a CUDA step used (``registry.Target.describe``), inside
        ``entered``."""
        return rules.assumed_target().describe(ran)

    def card_used(self) -> workspaces.Card:
        """The card the estimates are for (the default when ``card`` is None)."""
        return workspaces.assumed_card() if self.card is None else self.card
