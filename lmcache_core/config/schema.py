"""The configuration's schema, declared once: every key, its type, default and documentation.

The settings dataclasses (:class:`TopLevelSettings`, :class:`TierSettings`,
:class:`WriteSettings`, :class:`NamespaceSettings`) declare the keys with
:func:`lmcache_core.config.options.option`; :mod:`.loading` validates documents against
them into :class:`CacheConfig` / :class:`TierConfig`, and :mod:`.reference` renders the
tables ``docs/configuration.md`` embeds from them (a test keeps the two identical).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..redaction import REDACTED, redact_url
from ..token_db import HASH_ALGORITHMS
from .options import option

__all__ = [
    "DEFAULT_TIERS",
    "REDACTED",
    "CacheConfig",
    "NamespaceSettings",
    "NotImported",
    "PlacementSettings",
    "TierConfig",
    "TierSettings",
    "TopLevelSettings",
    "WriteSettings",
    "redact_url",
]

#: The tiers used when a configuration gives none: one in-memory tier.
DEFAULT_TIERS: tuple[dict[str, Any], ...] = ({"name": "cpu", "backend": "cpu"},)
WRITE_POLICIES = ("through", "back", "none")


# ---------------------------------------------------------------------------- schema
@dataclass(frozen=True)
class TopLevelSettings:
    """Top-level keys of a configuration."""

    chunk_size: int = option(
        256, doc="Tokens per stored chunk (the unit of lookup, load and store).", minimum=1
    )
    hash_algorithm: str = option(
        "xxh3_128",
        doc="Hash of the chunk chain (part of every key's namespace).",
        choices=HASH_ALGORITHMS,
    )
    hash_salt: str | None = option(
        None,
        kind="secret",
        doc="Secret salt making the chunk hash keyed: only instances with the "
        "same salt share chunks. Use {$env: NAME}; always redacted.",
    )
    stats_dir: str | None = option(
        None,
        kind="path",
        doc="Directory where each hierarchy writes <pid>.json statistics for "
        "`lmcache-core inspect`.",
    )
    stats_interval_s: float = option(5.0, doc="Seconds between two statistics files.", minimum=0.01)
    drain_timeout_s: float = option(
        10.0,
        doc="close() waits this long for pending background writes, then cancels the rest.",
        minimum=0,
    )
    tiers: list[Any] = option(  # noqa: RUF009
        list(DEFAULT_TIERS),
        kind="list",
        doc="Storage tiers, fastest first (see the tier table). Default: one cpu tier.",
    )
    namespace: dict[str, Any] | None = option(  # noqa: RUF009
        None,
        kind="dict",
        doc="Whose chunks these are (see the namespace table); a text is its `name`. "
        "Default: the namespace `default` (the vLLM connector supplies its own).",
    )
    placement: dict[str, Any] | None = option(  # noqa: RUF009
        None,
        kind="dict",
        doc="Which chunks each tier admits and evicts (see the placement table); a text "
        "is its `policy`. Default: each backend's own order (LRU), as without the section.",
    )


@dataclass(frozen=True)
class TierSettings:
    """Keys of one entry of ``tiers``."""

    name: str | None = option(None, kind="str", doc="Unique tier name (default: the backend name).")
    backend: str | None = option(
        None,
        kind="str",
        doc="A registered backend name (`cpu`, `disk`, ...) or a URL whose scheme "
        "selects the backend and fills its `url` option.",
    )
    backend_class: str | None = option(
        None,
        kind="str",
        doc="Escape hatch instead of `backend`: 'package.module:Class' of an unregistered backend.",
    )
    options: dict[str, Any] = option(  # noqa: RUF009
        {},
        kind="dict",
        doc="The backend's options, validated against its Options "
        "(`lmcache-core backends` lists them).",
    )
    write: dict[str, Any] = option(  # noqa: RUF009
        {}, kind="dict", doc="Write policy of this tier (see the write table)."
    )
    promote: bool = option(True, doc="Copy chunks loaded from this tier into the tiers above it.")
    load_deadline_ms: float | None = option(
        None,
        kind="float",
        minimum=0,
        doc="A load call (one chunk or one batch) slower than this is "
        "a miss. Default: no deadline.",
    )
    lookup_deadline_ms: float | None = option(
        None,
        kind="float",
        minimum=0,
        doc="A lookup slower than this skips the tier for that lookup. Default: no deadline.",
    )
    max_queue: int = option(
        64,
        doc="Background stores pending for this tier beyond which new ones are "
        "dropped (and counted).",
        minimum=1,
    )
    max_queue_latency_ms: float | None = option(
        None,
        kind="float",
        minimum=0,
        doc="New stores are dropped while the oldest pending one has "
        "waited longer than this. Default: no limit.",
    )
    write_concurrency: int = option(
        4, doc="Background stores run at once against this tier.", minimum=1
    )
    retry_backoff_ms: float = option(
        500.0,
        doc="After an error the tier is skipped this long, doubling per consecutive error.",
        minimum=0,
    )
    retry_backoff_max_ms: float = option(
        30000.0, doc="Upper bound of the retry backoff.", minimum=0
    )


@dataclass(frozen=True)
class WriteSettings:
    """Keys of a tier's ``write`` mapping."""

    policy: str = option(
        "through",
        choices=WRITE_POLICIES,
        doc="through: written (in the background) on every store; back: written when "
        "evicted from the tier above; none: never written by the hierarchy.",
    )
    admit_after: int = option(
        1,
        doc="Store a chunk in this tier only from its Nth sighting (a store or "
        "an eviction from above naming it).",
        minimum=1,
    )


