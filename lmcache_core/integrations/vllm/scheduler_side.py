"""The scheduler-side half of the connector (vLLM's engine-core process).

How the scheduler knows what is stored: vLLM's workers run in their own processes (on
the CPU backend even at TP=1), each with its own hierarchy. Every step, each worker
reports the chunk hashes it stored (:class:`~.metadata.WorkerReport`) and the scheduler
keeps them in a bounded index (hash -> set of ranks). Chunks stored by earlier processes
or other instances live in shared tiers (disk, S3), which the scheduler consults through
a lookup view of those tiers. A chunk is a hit only when **every** rank has it; a hit
that then fails to load on any rank is reported as invalid blocks and vLLM recomputes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .context import ConnectorContext
from .keying import RequestKeyer
from .metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from .stats_file import write_stats
from .storage import Storage

__all__ = ["SchedulerSide", "StoredIndex"]

log = logging.getLogger("vllm.lmcache_core.connector")


class StoredIndex:
    """Bounded LRU map chunk hash -> bit mask of the ranks that reported storing it."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self._masks: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def mask(self, h: int) -> int:
        return self._masks.get(h, 0)

    def add(self, rank: int, hashes: list[int]) -> None:
        bit = 1 << rank
        m = self._masks
        for h in hashes:
            m[h] = m.get(h, 0) | bit
            m.move_to_end(h)
        while len(m) > self.max_chunks:
            m.popitem(last=False)

    def discard(self, rank: int, hashes: list[int]) -> None:
        bit = 1 << rank
        for h in hashes:
            v = self._masks.get(h)
            if v is not None:
                v &= ~bit
                if v:
                    self._masks[h] = v
                else:
                    del self._masks[h]


@dataclass
class _Req:
    hashes: tuple[int, ...]
    request: Any
    stored_upto: int = 0  # leading chunks known to be stored (or being stored)
    lookup_local: int = 0
    load: tuple[int, int] | None = None  # token range to load this step


