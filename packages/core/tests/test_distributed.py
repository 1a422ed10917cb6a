"""Devices under torchrun, and resuming a checkpoint the way a GPU run loads it."""

from __future__ import annotations

import torch
from memfit.train import distributed
from memfit.train.checkpoint import _rng_state, _set_rng_state


def test_cuda_under_torchrun_is_the_ranks_own_gpu(monkeypatch):
    """`--device cuda` in a torchrun worker means cuda:LOCAL_RANK, as `auto` does: DDP needs device_ids
    of the rank's GPU (cuda without an index put every rank on GPU 0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert distributed.resolve_device("cuda") == torch.device("cuda", 3)
    assert distributed.resolve_device("auto") == torch.device("cuda", 3)
    assert distributed.resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index stands
    monkeypatch.delenv("LOCAL_RANK")
    assert distributed.resolve_device("cuda") == torch.device("cuda", 0)


def test_rng_state_restores_whatever_device_and_dtype_it_was_loaded_as():
    """torch.set_rng_state wants a CPU ByteTensor; a checkpoint loaded with map_location=cuda holds CUDA
    tensors (TypeError before). The restore takes any device or dtype: here an int64 copy stands in."""
    torch.manual_seed(123)
    state = _rng_state()
    expected = torch.rand(3)
    state["torch"] = state["torch"].to(torch.int64)  # not a ByteTensor, as a CUDA tensor would not be
    state["numpy"]["keys"] = state["numpy"]["keys"].clone()
    torch.manual_seed(0)
    _set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
