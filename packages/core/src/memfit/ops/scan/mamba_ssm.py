"""mamba_ssm's fused CUDA selective scan (the ``cuda`` extra) in the registry's calling convention.

Importing this module fails where mamba_ssm is not installed or its extension does not load; the registry
then counts the implementation as not available."""

from __future__ import annotations

from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as _selective_scan_fn


def selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, chunk_size):
    """mamba_ssm's kernel picks its own chunking (2048 steps); ``chunk_size`` does not apply."""
    return _selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
