"""The old name of ``memfit.ops.conv.causal_conv1d`` (causal-conv1d's CUDA kernel), kept for imports
written against it; the current name is ``memfit.ops.conv.causal_conv1d``."""

from memfit.ops.conv.causal_conv1d import conv_silu  # noqa: F401
