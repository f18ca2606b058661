"""fxzero's version: ``fxzero.__version__``, ``fxzero --version``; pyproject.toml holds the same (a test checks)."""

__all__ = ["__version__"]

__version__ = "0.3.0"
