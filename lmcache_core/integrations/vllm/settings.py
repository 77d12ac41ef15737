"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

``kv_connector_extra_config`` holds the storage configuration (the
:func:`lmcache_core.config.load_config` schema) either inline under ``"config"`` or as a
YAML/JSON file under ``"config_file"``, plus the connector's own options (see
:class:`ConnectorOptions`)::

    {"config": {"chunk_size": 256, "tiers": [{"name": "cpu", "backend": "cpu"}]},
     "model_revision": "v1"}

Users of LMCache's connector may give an LMCache configuration instead: a file under
``"lmcache_config_file"`` (or, when no storage is given at all, the file named by
``LMCACHE_CONFIG_FILE``), with ``"lmcache.<key>"`` entries and ``LMCACHE_<KEY>`` variables
overriding it as in LMCache; :mod:`lmcache_core.config.lmcache_compat` translates it and the
settings it cannot honour are named in one WARNING.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config.options import build_options, option
from ...errors import ConfigError

__all__ = [
    "DEFAULT_STORAGE_CONFIG",
    "ConnectorOptions",
    "ConnectorSettings",
    "options_markdown",
    "parse_settings",
]

log = logging.getLogger("vllm.lmcache_core.connector")

#: Storage used when neither ``config`` nor ``config_file`` is given.
DEFAULT_STORAGE_CONFIG: dict[str, Any] = {
    "chunk_size": 256,
    "tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}],
}


@dataclass(frozen=True)
class ConnectorOptions:
    """Options of the vLLM connector itself (next to ``config``/``config_file``)."""

    model_name: str | None = option(
        None,
        kind="str",
        doc="Model name in keys (default: vLLM's served_model_name when set, else the hub "
        "repo id, else the model directory's name).",
    )
    model_revision: str | None = option(
        None,
        kind="str",
        doc="Model revision in keys (default: hub snapshot commit, else SHA-256 of the weights).",
    )
    use_vllm_block_hashes: bool = option(
        False,
        doc="Key chunks from vLLM's block hashes when they are reproducible across processes.",
    )
    stats_dir: str | None = option(
        None,
        kind="path",
        doc="Write counters to <stats_dir>/scheduler-<pid>.json and worker<rank>-<pid>.json.",
    )
    max_staging_bytes: int = option(
        "256MiB",
        kind="bytes",
        minimum=1,
        doc="Bound on a worker's reused staging buffers: half for saves (a save finding "
        "none free is dropped and counted), a quarter each for the two kinds of loads. On "
        "CUDA (page-locked buffers) each is charged the power of two torch's host "
        "allocator rounds it to.",
    )
    lookup_deadline_ms: float = option(
        20.0,
        minimum=0.0,
        doc="A lookup in shared tiers (run in the background; the request waits meanwhile) "
        "not done this long after it started is a miss, counted as a lookup deadline.",
    )
    lookup_first_wait_ms: float = option(
        5.0,
        minimum=0.0,
        doc="The first time vLLM asks about a request whose shared-tier lookup still runs, "
        "the scheduler waits for it this long at most (once per request; later asks never "
        "wait; capped at lookup_deadline_ms). 0: never wait (vLLM runs an empty step and "
        "asks again).",
    )
    load_deadline_s: float = option(
        5.0,
        minimum=0.001,
        doc="A load not done this long after it started fails; its blocks are recomputed.",
    )
    max_load_bytes_per_step: int = option(
        "512MiB",
        kind="bytes",
        minimum=1,
        doc="Bytes loaded before one forward pass at most; larger hits load in the background.",
    )
    save_decode_chunks: bool = option(
        True,
        doc="Also store chunks completed while generating (multi-turn reuse).",
    )
    io_timeout_s: float | None = option(
        None,
        kind="float",
        minimum=0.001,
        doc="Deprecated: use lookup_deadline_ms and load_deadline_s (when set, it is the "
        "load deadline unless load_deadline_s is given).",
    )
    index_max_chunks: int = option(
        1_000_000,
        minimum=1,
        doc="Chunks the scheduler remembers as stored by its workers (LRU beyond).",
    )
    layerwise_loads: bool = option(
        True,
        doc="On CPU, copy a memory-tier hit into vLLM's blocks layer by layer beside the "
        "forward pass (each attention layer waits for its own copies) instead of before it.",
    )
    copy_nice: int = option(
        0,
        minimum=0,
        maximum=19,
        doc="Niceness added to the worker's copy threads (stored and promoted chunks into "
        "its memory tier; default 0: vLLM's priority). They run Python: while vLLM's "
        "compute threads or other processes load every core, a niced one holding the GIL "
        "stalls vLLM's engine thread and the connector's event loop.",
    )
    reset_shared_tiers: bool = option(
        False,
        doc="reset_cache also deletes this model's chunks (its namespace) from the shared "
        "tiers (disk, S3), not only the workers' memory tiers.",
    )


