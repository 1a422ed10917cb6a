"""MBS-Net speech enhancement that fits: band-split Mamba encoder, magnitude mask + explicit phase heads.

    import mbsnet_speech
    clean = mbsnet_speech.enhance(noisy, sample_rate)     # an array or tensor, (n,) or (batch, n)
    mbsnet_speech.enhance_file("in.wav", "out.wav")       # any length, read and written in blocks
    model = mbsnet_speech.load()                          # the shipped model; load(run) a run's or export's

Each name is imported on first use (memfit.system.lazy_exports), so `import mbsnet_speech` loads no torch.
"""

from importlib.metadata import version

from memfit.system import lazy_exports

__version__ = version("mbsnet-speech")
_EXPORTS = {
    "MBSNet": "model",
    "MBSNetConfig": "config",
    "default_config": "config",
    "enhance": "enhance",
    "enhance_file": "enhance",
    "get_config": "config",
    "load": "api",
    "seed_config": "config",
    "tiny_config": "config",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
