"""``LMCacheCoreConnector``: a vLLM v1 KV connector backed by lmcache-core's tiered storage.

Use it with ``--kv-transfer-config`` (``kv_connector: "LMCacheCoreConnector"``, registered
by the ``vllm.general_plugins`` entry point, or with ``kv_connector_module_path:
"lmcache_core.integrations.vllm.connector"``). vLLM builds one instance per role: the
scheduler side (:mod:`.scheduler_side`) in the engine-core process and one worker side
(:mod:`.worker_side`) per tensor-parallel rank in the worker processes. See
``docs/vllm.md``.

The connector supports vLLM's hybrid KV-cache manager (``SupportsHMA``): configuring it
leaves HMA on. It restores one KV-cache group of full-attention or MLA layers, or under HMA
full-attention plus sliding-window groups together (every load then runs in the
background, and a failed one fails the request's load as a whole: ``failed_recving``); for
a model with other groups (SSM state) it reports no hits and stores nothing (one INFO line
says why) and the model runs normally.

Hits in a worker's memory tier start loading at the top of the step (``handle_preemptions``,
else ``start_load_kv``), before the forward pass; every
other hit loads in the background (``load_async``, reported through ``get_finished``).
Saves are gathered into bounded staging memory in ``wait_for_save`` and stored in the
background; a finished request whose last saves are not gathered yet keeps its blocks
(``request_finished`` returns ``True``) until ``get_finished`` reports it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .connector_stats import ConnectorStats
from .context import ConnectorContext, build_context
from .kv_events import KVEvents
from .metadata import StepMetadata
from .prom_metrics import PromMetrics
from .scheduler_side import SchedulerSide
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LMCacheCoreConnector"]

log = logging.getLogger("vllm.lmcache_core.connector")


def _kv_events(vllm_config: Any, ctx: ConnectorContext) -> KVEvents | None:
    """The KV-event builder when vLLM publishes KV events (``--kv-events-config``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False):
        return None
    if ctx.disabled or ctx.layout is None or not ctx.storage_config.tiers:
        return None
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or "")
    return KVEvents(
        enabled=True,
        medium=ctx.storage_config.tiers[0].name,
        block_size=ctx.block_size,
        blocks_per_chunk=ctx.blocks_per_chunk,
        hash_block_size=ctx.hash_block_size or ctx.block_size,
        hash_algo=algo,
        group_idx=ctx.layout.group_id,
    )


class LMCacheCoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector storing prompt chunks in an lmcache-core tiered hierarchy.

    Observability in vLLM's own terms: figures in vLLM's statistics and on ``/metrics``
    (:mod:`.connector_stats`, :mod:`.prom_metrics`), hit sources by tier type
    (:meth:`get_external_cache_hit_sources`), KV events (:mod:`.kv_events`).
    """

    #: Used by vLLM only where the per-tier split is not asked for.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ctx = build_context(vllm_config, kv_cache_config)
        self._ctx = ctx
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(ctx, _kv_events(vllm_config, ctx))
        else:
            self._worker = WorkerSide(ctx, vllm_config, kv_cache_config)
            log.info("LMCacheCoreConnector worker-side connector created in pid=%d", os.getpid())

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never a correctness problem."""
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def _meta(self) -> StepMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, StepMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, StepMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads before the forward pass are copied layer by layer beside it (on CPU):
        wait for this layer's copies."""
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Chunks are saved whole (all layers) in :meth:`wait_for_save`."""
        return

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, plus the requests whose background load failed as a whole
        (models with several KV-cache groups, where vLLM takes no block-level errors)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker.take_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """The planned load's tokens by the type of the tier each chunk is read from:
        ``cpu`` tiers -> ``host``, ``disk``/``gds`` -> ``disk``, S3 and any other backend
        -> ``external_unspecified`` (vLLM has no "remote" source). This is the
        scheduler's plan; what the workers actually read is on the connector's own
        ``vllm:lmcache_core_hit_tokens`` series."""
        if num_external_tokens <= 0 or self._scheduler is None:
            return {}
        split = self._scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(src): n for src, n in split.items() if n > 0}

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, (block_ids,)), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """With HMA vLLM calls only this: everything :meth:`request_finished` does, on
        the blocks of the KV-cache groups the connector copies (taken by group id)."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids), None

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV-cache groups a load restores: every group the connector copies (the
        full-attention group, and with HMA on the sliding-window groups too). A model
        with groups it cannot restore is never offered a hit (``layout.describe_layout``)."""
        layout = self._ctx.layout
        if self._ctx.disabled or layout is None:
            return ()
        return layout.group_ids

    # ------------------------------------------------------------------ observability
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's figures since the last call (worker: tokens, bytes, timings,
        tier health; scheduler: request-level counts)."""
        try:
            if self._worker is not None:
                return self._worker.kv_connector_stats()
            if self._scheduler is not None:
                return self._scheduler.kv_connector_stats()
        except Exception:  # statistics must never break a step
            log.exception("LMCacheCoreConnector: collecting statistics failed")
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return ConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PromMetrics:
        return PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored``/``BlockRemoved`` for the workers' memory tier (see
        :mod:`.kv_events`); none unless vLLM's KV events are enabled."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        """``LLM.reset_prefix_cache(reset_connector=True)``: the scheduler forgets what the
        memory tiers hold at once; every worker clears its private tiers at the start of
        the next step, before any load. Shared tiers (disk, S3) are untouched unless the
        ``reset_shared_tiers`` option is set."""
        if self._scheduler is None:
            return None
        return self._scheduler.reset_cache()
