"""The connector's Prometheus series on vLLM's ``/metrics`` (``build_prom_metrics``).

vLLM's front-end process builds :class:`PromMetrics` once, with its own metric classes
(they handle multiprocess collection) and the per-engine labels (``model_name``,
``engine``), and calls :meth:`PromMetrics.observe` with each step's
:class:`~.connector_stats.ConnectorStats` payload. :data:`SERIES` lists every series
with its kind, extra labels and meaning; ``docs/vllm.md`` documents exactly these (a
drift test compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

__all__ = ["SERIES", "PromMetrics", "Series"]

#: Seconds buckets of one load or save (a chunk read from memory is ~0.1 ms; a request's
#: background load from S3 can take seconds).
SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0)
#: Bytes buckets of one load or save (one chunk of a small model: KiBs; a request's
#: load of a large model: GiBs).
BYTES_BUCKETS = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30)


@dataclass(frozen=True)
class Series:
    """One Prometheus series: ``name`` as registered (a counter is exposed with
    ``_total`` appended, a histogram as ``_bucket``/``_sum``/``_count``)."""

    name: str
    kind: str  # "counter" | "histogram" | "gauge"
    labels: tuple[str, ...]
    help: str


SERIES: tuple[Series, ...] = (
    Series(
        "vllm:lmcache_core_hit_tokens",
        "counter",
        ("tier",),
        "Prompt tokens loaded by the connector instead of computed, by the tier they were "
        "read from (counted once per chunk: rank 0's loads).",
    ),
    Series(
        "vllm:lmcache_core_load_bytes",
        "counter",
        ("tier",),
        "KV bytes loaded into vLLM's KV cache, by tier, summed over tensor-parallel ranks.",
    ),
    Series(
        "vllm:lmcache_core_save_bytes",
        "counter",
        (),
        "KV bytes stored into the first tier, summed over tensor-parallel ranks.",
    ),
    Series(
        "vllm:lmcache_core_load_seconds",
        "histogram",
        ("tier",),
        "Duration of one load (a step's loads from the memory tier, or one request's "
        "background load, by its deepest tier), per rank.",
    ),
    Series(
        "vllm:lmcache_core_load_size_bytes",
        "histogram",
        ("tier",),
        "Bytes of one load (as for load_seconds), per rank.",
    ),
    Series(
        "vllm:lmcache_core_save_seconds",
        "histogram",
        (),
        "Duration of one chunk's store into the first tier, per rank.",
    ),
    Series(
        "vllm:lmcache_core_save_size_bytes",
        "histogram",
        (),
        "Bytes of one chunk's store, per rank.",
    ),
    Series(
        "vllm:lmcache_core_failed_loads",
        "counter",
        (),
        "Loads that failed (per request and step); the tokens were recomputed or the "
        "request failed, by kv_load_failure_policy.",
    ),
    Series(
        "vllm:lmcache_core_stale_loads",
        "counter",
        (),
        "Chunks promised by a lookup but gone when loaded (evicted or removed meanwhile).",
    ),
    Series(
        "vllm:lmcache_core_dropped_saves",
        "counter",
        (),
        "Saves dropped (staging memory full, or the storage refused the store), per "
        "request and step: a future miss, never wrong KV.",
    ),
    Series(
        "vllm:lmcache_core_unkeyable_requests",
        "counter",
        (),
        "Requests neither looked up nor saved because they cannot be keyed safely "
        "(e.g. a multimodal item without a hash).",
    ),
    Series(
        "vllm:lmcache_core_tier_healthy",
        "gauge",
        ("tier",),
        "1 while the tier answers on every rank, 0 while it is in error back-off on some "
        "rank (its operations are then misses).",
    ),
)

_BY_NAME = {s.name: s for s in SERIES}


class PromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Registers :data:`SERIES` and records each step's stats payload into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {
            "counter": metric_types[Counter],
            "gauge": metric_types[Gauge],
            "histogram": metric_types[Histogram],
        }
        self._metrics: dict[str, Any] = {}
        for s in SERIES:
            kwargs: dict[str, Any] = {
                "name": s.name,
                "documentation": s.help,
                "labelnames": list(labelnames) + list(s.labels),
            }
            if s.kind == "histogram":
                kwargs["buckets"] = SECONDS_BUCKETS if "seconds" in s.name else BYTES_BUCKETS
            if s.kind == "gauge":
                kwargs["multiprocess_mode"] = "mostrecent"
            self._metrics[s.name] = classes[s.kind](**kwargs)
        # Label-less series exist from the start (0 until something happens).
        for values in per_engine_labelvalues.values():
            for s in SERIES:
                if not s.labels:
                    self._metrics[s.name].labels(*values)

    def _m(self, name: str, engine_idx: int, *extra: object) -> Any:
        return self._metrics[name].labels(*self.per_engine_labelvalues[engine_idx], *extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data or {}
        for tier, n in d.get("hit_tokens", {}).items():
            if n:
                self._m("vllm:lmcache_core_hit_tokens", engine_idx, tier).inc(n)
        for tier, n in d.get("load_bytes", {}).items():
            if n:
                self._m("vllm:lmcache_core_load_bytes", engine_idx, tier).inc(n)
        if d.get("save_bytes"):
            self._m("vllm:lmcache_core_save_bytes", engine_idx).inc(d["save_bytes"])
        for tier, nbytes, seconds in d.get("load_obs", []):
            self._m("vllm:lmcache_core_load_seconds", engine_idx, tier).observe(seconds)
            self._m("vllm:lmcache_core_load_size_bytes", engine_idx, tier).observe(nbytes)
        for nbytes, seconds in d.get("save_obs", []):
            self._m("vllm:lmcache_core_save_seconds", engine_idx).observe(seconds)
            self._m("vllm:lmcache_core_save_size_bytes", engine_idx).observe(nbytes)
        for key in ("failed_loads", "stale_loads", "dropped_saves", "unkeyable_requests"):
            if d.get(key):
                self._m(f"vllm:lmcache_core_{key}", engine_idx).inc(d[key])
        for tier, ranks in d.get("tier_health", {}).items():
            ok = all(ranks.values())
            self._m("vllm:lmcache_core_tier_healthy", engine_idx, tier).set(1 if ok else 0)
