"""The one place the package version lives (pyproject reads it; the calibration key uses it)."""

__version__ = "0.1.0"
