"""GPT-2 with sliding-window attention that costs no more memory than causal attention.

Each name is imported on first use (memfit.system.lazy_exports), so `import gpt2_window` loads no torch.
"""

from importlib.metadata import version

from memfit.system import lazy_exports

__version__ = version("gpt2-window")
_EXPORTS = {"generate": "api", "load": "api", "samples": "api"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
