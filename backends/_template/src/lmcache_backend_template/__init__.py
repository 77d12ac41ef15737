"""lmcache-backend-template: TEMPLATE (say what the tier stores and where)."""

__all__ = ["__version__"]
__version__ = "0.1.0"
