"""The codec registry: KV codec names to (lazily imported) codec classes.

Plugins fill it from their ``lmcache_register_codecs(registry)`` hook with
``registry.add("package.module:Class", name=..., lossless=...)``. It is built the first
time something needs a codec (a tier's ``codec:`` configuration, ``bench codecs``), from
the plugins the backend registry loaded, each plugin's hook in its own ``try``. An
unknown name raises :class:`~lmcache_core.errors.UnknownCodecError` naming what is
registered and the distribution (with its install command) that provides the name.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import DuplicateBackendError, PluginError, UnknownCodecError
from .registry import install_hint, load_backend_class

if TYPE_CHECKING:
    from ..codecs import KVCodec
    from .registry import BackendRegistry

__all__ = [
    "KNOWN_CODECS",
    "CodecRegistry",
    "CodecSpec",
    "codecs_for",
    "fill_codec_registry",
    "get_codec_registry",
]

log = logging.getLogger("lmcache_core.plugins")

#: First-party codec names and the distribution (``plugins/<dist>``) that provides each.
KNOWN_CODECS: dict[str, str] = {
    "lossless": "lmcache-codec-lossless",
    "int8": "lmcache-codec-quant",
    "int4": "lmcache-codec-quant",
    "fp8": "lmcache-codec-quant",
    "cachegen": "lmcache-codec-cachegen",
}


@dataclass
class CodecSpec:
    """One registered codec: its name, class, whether it is lossless, who provided it."""

    name: str
    target: str | type[Any]
    lossless: bool
    provider: str = "unknown"
    _cls: type[Any] | None = field(default=None, repr=False)

    @property
    def target_text(self) -> str:
        """``"package.module:Class"`` whether registered as a string or a class."""
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def load(self) -> type[Any]:
        """Import (once) and return the codec class; :class:`PluginError` if it cannot."""
        if self._cls is None:
            try:
                self._cls = load_backend_class(self.target)
            except PluginError as exc:
                raise PluginError(
                    f"codec {self.name!r} (registered by {self.provider!r}) cannot be loaded: "
                    f"{str(exc).replace('backend class', 'codec class')}"
                ) from exc
        return self._cls

    def option_names(self) -> list[str]:
        """The keyword options the codec class accepts (imports the class)."""
        sig = inspect.signature(self.load())
        return [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]

    def create(self, options: Mapping[str, Any] | None = None) -> KVCodec:
        """A codec instance with ``options``; ``ValueError`` naming a bad or unknown option."""
        cls = self.load()
        opts = dict(options or {})
        allowed = self.option_names()
        unknown = sorted(set(opts) - set(allowed))
        if unknown:
            raise ValueError(
                f"codec {self.name!r} has no option(s) {', '.join(unknown)}; "
                f"its options: {', '.join(allowed) or '(none)'}"
            )
        try:
            codec = cls(**opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"codec {self.name!r}: {exc}") from exc
        if bool(getattr(codec, "lossless", None)) != self.lossless:
            raise PluginError(
                f"codec {self.name!r} was registered with lossless={self.lossless} but its "
                f"instance says lossless={getattr(codec, 'lossless', None)!r}"
            )
        result: KVCodec = codec
        return result


class CodecRegistry:
    """Codec names to codec classes (filled by the ``lmcache_register_codecs`` hook)."""

    def __init__(self) -> None:
        self._specs: dict[str, CodecSpec] = {}
        self.current_provider = "unknown"
        #: ``(plugin name, error text)`` of plugins whose codec hook raised.
        self.failed: list[tuple[str, str]] = []
        #: The backend registry's plugin reports (for "installed but not loaded" hints).
        self.backend_registry: BackendRegistry | None = None
        self._lock = threading.RLock()

    def add(
        self,
        target: str | type[Any],
        *,
        name: str,
        lossless: bool,
        override: bool = False,
        provider: str | None = None,
    ) -> None:
        """Register ``target`` (a class or ``"pkg.mod:Class"``) as codec ``name``.

        A name registered twice raises (a silently swapped codec would decode another
        codec's bytes) unless ``override=True``."""
        if not isinstance(name, str) or not name or name != name.strip() or " " in name:
            raise PluginError(f"invalid codec name {name!r}")
        if not isinstance(lossless, bool):
            raise PluginError(f"codec {name!r}: lossless must be True or False")
        if isinstance(target, str) and ":" not in target:
            raise PluginError(f"codec {name!r}: target {target!r} must look like 'pkg.mod:Class'")
        if not isinstance(target, str | type):
            raise PluginError(f"codec {name!r}: target must be a class or 'pkg.mod:Class'")
        prov = provider or self.current_provider
        with self._lock:
            old = self._specs.get(name)
            if old is not None and not override:
                raise DuplicateBackendError(
                    f"codec {name!r} is registered twice: by {old.provider!r} and by {prov!r}; "
                    "pass override=True to replace it on purpose"
                )
            if old is not None:
                log.warning("codec %r registered by %r is replaced by %r", name, old.provider, prov)
            self._specs[name] = CodecSpec(name, target, lossless, prov)

    def names(self) -> list[str]:
        """Registered codec names, sorted."""
        return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def get(self, name: str) -> CodecSpec:
        """The spec of codec ``name``; :class:`UnknownCodecError` if none."""
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownCodecError(self.unknown_message(name)) from None

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> KVCodec:
        """An instance of codec ``name`` with ``options`` (see :meth:`CodecSpec.create`)."""
        return self.get(name).create(options)

    def unknown_message(self, name: str) -> str:
        """The error text for an unknown codec ``name``."""
        msg = f"unknown codec {name!r}; registered: {', '.join(self.names()) or '(none)'}"
        dist = KNOWN_CODECS.get(name)
        if dist is None:
            close = difflib.get_close_matches(name, [*self.names(), *KNOWN_CODECS], n=1)
            if close:
                msg += f"; did you mean {close[0]!r}?"
            return msg
        for plugin, error in self.failed:
            if plugin == dist:
                return msg + f"; {dist} is installed but its codec hook failed: {error}"
        if self.backend_registry is not None:
            for info in self.backend_registry.plugins:
                if dist in (info.name, info.distribution) and info.status != "ok":
                    return msg + f"; {dist} is installed but its plugin did not load: {info.error}"
        return msg + f"; the plugin {dist} provides it: {install_hint(dist)}"

    def _snapshot(self) -> dict[str, CodecSpec]:
        with self._lock:
            return dict(self._specs)

    def _restore(self, snap: dict[str, CodecSpec]) -> None:
        with self._lock:
            self._specs = dict(snap)


def fill_codec_registry(codecs: CodecRegistry, backends: BackendRegistry, strict: bool) -> None:
    """Run every loaded plugin's ``lmcache_register_codecs`` hook into ``codecs``.

    The built-in plugin first, then the others in load order; each in its own ``try``
    (a failure undoes that plugin's registrations and is logged, or raised when
    ``strict``)."""
    codecs.backend_registry = backends
    pm = backends.plugin_manager
    if pm is None:
        return
    order = [p.name for p in backends.plugins if p.status == "ok"]
    by_plugin = {
        pm.get_name(impl.plugin): impl for impl in pm.hook.lmcache_register_codecs.get_hookimpls()
    }
    for name in order:
        impl = by_plugin.get(name)
        if impl is None:
            continue
        snapshot = codecs._snapshot()
        codecs.current_provider = name
        try:
            impl.function(registry=codecs)
        except Exception as exc:
            codecs._restore(snapshot)
            text = f"{type(exc).__name__}: {exc}"
            codecs.failed.append((name, text))
            if strict:
                raise PluginError(
                    f"plugin {name!r}: lmcache_register_codecs raised {text}"
                ) from exc
            log.warning("lmcache-core plugin %s: its codecs are skipped: %s", name, text)
        finally:
            codecs.current_provider = "unknown"


_lock = threading.Lock()
_codecs: CodecRegistry | None = None


def codecs_for(backends: BackendRegistry | None) -> CodecRegistry:
    """The codec registry of the plugins ``backends`` loaded: the process-wide one for the
    process-wide backend registry (or ``None``), else one built once for ``backends``."""
    from .registry import get_registry

    if backends is None or backends is get_registry():
        return get_codec_registry()
    with _lock:
        reg: CodecRegistry | None = getattr(backends, "_codec_registry", None)
        if reg is None:
            from .settings import PluginSettings

            reg = CodecRegistry()
            fill_codec_registry(reg, backends, PluginSettings.from_env().strict)
            backends._codec_registry = reg  # type: ignore[attr-defined]
        return reg


def get_codec_registry(*, reload: bool = False) -> CodecRegistry:
    """The process-wide codec registry, built once from the loaded plugins."""
    global _codecs
    with _lock:
        if _codecs is None or reload:
            from .registry import get_registry
            from .settings import PluginSettings

            backends = get_registry(reload=reload)
            reg = CodecRegistry()
            fill_codec_registry(reg, backends, PluginSettings.from_env().strict)
            _codecs = reg
        return _codecs
