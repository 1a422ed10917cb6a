"""The old name of ``memfit.ops.attention.flash_attn`` (flash-attn's window kernel), kept for imports
written against it; the current name is ``memfit.ops.attention.flash_attn``."""

from memfit.ops.attention.flash_attn import window_attention  # noqa: F401
