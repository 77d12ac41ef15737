"""Plugin discovery and loading, one plugin at a time.

Plugins are found through the entry-point group ``lmcache_core``; the entry-point name is
the distribution name. The built-in plugin (``lmcache-core``: the ``cpu`` backend) is
registered first through the same hooks. Each third-party plugin then goes through, in
its own ``try``:

1. the allow/deny lists (:class:`~lmcache_core.plugins.settings.PluginSettings`);
2. its distribution's ``Requires-Dist: lmcache-core ...`` against the running core;
3. import, then its ``LMCACHE_HOOKSPEC_VERSION`` (optional) against ours;
4. registration with pluggy and ``check_pending()`` (a misspelled hook fails here);
5. its ``lmcache_register_backends`` and ``lmcache_register_policies`` hooks; whatever
   it registered is rolled back if one raises.

A plugin that fails any step is reported (name, version, error), logged as a warning and
skipped; with ``LMCACHE_CORE_STRICT_PLUGINS=1`` it raises
:class:`~lmcache_core.plugins.report.PluginLoadError` instead.

Two packaging mistakes that would otherwise be silent are reported the same way (status
``misconfigured``): a plugin module that implements no hook (a hook function without
``@hookimpl`` is an ordinary function to pluggy), and an installed distribution named
like a plugin (``lmcache-backend-*``, ``lmcache-codec-*``, ``lmcache-policy-*``) that
declares no entry point in group ``lmcache_core`` (a wrong group name, or none).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from importlib.metadata import Distribution, EntryPoint, entry_points
from importlib.metadata import distributions as installed_distributions
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs
from .compat import canonical_name, core_requirement_problem, core_version, hookspec_problem
from .registry import BackendRegistry
from .report import PluginInfo, PluginLoadError, PluginStatus
from .settings import PluginSettings

__all__ = [
    "BUILTIN_PLUGIN",
    "ENTRY_POINT_GROUP",
    "PLUGIN_PREFIXES",
    "discover_entry_points",
    "load_plugins",
    "unregistered_distributions",
]

ENTRY_POINT_GROUP = "lmcache_core"
#: Plugin name of the built-in plugin (the core distribution's name).
BUILTIN_PLUGIN = "lmcache-core"
#: Hooks called by :func:`load_plugins`, in this order.
LOAD_HOOKS = ("lmcache_register_backends", "lmcache_register_policies")
#: Distribution names that say "I am an lmcache-core plugin" (canonical form).
PLUGIN_PREFIXES = ("lmcache-backend-", "lmcache-codec-", "lmcache-policy-")

log = logging.getLogger("lmcache_core.plugins")


def discover_entry_points(group: str = ENTRY_POINT_GROUP) -> list[EntryPoint]:
    """Installed entry points of ``group``, sorted by name."""
    return sorted(entry_points(group=group), key=lambda ep: ep.name)


def _dist_name(dist: Distribution) -> str:
    try:
        return str(dist.metadata["Name"] or "")
    except Exception:  # unreadable metadata: not ours to judge
        return ""


def unregistered_distributions(
    dists: Iterable[Distribution] | None = None, group: str = ENTRY_POINT_GROUP
) -> list[tuple[str, str | None, list[EntryPoint]]]:
    """Installed plugin-named distributions without an entry point in ``group``.

    Returns ``(name, version, entry points in other groups)`` for each, sorted by name.
    ``dists`` replaces ``importlib.metadata.distributions()`` (tests pass their own).
    """
    found: dict[str, tuple[str, str | None, list[EntryPoint]]] = {}
    for dist in installed_distributions() if dists is None else dists:
        # importlib's folder-derived name, when it has one, spares parsing every METADATA
        quick = getattr(dist, "_normalized_name", None)
        if isinstance(quick, str) and not quick.lower().startswith("lmcache"):
            continue
        name = _dist_name(dist)
        if not canonical_name(name).startswith(PLUGIN_PREFIXES):
            continue
        try:
            eps = list(dist.entry_points)
            version = dist.version
        except Exception:
            eps, version = [], None
        if any(ep.group == group for ep in eps):
            continue
        found.setdefault(canonical_name(name), (name, version, eps))
    return [found[k] for k in sorted(found)]


def _no_entry_point_error(name: str, eps: list[EntryPoint]) -> str:
    module = canonical_name(name).replace("-", "_")
    msg = f"installed, but declares no entry point in group {ENTRY_POINT_GROUP!r}, so it is never loaded"
    if eps:
        declared = ", ".join(f"[{ep.group}] {ep.name} = {ep.value}" for ep in eps)
        msg += f" (it declares {declared}: a wrong group?)"
    return (
        f"{msg}; its pyproject.toml needs [project.entry-points.{ENTRY_POINT_GROUP}] "
        f'{canonical_name(name)} = "{module}.plugin"'
    )


def _no_hook_error(plugin: object) -> str:
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    loose = sorted(
        n
        for n in dir(plugin)
        if n.startswith("lmcache_")
        and callable(getattr(plugin, n, None))
        and not hasattr(getattr(plugin, n), marker)
    )
    known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("lmcache_")))
    if loose:
        return (
            f"implements no hook: {', '.join(loose)} is not decorated with @hookimpl "
            "(from lmcache_core.plugins import hookimpl), so pluggy ignores it"
        )
    return f"implements no hook (the hooks are: {known})"


def new_plugin_manager() -> pluggy.PluginManager:
    """A pluggy manager that knows the lmcache-core hook specifications."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _info_for(ep: EntryPoint) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    dist_name = version = None
    if dist is not None:
        try:
            dist_name = dist.metadata["Name"]
            version = dist.version
        except Exception:  # broken metadata is reported through the missing fields
            pass
    return PluginInfo(name=ep.name, version=version, distribution=dist_name, target=ep.value)


