"""A triplane generator (image -> 3D) with NeRF rendering, rebuilt to fit in memory.

Each name is imported on first use (memfit.system.lazy_exports): `import moremouse_triplane` loads no torch.
"""

from importlib.metadata import version

from memfit.system import lazy_exports

__version__ = version("moremouse-triplane")
_EXPORTS = {"load": "api", "render_views": "api"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
