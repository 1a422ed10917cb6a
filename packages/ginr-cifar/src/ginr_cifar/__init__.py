"""Mamba-GINR on CIFAR-10: images encoded to latent tokens, decoded at any pixel coordinates.

Each name is imported on first use (memfit.system.lazy_exports), so `import ginr_cifar` loads no torch.
"""

from importlib.metadata import version

from memfit.system import lazy_exports

__version__ = version("ginr-cifar")
_EXPORTS = {"load": "api", "reconstruct": "api"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
