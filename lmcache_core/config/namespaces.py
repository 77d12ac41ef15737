"""The hierarchy's namespace: from the configuration, from the caller, or ``default``.

Every stored object carries its namespace, and a tier serves only chunks of its own, so
the namespace is what keeps one model's KV from being served to another. It is always
explicit: the configuration's top-level ``namespace`` section (model, revision, layout,
or an opaque name), or an argument (``TieredHierarchy.from_config(cfg,
namespace=...)``; the vLLM connector derives one from the served model), or, without
either, the visible namespace named ``default`` — never an empty one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, KeyFormatError
from ..keys import Namespace

if TYPE_CHECKING:
    from .schema import CacheConfig

__all__ = [
    "DEFAULT_NAMESPACE",
    "configured_namespace",
    "namespace_label",
    "namespace_warnings",
    "resolve_namespace",
]

#: The name of the namespace a configuration without a ``namespace`` section gets.
DEFAULT_NAMESPACE = "default"
#: ``Namespace.extra`` key that holds the configured (or default) name.
NAME_KEY = "name"

# configuration key -> Namespace field
_FIELDS = (("model", "model_name"), ("revision", "model_revision"), ("layout", "kv_layout"))


def _salt_id(cfg: CacheConfig) -> str:
    if not cfg.hash_salt:
        return ""
    from ..token_db import ChunkedTokenDatabase

    return ChunkedTokenDatabase.salt_id(cfg.hash_salt)


def configured_namespace(cfg: CacheConfig) -> Namespace:
    """The namespace ``cfg`` names, or the ``default`` one when it names none."""
    ns = cfg.namespace
    name = DEFAULT_NAMESPACE if ns is None else ns.name
    try:
        return Namespace(
            model_name="" if ns is None else ns.model,
            model_revision="" if ns is None else ns.revision,
            kv_layout="" if ns is None else ns.layout,
            chunk_size=cfg.chunk_size,
            hash_algorithm=cfg.hash_algorithm,
            hash_salt_id=_salt_id(cfg),
            extra=((NAME_KEY, name),) if name else (),
        )
    except KeyFormatError as exc:
        raise ConfigError(str(exc), "namespace") from None


def _name(ns: Namespace) -> str:
    return dict(ns.extra).get(NAME_KEY, "")


def resolve_namespace(
    cfg: CacheConfig, given: Namespace | None, who: str = "the namespace argument"
) -> Namespace:
    """The namespace a hierarchy built from ``cfg`` uses.

    ``given`` (from ``who``) wins when the configuration names none; each value the
    configuration sets fills the same field of ``given`` when that is empty, and one that
    differs from a non-empty field raises :class:`~lmcache_core.errors.ConfigError` at
    ``namespace.<key>``, naming both values.
    """
    if given is None:
        return configured_namespace(cfg)
    ns = cfg.namespace
    if ns is None:
        return given
    updates: dict[str, Any] = {}
    for key, attr in _FIELDS:
        mine = getattr(ns, key)
        theirs = getattr(given, attr)
        if not mine:
            continue
        if theirs and theirs != mine:
            raise ConfigError(
                f"the configuration names {key} {mine!r} but {who} uses {theirs!r}; "
                f"remove namespace.{key} or make them agree",
                f"namespace.{key}",
            )
        updates[attr] = mine
    out = dataclasses.replace(given, **updates) if updates else given
    if ns.name:
        theirs = _name(given)
        if theirs and theirs != ns.name:
            raise ConfigError(
                f"the configuration names namespace {ns.name!r} but {who} uses {theirs!r}; "
                "remove namespace.name or make them agree",
                "namespace.name",
            )
        extra = dict(out.extra)
        extra[NAME_KEY] = ns.name
        out = dataclasses.replace(out, extra=tuple(extra.items()))
    return out


def namespace_label(ns: Namespace | None) -> str:
    """A short human-readable form (``default``, ``name=team-a``, ``model=m@rev``)."""
    if ns is None:
        return "(none)"
    parts = []
    if ns.model_name:
        parts.append(
            f"model={ns.model_name}" + (f"@{ns.model_revision}" if ns.model_revision else "")
        )
    if ns.kv_layout:
        parts.append(f"layout={ns.kv_layout}")
    name = _name(ns)
    if name:
        parts.append(name if not parts else f"name={name}")
    return ", ".join(parts) or "(empty)"


def namespace_warnings(cfg: CacheConfig) -> list[str]:
    """Warnings about ``cfg``'s namespace (``config check`` prints them): a configuration
    without one whose tiers another process can share uses ``default``, so two models
    writing to that tier would be told apart only by their keys."""
    if cfg.namespace is not None:
        return []
    shared = [
        f"{t.name} ({t.backend})"
        for t in cfg.tiers
        if t.capabilities is not None and (t.capabilities.shared or t.capabilities.persistent)
    ]
    if not shared:
        return []
    return [
        f"namespace: not set, so the tiers use the namespace {DEFAULT_NAMESPACE!r}; "
        f"a tier shared between models ({', '.join(shared)}) should name one, e.g. "
        "`namespace: {model: my-model, revision: abc123}` or `namespace: my-deployment` "
        "(the vLLM connector supplies its own)"
    ]
