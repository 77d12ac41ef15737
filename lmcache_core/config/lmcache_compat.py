"""Read an LMCache configuration and give the lmcache-core equivalent.

Users moving from LMCache's ``LMCacheConnectorV1`` keep their LMCache configuration file
(the one ``LMCACHE_CONFIG_FILE`` names, with ``lmcache.<key>`` entries of vLLM's
``kv_connector_extra_config`` and ``LMCACHE_<KEY>`` environment variables overriding
it, as in LMCache). :func:`from_lmcache` turns such a document into

* ``storage``: an lmcache-core configuration (:func:`lmcache_core.config.load_config`
  schema): ``chunk_size``, ``hash_algorithm`` and the tiers (``local_cpu`` -> a ``cpu``
  tier, ``local_disk`` -> a ``disk`` tier written through, ``gds_path`` -> a ``gds``
  tier written through, ``remote_url`` ``s3://`` / ``fs://`` -> an ``s3`` / ``disk``
  tier);
* ``connector``: options of the vLLM connector (``save_decode_cache`` ->
  ``save_decode_chunks``, ``lookup_timeout_ms`` -> ``lookup_deadline_ms``);
* ``not_honoured``: the keys set to something lmcache-core does not do, with the reason
  (the caller names them in one warning).

:data:`LMCACHE_KEYS` is the translation table: every key of LMCache 0.5.6's
configuration (``lmcache/v1/config.py``), what it maps to or why it is ignored.
``docs/vllm.md`` embeds :func:`translation_markdown` (a test keeps the two identical).
Chunks stored by LMCache are not readable by lmcache-core (other keys and object
format): a migrated server starts with empty tiers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..tables import markdown_table

__all__ = [
    "LMCACHE_ALIASES",
    "LMCACHE_KEYS",
    "LMCacheKey",
    "Translation",
    "from_lmcache",
    "read_lmcache_file",
    "translation_markdown",
]

#: Where a key goes: mapped (to ``target``), ignored (no effect needed: ``why``), or
#: not honoured (a value other than LMCache's default is named in the warning).
MAPPED, IGNORED, UNSUPPORTED = "mapped", "ignored", "not honoured"


@dataclass(frozen=True)
class LMCacheKey:
    """One LMCache configuration key and what lmcache-core does with it."""

    name: str
    default: Any
    kind: str  # MAPPED, IGNORED or UNSUPPORTED
    target: str  # where it goes (MAPPED) or "" (see why)
    why: str = ""


def _k(name: str, default: Any, kind: str, target: str = "", why: str = "") -> LMCacheKey:
    return LMCacheKey(name, default, kind, target, why)


_PD = "disaggregated prefill (KV sent between instances) is not provided; share a tier instead"
_P2P = "peer-to-peer KV transfer between instances is not provided; share a disk or S3 tier"
_BLEND = "CacheBlend (reuse of non-prefix chunks) is not provided: only prefixes are reused"
_CTRL = "LMCache's controller is not provided; `lmcache-core inspect` shows what tiers hold"
_API = "LMCache's internal API server is not provided; `lmcache-core inspect` reads the tiers"
_MEM = "LMCache's own allocator; lmcache-core's cpu tier allocates per chunk"
_GDS_EVICTS = (
    "LMCache's gds backend never evicts; the `gds` tier evicts least recently used chunks "
    "beyond its max_bytes (16 GiB unless set)"
)
_PLUG = "lmcache-core plugins are pip-installed distributions found through entry points"
_HS = "hidden-state caching is not provided"
_STATS = "chunk statistics are not provided; `lmcache-core inspect` reports per-tier figures"

#: Every key of LMCache 0.5.6's configuration, in its order.
LMCACHE_KEYS: tuple[LMCacheKey, ...] = (
    _k("chunk_size", 256, MAPPED, "`chunk_size`"),
    _k("local_cpu", True, MAPPED, "a `cpu` tier (first) when true"),
    _k("max_local_cpu_size", 5.0, MAPPED, "`cpu` tier `max_bytes` (GiB, as in LMCache)"),
    _k("local_cpu_use_hugepages", False, IGNORED, why=_MEM),
    _k("reserve_local_cpu_size", 0.0, IGNORED, why=_MEM),
    _k(
        "local_disk",
        None,
        MAPPED,
        "a `disk` tier on that path (`file://` stripped), written through",
        "only the first of several comma-separated paths is used (the others are named in "
        "the warning)",
    ),
    _k(
        "local_disk_path_sharding",
        "by_gpu",
        IGNORED,
        why="keys carry the worker's rank, so one directory serves every rank",
    ),
    _k(
        "max_local_disk_size",
        0.0,
        MAPPED,
        "`disk` tier `max_bytes` (GiB)",
        "0 (LMCache's default) means no disk tier in LMCache, so none here either",
    ),
    _k(
        "remote_url",
        None,
        MAPPED,
        "`s3://BUCKET...` -> an `s3` tier on the bucket; `fs://HOST:PORT/PATH` -> a `disk` "
        "tier on PATH",
        "other schemes (lm, redis, valkey, mooncakestore, infinistore, ...) have no backend "
        "here and are named in the warning",
    ),
    _k(
        "remote_serde",
        "naive",
        MAPPED,
        "`naive`: lmcache-core's own object format",
        "`cachegen` is not translated: give the tier a codec instead (`codec: cachegen`, "
        "the lmcache-codec-cachegen plugin; docs/codecs.md)",
    ),
    _k(
        "use_layerwise",
        False,
        UNSUPPORTED,
        why="layer-by-layer saves; loads on CPU are layer by layer already (the connector's "
        "`layerwise_loads`, on by default)",
    ),
    _k("save_decode_cache", False, MAPPED, "connector option `save_decode_chunks`"),
    _k(
        "pre_caching_hash_algorithm",
        "builtin",
        MAPPED,
        "`hash_algorithm`: `sha256*` -> `sha256`; anything else -> `xxh3_128` (the default)",
        "LMCache's keys are never read by lmcache-core, so only the strength matters",
    ),
    _k("enable_blending", False, UNSUPPORTED, why=_BLEND),
    _k("blend_recompute_ratios", None, UNSUPPORTED, why=_BLEND),
    _k("blend_thresholds", None, UNSUPPORTED, why=_BLEND),
    _k("blend_check_layers", None, UNSUPPORTED, why=_BLEND),
    _k("blend_min_tokens", 256, UNSUPPORTED, why=_BLEND),
    _k("blend_special_str", " # # ", UNSUPPORTED, why=_BLEND),
    _k(
        "retrieve_locations",
        None,
        UNSUPPORTED,
        why="every tier is looked up, fastest first; per-location selection is not provided",
    ),
    _k(
        "store_location",
        None,
        UNSUPPORTED,
        why="stores go to the first tier and flow down by each tier's write policy",
    ),
    _k("enable_p2p", False, UNSUPPORTED, why=_P2P),
    _k("p2p_host", None, UNSUPPORTED, why=_P2P),
    _k("p2p_init_ports", None, UNSUPPORTED, why=_P2P),
    _k("p2p_lookup_ports", None, UNSUPPORTED, why=_P2P),
    _k("mp_host", None, IGNORED, why="SGLang's multiprocess server; not used with vLLM"),
    _k("mp_port", 5555, IGNORED, why="SGLang's multiprocess server; not used with vLLM"),
    _k("enable_controller", False, UNSUPPORTED, why=_CTRL),
    _k("lmcache_instance_id", None, IGNORED, why="names an instance for LMCache's controller"),
    _k("controller_pull_url", None, UNSUPPORTED, why=_CTRL),
    _k("controller_reply_url", None, UNSUPPORTED, why=_CTRL),
    _k("lmcache_worker_ports", None, UNSUPPORTED, why=_CTRL),
    _k("lmcache_worker_ids", None, UNSUPPORTED, why=_CTRL),
    _k("lmcache_worker_heartbeat_delay_time", 10, UNSUPPORTED, why=_CTRL),
    _k("lmcache_worker_heartbeat_time", None, UNSUPPORTED, why=_CTRL),
    _k("enable_pd", False, UNSUPPORTED, why=_PD),
    _k("pd_role", None, UNSUPPORTED, why=_PD),
    _k("pd_buffer_size", None, UNSUPPORTED, why=_PD),
    _k("pd_buffer_device", None, UNSUPPORTED, why=_PD),
    _k("pd_peer_host", None, UNSUPPORTED, why=_PD),
    _k("pd_peer_init_port", None, UNSUPPORTED, why=_PD),
    _k("pd_peer_alloc_port", None, UNSUPPORTED, why=_PD),
    _k("pd_peer_query_port", None, UNSUPPORTED, why=_PD),
    _k("pd_proxy_host", None, UNSUPPORTED, why=_PD),
    _k("pd_proxy_port", None, UNSUPPORTED, why=_PD),
    _k("pd_allocation_timeout_sec", math.inf, UNSUPPORTED, why=_PD),
    _k("pd_shutdown_timeout_sec", 5.0, UNSUPPORTED, why=_PD),
    _k("pd_condition_poll_interval_sec", 0.005, UNSUPPORTED, why=_PD),
    _k("pd_max_prefill_len", 0, UNSUPPORTED, why=_PD),
    _k("pd_backend_mode", "async", UNSUPPORTED, why=_PD),
    _k("pd_skip_proxy_notification", False, UNSUPPORTED, why=_PD),
    _k("pd_bidirectional", False, UNSUPPORTED, why=_PD),
    _k("transfer_channel", None, UNSUPPORTED, why=_PD),
    _k("nixl_backends", None, UNSUPPORTED, why=_PD),
    _k("nixl_buffer_size", None, UNSUPPORTED, why=_PD),
    _k("nixl_buffer_device", None, UNSUPPORTED, why=_PD),
    _k(
        "gds_path",
        None,
        MAPPED,
        "a `gds` tier (lmcache-backend-gds, docs/backends/gds.md) on that directory, below "
        "the disk tier, written through; several comma-separated directories become its "
        "`paths`, striped by key",
        _GDS_EVICTS + " (said in the warning)",
    ),
    _k(
        "gds_path_sharding",
        "by_gpu",
        IGNORED,
        why="LMCache gives each GPU one of the directories; the `gds` tier stripes every "
        "rank's chunks over all of them by key",
    ),
    _k("gds_buffer_size", None, IGNORED, why="kvikio manages cuFile's buffers"),
    _k("maru_path", None, UNSUPPORTED, why="LMCache's Maru shared-memory store is not provided"),
    _k("maru_pool_size", 4.0, UNSUPPORTED, why="LMCache's Maru store is not provided"),
    _k("use_gds", True, MAPPED, "the `gds` tier's `force_posix` (use_gds false: true)"),
    _k(
        "gds_backend",
        "cufile",
        UNSUPPORTED,
        why="the `gds` tier uses cuFile through kvikio, or its POSIX path",
    ),
    _k("audit_actual_remote_url", None, UNSUPPORTED, why="LMCache's audit connector"),
    _k("internal_api_server_host", "127.0.0.1", IGNORED, why=_API),
    _k(
        "extra_config",
        None,
        MAPPED,
        "for an `s3` tier: `s3_region` -> `region`, `s3_num_io_threads` -> `max_concurrency`",
        "credentials (`aws_access_key_id`, `aws_secret_access_key`) are not copied into a "
        "file: the tier uses the AWS credential chain, or give them as `{$env: NAME}`; "
        "other entries are ignored",
    ),
    _k(
        "save_unfull_chunk",
        False,
        UNSUPPORTED,
        why="only full chunks are stored (a partial chunk is recomputed)",
    ),
    _k(
        "blocking_timeout_secs",
        10,
        MAPPED,
        "the remote tier's `load_deadline_ms` (x 1000)",
        "ignored without a remote tier",
    ),
    _k("external_lookup_client", None, UNSUPPORTED, why="lookups run in the scheduler process"),
    _k("py_enable_gc", True, IGNORED, why="LMCache's garbage-collector switch"),
    _k(
        "cache_policy",
        "LRU",
        MAPPED,
        "`LRU`: every tier evicts least recently used chunks",
        "other policies (FIFO, LFU, MRU) are not provided",
    ),
    _k("numa_mode", None, IGNORED, why="LMCache's NUMA-aware allocator"),
    _k(
        "enable_async_loading",
        False,
        IGNORED,
        why="loads of chunks not in a worker's memory tier always run in the background",
    ),
    _k("internal_api_server_enabled", False, UNSUPPORTED, why=_API),
    _k("internal_api_server_port_start", 6999, IGNORED, why=_API),
    _k("priority_limit", None, UNSUPPORTED, why="request priorities do not gate stores"),
    _k("internal_api_server_include_index_list", None, IGNORED, why=_API),
    _k("internal_api_server_socket_path_prefix", None, IGNORED, why=_API),
    _k("runtime_plugin_locations", None, UNSUPPORTED, why=_PLUG),
    _k("storage_plugins", None, UNSUPPORTED, why=_PLUG),
    _k("remote_storage_plugins", None, UNSUPPORTED, why=_PLUG),
    _k(
        "lookup_timeout_ms",
        3000,
        MAPPED,
        "connector option `lookup_deadline_ms`",
        "a lookup past it is a miss (lmcache-core's default is 20 ms)",
    ),
    _k("min_retrieve_tokens", 0, UNSUPPORTED, why="every hit of at least one chunk is loaded"),
    _k("hit_miss_ratio", None, UNSUPPORTED, why="stores are not gated by a hit ratio"),
    _k("lookup_server_worker_ids", None, IGNORED, why="every rank is looked up"),
    _k("enable_scheduler_bypass_lookup", False, UNSUPPORTED, why="lookups run in the scheduler"),
    _k("script_allowed_imports", None, IGNORED, why=_API),
    _k("run_script_api_enabled", False, IGNORED, why=_API),
    _k("enable_lazy_memory_allocator", False, IGNORED, why=_MEM),
    _k("lazy_memory_initial_ratio", 0.2, IGNORED, why=_MEM),
    _k("lazy_memory_expand_trigger_ratio", 0.5, IGNORED, why=_MEM),
    _k("lazy_memory_step_ratio", 0.1, IGNORED, why=_MEM),
    _k("lazy_memory_safe_size", 0.0, IGNORED, why=_MEM),
    _k("enable_chunk_statistics", False, UNSUPPORTED, why=_STATS),
    _k("chunk_statistics_auto_start_statistics", False, IGNORED, why=_STATS),
    _k("chunk_statistics_auto_exit_timeout_hours", 0.0, IGNORED, why=_STATS),
    _k("chunk_statistics_auto_exit_target_unique_chunks", 0, IGNORED, why=_STATS),
    _k("chunk_statistics_strategy", "memory_bloom_filter", IGNORED, why=_STATS),
    _k(
        "enable_kv_events",
        False,
        UNSUPPORTED,
        why="the connector publishes KV events when vLLM's --kv-events-config enables them",
    ),
    _k("use_gpu_connector_v3", False, IGNORED, why="LMCache's GPU copy kernels"),
    _k(
        "pin_timeout_sec",
        300,
        MAPPED,
        "the `disk` tier's `pin_seconds`",
        "ignored without a disk tier",
    ),
    _k("pin_check_interval_sec", 30, IGNORED, why="pins expire by themselves"),
    _k("remote_config_url", None, UNSUPPORTED, why="configuration is read from files only"),
    _k("app_id", None, IGNORED, why="identifies the instance to remote_config_url"),
    _k("enable_hidden_state_cache", False, UNSUPPORTED, why=_HS),
    _k("max_hidden_state_cpu_size", 2.0, IGNORED, why=_HS),
    _k("hidden_state_layers", None, IGNORED, why=_HS),
    _k("hidden_states_retrieve_mode", "prefix_strict", IGNORED, why=_HS),
)

#: LMCache's deprecated names, read as the key they stand for (LMCache also lists
#: ``nixl_buffer_size``, which is a key of its own in 0.5.6: read as itself).
LMCACHE_ALIASES: dict[str, str] = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_role": "pd_role",
    "controller_url": "controller_pull_url",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}

_BY_NAME = {k.name: k for k in LMCACHE_KEYS}
_GIB = 1 << 30
_AWS_HOST = re.compile(r"^(?P<bucket>[^.]+)\.s3[.-](?P<region>[a-z0-9-]+)\.amazonaws\.com$")


@dataclass
class Translation:
    """What :func:`from_lmcache` made of an LMCache configuration."""

    storage: dict[str, Any]
    connector: dict[str, Any] = field(default_factory=dict)
    #: ``(LMCache key, reason)`` of every setting lmcache-core does not honour.
    not_honoured: list[tuple[str, str]] = field(default_factory=list)

    def warning(self) -> str | None:
        """The one warning naming every key not honoured (None when there is none)."""
        if not self.not_honoured:
            return None
        parts = "; ".join(f"{k} ({why})" for k, why in self.not_honoured)
        return f"LMCache settings not honoured by lmcache-core: {parts}"


def read_lmcache_file(path: str | Path) -> dict[str, Any]:
    """Read an LMCache YAML configuration file (a mapping; empty file: ``{}``)."""
    import yaml

    p = Path(path).expanduser()
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}", "lmcache_config_file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}", "lmcache_config_file") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{p} must hold a mapping of LMCache keys", "lmcache_config_file")
    return doc


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", "", "none"):
        return False
    raise ConfigError(f"{value!r} is not a boolean", key)


def _float(value: Any, key: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{value!r} is not a number", key) from None
    if out < 0 or math.isnan(out):
        raise ConfigError(f"{value!r} must be >= 0", key)
    return out


def _gib(value: Any, key: str) -> int | str:
    size = _float(value, key)
    if size == int(size):
        return f"{int(size)}GiB"
    return int(size * _GIB)


def _is_default(spec: LMCacheKey, value: Any) -> bool:
    if value is None:
        return spec.default is None
    if isinstance(spec.default, bool):
        try:
            return _bool(value, spec.name) == spec.default
        except ConfigError:
            return False
    if isinstance(spec.default, (int, float)):
        try:
            return float(value) == float(spec.default)
        except (TypeError, ValueError):
            return False
    if isinstance(value, (list, tuple, dict)) and not value:
        return spec.default is None
    return bool(value == spec.default)


def _directories(value: Any) -> list[str]:
    """The directories of an LMCache path setting: comma-separated, ``file://`` stripped."""
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    return [p[len("file://") :] if p.startswith("file://") else p for p in parts]


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``LMCACHE_<KEY>`` variables (LMCache lets them override the file)."""
    out: dict[str, Any] = {}
    for name in [*LMCACHE_ALIASES, *_BY_NAME]:
        value = environ.get(f"LMCACHE_{name.upper()}")
        if value is not None:
            out[name] = value
    return out


def _remote_tier(url: str, extra: Mapping[str, Any], notes: list[tuple[str, str]]) -> Any:
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme == "s3":
        host, _, prefix = rest.partition("/")
        options: dict[str, Any] = {}
        m = _AWS_HOST.match(host)
        bucket = m.group("bucket") if m else host.split(":")[0].split(".")[0]
        if m:
            options["region"] = m.group("region")
        if extra.get("s3_region"):
            options["region"] = str(extra["s3_region"])
        if extra.get("s3_num_io_threads"):
            options["max_concurrency"] = int(extra["s3_num_io_threads"])
        for secret in ("aws_access_key_id", "aws_secret_access_key"):
            if extra.get(secret):
                notes.append(
                    (
                        f"extra_config.{secret}",
                        "not copied into a file: use the AWS credential chain or "
                        "{$env: NAME} in the s3 tier's options",
                    )
                )
        backend = f"s3://{bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{bucket}"
        tier: dict[str, Any] = {"name": "remote", "backend": backend}
        if options:
            tier["options"] = options
        return tier
    if scheme == "fs":
        path = "/" + rest.partition("/")[2] if "/" in rest else ""
        if not path.strip("/"):
            notes.append(("remote_url", f"{url!r} names no directory"))
            return None
        return {"name": "remote", "backend": "disk", "options": {"path": path}}
    notes.append(
        (
            "remote_url",
            f"no lmcache-core backend for {scheme}:// (the s3 and disk backends cover "
            "s3:// and shared file systems)",
        )
    )
    return None


def from_lmcache(
    doc: Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Translation:
    """Translate an LMCache configuration (a mapping of its keys).

    ``overrides`` (``lmcache.<key>`` entries of ``kv_connector_extra_config``, without the
    prefix) and ``LMCACHE_<KEY>`` variables of ``environ`` override the document, as in
    LMCache. Unknown keys are not honoured (named in the warning); values of the wrong
    type raise :class:`~lmcache_core.errors.ConfigError` naming the key.
    """
    merged: dict[str, Any] = {}
    notes: list[tuple[str, str]] = []
    layers = (doc, _env_overrides(environ or {}), overrides or {})
    for layer in layers:
        for raw, value in layer.items():
            key = LMCACHE_ALIASES.get(str(raw), str(raw))
            if key not in _BY_NAME:
                notes.append((str(raw), "not an LMCache 0.5.6 configuration key"))
                continue
            merged[key] = value

    def get(name: str) -> Any:
        return merged.get(name, _BY_NAME[name].default)

    for name, value in merged.items():
        spec = _BY_NAME[name]
        if spec.kind == UNSUPPORTED and not _is_default(spec, value):
            notes.append((name, spec.why))

    storage: dict[str, Any] = {}
    connector: dict[str, Any] = {}
    chunk = get("chunk_size")
    try:
        storage["chunk_size"] = int(chunk)
    except (TypeError, ValueError):
        raise ConfigError(f"{chunk!r} is not an integer", "chunk_size") from None
    algo = str(get("pre_caching_hash_algorithm")).lower()
    storage["hash_algorithm"] = "sha256" if algo.startswith("sha256") else "xxh3_128"
    serde = get("remote_serde")
    if serde not in (None, "naive"):
        notes.append(
            (
                "remote_serde",
                f"{serde!r} is not translated: give the tier a codec (e.g. `codec: cachegen`, "
                "docs/codecs.md)",
            )
        )
    policy = str(get("cache_policy")).upper()
    if policy != "LRU":
        notes.append(("cache_policy", f"{policy}: every tier evicts least recently used"))

    tiers: list[dict[str, Any]] = []
    if _bool(get("local_cpu"), "local_cpu"):
        size = get("max_local_cpu_size")
        tiers.append(
            {
                "name": "cpu",
                "backend": "cpu",
                "options": {"max_bytes": _gib(size, "max_local_cpu_size")},
            }
        )
    disk = get("local_disk")
    if disk:
        paths = _directories(disk)
        size = _float(get("max_local_disk_size"), "max_local_disk_size")
        if size <= 0:
            notes.append(
                ("local_disk", "max_local_disk_size is 0, so LMCache (and this) use no disk")
            )
        elif paths:
            options: dict[str, Any] = {
                "path": paths[0],
                "max_bytes": _gib(size, "max_local_disk_size"),
            }
            if "pin_timeout_sec" in merged:
                options["pin_seconds"] = _float(merged["pin_timeout_sec"], "pin_timeout_sec")
            tiers.append(
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": options,
                    "write": {"policy": "through"},
                }
            )
            if len(paths) > 1:
                notes.append(("local_disk", f"only {paths[0]} is used, not {', '.join(paths[1:])}"))
    gds = get("gds_path")
    if gds:
        gds_paths = _directories(gds)
        if gds_paths:
            gds_options: dict[str, Any] = (
                {"path": gds_paths[0]} if len(gds_paths) == 1 else {"paths": gds_paths}
            )
            if not _bool(get("use_gds"), "use_gds"):
                gds_options["force_posix"] = True
            tiers.append(
                {
                    "name": "gds",
                    "backend": "gds",
                    "options": gds_options,
                    "write": {"policy": "through"},
                }
            )
            notes.append(("gds_path", _GDS_EVICTS))
    url = get("remote_url")
    if url:
        extra = get("extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{extra!r} is not a mapping", "extra_config")
        remote = _remote_tier(str(url), extra, notes)
        if remote is not None:
            if "blocking_timeout_secs" in merged:
                remote["load_deadline_ms"] = 1000 * _float(
                    merged["blocking_timeout_secs"], "blocking_timeout_secs"
                )
            remote["write"] = {"policy": "through"}
            tiers.append(remote)
    if not tiers:
        raise ConfigError(
            "the LMCache configuration selects no storage lmcache-core provides "
            "(local_cpu false, no local_disk, no gds_path, no s3:// or fs:// remote_url)",
            "local_cpu",
        )
    storage["tiers"] = tiers

    if "save_decode_cache" in merged:
        connector["save_decode_chunks"] = _bool(merged["save_decode_cache"], "save_decode_cache")
    if "lookup_timeout_ms" in merged:
        connector["lookup_deadline_ms"] = _float(merged["lookup_timeout_ms"], "lookup_timeout_ms")
    return Translation(storage=storage, connector=connector, not_honoured=notes)


def translation_markdown() -> str:
    """The translation table of :data:`LMCACHE_KEYS` and the aliases (Markdown)."""
    rows = []
    for k in LMCACHE_KEYS:
        default = "" if k.default is None else f"`{k.default!r}`"
        if k.kind == MAPPED:
            what = f"mapped: {k.target}"
        elif k.kind == IGNORED:
            what = "ignored"
        else:
            what = "not honoured (warned when set)"
        rows.append([f"`{k.name}`", default, what, k.why])
    for old, new in LMCACHE_ALIASES.items():
        rows.append([f"`{old}`", "", f"read as `{new}`", "LMCache's deprecated name"])
    return markdown_table(rows, ["LMCache key", "LMCache default", "lmcache-core", "Notes"])
