"""Loading a configuration: YAML, JSON or a dict, validated before anything opens.

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
        options: {secret_access_key: {$env: S3_SECRET}}
        write: {policy: through, admit_after: 2}

The fields, their defaults and their documentation are declared once, in :mod:`.schema`;
``docs/configuration.md`` embeds the tables :mod:`.reference` generates from them (a test
keeps the two identical).

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
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import yaml

from ..errors import ConfigError, PluginError
from ..interface import EvictionEvents, check_backend_class, implements
from ..redaction import redact_url, register_secrets, scrub_text, url_password
from .options import build_options, shown
from .schema import (
    CacheConfig,
    NamespaceSettings,
    NotImported,
    PlacementSettings,
    TierConfig,
    TierSettings,
    TopLevelSettings,
    WriteSettings,
    _options_dict,
)

__all__ = ["ConfigSource", "load_config"]


# ---------------------------------------------------------------------------- loading
ConfigSource = Any  # CacheConfig | Mapping | str | os.PathLike | None


def load_config(
    source: ConfigSource = None,
    *,
    registry: Any = None,
    environ: Mapping[str, str] | None = None,
    import_backend_classes: bool = True,
) -> CacheConfig:
    """Validate a configuration and return it as a :class:`CacheConfig`.

    ``source`` is a path to a ``.yaml``/``.yml``/``.json`` file, a mapping, YAML/JSON text
    starting with ``{``, an existing :class:`CacheConfig` (returned as is) or ``None`` (the
    default configuration: one ``cpu`` tier). ``registry`` is the backend registry to
    resolve names in (default: the process-wide one, plugins loaded); ``environ`` replaces
    ``os.environ`` for ``$env`` references. With ``import_backend_classes=False`` a tier's
    ``backend_class`` is checked for form only: its module is not imported, its options
    are kept unvalidated and :meth:`TierConfig.create_backend` refuses to build it.

    Every problem raises :class:`~lmcache_core.errors.ConfigError` (and nothing else) with
    the path of the bad value; its message never contains a secret (``$env`` values,
    ``hash_salt``, ``secret`` options, URL passwords).
    """
    if isinstance(source, CacheConfig):
        return source
    secrets: list[str] = []
    try:
        cfg = _load(source, registry, environ, import_backend_classes, secrets)
    except ConfigError as exc:
        error = _without_secrets(exc, secrets)
        if error is exc:
            raise
    except (ValueError, TypeError, LookupError, AttributeError, OverflowError) as exc:
        # a defect of ours or of a plugin: still a configuration error, and still scrubbed
        error = _without_secrets(
            ConfigError(f"invalid configuration ({type(exc).__name__}: {exc})"), secrets
        )
    except RecursionError:
        error = ConfigError("the configuration is nested too deeply")
    else:
        register_secrets(secrets)
        return cfg
    # raised outside the handlers: an error that quoted a secret is not kept as context
    raise error


def _without_secrets(exc: ConfigError, secrets: Sequence[str]) -> ConfigError:
    """``exc``, or a copy whose message (and cause chain) carries none of ``secrets``."""
    text = exc.reason
    clean = scrub_text(text, secrets)
    linked: BaseException | None = exc.__cause__ or exc.__context__
    leaked = False
    for _ in range(16):  # the causes and contexts it carries
        if linked is None or leaked:
            break
        leaked = scrub_text(str(linked), secrets) != str(linked)
        linked = linked.__cause__ or linked.__context__
    if clean == text and not leaked:
        return exc
    return ConfigError(clean, exc.path)


def _load(
    source: ConfigSource,
    registry: Any,
    environ: Mapping[str, str] | None,
    import_classes: bool,
    secrets: list[str],
) -> CacheConfig:
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
    _check_shape(raw)
    env_paths: dict[str, str] = {}
    env = os.environ if environ is None else environ
    resolved = _resolve_env(raw, "", env_paths, env, secrets)
    _collect_url_passwords(resolved, secrets)
    if not isinstance(resolved, Mapping):
        raise ConfigError(f"the configuration must be a mapping, got {type(resolved).__name__}")
    hidden = frozenset(env_paths)
    _check_keys(TopLevelSettings, resolved, "")
    if isinstance(resolved.get("namespace"), str):  # a text is the namespace's name
        resolved = {**resolved, "namespace": {"name": resolved["namespace"]}}
    if isinstance(resolved.get("placement"), str):  # a text is the policy's name
        resolved = {**resolved, "placement": {"policy": resolved["placement"]}}
    top = build_options(TopLevelSettings, resolved, path="", hidden=hidden)
    if top.hash_salt is not None:
        secrets.append(top.hash_salt)
        if not top.hash_salt:
            raise ConfigError("must not be empty (leave it out for no salt)", "hash_salt")
    tiers = _build_tiers(top.tiers, registry, hidden, import_classes, secrets)
    namespace = None
    if top.namespace is not None:
        _check_keys(NamespaceSettings, top.namespace, "namespace")
        namespace = build_options(NamespaceSettings, top.namespace, path="namespace", hidden=hidden)
        if not any(vars(namespace).values()):
            raise ConfigError(
                "names nothing: give a model (and revision, layout) or a name, "
                "or leave the section out for the 'default' namespace",
                "namespace",
            )
    placement = None
    placement_factory = None
    if top.placement is not None:
        _check_keys(PlacementSettings, top.placement, "placement")
        placement = build_options(PlacementSettings, top.placement, path="placement", hidden=hidden)
        placement_factory = _check_placement(placement, tiers, top.chunk_size, registry)
    cfg = CacheConfig(
        tiers=tiers,
        placement=placement,
        placement_factory=placement_factory,
        chunk_size=top.chunk_size,
        hash_algorithm=top.hash_algorithm,
        hash_salt=top.hash_salt,
        stats_dir=top.stats_dir,
        stats_interval_s=top.stats_interval_s,
        drain_timeout_s=top.drain_timeout_s,
        namespace=namespace,
        env_paths=env_paths,
        source=origin,
    )
    from .namespaces import configured_namespace

    configured_namespace(cfg)  # a namespace too large for an object header is refused here
    return cfg


#: A configuration nested deeper than this is refused (real ones are ~5 levels deep).
MAX_DEPTH = 32
#: A configuration holding more values than this, counting every use of a YAML alias
#: as a copy, is refused (a 400-byte "billion laughs" file expands to 10**9).
MAX_VALUES = 100_000


def _check_shape(doc: Any) -> None:
    """Refuse documents nested too deeply, referring to themselves or too large.

    Sizes are counted with shared (aliased) parts memoised, so the check itself is linear
    in the size of the *text*, whatever the expansion.
    """
    sizes: dict[int, int] = {}

    def size(node: Any, depth: int, path: str) -> int:
        if not isinstance(node, (Mapping, list, tuple)):
            return 1
        known = sizes.get(id(node))
        if known is not None:
            if known < 0:
                raise ConfigError("the configuration refers to itself (a recursive alias)", path)
            return known
        if depth >= MAX_DEPTH:
            raise ConfigError(f"the configuration is nested deeper than {MAX_DEPTH} levels", path)
        sizes[id(node)] = -1
        items = (
            [(_join(path, shown(k) if not isinstance(k, str) else k), v) for k, v in node.items()]
            if isinstance(node, Mapping)
            else [(f"{path}[{i}]", v) for i, v in enumerate(node)]
        )
        total = 1
        for where, child in items:
            total += size(child, depth + 1, where)
            if total > MAX_VALUES:
                raise ConfigError(
                    f"the configuration expands to more than {MAX_VALUES} values "
                    "(YAML aliases repeating a large part?)",
                    path,
                )
        sizes[id(node)] = total
        return total

    size(doc, 0, "")


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"configuration file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read configuration file {str(path)!r}: {exc}") from None
    return _parse_text(text, str(path), json_first=path.suffix.lower() == ".json")


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that rejects duplicated mapping keys (a silent override is a config bug)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)):
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"line {mark.line + 1}: key {shown(key)} appears twice")
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_text(text: str, origin: str, json_first: bool) -> Any:
    if json_first:
        try:
            return json.loads(text)
        except RecursionError:
            raise ConfigError(f"{origin}: the JSON is nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
            if origin != "<inline>":
                line, msg = "", str(exc)
                if isinstance(exc, json.JSONDecodeError):
                    line, msg = f" at line {exc.lineno} column {exc.colno}", exc.msg
                raise ConfigError(f"{origin}: invalid JSON{line}: {msg}") from None
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc.reason}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{origin}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{origin}: the YAML is nested too deeply") from None
    except (ValueError, OverflowError, TypeError) as exc:
        # a scalar the YAML resolver accepts but cannot convert: a 5000-digit integer,
        # a date such as 2001-02-30
        raise ConfigError(f"{origin}: invalid YAML value: {str(exc)[:120]}") from None
    return {} if doc is None else doc


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _resolve_env(
    value: Any,
    path: str,
    env_paths: dict[str, str],
    environ: Mapping[str, str],
    secrets: list[str],
) -> Any:
    if isinstance(value, Mapping):
        if "$env" in value:
            extra = sorted(shown(k) for k in value if k not in ("$env", "default"))
            if extra:
                raise ConfigError(
                    f"an $env reference takes only '$env' and 'default', got {extra}", path
                )
            name = value["$env"]
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"$env must name an environment variable, got {shown(name)}", path
                )
            env_paths[path] = name
            if name in environ:
                secrets.append(environ[name])
                return environ[name]
            if "default" in value:
                return value["default"]
            raise ConfigError(f"environment variable {name} is not set", path)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"keys must be strings, got {shown(k)}", path)
            out[k] = _resolve_env(v, _join(path, k), env_paths, environ, secrets)
        return out
    if isinstance(value, (list, tuple)):
        return [
            _resolve_env(v, f"{path}[{i}]", env_paths, environ, secrets)
            for i, v in enumerate(value)
        ]
    return value


def _collect_url_passwords(doc: Any, secrets: list[str]) -> None:
    """Add the password of every URL-looking string in ``doc`` to ``secrets``."""
    if isinstance(doc, str):
        if "://" in doc and "@" in doc:
            password = url_password(doc)
            if password:
                secrets.append(password)
    elif isinstance(doc, Mapping):
        for v in doc.values():
            _collect_url_passwords(v, secrets)
    elif isinstance(doc, list):
        for v in doc:
            _collect_url_passwords(v, secrets)


def _check_placement(
    placement: PlacementSettings, tiers: Sequence[TierConfig], chunk_size: int, registry: Any
) -> Any:
    """The policy's factory. Refuses an unknown policy, an unknown tier name or options the
    policy rejects (each tier's policy is built once here, without I/O, to ask it)."""
    from ..errors import UnknownPolicyError
    from ..placement.wiring import policy_context

    if registry is None:
        from ..plugins import get_registry

        registry = get_registry()
    try:
        factory = registry.policy_factory(placement.policy)
    except UnknownPolicyError as exc:
        raise ConfigError(str(exc), "placement.policy") from None
    names = {t.name for t in tiers}
    for name in placement.tiers:
        if name not in names:
            raise ConfigError(
                f"no tier is called {name!r} (tiers: {', '.join(t.name for t in tiers)})",
                f"placement.tiers.{name}",
            )
        if not isinstance(placement.tiers[name], Mapping):
            raise ConfigError("expected a mapping of policy options", f"placement.tiers.{name}")
    for t in tiers:
        where = f"placement.tiers.{t.name}" if t.name in placement.tiers else "placement.options"
        try:
            factory(policy_context(t, placement, chunk_size))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"policy {placement.policy!r}: {exc}", where) from None
    return factory


def _check_keys(schema: type[Any], raw: Mapping[str, Any], path: str) -> None:
    """Reject an unknown key, naming it (and the closest known one)."""
    known = [f.name for f in dataclasses.fields(schema)]
    for key in raw:
        if key not in known:
            text = key if isinstance(key, str) else shown(key)
            hint = difflib.get_close_matches(text[:100], known, n=1)
            msg = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
            raise ConfigError(f"{msg} (known: {', '.join(known)})", _join(path, text[:100]))


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CLASS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")


def _build_tiers(
    raw_tiers: Sequence[Any],
    registry: Any,
    hidden: frozenset[str],
    import_classes: bool,
    secrets: list[str],
) -> tuple[TierConfig, ...]:
    if not raw_tiers:
        raise ConfigError("at least one tier is needed", "tiers")
    if registry is None:
        from ..plugins import get_registry

        registry = get_registry()
    out: list[TierConfig] = []
    names: dict[str, int] = {}
    for i, raw in enumerate(raw_tiers):
        where = f"tiers[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"expected a mapping, got {type(raw).__name__}", where)
        _check_keys(TierSettings, raw, where)
        raw = dict(raw)
        if isinstance(raw.get("codec"), str):
            raw["codec"] = {"name": raw["codec"]}
        ts = build_options(TierSettings, raw, path=where, hidden=hidden)
        codec, codec_impl = _build_codec(ts.codec, f"{where}.codec", registry)
        _check_keys(WriteSettings, ts.write, f"{where}.write")
        write = build_options(WriteSettings, ts.write, path=f"{where}.write", hidden=hidden)
        cls, backend_name, url, options = _resolve_backend(
            ts, registry, where, hidden, import_classes
        )
        env_options = {p.rsplit(".", 1)[1] for p in hidden if p.startswith(f"{where}.options.")}
        if f"{where}.backend" in hidden and url is not None:
            env_options |= {"url", "path"}
        secret_values, _ = _secret_options(options)
        secrets.extend(secret_values)
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
        if write.policy == "back" and out[i - 1].codec is not None:
            raise ConfigError(
                f"write-back hands this tier the evicted chunks of {out[i - 1].name!r}, which "
                "are coded by its codec; use policy 'through' below a tier with a codec",
                f"{where}.write.policy",
            )
        if write.policy == "back":
            above = out[i - 1]
            if above.backend_cls is not NotImported and not implements(
                above.backend_cls, EvictionEvents
            ):
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
                codec=codec,
                codec_impl=codec_impl,
                env_options=frozenset(env_options),
            )
        )
    return tuple(out)


