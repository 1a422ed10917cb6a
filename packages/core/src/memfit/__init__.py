"""memfit: measure, estimate and cut the memory of a training step; the shared layers and training loop."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("memfit-core")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