class _Loader:
    def __init__(self, registry: BackendRegistry, settings: PluginSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.pm = new_plugin_manager()
        self.infos: list[PluginInfo] = []

    # ------------------------------------------------------------------ reporting
    def fail(
        self, info: PluginInfo, status: PluginStatus, error: str, cause: BaseException | None = None
    ) -> None:
        info.status, info.error = status, error
        if self.settings.strict:
            raise PluginLoadError(info) from cause
        log.warning("lmcache-core plugin %s skipped (%s): %s", info.describe(), status, error)

    def drop(self, info: PluginInfo) -> None:
        if self.pm.get_plugin(info.name) is not None:
            self.pm.unregister(name=info.name)

    # ------------------------------------------------------------------ steps
    def admit(self, ep: EntryPoint) -> PluginInfo | None:
        """Steps 1-4 for one entry point; the registered plugin's info, or ``None``."""
        info = _info_for(ep)
        self.infos.append(info)
        if info.distribution and canonical_name(info.distribution) != canonical_name(ep.name):
            log.debug(
                "plugin entry point %r differs from its distribution %r", ep.name, info.distribution
            )
        reason = self.settings.skip_reason(ep.name, info.distribution)
        if reason is not None:
            info.status, info.error = "disabled", reason
            log.info("lmcache-core plugin %s not loaded: %s", info.describe(), reason)
            return None
        dist = getattr(ep, "dist", None)
        try:
            requires = dist.requires if dist is not None else None
        except Exception:
            requires = None
        problem = core_requirement_problem(requires, core_version())
        if problem is not None:
            self.fail(info, "incompatible", f"{info.describe()} {problem}")
            return None
        try:
            plugin = ep.load()
        except (Exception, SystemExit) as exc:  # a plugin must not end the process
            self.fail(info, "failed", f"import of {ep.value!r} failed: {_error_text(exc)}", exc)
            return None
        problem = hookspec_problem(getattr(plugin, "LMCACHE_HOOKSPEC_VERSION", None))
        if problem is not None:
            self.fail(info, "incompatible", f"{info.describe()} {problem}")
            return None
        if not self.register(info, plugin):
            return None
        return info

    def register(self, info: PluginInfo, plugin: ModuleType | Any) -> bool:
        try:
            self.pm.register(plugin, name=info.name)
            info.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or ())
            self.pm.check_pending()
        except Exception as exc:
            self.drop(info)
            self.fail(info, "failed", f"invalid plugin: {_error_text(exc)}", exc)
            return False
        if not info.hooks:
            self.drop(info)
            self.fail(info, "misconfigured", f"{info.target!r} {_no_hook_error(plugin)}")
            return False
        return True

    def flag_unregistered(self, dists: Iterable[Distribution] | None) -> None:
        """Report plugin-named distributions that no entry point of ours loads."""
        for name, version, eps in unregistered_distributions(dists):
            info = PluginInfo(name=canonical_name(name), version=version, distribution=name)
            if self.settings.skip_reason(name) is not None:
                continue
            self.infos.append(info)
            self.fail(info, "misconfigured", _no_entry_point_error(name, eps))

    def run_hooks(self, info: PluginInfo, plugin: object) -> None:
        """Call ``plugin``'s implementations of the load hooks, in :data:`LOAD_HOOKS` order."""
        self.registry.current_provider = info.name
        try:
            for hook_name in LOAD_HOOKS:
                for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                    if impl.plugin is plugin:
                        impl.function(registry=self.registry)
        finally:
            self.registry.current_provider = "unknown"

    def call_hooks(self, info: PluginInfo, plugin: object) -> None:
        """:meth:`run_hooks`; on error undo the plugin's registrations and report it."""
        snapshot = self.registry._snapshot()
        try:
            self.run_hooks(info, plugin)
        except (Exception, SystemExit) as exc:
            self.registry._restore(snapshot)
            self.drop(info)
            self.fail(info, "failed", f"hook raised {_error_text(exc)}", exc)