@dataclass
class _Counters:
    requests: int = 0
    unkeyable: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    loads_planned: int = 0
    saves_planned: int = 0
    load_failures: int = 0
    lookup_errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class SchedulerSide:
    """Lookups, load/save planning and bookkeeping for one engine core."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.disabled = ctx.disabled
        self.counters = _Counters()
        self.reqs: dict[str, _Req] = {}
        self.index = StoredIndex(ctx.settings.options.index_max_chunks)
        self.full_mask = (1 << ctx.world_size) - 1
        self.view: Storage | None = None
        self.keyer: RequestKeyer | None = None
        self._dbs: list[Any] = []
        self._last_log = time.monotonic()
        if self.disabled:
            log.error("LMCacheCoreConnector disabled, serving no hits: %s", self.disabled)
            return
        assert ctx.db is not None and ctx.namespace is not None
        self.keyer = RequestKeyer(
            ctx.db,
            ctx.hash_block_size if ctx.use_vllm_hashes else ctx.block_size,
            vllm_block_hashes=ctx.use_vllm_hashes,
        )
        self._dbs = [ctx.db.for_worker(r, ctx.world_size) for r in range(ctx.world_size)]
        self.view = Storage.lookup_view(
            ctx.storage_config, ctx.namespace, timeout_s=ctx.settings.options.io_timeout_s
        )
        log.info(
            "LMCacheCoreConnector scheduler side: pid=%d world_size=%d chunk_size=%d "
            "namespace=%s model=%s@%s layout=%s lookup_view=%s",
            os.getpid(),
            ctx.world_size,
            ctx.chunk_size,
            ctx.namespace.digest(),
            ctx.namespace.model_name,
            ctx.namespace.model_revision[:19],
            ctx.namespace.kv_layout,
            list(self.view.tier_names) if self.view else "none",
        )

    # ------------------------------------------------------------------ lookups
    def _matched_chunks(self, hashes: tuple[int, ...]) -> int:
        """Leading chunks every rank can load (index first, shared tiers for the rest)."""
        n = len(hashes)
        i = 0
        while i < n and self.index.mask(hashes[i]) == self.full_mask:
            i += 1
        if i == n or self.view is None:
            return i
        best = n
        for rank, db in enumerate(self._dbs):
            bit = 1 << rank
            j = i
            while j < best:
                while j < best and self.index.mask(hashes[j]) & bit:
                    j += 1
                if j >= best:
                    break
                found = self._view_lookup([db.make_key(h) for h in hashes[j:best]])
                if found == 0:
                    best = j
                    break
                j += found
        return best

    def _view_lookup(self, keys: list[Any]) -> int:
        """Leading ``keys`` in the shared tiers; a failing lookup finds nothing."""
        assert self.view is not None
        try:
            return self.view.lookup(keys).num_hit
        except Exception as exc:
            self.counters.lookup_errors += 1
            n = self.counters.lookup_errors
            if n == 1 or n % 1000 == 0:
                log.warning(
                    "LMCacheCoreConnector: shared-tier lookup failed (%d so far): %s", n, exc
                )
            return 0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (never the last one).

        Any error here is logged and answers 0: a miss is always safe.
        """
        if self.disabled or self.keyer is None:
            return 0, False
        try:
            return self._matched_tokens(request, num_computed_tokens)
        except Exception:
            log.exception(
                "LMCacheCoreConnector: lookup of %s failed; computing it", request.request_id
            )
            return 0, False

    def _matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.keyer is not None
        req_id = request.request_id
        st = self.reqs.get(req_id)
        if st is None:
            keys = self.keyer.keys(request)
            st = _Req(keys.hashes, request)
            self.reqs[req_id] = st
            self.counters.requests += 1
            if keys.reason is not None:
                self.counters.unkeyable += 1
        st.load = None
        st.lookup_local = num_computed_tokens
        if not st.hashes:
            return 0, False
        matched = self._matched_chunks(st.hashes)
        st.stored_upto = max(st.stored_upto, matched)
        hit = matched * self.ctx.chunk_size
        if hit >= request.num_tokens:
            hit = request.num_tokens - 1  # the last token is always recomputed
        self.counters.queried_tokens += max(0, request.num_tokens - num_computed_tokens)
        ext = hit - num_computed_tokens
        return (ext, False) if ext > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        start = st.lookup_local
        st.load = (start, start + num_external_tokens)
        self.counters.hit_tokens += num_external_tokens
        self.counters.hit_requests += 1

    # ------------------------------------------------------------------ planning
    def build_meta(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata()
        if self.disabled:
            return meta
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        steps: list[tuple[str, int, list[int] | None]] = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            steps.append((req_id, cached.num_computed_tokens[i], None))
        saving: set[int] = set()
        for req_id, computed, new_blocks in steps:
            st = self.reqs.get(req_id)
            if st is None or not st.hashes:
                continue
            blocks: list[int] | None = None
            if block_state is not None:
                ids = block_state.get_block_ids(req_id)
                blocks = list(ids[0]) if ids else None
            if blocks is None:
                blocks = new_blocks
            if blocks is None:
                continue
            if st.load is not None:
                self._plan_load(meta, req_id, st, blocks)
            done = computed + int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
            self._plan_saves(meta, req_id, st, blocks, done, saving)
        self.counters.loads_planned += len(meta.loads)
        self.counters.saves_planned += len(meta.saves)
        return meta

    def _plan_load(self, meta: StepMetadata, req_id: str, st: _Req, blocks: list[int]) -> None:
        assert st.load is not None
        start, end = st.load
        st.load = None
        cs, bs, bpc = self.ctx.chunk_size, self.ctx.block_size, self.ctx.blocks_per_chunk
        last_block = -(-end // bs)  # blocks [start // bs, last_block) receive data
        if last_block > len(blocks):
            log.error(
                "load of %s needs %d blocks but %d are allocated; not loading",
                req_id,
                last_block,
                len(blocks),
            )
            return
        for c in range(start // cs, -(-end // cs)):
            first = max(start // bs, c * bpc)
            stop = min(last_block, (c + 1) * bpc)
            meta.loads.append(
                ChunkLoad(req_id, c, st.hashes[c], first - c * bpc, blocks[first:stop])
            )

    def _plan_saves(
        self,
        meta: StepMetadata,
        req_id: str,
        st: _Req,
        blocks: list[int],
        done: int,
        saving: set[int],
    ) -> None:
        cs, bpc = self.ctx.chunk_size, self.ctx.blocks_per_chunk
        limit = min(done, int(st.request.num_prompt_tokens)) // cs
        limit = min(limit, len(st.hashes), len(blocks) // bpc)
        for c in range(st.stored_upto, limit):
            h = st.hashes[c]
            if h in saving:
                continue
            saving.add(h)
            meta.saves.append(ChunkSave(req_id, c, h, blocks[c * bpc : (c + 1) * bpc]))
        st.stored_upto = max(st.stored_upto, limit)

    # ------------------------------------------------------------------ feedback
    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport):
            return
        for rank, hashes in report.stored.items():
            self.index.add(rank, hashes)
        for rank, hashes in report.missing.items():
            self.index.discard(rank, hashes)
        for req_id, idx in report.failed_loads.items():
            self.counters.load_failures += 1
            st = self.reqs.get(req_id)
            if st is not None:
                st.stored_upto = min(st.stored_upto, idx)
        if report.disabled and not self.disabled:
            rank, why = next(iter(sorted(report.disabled.items())))
            self.disabled = f"worker rank {rank}: {why}"
            log.error("LMCacheCoreConnector disabled, serving no hits: %s", self.disabled)

    def request_finished(self, request: Any) -> None:
        self.reqs.pop(request.request_id, None)
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            c = self.counters
            log.info(
                "LMCacheCoreConnector: %d requests, %d hit, %d/%d prompt tokens loaded, "
                "%d load failures, %d unkeyable",
                c.requests,
                c.hit_requests,
                c.hit_tokens,
                c.queried_tokens,
                c.load_failures,
                c.unkeyable,
            )
        self.write_stats()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        d: dict[str, Any] = {
            "role": "scheduler",
            "pid": os.getpid(),
            "disabled": self.disabled,
            "requests": c.requests,
            "unkeyable": c.unkeyable,
            "unkeyable_reasons": dict(self.keyer.unkeyable) if self.keyer else {},
            "queried_tokens": c.queried_tokens,
            "hit_tokens": c.hit_tokens,
            "hit_requests": c.hit_requests,
            "loads_planned": c.loads_planned,
            "saves_planned": c.saves_planned,
            "load_failures": c.load_failures,
            "lookup_errors": c.lookup_errors,
            "active_requests": len(self.reqs),
            "index_chunks": len(self.index),
        }
        if self.ctx.namespace is not None:
            d["namespace"] = json.loads(self.ctx.namespace.to_json())
        return d

    def write_stats(self) -> None:
        stats_dir = self.ctx.settings.options.stats_dir
        if stats_dir:
            write_stats(stats_dir, f"scheduler-{os.getpid()}.json", self.stats())

    def close(self) -> None:
        self.write_stats()
        if self.view is not None:
            self.view.close()
            self.view = None
