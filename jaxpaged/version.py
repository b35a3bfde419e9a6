"""The package version, on the ground floor (snapshots record it; `jaxpaged.__version__` re-exports it)."""

__version__ = "0.1.0"
