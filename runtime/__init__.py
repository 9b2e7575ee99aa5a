"""Strata runtime: Qwen3-MoE targets with MTP and DFlash2 drafters, in plain PyTorch."""

from runtime.version import __version__

__all__ = ["__version__"]
