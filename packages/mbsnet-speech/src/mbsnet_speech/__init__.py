"""MBS-Net speech enhancement that fits: band-split Mamba encoder, magnitude mask + explicit phase heads."""

from mbsnet_speech.config import MBSNetConfig, default_config, get_config, seed_config, tiny_config
from mbsnet_speech.model import MBSNet

__all__ = ["MBSNet", "MBSNetConfig", "default_config", "get_config", "seed_config", "tiny_config"]
