"""Mamba-GINR on CIFAR-10: images encoded to latent tokens, decoded at any pixel coordinates."""

from importlib.metadata import version

from ginr_cifar.api import load, reconstruct

__version__ = version("ginr-cifar")
__all__ = ["load", "reconstruct"]
