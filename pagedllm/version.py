"""The package version (also in pyproject.toml), below everything that reports it."""
__version__ = "0.1.0"
