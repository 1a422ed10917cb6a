"""The ops wing: what models are built from, and every implementation of each op.

- ``attention``: one attention entry point (SDPA, FlexAttention, windowed CPU paths, flash-attn).
- ``scan/``: the Mamba-1 selective scan: the plain reference beside each fast implementation.
- ``conv``, ``mamba``, ``layers``: the causal conv, the Mamba block, shared layers.
- ``registry``: one record per implementation of an op (device, import, preconditions, probe, priority);
  every call site, ``memfit doctor`` and the estimator's CUDA target read it.
- ``cpu_kernel``: the fused C kernels (scan, conv) built on first use.

A new kernel is one record in ``registry`` and one file here. This wing imports nothing from
``memfit.estimate`` or ``memfit.train``.
"""
