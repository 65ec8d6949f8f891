"""The package version (pyproject.toml says the same; tests/docs/test_docs.py checks --version)."""

__version__ = "0.1.0"