@dataclass(frozen=True)
class ConnectorSettings:
    """Parsed ``kv_connector_extra_config``: the storage config plus connector options."""

    storage: dict[str, Any]
    options: ConnectorOptions
    source: str = "<default>"
    raw: dict[str, Any] = field(default_factory=dict)


def _read_file(path: str) -> dict[str, Any]:
    p = Path(os.path.expanduser(path))
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}", "config_file") from exc
    data: Any
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{p} is not valid JSON: {exc}", "config_file") from exc
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p} is not valid YAML: {exc}", "config_file") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping", "config_file")
    return data


def _from_lmcache(
    extra: dict[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], str] | None:
    """The storage translated from an LMCache configuration, when one is given (its
    ``lmcache.*`` entries are taken out of ``extra``, its connector options put in)."""
    from ...config.lmcache_compat import from_lmcache, read_lmcache_file

    overrides = {
        k[len("lmcache.") :]: extra.pop(k)
        for k in list(extra)
        if isinstance(k, str) and k.startswith("lmcache.")
    }
    path = extra.pop("lmcache_config_file", None)
    if path is None and not overrides:
        if "config" in extra or "config_file" in extra or "LMCACHE_CONFIG_FILE" not in environ:
            return None
        path = environ["LMCACHE_CONFIG_FILE"]
        log.info("LMCacheCoreConnector: reading the LMCache configuration in %s", path)
    if "config" in extra or "config_file" in extra:
        raise ConfigError(
            "give the storage once: 'config', 'config_file' or an LMCache configuration "
            "('lmcache_config_file', 'lmcache.*' keys)",
            "kv_connector_extra_config",
        )
    if path is not None and not isinstance(path, str):
        raise ConfigError("must be a path string", "kv_connector_extra_config.lmcache_config_file")
    doc = read_lmcache_file(path) if path else {}
    try:
        tr = from_lmcache(doc, overrides=overrides, environ=environ)
    except ConfigError as exc:
        raise ConfigError(exc.reason, f"LMCache configuration: {exc.path}") from exc
    warning = tr.warning()
    if warning:
        log.warning("LMCacheCoreConnector: %s", warning)
    for key, value in tr.connector.items():
        extra.setdefault(key, value)
    return tr.storage, f"LMCache configuration {path or '(lmcache.* keys)'}"


def parse_settings(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; errors name the offending key.

    ``environ`` (default ``os.environ``) is read for ``LMCACHE_CONFIG_FILE`` and
    ``LMCACHE_<KEY>`` overrides, only when an LMCache configuration is in use.
    """
    extra = dict(extra or {})
    has_cfg, has_file = "config" in extra, "config_file" in extra
    if has_cfg and has_file:
        raise ConfigError(
            "give either 'config' or 'config_file', not both", "kv_connector_extra_config"
        )
    lmcache = _from_lmcache(extra, os.environ if environ is None else environ)
    if lmcache is not None:
        storage, source = lmcache
    elif has_cfg:
        storage = extra.pop("config")
        if not isinstance(storage, dict):
            raise ConfigError(
                "must be a mapping (the lmcache-core config)", "kv_connector_extra_config.config"
            )
        source = "kv_connector_extra_config.config"
    elif has_file:
        path = extra.pop("config_file")
        if not isinstance(path, str):
            raise ConfigError("must be a path string", "kv_connector_extra_config.config_file")
        storage = _read_file(path)
        source = path
    else:
        storage = json.loads(json.dumps(DEFAULT_STORAGE_CONFIG))
        source = "<default>"
    options = build_options(ConnectorOptions, extra, path="kv_connector_extra_config")
    if options.io_timeout_s is not None:
        log.warning(
            "LMCacheCoreConnector: io_timeout_s is deprecated; use lookup_deadline_ms "
            "(default 20) and load_deadline_s (default 5)%s",
            "" if "load_deadline_s" in extra else f"; load_deadline_s={options.io_timeout_s}",
        )
        if "load_deadline_s" not in extra:
            options = dataclasses.replace(options, load_deadline_s=options.io_timeout_s)
    return ConnectorSettings(storage=storage, options=options, source=source, raw=dict(extra))


def options_markdown() -> str:
    """The Markdown table of :class:`ConnectorOptions` (embedded in ``docs/vllm.md``)."""
    from ...config.options import describe_options
    from ...tables import markdown_table

    rows = []
    for o in describe_options(ConnectorOptions):
        default = o["default_text"]
        if isinstance(o["default"], bool):
            default = str(o["default"]).lower()
        rows.append([f"`{o['name']}`", o["type"], f"`{default}`" if default else "", o["doc"]])
    return markdown_table(rows, ["Key", "Type", "Default", "Description"])
