"""The old name of ``memfit.ops.attention.triton`` (the Triton window kernels), kept for imports written
against it; the current name is ``memfit.ops.attention.triton``."""

from memfit.ops.attention.triton import *  # noqa: F403
from memfit.ops.attention.triton import MAX_HEAD_DIM, why_unavailable, window_attention_triton  # noqa: F401
