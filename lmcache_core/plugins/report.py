"""What plugin loading found: one :class:`PluginInfo` per plugin, and the load error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import PluginError

__all__ = ["ERROR_STATUSES", "PluginInfo", "PluginLoadError", "PluginStatus"]

#: ``ok``: loaded and its hooks ran. ``failed``: raised on import or in a hook, or has an
#: invalid hook. ``incompatible``: built for another lmcache-core / hook interface.
#: ``disabled``: left out by ``LMCACHE_CORE_DISABLE_PLUGINS`` / ``LMCACHE_CORE_LOAD_PLUGINS``.
#: ``misconfigured``: installed but never usable as packaged: a ``lmcache-backend-*``
#: distribution without an entry point in group ``lmcache_core``, or a plugin module that
#: implements no hook (a hook function without ``@hookimpl``).
PluginStatus = Literal["ok", "failed", "incompatible", "disabled", "misconfigured"]
#: Statuses that ``plugins --strict`` and ``LMCACHE_CORE_STRICT_PLUGINS=1`` treat as errors.
ERROR_STATUSES: frozenset[str] = frozenset({"failed", "incompatible", "misconfigured"})


@dataclass
class PluginInfo:
    """One plugin as discovery saw it (the built-in plugin included)."""

    name: str
    """Entry-point name, which by convention is the distribution name."""
    version: str | None = None
    """Version of the distribution that provides the plugin, when known."""
    distribution: str | None = None
    """Name of the distribution that provides the plugin, when known."""
    target: str = ""
    """What the entry point points at (``package.plugin``)."""
    status: PluginStatus = "ok"
    error: str | None = None
    """Why the plugin is not ``ok`` (exception type and message, or the reason)."""
    hooks: list[str] = field(default_factory=list)
    """Hooks the plugin implements."""
    builtin: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "name": self.name,
            "version": self.version,
            "distribution": self.distribution,
            "target": self.target,
            "builtin": self.builtin,
            "status": self.status,
            "error": self.error,
            "hooks": list(self.hooks),
        }

    def describe(self) -> str:
        """``name version`` for messages."""
        return f"{self.name} {self.version}" if self.version else self.name


class PluginLoadError(PluginError):
    """A plugin failed to load and strict mode (``LMCACHE_CORE_STRICT_PLUGINS=1``) is on."""

    def __init__(self, info: PluginInfo) -> None:
        self.info = info
        super().__init__(f"plugin {info.describe()} ({info.status}): {info.error}")
