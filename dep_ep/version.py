"""The library version (one definition: pyproject.toml reads it, EpRouted's agreement compares it)."""

__version__ = "0.2.0"
