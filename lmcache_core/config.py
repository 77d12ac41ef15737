"""Configuration: one schema, from YAML, JSON or a dict, validated before anything opens.

::

    chunk_size: 256
    tiers:
      - name: hot
        backend: cpu
        options: {max_bytes: 4GiB}
      - name: warm
        backend: disk
        options: {path: /nvme/kv, max_bytes: 200GiB}
        write: {policy: through}
        load_deadline_ms: 200
      - name: shared
        backend: s3://bucket/kv            # a URL: the scheme picks the backend, fills `url`
        options: {secret_key: {$env: S3_SECRET}}
        write: {policy: back, admit_after: 2}

The fields, their defaults and their documentation are declared once, below, with
:func:`lmcache_core.options.option`; ``docs/configuration.md`` embeds the tables
:func:`schema_markdown` generates from them (a test keeps the two identical).

:func:`load_config` validates everything (backend names, URL schemes, every backend
option against the backend's ``Options``) and raises
:class:`~lmcache_core.errors.ConfigError` whose ``path`` says where
(``tiers[1].options.max_bytes``). It reads the file and imports backend classes, and does
nothing else: no connection is opened and nothing is written.

``{"$env": "NAME"}`` (optionally with ``"default"``) anywhere in the document is replaced
by the environment variable; such values, ``hash_salt``, backend options of kind
``secret`` and URL passwords are redacted by :meth:`CacheConfig.to_dict`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from .errors import ConfigError, PluginError
from .options import build_options, describe_options, option
from .token_db import HASH_ALGORITHMS

__all__ = [
    "DEFAULT_TIERS",
    "REDACTED",
    "CacheConfig",
    "TierConfig",
    "TierSettings",
    "TopLevelSettings",
    "WriteSettings",
    "load_config",
    "schema_markdown",
]

#: What a redacted secret is shown as.
REDACTED = "<redacted>"
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


# ---------------------------------------------------------------------------- resolved
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
    write_policy: str = "through"
    admit_after: int = 1
    promote: bool = True
    load_deadline_ms: float | None = None
    lookup_deadline_ms: float | None = None
    max_queue: int = 64
    max_queue_latency_ms: float | None = None
    write_concurrency: int = 4
    retry_backoff_ms: float = 500.0
    retry_backoff_max_ms: float = 30000.0

    def create_backend(self, namespace: Any = None) -> Any:
        """A new, unstarted backend instance for this tier (no I/O)."""
        return self.backend_cls(self.options, namespace=namespace, name=self.name)


@dataclass(frozen=True)
class CacheConfig:
    """A validated configuration (see :func:`load_config`)."""

    tiers: tuple[TierConfig, ...]
    chunk_size: int = 256
    hash_algorithm: str = "xxh3_128"
    hash_salt: str | None = field(default=None, repr=False)
    stats_dir: str | None = None
    stats_interval_s: float = 5.0
    drain_timeout_s: float = 10.0
    #: Config paths whose value came from ``{"$env": NAME}``, with the variable name.
    env_paths: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Where the configuration was read from (a file path), if anywhere.
    source: str | None = None

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
            if f.name != "tiers":
                out[f.name] = getattr(self, f.name)
        if redact and self.hash_salt is not None:
            out["hash_salt"] = REDACTED
        tiers = []
        for t in self.tiers:
            opts, secret_kinds = _options_dict(t.options)
            if redact:
                for name in list(opts):
                    if opts[name] is not None and (
                        name in secret_kinds or f"tiers[{t.index}].options.{name}" in self.env_paths
                    ):
                        opts[name] = REDACTED
                    elif name == "url" and isinstance(opts[name], str):
                        opts[name] = redact_url(opts[name])
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
        values = {f.name: getattr(options, f.name) for f in fields}
        return values, {f.name for f in fields if f.metadata.get("kind") == "secret"}
    return dict(options), set()


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``<redacted>``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username or ''}:{REDACTED}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


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


# ---------------------------------------------------------------------------- loading
ConfigSource = Any  # CacheConfig | Mapping | str | os.PathLike | None


def load_config(
    source: ConfigSource = None,
    *,
    registry: Any = None,
    environ: Mapping[str, str] | None = None,
) -> CacheConfig:
    """Validate a configuration and return it as a :class:`CacheConfig`.

    ``source`` is a path to a ``.yaml``/``.yml``/``.json`` file, a mapping, YAML/JSON text
    starting with ``{``, an existing :class:`CacheConfig` (returned as is) or ``None`` (the
    default configuration: one ``cpu`` tier). ``registry`` is the backend registry to
    resolve names in (default: the process-wide one, plugins loaded); ``environ`` replaces
    ``os.environ`` for ``$env`` references.
    """
    if isinstance(source, CacheConfig):
        return source
    origin: str | None = None
    if source is None:
        raw: Any = {}
    elif isinstance(source, Mapping):
        raw = source
    elif isinstance(source, (str, os.PathLike)):
        text_source = isinstance(source, str) and source.lstrip().startswith("{")
        if text_source:
            raw = _parse_text(str(source), "<inline>", json_first=True)
        else:
            origin = os.fspath(source)
            raw = _read_file(Path(origin))
    else:
        raise ConfigError(f"expected a file path, a mapping or None, got {type(source).__name__}")
    env_paths: dict[str, str] = {}
    resolved = _resolve_env(raw, "", env_paths, os.environ if environ is None else environ)
    if not isinstance(resolved, Mapping):
        raise ConfigError(f"the configuration must be a mapping, got {type(resolved).__name__}")
    _check_keys(TopLevelSettings, resolved, "")
    top = build_options(TopLevelSettings, resolved, path="")
    if top.hash_salt is not None and not top.hash_salt:
        raise ConfigError("must not be empty (leave it out for no salt)", "hash_salt")
    tiers = _build_tiers(top.tiers, registry)
    return CacheConfig(
        tiers=tiers,
        chunk_size=top.chunk_size,
        hash_algorithm=top.hash_algorithm,
        hash_salt=top.hash_salt,
        stats_dir=top.stats_dir,
        stats_interval_s=top.stats_interval_s,
        drain_timeout_s=top.drain_timeout_s,
        env_paths=env_paths,
        source=origin,
    )


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"configuration file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read configuration file {str(path)!r}: {exc}") from exc
    return _parse_text(text, str(path), json_first=path.suffix.lower() == ".json")


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that rejects duplicated mapping keys (a silent override is a config bug)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            mark = key_node.start_mark
            raise ConfigError(f"line {mark.line + 1}: key {key!r} appears twice")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_text(text: str, origin: str, json_first: bool) -> Any:
    if json_first:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            if origin != "<inline>":
                raise ConfigError(
                    f"{origin}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
                ) from exc
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc.reason}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{origin}: invalid YAML{where}: {problem}") from exc
    return {} if doc is None else doc


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _resolve_env(
    value: Any, path: str, env_paths: dict[str, str], environ: Mapping[str, str]
) -> Any:
    if isinstance(value, Mapping):
        if "$env" in value:
            extra = sorted(set(value) - {"$env", "default"})
            if extra:
                raise ConfigError(
                    f"an $env reference takes only '$env' and 'default', got {extra}", path
                )
            name = value["$env"]
            if not isinstance(name, str) or not name:
                raise ConfigError(f"$env must name an environment variable, got {name!r}", path)
            env_paths[path] = name
            if name in environ:
                return environ[name]
            if "default" in value:
                return value["default"]
            raise ConfigError(f"environment variable {name} is not set", path)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"keys must be strings, got {k!r}", path)
            out[k] = _resolve_env(v, _join(path, k), env_paths, environ)
        return out
    if isinstance(value, (list, tuple)):
        return [_resolve_env(v, f"{path}[{i}]", env_paths, environ) for i, v in enumerate(value)]
    return value


def _check_keys(schema: type[Any], raw: Mapping[str, Any], path: str) -> None:
    """Reject an unknown key, naming it (and the closest known one)."""
    known = [f.name for f in dataclasses.fields(schema)]
    for key in raw:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            msg = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
            raise ConfigError(f"{msg} (known: {', '.join(known)})", _join(path, key))


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REQUIRED_METHODS = (
    "start",
    "close",
    "contains",
    "get",
    "get_into",
    "put",
    "remove",
    "batched_contains",
    "batched_get",
    "batched_get_into",
    "batched_put",
    "stats",
)


def _build_tiers(raw_tiers: Sequence[Any], registry: Any) -> tuple[TierConfig, ...]:
    if not raw_tiers:
        raise ConfigError("at least one tier is needed", "tiers")
    if registry is None:
        from .plugins import get_registry

        registry = get_registry()
    out: list[TierConfig] = []
    names: dict[str, int] = {}
    for i, raw in enumerate(raw_tiers):
        where = f"tiers[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"expected a mapping, got {type(raw).__name__}", where)
        _check_keys(TierSettings, raw, where)
        ts = build_options(TierSettings, raw, path=where)
        _check_keys(WriteSettings, ts.write, f"{where}.write")
        write = build_options(WriteSettings, ts.write, path=f"{where}.write")
        cls, backend_name, url, options = _resolve_backend(ts, registry, where)
        name = ts.name if ts.name is not None else backend_name.rsplit(":", 1)[-1].lower()
        if not _NAME_RE.match(name):
            raise ConfigError(
                f"tier name {name!r} must be letters, digits, '_', '.', '-'", f"{where}.name"
            )
        if name in names:
            raise ConfigError(
                f"tier name {name!r} is already used by tiers[{names[name]}]; "
                "give each tier a unique name",
                f"{where}.name",
            )
        names[name] = i
        if i == 0 and write.policy != "through":
            raise ConfigError(
                "the first tier receives every store: its policy must be 'through'",
                f"{where}.write.policy",
            )
        if write.policy == "back":
            above = out[i - 1]
            if not callable(getattr(above.backend_cls, "set_eviction_listener", None)):
                raise ConfigError(
                    f"write-back needs the tier above ({above.name!r}, backend {above.backend!r}) to "
                    "report evictions (set_eviction_listener), and it does not; use policy 'through'",
                    f"{where}.write.policy",
                )
        out.append(
            TierConfig(
                index=i,
                name=name,
                backend=backend_name,
                backend_cls=cls,
                options=options,
                url=url,
                backend_class=ts.backend_class,
                write_policy=write.policy,
                admit_after=write.admit_after,
                promote=ts.promote,
                load_deadline_ms=ts.load_deadline_ms,
                lookup_deadline_ms=ts.lookup_deadline_ms,
                max_queue=ts.max_queue,
                max_queue_latency_ms=ts.max_queue_latency_ms,
                write_concurrency=ts.write_concurrency,
                retry_backoff_ms=ts.retry_backoff_ms,
                retry_backoff_max_ms=max(ts.retry_backoff_ms, ts.retry_backoff_max_ms),
            )
        )
    return tuple(out)


def _resolve_backend(
    ts: TierSettings, registry: Any, where: str
) -> tuple[type[Any], str, str | None, Any]:
    """The backend class, its display name, the URL (if any) and the validated options."""
    raw_opts = dict(ts.options)
    url: str | None = None
    if ts.backend is not None and ts.backend_class is not None:
        raise ConfigError(
            "give either backend or backend_class, not both", f"{where}.backend_class"
        )
    if ts.backend_class is not None:
        cls = _import_class(ts.backend_class, f"{where}.backend_class")
        backend_name = ts.backend_class
        cls_where = f"{where}.backend_class"
    elif ts.backend is not None:
        spec_where = f"{where}.backend"
        text = ts.backend.strip()
        try:
            if _URL_RE.match(text):
                url = text
                spec = registry.for_scheme(urlsplit(text).scheme.lower())
            else:
                spec = registry.get(text)
            cls = spec.load()
        except PluginError as exc:
            raise ConfigError(str(exc), spec_where) from exc
        except Exception as exc:  # a broken plugin module: report where it was asked for
            raise ConfigError(
                f"backend {text!r} cannot be loaded: {type(exc).__name__}: {exc}", spec_where
            ) from exc
        backend_name = spec.name
        cls_where = spec_where
    else:
        raise ConfigError("required: a backend name or URL (or backend_class)", f"{where}.backend")
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} is not a storage backend (missing {missing})",
            cls_where,
        )
    opts_cls = getattr(cls, "Options", None)
    if not (isinstance(opts_cls, type) and dataclasses.is_dataclass(opts_cls)):
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} declares no Options dataclass", cls_where
        )
    if url is not None:
        fields = {f.name for f in dataclasses.fields(opts_cls)}
        scheme = urlsplit(url).scheme.lower()
        target = (
            "url"
            if "url" in fields
            else ("path" if scheme == "file" and "path" in fields else None)
        )
        rest = url.split("://", 1)[1]
        if target is None and rest.strip("/"):
            raise ConfigError(
                f"backend {backend_name!r} takes no url option; write backend: "
                f"{backend_name} and give its options instead",
                f"{where}.backend",
            )
        if target is not None:
            value = urlsplit(url).path if target == "path" else url
            if target in raw_opts and raw_opts[target] != value:
                raise ConfigError(
                    f"{target} is given twice (in backend: and in options:) with different values",
                    f"{where}.options.{target}",
                )
            raw_opts[target] = value
    options = build_options(opts_cls, raw_opts, path=f"{where}.options")
    return cls, backend_name, url, options


def _import_class(target: str, where: str) -> type[Any]:
    mod_name, sep, attr = target.strip().partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"{target!r} must look like 'package.module:Class'", where)
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise ConfigError(f"cannot import {target!r}: {type(exc).__name__}: {exc}", where) from exc
    if not isinstance(obj, type):
        raise ConfigError(f"{target!r} is a {type(obj).__name__}, not a class", where)
    return obj


# ---------------------------------------------------------------------------- docs
def _table(cls: type[Any], prefix: str = "") -> str:
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for o in describe_options(cls):
        kind = o["type"] + (f" ({', '.join(o['choices'])})" if o["choices"] else "")
        default = o["default_text"]
        if isinstance(o["default"], bool):
            default = str(o["default"]).lower()
        if o["name"] == "tiers":
            default = "one cpu tier"
        elif o["type"] == "dict" and default == "{}":
            default = "{}"
        cell = f"`{default}`" if default else ""
        doc = str(o["doc"]).replace("|", "\\|")
        lines.append(f"| `{prefix}{o['name']}` | {kind} | {cell} | {doc} |")
    return "\n".join(lines) + "\n"


def schema_markdown() -> str:
    """Markdown tables of every configuration key (embedded in ``docs/configuration.md``)."""
    return (
        "### Top-level keys\n\n"
        + _table(TopLevelSettings)
        + "\n### Tier keys (each entry of `tiers`)\n\n"
        + _table(TierSettings)
        + "\n### Write keys (a tier's `write`)\n\n"
        + _table(WriteSettings, "write.")
    )
