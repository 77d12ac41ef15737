"""Backend registry (minimal version; the plugin issue extends it)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DuplicateBackendError, UnknownBackendError

#: First-party backend names and the distribution that provides each.
KNOWN_BACKENDS = {
    "cpu": "lmcache-core",
    "disk": "lmcache-backend-disk",
    "s3": "lmcache-backend-s3",
    "gds": "lmcache-backend-gds",
}


@dataclass
class BackendSpec:
    """One registered backend: its name, where its class lives and who provided it."""

    name: str
    target: str | type[Any]
    schemes: tuple[str, ...] = ()
    install_hint: str | None = None
    provider: str = "unknown"
    _cls: type[Any] | None = field(default=None, repr=False)

    def load(self) -> type[Any]:
        """Import (once) and return the backend class."""
        if self._cls is None:
            if isinstance(self.target, str):
                mod_name, _, attr = self.target.partition(":")
                if not attr:
                    raise ValueError(f"backend target {self.target!r} must look like 'pkg.mod:Class'")
                obj: Any = importlib.import_module(mod_name)
                for part in attr.split("."):
                    obj = getattr(obj, part)
                self._cls = obj
            else:
                self._cls = self.target
        assert self._cls is not None
        return self._cls


class BackendRegistry:
    """Names (and URL schemes) to backend classes."""

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}
        self._schemes: dict[str, str] = {}
        self.current_provider = "unknown"

    def add(
        self,
        target: str | type[Any],
        *,
        name: str,
        schemes: Sequence[str] = (),
        install_hint: str | None = None,
        override: bool = False,
        provider: str | None = None,
    ) -> None:
        """Register ``target`` (a class or ``"pkg.mod:Class"``) under ``name``."""
        prov = provider or self.current_provider
        if name in self._specs and not override:
            raise DuplicateBackendError(
                f"backend {name!r} is registered twice: by {self._specs[name].provider!r} and by "
                f"{prov!r}; pass override=True to replace it on purpose"
            )
        self._specs[name] = BackendSpec(name, target, tuple(schemes), install_hint, prov)
        for s in schemes:
            self._schemes[s] = name

    def get(self, name: str) -> BackendSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownBackendError(self._unknown_message(name)) from None

    def for_scheme(self, scheme: str) -> BackendSpec:
        if scheme in self._schemes:
            return self._specs[self._schemes[scheme]]
        raise UnknownBackendError(f"no backend handles URL scheme {scheme!r}; registered schemes: "
                                  f"{sorted(self._schemes)}")

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[BackendSpec]:
        return [self._specs[n] for n in self.names()]

    def _unknown_message(self, name: str) -> str:
        msg = f"unknown backend {name!r}; registered: {self.names()}"
        if name in KNOWN_BACKENDS:
            msg += f"; `pip install {KNOWN_BACKENDS[name]}` provides it"
        return msg


_lock = threading.Lock()
_registry: BackendRegistry | None = None


def get_registry(*, reload: bool = False) -> BackendRegistry:
    """The process-wide registry, with every plugin loaded (once)."""
    global _registry
    with _lock:
        if _registry is None or reload:
            from .loader import load_plugins

            reg = BackendRegistry()
            load_plugins(reg)
            _registry = reg
        return _registry
