"""The backend registry: names and URL schemes to (lazily imported) backend classes.

Plugins fill it from their ``lmcache_register_backends(registry)`` hook with
``registry.add("package.module:Class", name=..., schemes=...)``; the class is imported on
first use only, so listing plugins imports nothing heavy. A name registered twice raises
(a silent backend swap is a data bug) unless ``override=True``; a replacement is logged and
recorded (:attr:`BackendSpec.replaces`) so that ``plugins`` and ``backends`` show it. An
unknown name raises an error that says what is registered, which installed plugin failed to
load, and the command that installs the first-party distribution providing the name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import (
    DuplicateBackendError,
    DuplicatePolicyError,
    PluginError,
    UnknownBackendError,
    UnknownPolicyError,
)

if TYPE_CHECKING:
    import pluggy

    from .report import PluginInfo

__all__ = [
    "KNOWN_BACKENDS",
    "KNOWN_SCHEMES",
    "BackendLoadError",
    "BackendRegistry",
    "BackendSpec",
    "get_registry",
    "install_hint",
    "load_backend_class",
]

log = logging.getLogger("lmcache_core.plugins")

#: First-party backend names and the distribution that provides each. Only distributions
#: that exist in the repository (``backends/<dist>``; a test checks each one).
KNOWN_BACKENDS: dict[str, str] = {
    "cpu": "lmcache-core",
    "disk": "lmcache-backend-disk",
    "gds": "lmcache-backend-gds",
    "s3": "lmcache-backend-s3",
}
#: URL schemes of first-party backends and the backend name that handles each.
KNOWN_SCHEMES: dict[str, str] = {
    "cpu": "cpu",
    "memory": "cpu",
    "file": "disk",
    "disk": "disk",
    "s3": "s3",
}
#: Plugins that did not load listed at most in an unknown-backend message.
_MAX_NOTED_PLUGINS = 3


def install_hint(dist: str) -> str:
    """The command that installs first-party distribution ``dist`` from a checkout of
    lmcache-core (backends live in ``backends/<dist>``, other plugins such as codecs in
    ``plugins/<dist>``)."""
    if dist == "lmcache-core":
        return "pip install -e . (in an lmcache-core checkout)"
    folder = "backends" if dist.startswith("lmcache-backend-") else "plugins"
    return f"pip install ./{folder}/{dist} (in an lmcache-core checkout)"


class BackendLoadError(PluginError, ImportError):
    """A backend class could not be imported (``"pkg.mod:Class"`` does not resolve)."""


def load_backend_class(target: str | type[Any]) -> type[Any]:
    """Resolve ``"package.module:Class"`` (or a class, returned as is) to the class.

    This is also the ``backend_class:`` escape hatch of the configuration, for backends
    that are not packaged as plugins. Raises :class:`BackendLoadError` with the reason.
    """
    if isinstance(target, type):
        return target
    if not isinstance(target, str):
        raise BackendLoadError(f"backend class must be a class or 'pkg.mod:Class', got {target!r}")
    mod_name, sep, attr = target.strip().partition(":")
    if not sep or not mod_name or not attr:
        raise BackendLoadError(f"backend class {target!r} must look like 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:
        raise BackendLoadError(
            f"cannot import module {mod_name!r} of backend class {target!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendLoadError(
                f"module {mod_name!r} has no attribute {attr!r} (backend class {target!r})"
            ) from None
    if not isinstance(obj, type):
        raise BackendLoadError(f"{target!r} is a {type(obj).__name__}, not a class")
    return obj


@dataclass
class BackendSpec:
    """One registered backend: its name, where its class lives and who provided it."""

    name: str
    target: str | type[Any]
    schemes: tuple[str, ...] = ()
    install_hint: str | None = None
    provider: str = "unknown"
    replaces: str | None = None
    """Provider of the registration this one replaced with ``override=True``, if any."""
    _cls: type[Any] | None = field(default=None, repr=False)

    @property
    def target_text(self) -> str:
        """``"package.module:Class"`` whether registered as a string or a class."""
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def load(self) -> type[Any]:
        """Import (once) and return the backend class.

        Raises :class:`BackendLoadError` naming the backend, its provider and the reason.
        """
        if self._cls is None:
            try:
                self._cls = load_backend_class(self.target)
            except BackendLoadError as exc:
                raise BackendLoadError(
                    f"backend {self.name!r} (registered by {self.provider!r}) cannot be "
                    f"loaded: {exc}"
                ) from exc
        return self._cls

    def describe_options(self) -> list[dict[str, Any]]:
        """The backend's options (name, type, default, doc, ...); imports the class."""
        from .backend_options import describe_backend_options

        return describe_backend_options(self.load())


