"""The seed's window-mask cache, kept as the memory baseline (`--attention seed`), out of the model file.

Per-length boolean masks made at B=H=1 and broadcast to dense (B, H, T, T) masks in every forward:
``memfit budget`` measures what that costs against our mask-free window attention.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class SeedMaskCache:
    """The seed's per-length mask cache: key (B=1, H=1, T, window, device), at most max_size entries."""

    def __init__(self, max_size: int = 10) -> None:
        self.max_size = max_size
        self.masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, T: int, window: int, device: torch.device) -> torch.Tensor:
        """(1, 1, T, T) bool, True where query i may see key j (i - window < j <= i)."""
        key = (1, 1, T, window, str(device))  # the seed forced B = H = 1 here and broadcast later
        if key not in self.masks:
            i = torch.arange(T, device=device)[:, None]
            j = torch.arange(T, device=device)[None, :]
            self.masks[key] = ((j <= i) & (j > i - window))[None, None]
            while len(self.masks) > self.max_size:
                self.masks.popitem(last=False)
        return self.masks[key]

    @property
    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masks.values())
