"""lmcache-backend-sqlite: a SQLite file as an lmcache-core tier (the tutorial's example)."""

__all__ = ["__version__"]
__version__ = "0.1.0"
