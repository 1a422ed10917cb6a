"""A triplane generator (image -> 3D) with NeRF rendering, rebuilt to fit in memory."""

from importlib.metadata import version

from moremouse_triplane.api import load, render_views

__version__ = version("moremouse-triplane")
__all__ = ["load", "render_views"]