def _build_codec(
    raw: Mapping[str, Any] | None, where: str, registry: Any
) -> tuple[dict[str, Any] | None, Any]:
    """A tier's ``codec`` entry checked and instantiated: ``({"name", "options"}, codec)``.

    An unknown name is a :class:`ConfigError` naming the plugin that provides it."""
    if raw is None:
        return None, None
    for key in raw:
        if key not in ("name", "options"):
            raise ConfigError("unknown key (known: name, options)", _join(where, str(key)))
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError("a codec needs a name (e.g. lossless, int8, cachegen)", f"{where}.name")
    options = raw.get("options", {}) or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"expected a mapping, got {type(options).__name__}", f"{where}.options")
    from ..errors import UnknownCodecError
    from ..plugins.codec_registry import codecs_for

    try:
        spec = codecs_for(registry).get(name)
    except UnknownCodecError as exc:
        raise ConfigError(str(exc), f"{where}.name") from None
    try:
        impl = spec.create(options)
    except ValueError as exc:
        raise ConfigError(str(exc), f"{where}.options") from None
    except Exception as exc:  # a codec plugin that cannot be imported
        raise ConfigError(f"{type(exc).__name__}: {exc}", f"{where}.name") from None
    return {"name": name, "options": dict(impl.options())}, impl