def load_plugins(
    registry: BackendRegistry,
    *,
    entry_points: Iterable[EntryPoint] | None = None,
    settings: PluginSettings | None = None,
    environ: Mapping[str, str] | None = None,
    distributions: Iterable[Distribution] | None = None,
) -> pluggy.PluginManager:
    """Load the built-in plugin and every installed plugin into ``registry``.

    ``entry_points`` replaces discovery (tests pass fake ones); ``settings`` replaces the
    ``LMCACHE_CORE_*_PLUGINS`` environment (read from ``environ``, default ``os.environ``).
    ``distributions`` replaces the installed distributions checked for a missing entry
    point (by default they are checked only when ``entry_points`` is not given).
    Fills ``registry.plugins`` and ``registry.plugin_manager`` and returns the manager.
    """
    settings = settings if settings is not None else PluginSettings.from_env(environ)
    eps = discover_entry_points() if entry_points is None else list(entry_points)
    loader = _Loader(registry, settings)
    registry.plugins = loader.infos
    registry.plugin_manager = loader.pm

    from ..backends import builtin

    core = PluginInfo(
        name=BUILTIN_PLUGIN,
        version=core_version(),
        distribution=BUILTIN_PLUGIN,
        target=builtin.__name__,
        builtin=True,
    )
    loader.infos.append(core)
    loader.pm.register(builtin, name=BUILTIN_PLUGIN)
    loader.pm.check_pending()
    core.hooks = sorted(h.name for h in loader.pm.get_hookcallers(builtin) or ())

    admitted: list[PluginInfo] = []
    for ep in eps:
        info = loader.admit(ep)
        if info is not None:
            admitted.append(info)
    if entry_points is None or distributions is not None:
        loader.flag_unregistered(distributions)

    # The built-in plugin's hooks run first and never fail quietly (that would be a bug).
    loader.run_hooks(core, builtin)
    for info in admitted:
        plugin = loader.pm.get_plugin(info.name)
        if plugin is not None:
            loader.call_hooks(info, plugin)
    return loader.pm
