"""Exception hierarchy of lmcache-core.

Every error the library raises on purpose derives from :class:`LMCacheError`, so callers
can catch the whole family at once. Errors about malformed *input* also derive from
:class:`ValueError`, so generic validation code handles them too.
"""

from __future__ import annotations


class LMCacheError(Exception):
    """Base class of every error raised on purpose by lmcache-core."""


class KeyFormatError(LMCacheError, ValueError):
    """A key string (or one of its parts) is malformed. The message names the bad part."""


class SizeFormatError(LMCacheError, ValueError):
    """A byte size such as ``"8GiB"`` could not be parsed or is out of range."""


class ConfigError(LMCacheError, ValueError):
    """A configuration value is invalid. ``path`` says where (``tiers[1].options.max_bytes``)."""

    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)


class BackendClosedError(LMCacheError, RuntimeError):
    """An operation was called on a backend after ``close()``."""


class BackendNotStartedError(LMCacheError, RuntimeError):
    """An operation was called on a backend before ``start()``."""


class FormatError(LMCacheError, ValueError):
    """Bytes are not a valid lmcache object (truncated, corrupted, foreign or wrong version)."""


class BufferMismatchError(LMCacheError, ValueError):
    """A caller-provided buffer has the wrong shape, dtype, size or is not contiguous."""


class PluginError(LMCacheError):
    """A plugin could not be loaded or registered something invalid."""


class DuplicateBackendError(PluginError, ValueError):
    """A backend name was registered twice without ``override=True``."""


class UnknownBackendError(PluginError, LookupError):
    """A backend name or URL scheme is not registered."""


class DuplicatePolicyError(PluginError, ValueError):
    """A placement policy name was registered twice without ``override=True``."""


class UnknownPolicyError(PluginError, LookupError):
    """A placement policy name is not registered."""


class TokenInputError(LMCacheError, ValueError):
    """Tokens, a mask, extra keys or block hashes given to the token database are invalid.

    Raised for values out of range (a token id outside ``[-2**31, 2**31)``, a negative
    block hash, a mask that does not fit the tokens, extra keys nested too deeply). The
    one error family :class:`~lmcache_core.ChunkedTokenDatabase` raises for bad input,
    whatever its form (list, tuple, numpy array, torch tensor).
    """


class TokenTypeError(TokenInputError, TypeError):
    """Token database input of the wrong kind: token ids that are not integers (bools,
    floats, strings), an array that is not one-dimensional, a value extra keys cannot
    encode. Both a :class:`TokenInputError` (so a ``ValueError``) and a ``TypeError``."""
