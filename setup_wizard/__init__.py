"""strata-setup: the wizard, model manager and artifact pipeline."""

from runtime.version import __version__

__all__ = ["__version__"]
