"""The worker-side half of the connector (one per tensor-parallel rank, in vLLM's worker
process): it owns this rank's storage hierarchy, loads hit chunks into vLLM's paged KV
cache and stores computed chunks.

* **Loads before the forward pass** (``start_load_kv``) only of chunks the scheduler knows
  are in this worker's memory tier, served from the calling thread; a chunk that fails on
  any rank fails on every rank (one small all-reduce), its blocks are reported to vLLM.
* **Background loads** (:mod:`.loads`) for every other hit, reported through
  ``get_finished``. With several KV-cache groups (HMA) every load is one, and a failed
  one is reported for its request (``failed_recving``), never as block ids.
* **Saves** (:mod:`.saves`): gathered into bounded staging memory inside the step, stored
  in the background. A save whose computation read a block that failed to load (in this
  step, or in one the scheduler had not heard of when it planned the save) is dropped.
* Under ``kv_load_failure_policy: fail`` every chunk reported as stored stays pinned in
  the memory tier until the scheduler has acknowledged it no longer offers it, so a
  promised chunk cannot be evicted before its load.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...keys import CacheEngineKey
from ...memory import pinned_available
from .connector_stats import ConnectorStats, StatsDelta
from .context import ConnectorContext
from .group_copier import GroupedCopier
from .layer_copy import LayerCopies, Segment
from .layout import BlockCopier, UnsupportedModel, check_attention_backends
from .loads import AsyncLoads
from .metadata import ChunkLoad, StepMetadata, WorkerReport
from .saves import SaveItem, SaveQueue
from .staging import ChunkBuffers, buffer_count
from .stats_file import encode_stats, write_stats_text
from .storage import Storage, replica_storage_config

__all__ = ["WorkerSide"]

log = logging.getLogger("vllm.lmcache_core.connector")

#: Pinned (offered) chunks may fill at most this fraction of the memory tier under
#: policy ``fail``; beyond it the oldest are withdrawn.
OFFERED_FRACTION = 0.75
#: Withdrawal picks, among this many least recently used offered chunks per victim, the
#: ones furthest into their prompt (a prefix without its first chunk is useless).
WITHDRAW_WINDOW = 4
#: Tier health goes into vLLM's statistics when it changes, and at least this often.
HEALTH_EVERY_S = 5.0
#: In a step that computes nothing while background loads run, ``get_finished`` waits up
#: to this long for one of them to finish (or to need the step: see
#: :meth:`AsyncLoads.wait_progress`): vLLM steps back to back while requests wait for their
#: KV, and each idle step costs the engine thread ~5 ms of CPU that the reads and copies
#: need on a small machine (a request arriving meanwhile starts at most this much later).
IDLE_WAIT_S = 0.02


@dataclass
class _Counters:
    loaded_chunks: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed_chunks: int = 0
    skipped_saves: int = 0
    load_seconds: float = 0.0
    lookup_seconds: float = 0.0
    read_seconds: float = 0.0
    scatter_seconds: float = 0.0
    steps_with_loads: int = 0
    dropped_at_close: int = 0
    withdrawn: int = 0
    resets: int = 0
    reset_removed: int = 0
    warm_seconds: float = -1.0  # the load path's warm-up (-1: not finished)


class WorkerSide:
    """Loads and saves for one rank."""

    def __init__(self, ctx: ConnectorContext, vllm_config: Any, kv_cache_config: Any) -> None:
        self.ctx = ctx
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.disabled = ctx.disabled
        self.rank = 0
        self.copier: BlockCopier | GroupedCopier | None = None
        self.storage: Storage | None = None
        self.saves: SaveQueue | None = None
        self.loads: AsyncLoads | None = None
        self.db: Any = None
        self.counters = _Counters()
        self._sync_buffers: ChunkBuffers | None = None
        self._warming: threading.Thread | None = None
        self.layer_copies: LayerCopies | None = None
        self._errors: set[int] = set()
        #: several KV-cache groups: vLLM takes no block-level errors, a failed background
        #: load is reported per request (``failed_recving``)
        self._per_request_failures = bool(ctx.layout is not None and ctx.layout.groups)
        self._failed_requests: set[str] = set()
        self._failed_at: dict[int, int] = {}  # block -> step of its failed load
        self._report = WorkerReport()
        self._reported_disabled = False
        self._dirty = False
        self._stats_text = ""  # the statistics document last written (stats_dir)
        self._step = -1
        self._load_step = -1  # the last step whose loads started
        self._idle = False  # the current step computes nothing
        self._evicted: list[int] = []
        # (appended from any thread, taken on vLLM's: swapping the list without the lock
        # could lose an append made to the old list between its lookup and its call)
        self._evicted_lock = threading.Lock()
        self._fail_policy = ctx.failure_policy != "recompute"
        self._report_stored = True
        self._offered: OrderedDict[int, tuple[object, int]] = OrderedDict()  # handle, chunk
        self._withdrawing: dict[int, object] = {}
        self._pinned_limit = 0
        self._pending_finish: set[str] = set()
        self._to_release: set[int] = set()
        self._unstarted: dict[str, list[ChunkLoad]] = {}
        self._saves_off = False  # a replica rank whose first tier is shared stores nothing
        self._delta = StatsDelta()
        self._sync_obs: list[tuple[str, int, float]] = []  # (tier, bytes, seconds) per step
        self._health: dict[str, bool] = {}
        self._health_at = 0.0

    # ------------------------------------------------------------------ set-up
    def _tp_rank(self) -> int:
        if self.ctx.world_size <= 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _backend_names(self) -> dict[str, str]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        names = {}
        layer_type: Any = AttentionLayerBase
        for name, layer in get_layers_from_vllm_config(self.vllm_config, layer_type).items():
            try:
                names[name] = str(layer.get_attn_backend().get_name())
            except Exception:  # a layer without a backend is reported as unknown
                names[name] = "unknown"
        return names

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            self.rank = self._tp_rank()
        except Exception as exc:
            self._disable(f"cannot read the tensor-parallel rank: {exc}")
            return
        if self.disabled:
            return
        ctx = self.ctx
        assert ctx.layout is not None and ctx.namespace is not None and ctx.db is not None
        try:
            check_attention_backends(ctx.layout.device_type, self._backend_names())
            layers = [n for n in ctx.layout.layer_names if n in kv_caches]
            if len(layers) != len(kv_caches):
                extra = sorted(set(kv_caches) - set(layers))
                raise UnsupportedModel(
                    f"KV caches of layers outside the attention group: {extra[:3]}"
                )
            num_blocks = int(self.kv_cache_config.num_blocks)
            if ctx.layout.groups:  # HMA: every group's layers, group after group
                self.copier = GroupedCopier(
                    [
                        BlockCopier([kv_caches[n] for n in g.layer_names], num_blocks)
                        for g in ctx.layout.groups
                    ]
                )
            else:
                self.copier = BlockCopier([kv_caches[n] for n in layers], num_blocks)
                per_layer = self.copier.views
                if ctx.settings.options.layerwise_loads and LayerCopies.usable(per_layer):
                    self.layer_copies = LayerCopies(layers, per_layer)
        except UnsupportedModel as exc:
            self._disable(str(exc))
            return
        self.db = ctx.db.for_worker(ctx.shard_of(self.rank), ctx.key_world_size)
        config = ctx.storage_config
        if not ctx.is_writer(self.rank):
            config, self._saves_off = replica_storage_config(config)
        self.storage = Storage(config, ctx.namespace, copy_nice=ctx.settings.options.copy_nice)
        self._open_transfers()
        self._start_warming()
        copier, storage = self.copier, self.storage
        log.info(
            "LMCacheCoreConnector worker side: pid=%d rank=%d/%d layers=%d chunk=%s %s "
            "(%.1f KiB, %s) tiers=%s",
            os.getpid(),
            self.rank,
            ctx.world_size,
            copier.num_layers,
            list(copier.chunk_shape(ctx.blocks_per_chunk)),
            copier.dtype,
            copier.block_nbytes * ctx.blocks_per_chunk / 1024,
            "one copy for all layers" if copier.one_view else "one copy per layer",
            list(storage.tier_names),
        )

    def _open_transfers(self) -> None:
        assert self.copier is not None and self.storage is not None
        opts = self.ctx.settings.options
        shape = self.copier.chunk_shape(self.ctx.blocks_per_chunk)
        chunk_bytes = self.copier.block_nbytes * self.ctx.blocks_per_chunk
        n = buffer_count(opts.max_staging_bytes, chunk_bytes, pinned_available())
        self._sync_buffers = ChunkBuffers(shape, self.copier.dtype, n // 4)
        self._report_stored = self.storage.top_is_private_memory
        pin = self._fail_policy and self._report_stored
        self.loads = AsyncLoads(
            self.storage,
            ChunkBuffers(shape, self.copier.dtype, n // 4),
            self.copier,
            deadline_s=opts.load_deadline_s,
            block_nbytes=self.copier.block_nbytes,
            # (promoted chunks are reported like saved ones, pinned the same way)
            after_promotion=self._pin_stored if pin else None,
        )
        self.saves = SaveQueue(
            self.storage,
            ChunkBuffers(shape, self.copier.dtype, n - 2 * (n // 4)),
            self.copier,
            after_store=self._pin_stored if pin else None,
        )
        if pin:
            cap = self.storage.top_max_bytes
            self._pinned_limit = (
                max(1, int(cap * OFFERED_FRACTION) // chunk_bytes) if cap else 1 << 30
            )
        if self._report_stored:
            self.storage.on_top_eviction(self._on_evicted)

    def _start_warming(self) -> None:
        """Warm the background load path (:meth:`AsyncLoads.warm`) in a thread of its
        own, never on vLLM's: the engine compiles and profiles for seconds after this,
        and a process's first load would otherwise pay for it (page faults of fresh
        staging memory above all)."""
        loads = self.loads
        if loads is None:
            return

        def warm() -> None:
            t0 = time.perf_counter()
            try:
                loads.warm()
            except Exception as exc:  # only the first load gets slower
                log.warning("LMCacheCoreConnector: warming the load path failed: %s", exc)
            self.counters.warm_seconds = time.perf_counter() - t0

        self._warming = threading.Thread(target=warm, name="lmcache-warm", daemon=True)
        self._warming.start()

    def _pin_stored(self, key: CacheEngineKey) -> object | None:
        assert self.storage is not None
        return self.storage.pin_top([key])[0]

    def _on_evicted(self, key: CacheEngineKey) -> None:
        with self._evicted_lock:  # any thread
            self._evicted.append(key.chunk_hash)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.error(
            "LMCacheCoreConnector disabled on rank %d, serving no hits: %s", self.rank, reason
        )
        self._report.disabled[self.rank] = reason

    # ------------------------------------------------------------------ step start
    def handle_preemptions(self, meta: StepMetadata) -> None:
        """Blocks of preempted requests are reused from this step on: every gather still
        reading them must be complete (asynchronous only on CUDA). Then the step's loads
        start: vLLM calls this at the top of ``execute_model``, before it prepares the
        step's inputs, so copies beside the forward pass (:mod:`.layer_copy`) begin while
        the engine thread is still in Python and a core is free (``start_load_kv``
        then finds them started)."""
        if meta.preempted and self.saves is not None:
            self.saves.wait_gathers()
        self.start_load(meta)

    def _begin(self, meta: StepMetadata) -> None:
        if meta.step <= self._step:
            return
        self._step = meta.step
        self._dirty = True
        if self._failed_at:
            self._failed_at = {b: s for b, s in self._failed_at.items() if s > meta.acked}
        if meta.finish_after_save:
            self._pending_finish.update(meta.finish_after_save)
        if meta.reset:
            self._reset()

    def _reset(self) -> None:
        """``reset_cache``: finish the queued saves (KV computed before the reset must not
        land after it), drop every pin, and clear the private tiers."""
        if self.storage is None:
            return
        unreported = []  # stored or promoted before the reset: never reported, unpinned
        if self.saves is not None:
            self.saves.wait_gathers()
            self.saves.drain(self.storage.drain_timeout_s)
            unreported += self.saves.take_stored()
        if self.loads is not None:
            unreported += self.loads.take_promoted()
        handles = [h for h, _ in self._offered.values()] + list(self._withdrawing.values())
        handles += [x for _, _, x in unreported if x is not None]
        self._offered.clear()
        self._withdrawing.clear()
        self._to_release.clear()
        if handles:
            self.storage.unpin_top(handles)
        with self._evicted_lock:
            self._evicted.clear()
        try:
            removed = self.storage.clear_private()
        except Exception:
            log.exception("LMCacheCoreConnector: clearing the memory tier for a reset failed")
            removed = 0
        if self.ctx.settings.options.reset_shared_tiers and self.rank == 0:
            assert self.ctx.namespace is not None
            try:
                removed += self.storage.purge_shared(self.ctx.namespace.to_json())
            except Exception:
                log.exception("LMCacheCoreConnector: deleting from the shared tiers failed")
        self.counters.resets += 1
        self.counters.reset_removed += removed
        log.info("LMCacheCoreConnector rank %d: reset, %d chunks removed", self.rank, removed)

    def start_load(self, meta: StepMetadata) -> None:
        """Start the step's loads, once per step (from ``handle_preemptions`` or, for a
        runner that does not call it, ``start_load_kv``)."""
        if meta.step <= self._load_step:
            return
        self._load_step = meta.step
        self._begin(meta)
        if self.copier is not None:
            self.copier.begin_step()  # (CUDA: stream order between gathers, compute, scatters)
        if self.saves is not None:
            self.saves.prune_events()
        if meta.chains and self.storage is not None and self.db is not None:
            observe = self.storage.hierarchy.observe_prefix
            try:
                for hashes in meta.chains:
                    observe([self.db.make_key(h) for h in hashes])
            except Exception:  # a policy's failure must not fail the step
                log.exception("LMCacheCoreConnector: placement policy failed to observe")
        self._idle = meta.idle
        if meta.failed_blocks:
            self._errors.update(meta.failed_blocks)
            for b in meta.failed_blocks:
                self._failed_at[b] = meta.step
        if meta.loads:
            self._load_sync(meta)
        doomed = set(meta.failed_async)
        for req_id, loads in meta.async_loads.items():
            if self.disabled or self.loads is None or req_id in doomed:
                self._unstarted[req_id] = loads  # reported as failed in get_finished
                continue
            self.loads.start(req_id, loads, [self.db.make_key(ld.chunk_hash) for ld in loads])
        self._release(meta)

    def _release(self, meta: StepMetadata | None) -> None:
        """Unpin the chunks the scheduler no longer offers, except those a background
        load still reads (planned before the scheduler stopped offering them)."""
        if meta is not None:
            self._to_release.update(meta.release.get(self.rank, ()))
        if not self._to_release or self.storage is None:
            return
        busy = self.loads.hashes_in_use() if self.loads is not None else set()
        ready = [x for x in self._to_release if x not in busy]
        self._to_release.difference_update(ready)
        handles = [h for h in (self._withdrawing.pop(x, None) for x in ready) if h is not None]
        if handles:
            self.storage.unpin_top(handles)

    # ------------------------------------------------------------------ loads
    def _load_sync(self, meta: StepMetadata) -> None:
        loads = meta.loads
        t0 = time.perf_counter()
        before = self.counters.loaded_bytes
        ok = [False] * len(loads)
        if not self.disabled:
            try:
                ok = self._load(loads)
            except Exception:
                log.exception("LMCacheCoreConnector: loading failed; the chunks are recomputed")
                ok = [False] * len(loads)
        ok = self._agree(ok)
        c = self.counters
        if self.storage is not None and c.loaded_bytes > before:
            self._sync_obs.append(
                (self.storage.tier_names[0], c.loaded_bytes - before, time.perf_counter() - t0)
            )
        first_fail: dict[str, int] = {}
        for load, good in zip(loads, ok, strict=True):
            if not good:
                self._errors.update(load.block_ids)
                for b in load.block_ids:
                    self._failed_at[b] = meta.step
                first_fail[load.req_id] = min(
                    load.chunk_index, first_fail.get(load.req_id, load.chunk_index)
                )
        self._report.failed_loads.update(first_fail)
        c.failed_chunks += sum(1 for g in ok if not g)
        c.steps_with_loads += 1
        c.load_seconds += time.perf_counter() - t0

    def _load(self, loads: list[ChunkLoad]) -> list[bool]:
        assert self.copier is not None and self.storage is not None
        assert self._sync_buffers is not None
        keys = [self.db.make_key(ld.chunk_hash) for ld in loads]
        c = self.counters
        ok = self._load_borrowed(loads, keys)
        if ok is None:
            ok = self._load_staged(loads, keys)
        bs = self.ctx.block_size
        missing = []
        for j, ld in enumerate(loads):
            if ok[j]:
                c.loaded_chunks += 1
                c.loaded_tokens += len(ld.block_ids) * bs
                c.loaded_bytes += len(ld.block_ids) * self.copier.block_nbytes
                c.loaded_tokens_by_tier[self.storage.tier_names[0]] += len(ld.block_ids) * bs
            else:
                missing.append(ld.chunk_hash)
        for ld in reversed(loads):  # the first chunk of a prompt is the most recently used
            if ld.chunk_hash in self._offered:
                self._offered.move_to_end(ld.chunk_hash)
        if missing:
            self._report.missing.setdefault(self.rank, []).extend(missing)
        return ok

    def _load_borrowed(
        self, loads: list[ChunkLoad], keys: list[CacheEngineKey]
    ) -> list[bool] | None:
        """One copy per chunk: straight from the memory tier's stored tensor (borrowed:
        it can be neither evicted nor overwritten until the borrow ends, after the copy)
        into the request's blocks. ``None``: the tier cannot lend (the caller copies
        through staging buffers). A chunk of another shape or dtype is a miss."""
        assert self.copier is not None and self.storage is not None
        c = self.counters
        t1 = time.perf_counter()
        borrowed = self.storage.borrow_from_memory(keys)
        if borrowed is None:
            return None
        t2 = time.perf_counter()
        shape = self.copier.chunk_shape(self.ctx.blocks_per_chunk)
        if self.layer_copies is not None:
            ok_layered = self._start_layer_copies(loads, borrowed, shape)
            if ok_layered is not None:
                c.read_seconds += t2 - t1
                c.scatter_seconds += time.perf_counter() - t2  # (planning; copies beside)
                return ok_layered
        ok = [False] * len(loads)
        events = []
        try:
            for j, view in self._usable_borrows(borrowed, shape):
                ld = loads[j]
                n = len(ld.block_ids)
                events.append(
                    self.copier.scatter_from_host(
                        view[:, ld.skip : ld.skip + n], ld.block_ids, ld.other_blocks
                    )
                )
                ok[j] = True
            for e in events:  # the views are read until the copies are done
                if e is not None:
                    e.synchronize()
        finally:
            self.storage.end_borrows([b[0] for b in borrowed if b is not None])
        c.read_seconds += t2 - t1  # the borrows (no copy)
        c.scatter_seconds += time.perf_counter() - t2
        return ok

    def _usable_borrows(
        self, borrowed: list[tuple[object, Any] | None], shape: tuple[int, ...]
    ) -> list[tuple[int, Any]]:
        """``(index, view)`` of the borrowed chunks of this cache's dtype and chunk
        ``shape``; the others (absent, or foreign data) are misses."""
        assert self.copier is not None
        dtype = self.copier.dtype
        return [
            (j, b[1])
            for j, b in enumerate(borrowed)
            if b is not None and b[1].dtype == dtype and tuple(b[1].shape) == shape
        ]

    def _start_layer_copies(
        self,
        loads: list[ChunkLoad],
        borrowed: list[tuple[object, Any] | None],
        shape: tuple[int, ...],
    ) -> list[bool] | None:
        """Start copying the borrowed chunks into their blocks layer by layer beside the
        forward pass (:mod:`.layer_copy`); the borrows end after the last layer. ``None``
        (nothing started, borrows kept) when a copy would not be one contiguous run."""
        assert self.copier is not None and self.storage is not None
        assert self.layer_copies is not None
        ok = [False] * len(loads)
        per_layer: list[list[Segment]] = [[] for _ in range(self.copier.num_layers)]
        for j, view in self._usable_borrows(borrowed, shape):
            ld = loads[j]
            if not self.layer_copies.plan(per_layer, view, ld.skip, ld.block_ids):
                return None
            ok[j] = True
        storage = self.storage
        handles = [b[0] for b in borrowed if b is not None]
        self.layer_copies.start(per_layer, lambda: storage.end_borrows(handles))
        return ok

    def wait_for_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention reads its KV: its copies are done."""
        if self.layer_copies is not None:
            self.layer_copies.wait_layer(layer_name)

    def _layers_done(self) -> None:
        if self.layer_copies is not None:
            self.layer_copies.wait_all()

    def _load_staged(self, loads: list[ChunkLoad], keys: list[CacheEngineKey]) -> list[bool]:
        """Two copies per chunk: from the memory tier into a staging buffer, then into the
        request's blocks (tiers that cannot lend a view)."""
        assert self.copier is not None and self.storage is not None
        assert self._sync_buffers is not None
        ok = [False] * len(loads)
        c = self.counters
        events = []
        i = 0
        while i < len(loads):
            bufs = self._sync_buffers.take_many(len(loads) - i)
            if not bufs:  # pragma: no cover - the pool always has at least one
                break
            batch = list(range(i, i + len(bufs)))
            try:
                t1 = time.perf_counter()
                hits = self.storage.get_into_memory([keys[j] for j in batch], bufs)
                t2 = time.perf_counter()
                for j, buf, hit in zip(batch, bufs, hits, strict=True):
                    if not hit:
                        continue
                    ld = loads[j]
                    n = len(ld.block_ids)
                    events.append(
                        self.copier.scatter_from_host(
                            buf[:, ld.skip : ld.skip + n], ld.block_ids, ld.other_blocks
                        )
                    )
                    ok[j] = True
                if any(e is not None for e in events):
                    for e in events:  # the buffers are reused next: the copies must be done
                        if e is not None:
                            e.synchronize()
                c.read_seconds += t2 - t1
                c.scatter_seconds += time.perf_counter() - t2
            finally:
                for buf in bufs:
                    self._sync_buffers.give(buf)
            i += len(bufs)
        return ok

    def _agree(self, ok: list[bool]) -> list[bool]:
        """The per-chunk AND of ``ok`` over all tensor-parallel ranks."""
        if self.ctx.world_size <= 1:
            return ok
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flags = torch.tensor([1 if g else 0 for g in ok], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        return [bool(v) for v in flags.tolist()]

    # ------------------------------------------------------------------ saves
    def save(self, meta: StepMetadata) -> None:
        self._layers_done()  # (the forward pass waited for each layer; this ends the batch)
        self._begin(meta)
        if not meta.saves or self._saves_off:
            return
        failed = self._failed_at
        saves = [s for s in meta.saves if not (failed and any(b in failed for b in s.reads))]
        self.counters.skipped_saves += len(meta.saves) - len(saves)
        if not saves or self.disabled or self.saves is None:
            return
        items = [
            SaveItem(
                self.db.make_key(s.chunk_hash),
                s.chunk_hash,
                s.req_id,
                s.chunk_index,
                s.block_ids,
                s.other_blocks,
            )
            for s in saves
        ]
        try:
            dropped = self.saves.submit(items)
        except Exception:
            log.exception("LMCacheCoreConnector: saving failed; these chunks are not cached")
            dropped = items
        for it in dropped:
            d = self._report.dropped_saves
            d[it.req_id] = min(it.chunk_index, d.get(it.req_id, it.chunk_index))

    # ------------------------------------------------------------------ results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._layers_done()
        recving: set[str] = set()
        if self.loads is not None:
            if finished_req_ids:
                self.loads.cancel(finished_req_ids)
            elif self._idle:
                self.loads.wait_progress(IDLE_WAIT_S)
            self._idle = False
            out = self.loads.poll()
            recving = out.finished
            if out.failed_blocks:
                if not self._per_request_failures:
                    self._errors.update(out.failed_blocks)
                for b in out.failed_blocks:
                    self._failed_at[b] = self._step
            if self._per_request_failures:
                self._failed_requests.update(out.failed_chunks)
            self._report.async_failed.update(out.failed_chunks)
            if out.missing_hashes:
                self._report.missing.setdefault(self.rank, []).extend(out.missing_hashes)
            if recving or out.failed_chunks:
                self._dirty = True
        if self._to_release and recving:
            self._release(None)
        # Loads the worker could not even start (disabled) end at once, all failed.
        for req_id, loads in self._unstarted.items():
            for ld in loads:
                if not self._per_request_failures:
                    self._errors.update(ld.block_ids)
                for b in ld.block_ids:
                    self._failed_at[b] = self._step
            self._report.async_failed[req_id] = sorted({ld.chunk_index for ld in loads})
            if self._per_request_failures:
                self._failed_requests.add(req_id)
            recving.add(req_id)
        self._unstarted.clear()
        sending = {
            r for r in self._pending_finish if self.saves is None or self.saves.gathered_for(r)
        }
        self._pending_finish -= sending
        return sending or None, recving or None

    def take_failed_requests(self) -> set[str]:
        """Requests whose background load failed, reported as a whole (several KV-cache
        groups); each is also in this call's or an earlier call's finished set."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _collect_stores(self) -> None:
        if self.saves is None:
            return
        stored = self.saves.take_stored()
        if self.loads is not None:
            stored.extend(self.loads.take_promoted())
        if stored and self._report_stored:
            hashes = []
            # Later chunks first: of chunks stored together, the first of a prompt is then
            # the most recently used, the last to be withdrawn.
            for h, chunk, handle in sorted(stored, key=lambda x: -x[1]):
                hashes.append(h)
                if handle is None:
                    continue
                # Stored again: the new entry replaced the one pinned before (which the
                # store left pinned but unreachable): keep the pin on the new one.
                prev = self._offered.pop(h, None)
                old = prev[0] if prev is not None else self._withdrawing.pop(h, None)
                if old is not None:
                    assert self.storage is not None
                    self.storage.unpin_top([old])
                self._offered[h] = (handle, chunk)
            self._report.stored.setdefault(self.rank, []).extend(hashes)
        for req_id, idx in self.saves.take_refused():
            d = self._report.dropped_saves
            d[req_id] = min(idx, d.get(req_id, idx))
        self._withdraw_excess()

    def _withdraw_excess(self) -> None:
        """Under policy ``fail``: ask the scheduler to stop offering the least useful
        pinned chunks once they exceed their share of the memory tier."""
        excess = len(self._offered) + len(self._withdrawing) - self._pinned_limit
        if excess <= 0 or not self._offered:
            return
        window = list(self._offered.items())[: excess * WITHDRAW_WINDOW]
        window.sort(key=lambda item: -item[1][1])
        out = []
        for h, (handle, _) in window[:excess]:
            del self._offered[h]
            self._withdrawing[h] = handle
            out.append(h)
        self.counters.withdrawn += len(out)
        self._report.withdrawn.setdefault(self.rank, []).extend(out)

    def take_report(self) -> WorkerReport | None:
        self._collect_stores()
        if self._evicted:
            with self._evicted_lock:
                evicted, self._evicted = self._evicted, []
            self._report.evicted.setdefault(self.rank, []).extend(evicted)
        report, self._report = self._report, WorkerReport()
        report.step = self._step
        if report.disabled and self._reported_disabled:
            report.disabled = {}
        if report.disabled:
            self._reported_disabled = True
        if self._dirty:
            self._dirty = False
            self.write_stats()
        return None if report.is_empty() else report

    def _tokens_by_tier(self) -> dict[str, int]:
        out = dict(self.counters.loaded_tokens_by_tier)
        if self.loads is not None:
            for tier, blocks in self.loads.loaded_blocks_by_tier.items():
                out[tier] = out.get(tier, 0) + blocks * self.ctx.block_size
        return out

    def _bytes_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.counters.loaded_bytes and self.storage is not None:
            out[self.storage.tier_names[0]] = self.counters.loaded_bytes
        if self.loads is not None:
            for tier, blocks in self.loads.loaded_blocks_by_tier.items():
                out[tier] = out.get(tier, 0) + blocks * self.loads.block_nbytes
        return out

    def kv_connector_stats(self) -> ConnectorStats | None:
        """This rank's figures since the last call, for vLLM's statistics (see
        :mod:`.connector_stats`: tokens from rank 0 only, bytes from every rank)."""
        if self.storage is None:
            return None
        dl = self._delta
        data: dict[str, Any] = {}
        if self.rank == 0:
            tokens = dl.per_tier("hit_tokens", self._tokens_by_tier())
            if tokens:
                data["hit_tokens"] = tokens
        nbytes = dl.per_tier("load_bytes", self._bytes_by_tier())
        if nbytes:
            data["load_bytes"] = nbytes
        obs = [list(o) for o in self._sync_obs]
        self._sync_obs = []
        if self.loads is not None:
            obs.extend(list(o) for o in self.loads.take_observations())
        if obs:
            data["load_obs"] = obs
        if self.saves is not None:
            n = dl.flat("save_bytes", self.saves.stored_bytes)
            if n:
                data["save_bytes"] = n
                data["saved_chunks"] = dl.flat("saved_chunks", self.saves.stored)
            saves = self.saves.take_observations()
            if saves:
                data["save_obs"] = [list(o) for o in saves]
        now = time.monotonic()
        health = self.storage.tier_health()
        if health != self._health or now - self._health_at >= HEALTH_EVERY_S:
            self._health, self._health_at = health, now
            rank = str(self.rank)
            data["tier_health"] = {t: {rank: int(ok)} for t, ok in health.items()}
        return ConnectorStats(data=data) if data else None

    def _rates(self) -> dict[str, dict[str, float]]:
        """Bytes loaded and seconds spent, per tier: loads before the forward pass (read
        + scatter) and background loads (first read to reported done), the latter by the
        tier of each request's deepest chunk."""
        c = self.counters
        out: dict[str, dict[str, float]] = {}
        if c.loaded_bytes and self.storage is not None:
            out[self.storage.tier_names[0]] = {
                "bytes": float(c.loaded_bytes),
                "seconds": c.read_seconds + c.scatter_seconds,
            }
        if self.loads is not None:
            for tier, (nbytes, seconds) in self.loads.rate_by_tier.items():
                acc = out.setdefault(tier, {"bytes": 0.0, "seconds": 0.0})
                acc["bytes"] += nbytes
                acc["seconds"] += seconds
        return out

    def stats(self) -> dict[str, Any]:
        c = self.counters
        sv, ld = self.saves, self.loads
        d: dict[str, Any] = {
            "role": "worker",
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.ctx.world_size,
            "kv_tp_replicas": self.ctx.kv_tp_replicas,
            "writes_shared_tiers": self.ctx.is_writer(self.rank),
            "disabled": self.disabled,
            "one_copy_per_chunk": bool(self.copier and self.copier.one_view),
            "loaded_chunks": c.loaded_chunks + (ld.loaded_chunks if ld is not None else 0),
            "loaded_tokens": sum(self._tokens_by_tier().values()),
            "loaded_bytes": c.loaded_bytes + (ld.loaded_bytes if ld is not None else 0),
            "loaded_tokens_by_tier": self._tokens_by_tier(),
            "loaded_bytes_by_tier": self._bytes_by_tier(),
            "resets": c.resets,
            "reset_removed_chunks": c.reset_removed,
            "load_rate_by_tier": self._rates(),
            "failed_chunks": c.failed_chunks + (ld.failed_chunks if ld is not None else 0),
            "sync_loaded_chunks": c.loaded_chunks,
            "async_loaded_chunks": ld.loaded_chunks if ld is not None else 0,
            "async_loaded_bytes": ld.loaded_bytes if ld is not None else 0,
            "async_load_deadline_misses": ld.deadline_misses if ld is not None else 0,
            "async_loads_running": ld.active if ld is not None else 0,
            "async_load_throughput": [list(x) for x in ld.throughput[-64:]]
            if ld is not None
            else [],
            "async_load_spans_ms": ld.spans[:16] if ld is not None else [],
            "load_warm_seconds": round(c.warm_seconds, 6),
            "saved_chunks": sv.stored if sv is not None else 0,
            "saved_bytes": sv.stored_bytes if sv is not None else 0,
            "gathered_chunks": sv.gathered if sv is not None else 0,
            # (of those, gathered into memory the first tier reserved: stored without copies)
            "gathered_into_tier": sv.reserved if sv is not None else 0,
            "rejected_saves": sv.refused if sv is not None else 0,
            "dropped_saves_staging_full": sv.dropped_full if sv is not None else 0,
            "skipped_saves": c.skipped_saves,
            "pending_saves": sv.pending if sv is not None else 0,
            "dropped_saves_at_close": c.dropped_at_close,
            "offered_pinned": len(self._offered),
            "withdrawn": c.withdrawn,
            "load_seconds": round(c.load_seconds, 6),
            "save_seconds": round(sv.gather_seconds, 6) if sv is not None else 0.0,
            "load_breakdown_seconds": {
                "lookup": round(c.lookup_seconds, 6),
                "read": round(c.read_seconds, 6),
                "scatter": round(c.scatter_seconds, 6),
                "async_scatter": round(ld.scatter_seconds, 6) if ld is not None else 0.0,
                "async_idle_wait": round(ld.idle_wait_seconds, 6) if ld is not None else 0.0,
                "layer_copies": round(self.layer_copies.copy_seconds, 6)
                if self.layer_copies is not None
                else 0.0,
                "layer_waits": round(self.layer_copies.wait_seconds, 6)
                if self.layer_copies is not None
                else 0.0,
            },
            "save_breakdown_seconds": {
                "gather": round(sv.gather_seconds, 6) if sv is not None else 0.0,
                "write": round(sv.store_seconds, 6) if sv is not None else 0.0,
            },
        }
        if self.storage is not None:
            st = self.storage.stats()
            d["tiers"] = [
                {k: v for k, v in t.items() if k != "backend_stats"} for t in st.get("tiers", [])
            ]
        return d

    def write_stats(self) -> None:
        stats_dir = self.ctx.settings.options.stats_dir
        if stats_dir:
            # A decode step that loads and stores nothing leaves the document as it was:
            # writing it anyway cost ~0.5 ms of the engine thread per step (6% of a
            # decode step of the demo's model, `bench_vllm.py --scenario itl`).
            text = encode_stats(self.stats())
            name = f"worker{self.rank}-{os.getpid()}.json"
            if text != self._stats_text and write_stats_text(stats_dir, name, text):
                self._stats_text = text

    def close(self) -> None:
        """Finish queued saves up to the storage's ``drain_timeout_s`` (the rest are
        counted as dropped), then close the storage."""
        if self._warming is not None:
            self._warming.join(timeout=10.0)  # (seconds at most: faulting buffers in)
        if self.loads is not None:
            self.loads.abandon_all()
        if self.saves is not None and self.storage is not None:
            self.counters.dropped_at_close += self.saves.drain(self.storage.drain_timeout_s)
            self._collect_stores()
        self.write_stats()
        if self.storage is not None:
            self.storage.close()
            self.storage = None
