"""MBS-Net speech enhancement that fits: band-split Mamba encoder, magnitude mask + explicit phase heads."""

from importlib.metadata import version

from mbsnet_speech.api import load
from mbsnet_speech.config import MBSNetConfig, default_config, get_config, seed_config, tiny_config
from mbsnet_speech.enhance import enhance_file
from mbsnet_speech.model import MBSNet

__version__ = version("mbsnet-speech")
__all__ = [
    "MBSNet",
    "MBSNetConfig",
    "default_config",
    "enhance_file",
    "get_config",
    "load",
    "seed_config",
    "tiny_config",
]