@dataclass(frozen=True)
class PlacementSettings:
    """Keys of the top-level ``placement`` mapping (docs/placement.md). One policy class
    for the hierarchy, one instance per tier."""

    policy: str = option(
        "lru",
        kind="str",
        doc="A registered placement policy: lru, arc, s3fifo, cost, or a plugin's "
        "(lmcache_register_policies). lru keeps each backend's own order.",
    )
    options: dict[str, Any] = option(  # noqa: RUF009
        {}, kind="dict", doc="The policy's options for every tier (docs/placement.md)."
    )
    tiers: dict[str, Any] = option(  # noqa: RUF009
        {},
        kind="dict",
        doc="Per tier name, options that replace `options` keys for that tier.",
    )


@dataclass(frozen=True)
class NamespaceSettings:
    """Keys of the top-level ``namespace`` mapping. Stored objects carry the namespace and
    a tier serves only chunks of its own: name one for a tier shared between models."""

    model: str = option("", kind="str", doc="Model name recorded in the namespace.")
    revision: str = option("", kind="str", doc="Model revision (a commit hash, say).")
    layout: str = option("", kind="str", doc="KV layout (how the stored tensors are arranged).")
    name: str = option(
        "", kind="str", doc="An opaque name (a deployment, a tenant) instead of or besides these."
    )


# ---------------------------------------------------------------------------- resolved
def _default(settings: type[Any], name: str) -> Any:
    """The default the schema declares for key ``name`` of ``settings``: the resolved
    classes below take theirs from it, so each default is written once."""
    for f in dataclasses.fields(settings):
        if f.name == name:
            return f.default
    raise AssertionError(f"{settings.__name__} declares no key {name!r}")


@dataclass(frozen=True)
class TierConfig:
    """One validated tier. ``backend_cls`` is the imported class, ``options`` its typed Options."""

    index: int
    name: str
    backend: str  # registry name, or the backend_class text
    backend_cls: type[Any] = field(repr=False, compare=False)
    options: Any
    url: str | None = None
    backend_class: str | None = None
    write_policy: str = _default(WriteSettings, "policy")
    admit_after: int = _default(WriteSettings, "admit_after")
    promote: bool = _default(TierSettings, "promote")
    load_deadline_ms: float | None = _default(TierSettings, "load_deadline_ms")
    lookup_deadline_ms: float | None = _default(TierSettings, "lookup_deadline_ms")
    max_queue: int = _default(TierSettings, "max_queue")
    max_queue_latency_ms: float | None = _default(TierSettings, "max_queue_latency_ms")
    write_concurrency: int = _default(TierSettings, "write_concurrency")
    retry_backoff_ms: float = _default(TierSettings, "retry_backoff_ms")
    retry_backoff_max_ms: float = _default(TierSettings, "retry_backoff_max_ms")
    #: Names of options whose value came from ``$env`` (``"url"`` also when the URL did).
    env_options: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def capabilities(self) -> Any:
        """The backend class's :class:`~lmcache_core.interface.Capabilities`, or ``None``
        when its ``backend_class`` was not imported."""
        if self.backend_cls is NotImported:
            return None
        return self.backend_cls.capabilities

    def create_backend(self, namespace: Any = None) -> Any:
        """A new, unstarted backend instance for this tier (no I/O)."""
        if self.backend_cls is NotImported:
            raise ConfigError(
                f"backend_class {self.backend_class!r} was not imported (the configuration "
                "was loaded with import_backend_classes=False)",
                f"tiers[{self.index}].backend_class",
            )
        return self.backend_cls(self.options, namespace=namespace, name=self.name)

    def redacted_options(self) -> dict[str, Any]:
        """The options as a dict, secrets, ``$env`` values and URL passwords redacted."""
        opts, secret_kinds = _options_dict(self.options)
        unknown_kinds = self.backend_cls is NotImported  # any text may be a secret
        for name, value in opts.items():
            if value is None:
                continue
            if (
                name in secret_kinds
                or name in self.env_options
                or (unknown_kinds and isinstance(value, (str, dict, list)))
            ):
                opts[name] = REDACTED
            elif isinstance(value, str) and "://" in value:
                opts[name] = redact_url(value)
        return opts

    def __repr__(self) -> str:
        values: list[str] = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "options":
                text = f"{type(value).__name__}({_kwargs(self.redacted_options())})"
            elif f.name == "url" and value is not None:
                text = repr(REDACTED if "url" in self.env_options else redact_url(value))
            else:
                text = repr(value)
            values.append(f"{f.name}={text}")
        return f"TierConfig({', '.join(values)})"


