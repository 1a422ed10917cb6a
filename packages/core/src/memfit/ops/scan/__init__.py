"""The selective scan, the SSM core of Mamba-1: one entry point, every implementation beside its reference.

``selective_scan`` has mamba_ssm's ``selective_scan_fn`` arguments, shapes and result (see ``ref``) and
runs the implementation the registry (``memfit.ops.registry``) chooses for the call:

- ``ref.py``: ``selective_scan_ref``, plain and materialising: what every other file is tested against.
- ``chunked.py``: chunks that recompute, on torch ops: every device, memory O(batch*dim*(chunk*N +
L/chunk*N)).
- ``cpu.py``: the same scheme fused in C on the CPU (``memfit.ops.cpu_kernel``).
- ``triton.py``: the same scheme as a Triton kernel on CUDA, no build step.
- ``mamba_ssm.py``: mamba_ssm's CUDA kernel (the ``cuda`` extra), when installed and its probe passed.

Unlike mamba_ssm's, the gradient of ``last_state`` propagates in every implementation here (a call whose
last state needs one does not go to mamba_ssm).
"""

from __future__ import annotations

from memfit.ops import registry
from memfit.ops.scan.chunked import auto_chunk_size
from memfit.ops.scan.ref import check_args, selective_scan_ref

__all__ = ["auto_chunk_size", "selective_scan", "selective_scan_ref"]


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    *,
    chunk_size=None,
    use_kernels=True,
):
    """Chunked recomputing scan: u, delta (batch, dim, L) -> out (batch, dim, L) [, last (batch, dim, N)].

    Same arguments and result as mamba_ssm's ``selective_scan_fn``; ``chunk_size`` steps per chunk bound
    the memory (None: each implementation's default). ``use_kernels=False`` keeps every kernel out (the
    torch-op path)."""
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"selective_scan: chunk_size must be a positive int or None, got {chunk_size!r}")
    check_args(u, delta, A, B, C, D, z, delta_bias)
    args = (u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(return_last_state), chunk_size)
    _, fn = registry.choose("scan", *args, kernels=use_kernels)
    return fn(*args)