def _secret_options(options: Any) -> tuple[list[str], set[str]]:
    """The values and names of the ``secret`` options among typed ``options``."""
    values, kinds = _options_dict(options)
    return [values[n] for n in kinds if isinstance(values[n], str)], kinds


def _resolve_backend(
    ts: TierSettings, registry: Any, where: str, hidden: frozenset[str], import_classes: bool
) -> tuple[type[Any], str, str | None, Any]:
    """The backend class, its display name, the URL (if any) and the validated options."""
    raw_opts = dict(ts.options)
    url: str | None = None
    if ts.backend is not None and ts.backend_class is not None:
        raise ConfigError(
            "give either backend or backend_class, not both", f"{where}.backend_class"
        )
    if ts.backend_class is not None:
        if not import_classes:
            class_text = ts.backend_class.strip()
            if not _CLASS_RE.match(class_text):
                raise ConfigError(
                    f"{shown(class_text)} must look like 'package.module:Class'",
                    f"{where}.backend_class",
                )
            return NotImported, class_text, None, raw_opts
        cls = _import_class(ts.backend_class, f"{where}.backend_class")
        backend_name = ts.backend_class
        cls_where = f"{where}.backend_class"
    elif ts.backend is not None:
        spec_where = f"{where}.backend"
        text = ts.backend.strip()
        secret_spec = spec_where in hidden
        try:
            if _URL_RE.match(text):
                url = text
                spec = registry.for_scheme(_split_url(text, spec_where, secret_spec).scheme)
            else:
                spec = registry.get(text)
            cls = spec.load()
        except PluginError as exc:
            if secret_spec:
                raise ConfigError("no backend handles this value (from $env)", spec_where) from None
            raise ConfigError(str(exc), spec_where) from exc
        except ConfigError:
            raise
        except Exception as exc:  # a broken plugin module: report where it was asked for
            what = "(from $env)" if secret_spec else repr(redact_url(text))
            raise ConfigError(
                f"backend {what} cannot be loaded: {type(exc).__name__}: {exc}", spec_where
            ) from exc
        backend_name = spec.name
        cls_where = spec_where
    else:
        raise ConfigError("required: a backend name or URL (or backend_class)", f"{where}.backend")
    checked = check_backend_class(cls)
    if checked.problems:
        raise ConfigError("; ".join(checked.problems), cls_where)
    opts_cls = getattr(cls, "Options", None)
    if not (isinstance(opts_cls, type) and dataclasses.is_dataclass(opts_cls)):
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} declares no Options dataclass", cls_where
        )
    if url is not None:
        fields = {f.name for f in dataclasses.fields(opts_cls)}
        parts = _split_url(url, f"{where}.backend", f"{where}.backend" in hidden)
        scheme = parts.scheme
        target = "url" if "url" in fields else ("path" if "path" in fields else None)
        rest = url.split("://", 1)[1]
        if target == "path" and parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"a {scheme}:// URL names a local path and no host: write "
                f"{scheme}:///absolute/path (three slashes)",
                f"{where}.backend",
            )
        if target is None and rest.strip("/"):
            raise ConfigError(
                f"backend {backend_name!r} takes no url option; write backend: "
                f"{backend_name} and give its options instead",
                f"{where}.backend",
            )
        if target is not None:
            value = parts.path if target == "path" else url
            if target in raw_opts and raw_opts[target] != value:
                raise ConfigError(
                    f"{target} is given twice (in backend: and in options:) with different values",
                    f"{where}.options.{target}",
                )
            raw_opts[target] = value
    options = build_options(opts_cls, raw_opts, path=f"{where}.options", hidden=hidden)
    return cls, backend_name, url, options


def _split_url(url: str, where: str, secret: bool) -> SplitResult:
    """``urlsplit(url)`` with its port and host checked; a bad URL is a ConfigError."""
    try:
        parts = urlsplit(url)
        _ = parts.port, parts.hostname  # both raise ValueError when malformed
    except ValueError as exc:
        what = "" if secret else f" {redact_url(url)!r}"
        raise ConfigError(f"invalid URL{what}: {exc}", where) from None
    return parts._replace(scheme=parts.scheme.lower())


def _import_class(target: str, where: str) -> type[Any]:
    """``backend_class: "pkg.mod:Class"`` through the one class loader of the plugins."""
    from ..plugins.registry import BackendLoadError, load_backend_class

    try:
        return load_backend_class(target)
    except BackendLoadError as exc:
        raise ConfigError(f"cannot import {target!r}: {exc}", where) from exc
