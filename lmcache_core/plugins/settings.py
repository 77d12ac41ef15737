"""Environment controls of plugin loading.

``LMCACHE_CORE_STRICT_PLUGINS=1``
    A plugin that fails to load raises :class:`~lmcache_core.plugins.PluginLoadError`
    instead of being reported and skipped (for CI and plugin test suites).
``LMCACHE_CORE_DISABLE_PLUGINS=a,b``
    Plugins (entry-point or distribution names) that are not loaded; ``*`` disables every
    third-party plugin.
``LMCACHE_CORE_LOAD_PLUGINS=a,b``
    Allow-list: when set, only these third-party plugins load.

The built-in plugin (``lmcache-core``, the ``cpu`` backend) always loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .compat import canonical_name

__all__ = ["ALLOW_ENV", "DISABLE_ENV", "STRICT_ENV", "PluginSettings"]

STRICT_ENV = "LMCACHE_CORE_STRICT_PLUGINS"
DISABLE_ENV = "LMCACHE_CORE_DISABLE_PLUGINS"
ALLOW_ENV = "LMCACHE_CORE_LOAD_PLUGINS"

_TRUE = frozenset({"1", "true", "yes", "on"})


def _names(text: str | Iterable[str] | None) -> frozenset[str] | None:
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else text
    names = frozenset(canonical_name(n.strip()) for n in items if n.strip())
    return names


@dataclass(frozen=True)
class PluginSettings:
    """Which plugins to load and whether a failure raises."""

    strict: bool = False
    disabled: frozenset[str] = frozenset()
    allowed: frozenset[str] | None = None
    """``None``: no allow-list (everything not disabled loads)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        """Settings from ``LMCACHE_CORE_*_PLUGINS`` variables (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        allow_text = env.get(ALLOW_ENV, "")
        return cls(
            strict=env.get(STRICT_ENV, "").strip().lower() in _TRUE,
            disabled=_names(env.get(DISABLE_ENV, "")) or frozenset(),
            allowed=_names(allow_text) if allow_text.strip() else None,
        )

    @classmethod
    def build(
        cls,
        *,
        strict: bool | None = None,
        disabled: str | Iterable[str] | None = None,
        allowed: str | Iterable[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> PluginSettings:
        """Settings from the environment, with the explicitly given values taking priority."""
        base = cls.from_env(environ)
        return cls(
            strict=base.strict if strict is None else strict,
            disabled=base.disabled if disabled is None else (_names(disabled) or frozenset()),
            allowed=base.allowed if allowed is None else _names(allowed),
        )

    def skip_reason(self, *names: str | None) -> str | None:
        """Why a plugin known under ``names`` (entry point, distribution) is not loaded."""
        canon = {canonical_name(n) for n in names if n}
        if "*" in self.disabled or canon & self.disabled:
            return f"disabled by {DISABLE_ENV}"
        if self.allowed is not None and not canon & self.allowed:
            return f"not in the allow-list {ALLOW_ENV}={','.join(sorted(self.allowed))}"
        return None
