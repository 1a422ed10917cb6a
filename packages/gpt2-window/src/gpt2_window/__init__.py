"""GPT-2 with sliding-window attention that costs no more memory than causal attention."""

from importlib.metadata import version

from gpt2_window.api import generate, load

__version__ = version("gpt2-window")
__all__ = ["generate", "load"]