class NotImported:
    """Stands for a ``backend_class`` that was not imported (``import_backend_classes=False``)."""

    Options = None


def _kwargs(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


@dataclass(frozen=True)
class CacheConfig:
    """A validated configuration (see :func:`load_config`)."""

    tiers: tuple[TierConfig, ...]
    chunk_size: int = _default(TopLevelSettings, "chunk_size")
    hash_algorithm: str = _default(TopLevelSettings, "hash_algorithm")
    hash_salt: str | None = field(default=_default(TopLevelSettings, "hash_salt"), repr=False)
    stats_dir: str | None = _default(TopLevelSettings, "stats_dir")
    stats_interval_s: float = _default(TopLevelSettings, "stats_interval_s")
    drain_timeout_s: float = _default(TopLevelSettings, "drain_timeout_s")
    #: The ``namespace`` section; ``None`` when the configuration names none (the hierarchy
    #: then uses the visible ``default`` namespace, see :mod:`lmcache_core.config.namespaces`).
    namespace: NamespaceSettings | None = None
    #: The ``placement`` section; ``None`` when absent (every backend keeps its own order).
    placement: PlacementSettings | None = None
    #: The placement policy's factory, resolved from the registry the configuration was
    #: loaded with (``None`` without a ``placement`` section).
    placement_factory: Any = field(default=None, repr=False, compare=False)
    #: Config paths whose value came from ``{"$env": NAME}``, with the variable name.
    env_paths: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Where the configuration was read from (a file path), if anywhere.
    source: str | None = None

    def __repr__(self) -> str:
        values: list[str] = []
        for f in dataclasses.fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name in self.env_paths and value is not None:
                value = REDACTED
            values.append(f"{f.name}={value!r}")
        return f"CacheConfig({', '.join(values)})"

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """The resolved configuration (every default filled in) as plain data.

        With ``redact`` (the default), ``hash_salt``, values read from ``$env``, backend
        options of kind ``secret`` and passwords in URLs are replaced by ``<redacted>``.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(TopLevelSettings):
            if f.name == "namespace":
                ns = self.namespace
                out[f.name] = None if ns is None else {k: _plain(v) for k, v in vars(ns).items()}
            elif f.name == "placement":
                pl = self.placement
                out[f.name] = None if pl is None else dict(vars(pl))
            elif f.name != "tiers":
                out[f.name] = _plain(getattr(self, f.name))
        if redact and self.hash_salt is not None:
            out["hash_salt"] = REDACTED
        tiers = []
        for t in self.tiers:
            opts = t.redacted_options() if redact else _options_dict(t.options)[0]
            entry: dict[str, Any] = {"name": t.name}
            if t.backend_class is not None:
                entry["backend_class"] = t.backend_class
            else:
                entry["backend"] = t.backend
            if t.url is not None:
                entry["url"] = redact_url(t.url) if redact else t.url
            entry["options"] = opts
            entry["write"] = {"policy": t.write_policy, "admit_after": t.admit_after}
            for f in dataclasses.fields(TierSettings):
                if f.name not in ("name", "backend", "backend_class", "options", "write"):
                    entry[f.name] = getattr(t, f.name)
            tiers.append(entry)
        out["tiers"] = tiers
        if redact:
            for path, _name in self.env_paths.items():
                m = re.fullmatch(r"tiers\[(\d+)\]\.backend", path)
                if m and int(m.group(1)) < len(tiers):  # a URL from $env: hide the URL
                    entry = tiers[int(m.group(1))]
                    entry["url"] = REDACTED
                    filled = "url" if "url" in entry["options"] else "path"
                    if filled in entry["options"]:
                        entry["options"][filled] = REDACTED
                else:
                    _redact_path(out, path)
        return out


def _options_dict(options: Any) -> tuple[dict[str, Any], set[str]]:
    """Typed options as a dict, and the names of its ``secret`` options."""
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        fields = dataclasses.fields(options)
        values = {f.name: _plain(getattr(options, f.name)) for f in fields}
        return values, {f.name for f in fields if f.metadata.get("kind") == "secret"}
    return {k: _plain(v) for k, v in options.items()}, set()


def _plain(value: Any) -> Any:
    """A str subclass (HiddenText, URLText) as a plain str, for YAML and JSON output."""
    return str(value) if isinstance(value, str) else value


def _redact_path(doc: dict[str, Any], path: str) -> None:
    """Replace the value at ``path`` (``a.b[2].c``) in ``doc`` if it exists."""
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    node: Any = doc
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        if tok.startswith("["):
            idx = int(tok[1:-1])
            if not isinstance(node, list) or idx >= len(node):
                return
            if last:
                node[idx] = REDACTED
                return
            node = node[idx]
        else:
            if not isinstance(node, dict) or tok not in node:
                return
            if last:
                if node[tok] is not None:
                    node[tok] = REDACTED
                return
            node = node[tok]
