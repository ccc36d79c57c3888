"""The library version, defined once (pyproject.toml reads it)."""

__version__ = "0.2.0"