class BackendRegistry:
    """Names (and URL schemes) to backend classes.

    ``plugins`` lists what plugin loading found (filled by
    :func:`~lmcache_core.plugins.loader.load_plugins`); ``plugin_manager`` is its pluggy
    manager.
    """

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}
        self._schemes: dict[str, str] = {}
        #: Provider recorded by :meth:`add` when ``provider=`` is not given (the loader
        #: sets it to the plugin whose hook is running).
        self.current_provider = "unknown"
        self.plugins: list[PluginInfo] = []
        self.plugin_manager: pluggy.PluginManager | None = None
        self._lock = threading.RLock()
        #: Placement policies: name -> (factory or "package.module:attr", provider).
        self._policies: dict[str, tuple[Any, str]] = {}

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
        """Register ``target`` (a class or ``"pkg.mod:Class"``) under ``name``.

        A class is checked against the backend interface at once (a ``PluginError``
        names what is missing); a ``"pkg.mod:Class"`` target is checked when first
        imported (configuration, ``backends``, ``plugins --strict``).
        ``schemes`` are URL schemes the backend handles (``s3`` for ``s3://bucket``).
        Registering a name or scheme that is already taken raises
        :class:`~lmcache_core.errors.DuplicateBackendError` naming both providers, unless
        ``override=True``. A replacement is logged as a warning, recorded in
        :attr:`BackendSpec.replaces`, and keeps the URL schemes of the backend it replaces
        (``memory://`` still reaches a replaced ``cpu``).
        """
        if not isinstance(name, str) or not name or name != name.strip() or ":" in name:
            raise PluginError(f"invalid backend name {name!r}")
        if isinstance(target, str):
            if ":" not in target:
                raise PluginError(
                    f"backend {name!r}: target {target!r} must look like 'pkg.mod:Class'"
                )
        elif not isinstance(target, type):
            raise PluginError(
                f"backend {name!r}: target must be a class or 'pkg.mod:Class', got {target!r}"
            )
        else:
            from .checks import backend_class_problems

            problems = backend_class_problems(target)
            if problems:
                raise PluginError(f"backend {name!r}: {'; '.join(problems)}")
        if isinstance(schemes, str):
            schemes = (schemes,)
        prov = provider or self.current_provider
        with self._lock:
            if not override:
                if name in self._specs:
                    raise DuplicateBackendError(
                        f"backend {name!r} is registered twice: by {self._specs[name].provider!r} "
                        f"and by {prov!r}; pass override=True to replace it on purpose"
                    )
                for s in schemes:
                    owner = self._schemes.get(s)
                    if owner is not None and owner != name:
                        raise DuplicateBackendError(
                            f"URL scheme {s!r} is registered twice: for backend {owner!r} by "
                            f"{self._specs[owner].provider!r} and for backend {name!r} by "
                            f"{prov!r}; pass override=True to replace it on purpose"
                        )
            old = self._specs.get(name)
            replaces = None
            all_schemes = tuple(dict.fromkeys(schemes))
            if old is not None:
                replaces = old.provider
                kept = tuple(s for s in old.schemes if self._schemes.get(s) == name)
                all_schemes = tuple(dict.fromkeys((*all_schemes, *kept)))
                log.warning(
                    "backend %r registered by %r is replaced by %r's %s (override=True)",
                    name,
                    old.provider,
                    prov,
                    target if isinstance(target, str) else target.__qualname__,
                )
            for s in schemes:
                owner = self._schemes.get(s)
                if owner is not None and owner != name:
                    log.warning(
                        "URL scheme %r of backend %r (registered by %r) now goes to backend "
                        "%r of %r (override=True)",
                        s,
                        owner,
                        self._specs[owner].provider,
                        name,
                        prov,
                    )
                    spec_owner = self._specs[owner]
                    self._specs[owner] = dataclasses.replace(
                        spec_owner, schemes=tuple(x for x in spec_owner.schemes if x != s)
                    )
            self._specs[name] = BackendSpec(
                name, target, all_schemes, install_hint, prov, replaces=replaces
            )
            for s in all_schemes:
                self._schemes[s] = name

    def get(self, name: str) -> BackendSpec:
        """The spec registered under ``name``; raises :class:`UnknownBackendError` if none."""
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownBackendError(self.unknown_message(name)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def for_scheme(self, scheme: str) -> BackendSpec:
        """The spec of the backend that handles URL scheme ``scheme`` (``s3``, ``file``).

        A backend's name is a scheme for it too (``disk:///path``) unless another backend
        registered that scheme."""
        if scheme in self._schemes:
            return self._specs[self._schemes[scheme]]
        if scheme in self._specs:
            return self._specs[scheme]
        msg = (
            f"no backend handles URL scheme {scheme!r}; registered schemes: {sorted(self._schemes)}"
        )
        if scheme not in KNOWN_SCHEMES:
            close = difflib.get_close_matches(scheme, [*self._schemes, *self._specs], n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
        known = KNOWN_SCHEMES.get(scheme)
        msg += self._provider_note(scheme, KNOWN_BACKENDS[known] if known else None)
        raise UnknownBackendError(msg)

    def names(self) -> list[str]:
        """Registered backend names, sorted."""
        return sorted(self._specs)

    def schemes(self) -> dict[str, str]:
        """URL scheme to backend name."""
        return dict(sorted(self._schemes.items()))

    def specs(self) -> list[BackendSpec]:
        """Registered specs, sorted by name."""
        return [self._specs[n] for n in self.names()]

    def unknown_message(self, name: str) -> str:
        """The error text for an unknown backend ``name``."""
        msg = f"unknown backend {name!r}; registered: {', '.join(self.names()) or '(none)'}"
        dist = KNOWN_BACKENDS.get(name)
        if dist is None:
            close = difflib.get_close_matches(name, self.names(), n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
        return msg + self._provider_note(name, dist)

    def _provider_note(self, wanted: str, dist: str | None) -> str:
        """What to tell about the plugin that would provide ``wanted`` (a name or scheme).

        For a first-party ``dist``: how to install it, or why its installed plugin did not
        load. Otherwise the installed plugins that did not load (the likeliest first),
        since one of them may be the provider.
        """
        bad = [p for p in self.plugins if p.status != "ok" and not p.builtin]
        if dist is not None:
            for info in bad:
                if dist in (info.name, info.distribution):
                    return f"; {dist} is installed but its plugin {_why_not_loaded(info)}"
            return f"; {dist} provides it: {install_hint(dist)}"
        if not bad:
            return ""
        key = wanted.lower()
        bad.sort(key=lambda p: key not in p.name.lower())
        shown = bad[:_MAX_NOTED_PLUGINS]
        more = len(bad) - len(shown)
        notes = "; ".join(f"{p.describe()} {_why_not_loaded(p)}" for p in shown)
        which = "one of them may provide it" if len(bad) > 1 else "it may provide it"
        tail = f" (and {more} more: lmcache-core plugins)" if more else ""
        return f"; installed plugin(s) that did not load ({which}): {notes}{tail}"

    # -- placement policies (the lmcache_register_policies hook)
    def add_policy(self, name: str, factory: Any, *, override: bool = False) -> None:
        """Register placement policy ``name``: ``factory(context) -> policy`` (see
        :class:`~lmcache_core.placement.wiring.PolicyContext`), or its
        ``"package.module:attr"`` text, imported on first use. A name registered twice
        raises unless ``override=True``."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"a policy name must be a non-empty text, got {name!r}")
        if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
            raise PluginError(
                f"policy {name!r}: the factory must be callable or 'package.module:attr'"
            )
        with self._lock:
            if name in self._policies and not override:
                raise DuplicatePolicyError(
                    f"placement policy {name!r} is already registered by "
                    f"{self._policies[name][1]}; pass override=True to replace it"
                )
            self._policies[name] = (factory, self.current_provider)

    def policy_names(self) -> list[str]:
        """Registered placement policy names, sorted."""
        with self._lock:
            return sorted(self._policies)

    def policy_factory(self, name: str) -> Any:
        """The factory of placement policy ``name`` (imported now if registered as text).
        Raises :class:`UnknownPolicyError` naming the registered ones."""
        with self._lock:
            entry = self._policies.get(name)
        if entry is None:
            known = ", ".join(self.policy_names()) or "none"
            hint = difflib.get_close_matches(str(name), self.policy_names(), n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise UnknownPolicyError(
                f"unknown placement policy {name!r} (registered: {known}){extra}; a plugin "
                "adds one with the lmcache_register_policies hook"
            )
        factory = entry[0]
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            try:
                obj: Any = importlib.import_module(module)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:
                raise PluginError(
                    f"placement policy {name!r}: cannot import {factory!r}: {exc}"
                ) from exc
            factory = obj
        return factory

    # -- used by the loader to undo what a failing plugin registered
    def _snapshot(self) -> tuple[dict[str, BackendSpec], dict[str, str], dict[str, Any]]:
        with self._lock:
            return dict(self._specs), dict(self._schemes), dict(self._policies)

    def _restore(self, snap: tuple[dict[str, BackendSpec], dict[str, str], dict[str, Any]]) -> None:
        with self._lock:
            self._specs, self._schemes = dict(snap[0]), dict(snap[1])
            self._policies = dict(snap[2])


def _why_not_loaded(info: PluginInfo) -> str:
    if info.status == "disabled":
        return f"is not loaded: {info.error}"
    return f"failed to load ({info.status}): {info.error}"


_lock = threading.Lock()
_registry: BackendRegistry | None = None


def get_registry(*, reload: bool = False) -> BackendRegistry:
    """The process-wide registry, with every plugin loaded (once; ``reload=True`` redoes it).

    Loading follows the ``LMCACHE_CORE_*_PLUGINS`` environment variables (see
    :mod:`lmcache_core.plugins.settings`).
    """
    global _registry
    with _lock:
        if _registry is None or reload:
            from .loader import load_plugins

            reg = BackendRegistry()
            load_plugins(reg)
            _registry = reg
        return _registry
