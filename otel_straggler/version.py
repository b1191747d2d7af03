"""The package's version (``otel_straggler.__version__``; pyproject.toml reads it here)."""

__version__ = "0.1.0"
