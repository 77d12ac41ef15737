"""The scheduler-side half of the connector (vLLM's engine-core process).

**What is stored.** vLLM's workers run in their own processes (on the CPU backend even at
TP=1), each with its own hierarchy. Each worker reports the chunks whose store into its
memory tier completed and the ones that tier evicted; the scheduler keeps them in a
bounded index (hash -> ranks holding it). Chunks stored by earlier processes or other
instances live in shared tiers (disk, S3), looked up in the background through a lookup
view of those tiers (:mod:`.lookups`); vLLM asks again next step meanwhile.

**How a hit loads.** A hit wholly in every rank's memory tier (and within the step's byte
budget) loads before the forward pass; any other hit loads in the background
(``load_async``): vLLM keeps the request waiting, and caches its blocks in its prefix
cache only once the load is over.

**Never a promise it cannot keep.** Under vLLM's ``kv_load_failure_policy: fail`` a failed
load fails the user's request, so only chunks held by a lease from lookup to load are
offered: memory-tier chunks stay pinned by their worker until the scheduler has stopped
offering them; shared-tier chunks are offered only where the tier pins them.

**Never a chunk computed over a failed load.** :class:`~.taint.BlockTaint` follows every
block whose load failed or may yet fail, and everything computed over one, by any
request; saves are planned only from good blocks.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...interface import Pinning, implements
from .connector_stats import ConnectorStats, StatsDelta
from .context import ConnectorContext
from .group_copier import NULL_BLOCK
from .keying import RequestKeyer
from .kv_events import KVEvents
from .lookups import ViewLookups
from .metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from .stats_file import write_stats
from .storage import Storage
from .taint import BlockTaint

__all__ = ["SchedulerSide", "StoredIndex", "hit_source_of"]

log = logging.getLogger("vllm.lmcache_core.connector")

#: A finished lookup's answer is reused this long for a request vLLM asks about again.
LOOKUP_REUSE_S = 5.0
#: Leases from a lookup last this long beyond the load deadline unless released.
LEASE_MARGIN_S = 30.0

#: vLLM's hit source (``CacheHitSource`` value) of each backend type; any other backend
#: (S3 and other remote stores) is ``external_unspecified``: vLLM has no "remote" source.
HIT_SOURCES = {"cpu": "host", "disk": "disk", "gds": "disk"}


def hit_source_of(backend: str) -> str:
    """vLLM's ``CacheHitSource`` value for tokens read from a tier of ``backend``."""
    return HIT_SOURCES.get(backend, "external_unspecified")


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

    def clear(self) -> list[int]:
        """Forget every chunk; returns their hashes."""
        out = list(self._masks)
        self._masks.clear()
        return out

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
    request: Any
    hashes: list[int]
    keyable: bool = True
    stored_upto: int = 0  # leading chunks known to be stored (or being stored)
    lookup_local: int = 0
    plan_async: bool = False
    from_shared: bool = False  # the planned hit reaches into a shared tier
    loading_async: bool = False
    last_save_step: int = -1
    async_failed: set[int] = field(default_factory=set)
    chunk_tiers: dict[int, str] = field(default_factory=dict)  # planned hit: chunk -> tier
    #: chunks from here on are not offered again (a background load of one failed and
    #: vLLM recomputes the request from its start: several KV-cache groups)
    load_cap: int | None = None
    async_blocks: list[int] = field(default_factory=list)  # blocks a background load fills


@dataclass
class _Counters:
    requests: int = 0
    unkeyable: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0
    sync_loads: int = 0
    async_loads: int = 0
    loads_planned: int = 0
    saves_planned: int = 0
    decode_saves_planned: int = 0
    load_failures: int = 0
    failed_chunks: int = 0
    stale_hits: int = 0
    lookup_errors: int = 0
    saves_held_back: int = 0
    saves_outside_window: int = 0
    save_resets: int = 0
    unplannable_loads: int = 0
    delayed_finishes: int = 0
    dropped_saves: int = 0
    preempted_requests: int = 0
    resets: int = 0


class SchedulerSide:
    """Lookups, load/save planning and bookkeeping for one engine core."""

    def __init__(self, ctx: ConnectorContext, events: KVEvents | None = None) -> None:
        self.ctx = ctx
        self.events = events
        self._delta = StatsDelta()
        self._reset_pending = False
        self._backends = {t.name: t.backend for t in ctx.storage_config.tiers}
        self._top = ctx.storage_config.tiers[0].name if ctx.storage_config.tiers else "?"
        self.disabled = ctx.disabled
        self.counters = _Counters()
        self.reqs: dict[str, _Req] = {}
        opts = ctx.settings.options
        self.index = StoredIndex(opts.index_max_chunks)
        self.full_mask = (1 << ctx.world_size) - 1
        self.fail_policy = ctx.failure_policy != "recompute"
        self.view: Storage | None = None
        self.lookups: ViewLookups | None = None
        self.keyer: RequestKeyer | None = None
        self.taint: BlockTaint | None = None
        self._dbs: list[Any] = []
        self._last_log = time.monotonic()
        self.step = 0
        self.acked = 0
        self._sync_loads: list[ChunkLoad] = []
        self._async_loads: dict[str, list[ChunkLoad]] = {}
        self._failed_blocks: list[int] = []
        self._failed_async: list[str] = []
        self._final_saves: list[ChunkSave] = []
        self._finish_after: list[str] = []
        self._release: dict[int, list[int]] = {}
        self._step_load_bytes = 0
        self._chunk_bytes = 0
        self._group = 0  # vLLM's id of the KV-cache group whose blocks are copied
        self._others: tuple[int, ...] = ()  # the other restored groups (HMA), row order
        pl = ctx.storage_config.placement
        #: send new requests' chunk chains to the workers' placement policies
        self._observe = pl is not None and pl.policy != "lru"
        if self.disabled:
            if ctx.disabled_expected:
                log.info("LMCacheCoreConnector serves no hits for this model: %s", self.disabled)
            else:
                log.error("LMCacheCoreConnector disabled, serving no hits: %s", self.disabled)
            return
        assert ctx.db is not None and ctx.namespace is not None and ctx.layout is not None
        self.keyer = RequestKeyer(
            ctx.db,
            ctx.hash_block_size if ctx.use_vllm_hashes else ctx.block_size,
            vllm_block_hashes=ctx.use_vllm_hashes,
        )
        self.taint = BlockTaint(ctx.block_size, ctx.blocks_per_chunk)
        # One key list per tensor-parallel rank; replicas of one KV shard share keys.
        self._dbs = [
            ctx.db.for_worker(ctx.shard_of(r), ctx.key_world_size) for r in range(ctx.world_size)
        ]
        self._group = ctx.layout.group_id
        self._others = ctx.layout.other_group_ids
        lay = ctx.layout
        elem = 1 if "8" in lay.dtype else (2 if "16" in lay.dtype else 4)
        self._chunk_bytes = (
            len(lay.layer_names)
            * lay.num_kv_heads
            * (lay.head_size + lay.head_size_v)
            * ctx.chunk_size
            * elem
        )
        self.view = Storage.lookup_view(ctx.storage_config, ctx.namespace)
        if self.view is not None:
            self.lookups = ViewLookups(
                self.view,
                deadline_s=opts.lookup_deadline_ms / 1000.0,
                first_wait_s=opts.lookup_first_wait_ms / 1000.0,
                lease_s=opts.load_deadline_s + LEASE_MARGIN_S,
                reuse_s=LOOKUP_REUSE_S,
            )
        log.info(
            "LMCacheCoreConnector scheduler side: pid=%d world_size=%d kv_tp_replicas=%d "
            "chunk_size=%d namespace=%s model=%s@%s layout=%s lookup_view=%s policy=%s",
            os.getpid(),
            ctx.world_size,
            ctx.kv_tp_replicas,
            ctx.chunk_size,
            ctx.namespace.digest(),
            ctx.namespace.model_name,
            ctx.namespace.model_revision[:19],
            ctx.namespace.kv_layout,
            list(self.view.tier_names) if self.view else "none",
            ctx.failure_policy,
        )
        if self.fail_policy and self.view is not None:
            unpinnable = [
                t.name for t in self.view.hierarchy.tiers if not implements(t.backend, Pinning)
            ]
            if unpinnable:
                log.warning(
                    "LMCacheCoreConnector: kv_load_failure_policy is %r, so chunks in "
                    "tiers that cannot hold them until they are loaded (%s) are not offered; "
                    'set "kv_load_failure_policy": "recompute" to use them',
                    ctx.failure_policy,
                    ", ".join(unpinnable),
                )

    # ------------------------------------------------------------------ requests
    def _state(self, request: Any) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            assert self.keyer is not None
            keys = self.keyer.keys(request)
            st = _Req(request, list(keys.hashes), keyable=keys.reason is None)
            self.reqs[request.request_id] = st
            self.counters.requests += 1
            if keys.reason is not None:
                self.counters.unkeyable += 1
        return st

    def _extend_hashes(self, st: _Req, num_tokens: int) -> None:
        """Make sure the hashes of the chunks of the first ``num_tokens`` tokens are known."""
        cs = self.ctx.chunk_size
        if not st.keyable or len(st.hashes) >= num_tokens // cs or self.keyer is None:
            return
        if num_tokens // cs <= int(st.request.num_prompt_tokens) // cs:
            return
        keys = self.keyer.keys(st.request, num_tokens)
        if keys.reason is None and len(keys.hashes) > len(st.hashes):
            st.hashes = list(keys.hashes)

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (never the last one),
        and whether they load in the background; ``None`` while a lookup runs.

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

    def _matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.lookup_local = num_computed_tokens
        st.plan_async = False
        if request.num_tokens > request.num_prompt_tokens:  # a resumed or continued request
            self._extend_hashes(st, request.num_tokens)
        hashes = st.hashes
        if not hashes:
            return 0, False
        cs = self.ctx.chunk_size
        n = len(hashes)
        starts = self._memory_prefix(hashes, num_computed_tokens // cs)
        in_memory = min(starts)
        best = in_memory
        view_tiers: dict[int, str] = {}
        purging = self._reset_pending and self.ctx.settings.options.reset_shared_tiers
        if self.lookups is not None and in_memory < n and not purging:
            hits = self.lookups.poll(request.request_id, starts, self._view_keys(hashes, starts))
            if hits is None:
                return None, False  # ask again later: the lookup runs in the background
            usable = hits.pinned if self.fail_policy else hits.found
            best = min(s + u for s, u in zip(starts, usable, strict=True))
            view_tiers = hits.tiers
        if st.load_cap is not None:
            best = min(best, st.load_cap)
        hit = best * cs
        if hit >= request.num_tokens:
            hit = request.num_tokens - 1  # the last token is always recomputed
        ext = hit - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.plan_async = st.from_shared = best > in_memory
        st.chunk_tiers = {
            ch: (self._top if ch < in_memory else view_tiers.get(ch, "?"))
            for ch in range(num_computed_tokens // cs, best)
        }
        if self._others:
            # Several KV-cache groups: vLLM takes no block-level load errors (it raises),
            # so every load runs in the background and a failure fails the request's load.
            st.plan_async = True
        if not st.plan_async:
            nbytes = -(-ext // cs) * self._chunk_bytes
            limit = self.ctx.settings.options.max_load_bytes_per_step
            st.plan_async = self._step_load_bytes + nbytes > limit
        return ext, st.plan_async

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The planned load's tokens by vLLM hit source (``CacheHitSource`` values): each
        chunk's tokens under the source of the tier the plan reads it from (the workers'
        memory tier, or the shared tier rank 0's lookup found it in). Sums to
        ``num_external_tokens``."""
        st = self.reqs.get(request.request_id)
        if num_external_tokens <= 0:
            return {}
        if st is None:
            return {"external_unspecified": num_external_tokens}
        cs = self.ctx.chunk_size
        start, end = st.lookup_local, st.lookup_local + num_external_tokens
        out: dict[str, int] = {}
        pos = start
        while pos < end:
            ch = pos // cs
            stop = min(end, (ch + 1) * cs)
            tier = st.chunk_tiers.get(ch, "?")
            src = hit_source_of(self._backends.get(tier, ""))
            out[src] = out.get(src, 0) + stop - pos
            pos = stop
        return out

    def _memory_prefix(self, hashes: list[int], first: int) -> list[int]:
        """Per rank: the first chunk from ``first`` on that its memory tier lacks."""
        starts = []
        for rank in range(self.ctx.world_size):
            bit, j = 1 << rank, first
            while j < len(hashes) and self.index.mask(hashes[j]) & bit:
                j += 1
            starts.append(j)
        return starts

    def _view_keys(self, hashes: list[int], starts: list[int]) -> list[list[Any]]:
        return [
            [self._dbs[r].make_key(h) for h in hashes[starts[r] :]]
            for r in range(self.ctx.world_size)
        ]

    def on_new_request(self, request: Any) -> None:
        """Start the shared-tier lookup as soon as vLLM receives the request, so it has
        usually finished when vLLM first asks (no extra scheduler step for it)."""
        if self.disabled or self.keyer is None or self.lookups is None:
            return
        try:
            st = self._state(request)
            starts = self._memory_prefix(st.hashes, 0)
            if st.hashes and min(starts) < len(st.hashes):
                self.lookups.prefetch(
                    request.request_id, starts, self._view_keys(st.hashes, starts)
                )
        except Exception:
            log.exception("LMCacheCoreConnector: early lookup of %s failed", request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or self.taint is None:
            return
        try:
            groups = [list(g) for g in blocks.get_block_ids()] if blocks is not None else []
        except (AttributeError, TypeError):
            groups = []
        block_ids = groups[self._group] if self._group < len(groups) else []
        bs = self.ctx.block_size
        computed = max(st.lookup_local, int(getattr(request, "num_computed_tokens", 0) or 0))
        self.taint.admit(request.request_id, block_ids, -(-computed // bs) + 1)
        self.counters.queried_tokens += max(0, request.num_tokens - st.lookup_local)
        if num_external_tokens <= 0:
            if not st.loading_async and self.lookups is not None:
                self.lookups.release(request.request_id)
            return
        others = [groups[g] if g < len(groups) else [] for g in self._others]
        self._plan_load(
            st, block_ids, st.lookup_local, st.lookup_local + num_external_tokens, others
        )
        self.counters.hit_tokens += num_external_tokens
        self.counters.hit_requests += 1

    def _plan_load(
        self, st: _Req, block_ids: list[int], start: int, end: int, others: list[list[int]]
    ) -> None:
        """Plan the load of tokens ``[start, end)`` into ``block_ids`` (and, with several
        KV-cache groups, the same positions of ``others``)."""
        assert self.taint is not None
        req_id = st.request.request_id
        cs, bs, bpc = self.ctx.chunk_size, self.ctx.block_size, self.ctx.blocks_per_chunk
        last_block = -(-end // bs)  # blocks [start // bs, last_block) receive data
        loads: list[ChunkLoad] = []
        targets: list[tuple[int, int]] = []
        doomed = False
        for c in range(start // cs, -(-end // cs)):
            first = max(start // bs, c * bpc)
            stop = min(last_block, (c + 1) * bpc)
            short = any(stop > len(o) for o in others)
            if stop > len(block_ids) or c >= len(st.hashes) or short:
                self.counters.unplannable_loads += 1
                log.error(
                    "LMCacheCoreConnector: load of %s needs blocks up to %d but %d are "
                    "allocated; reporting them as failed",
                    req_id,
                    last_block,
                    min([len(block_ids), *(len(o) for o in others)]),
                )
                if self._others:  # the whole background load fails (see failed_async)
                    doomed = True
                    break
                # vLLM counts these tokens as computed: report their blocks as failed.
                bad = block_ids[first : min(last_block, len(block_ids))]
                self._failed_blocks.extend(bad)
                targets.extend((i, block_ids[i]) for i in range(first, first + len(bad)))
                break
            loads.append(
                ChunkLoad(
                    req_id,
                    c,
                    st.hashes[c],
                    first - c * bpc,
                    block_ids[first:stop],
                    [o[first:stop] for o in others],
                )
            )
            targets.extend((i, block_ids[i]) for i in range(first, stop))
        if loads:  # loaded chunks are stored already: never saved again from here
            st.stored_upto = max(st.stored_upto, loads[-1].chunk_index + 1)
        if doomed:
            self._failed_async.append(req_id)
        if st.plan_async and (loads or doomed):
            self._async_loads[req_id] = loads
            st.loading_async = True
            st.async_blocks = [b for _, b in targets]
            self.taint.loading(req_id, targets, None)
            self.counters.async_loads += 1
        else:
            self._sync_loads.extend(loads)
            self.taint.loading(req_id, targets, self.step + 1)
            self._step_load_bytes += len(loads) * self._chunk_bytes
            self.counters.sync_loads += 1 if loads else 0
            if self.lookups is not None:
                self.lookups.release(req_id)

    # ------------------------------------------------------------------ planning
    def build_meta(self, scheduler_output: Any) -> StepMetadata:
        self.step += 1
        meta = StepMetadata(
            step=self.step,
            acked=self.acked,
            reset=self._reset_pending,
            idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1),
        )
        self._reset_pending = False
        if self.disabled or self.taint is None:
            return meta
        meta.loads, self._sync_loads = self._sync_loads, []
        meta.async_loads, self._async_loads = self._async_loads, {}
        meta.failed_blocks, self._failed_blocks = self._failed_blocks, []
        meta.failed_async, self._failed_async = self._failed_async, []
        meta.saves, self._final_saves = self._final_saves, []
        meta.finish_after_save, self._finish_after = self._finish_after, []
        meta.release, self._release = self._release, {}
        self._step_load_bytes = 0
        taint = self.taint
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        for req_id in preempted:
            taint.drop(req_id)
        self.counters.preempted_requests += len(preempted)
        meta.preempted = sorted(preempted)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        steps: list[tuple[str, int, list[list[int]] | None]] = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, [list(g) for g in new.block_ids]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_ids and req_id not in resumed:
                taint.fresh(new_ids[self._group])
            steps.append((req_id, cached.num_computed_tokens[i], None))

        if self._observe:
            meta.chains = self._new_chains(scheduler_output)
        tables: dict[str, list[list[int]] | None] = {}

        def table(req_id: str, fallback: list[list[int]] | None) -> list[list[int]] | None:
            """The request's block ids, every KV-cache group."""
            if req_id not in tables:
                ids = block_state.get_block_ids(req_id) if block_state is not None else None
                tables[req_id] = [list(g) for g in ids] if ids else fallback
            return tables[req_id]

        num_sched = scheduler_output.num_scheduled_tokens
        accesses = []
        for req_id, computed, fallback in steps:
            if taint.holds(req_id):
                groups = table(req_id, fallback)
                if groups is not None and self._group < len(groups):
                    sched = int(num_sched.get(req_id, 0))
                    accesses.append(taint.access(req_id, groups[self._group], computed, sched))
        taint.record_step(self.step, accesses)

        saving = {s.chunk_hash for s in meta.saves}
        for req_id, computed, fallback in steps:
            st = self.reqs.get(req_id)
            if st is None or not st.keyable:
                continue
            done = computed + int(num_sched.get(req_id, 0))
            self._plan_saves(meta.saves, st, done, lambda r=req_id, f=fallback: table(r, f), saving)
        self.counters.loads_planned += len(meta.loads) + sum(
            len(v) for v in meta.async_loads.values()
        )
        self.counters.saves_planned += len(meta.saves)
        return meta

    def _new_chains(self, scheduler_output: Any) -> list[list[int]]:
        """The prompt chunk hashes of each request scheduled for the first time."""
        cs = self.ctx.chunk_size
        out = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None or not st.keyable or not st.hashes:
                continue
            prompt = getattr(st.request, "num_prompt_tokens", None)
            n = len(st.hashes) if not isinstance(prompt, int) else prompt // cs
            if n > 0:
                out.append(st.hashes[:n])
        return out

    def _save_limit(self, st: _Req, done: int) -> int:
        """Chunks of ``st`` whose KV exists after ``done`` computed tokens and whose tokens
        are known."""
        req = st.request
        limit_tokens = min(done, int(req.num_tokens))
        if not self.ctx.settings.options.save_decode_chunks:
            limit_tokens = min(limit_tokens, int(req.num_prompt_tokens))
        return limit_tokens // self.ctx.chunk_size

    def _plan_saves(
        self, out: list[ChunkSave], st: _Req, done: int, blocks_of: Any, saving: set[int]
    ) -> bool:
        """Plan saves of the chunks of ``st`` complete after ``done`` computed tokens into
        ``out``; ``True`` if any was planned."""
        assert self.taint is not None
        limit = self._save_limit(st, done)
        if limit <= st.stored_upto:
            return False
        self._extend_hashes(st, limit * self.ctx.chunk_size)
        limit = min(limit, len(st.hashes))
        if limit <= st.stored_upto:
            return False
        groups = blocks_of()
        if groups is None or self._group >= len(groups):
            return False
        blocks = groups[self._group]
        others = [groups[g] if g < len(groups) else [] for g in self._others]
        bpc = self.ctx.blocks_per_chunk
        limit = min(limit, len(blocks) // bpc)
        req_id = st.request.request_id
        n_prompt_chunks = int(st.request.num_prompt_tokens) // self.ctx.chunk_size
        planned = False
        for c in range(st.stored_upto, limit):
            h = st.hashes[c]
            if self.index.mask(h) == self.full_mask or h in saving:
                continue
            reads = self.taint.save_reads(req_id, (c + 1) * bpc)
            if reads is None:
                # computed over a failed load: saved once the blocks are recomputed
                self.counters.saves_held_back += 1
                limit = c
                break
            window = [o[c * bpc : (c + 1) * bpc] for o in others]
            if any(len(w) < bpc or NULL_BLOCK in w for w in window):
                # A sliding-window group no longer holds (part of) this chunk: vLLM freed
                # the blocks outside the window before the chunk could be saved.
                self.counters.saves_outside_window += 1
                continue
            saving.add(h)
            out.append(ChunkSave(req_id, c, h, blocks[c * bpc : (c + 1) * bpc], reads, window))
            if self.events is not None:
                self.events.planned(h, st.request, c)
            if c >= n_prompt_chunks:
                self.counters.decode_saves_planned += 1
            planned = True
        st.stored_upto = max(st.stored_upto, limit)
        if planned:
            st.last_save_step = self.step
        return planned

    # ------------------------------------------------------------------ feedback
    def update_connector_output(self, output: Any) -> None:
        if self.taint is None:
            return
        report = getattr(output, "kv_connector_worker_meta", None)
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        c = self.counters
        if isinstance(report, WorkerReport):
            ev = self.events
            for rank, hashes in report.stored.items():
                new = [h for h in hashes if not self.index.mask(h)] if ev is not None else []
                self.index.add(rank, hashes)
                for h in new:
                    ev.stored(h)  # type: ignore[union-attr]
            for name in ("evicted", "missing", "withdrawn"):
                for rank, hashes in getattr(report, name).items():
                    self.index.discard(rank, hashes)
                    if ev is not None:  # no rank can serve it any more
                        for h in hashes:
                            if not self.index.mask(h):
                                ev.removed(h)
            for rank, hashes in report.withdrawn.items():
                self._release.setdefault(rank, []).extend(hashes)
            c.stale_hits += len({h for hashes in report.missing.values() for h in hashes})
            for req_id, idx in report.failed_loads.items():
                c.load_failures += 1
                st = self.reqs.get(req_id)
                if st is not None:
                    st.stored_upto = min(st.stored_upto, idx)
            for req_id, idxs in report.async_failed.items():
                st = self.reqs.get(req_id)
                if st is not None:
                    st.async_failed.update(idxs)
            for req_id, idx in report.dropped_saves.items():
                c.dropped_saves += 1
                st = self.reqs.get(req_id)
                if st is not None:
                    st.stored_upto = min(st.stored_upto, idx)
            if report.step > self.acked:
                self.taint.resolve_step(report.step, invalid)
                self.acked = report.step
            elif invalid:
                self.taint.resolve_step(self.acked, invalid)
            if report.disabled and not self.disabled:
                rank, why = next(iter(sorted(report.disabled.items())))
                self.disabled = f"worker rank {rank}: {why}"
                log.error("LMCacheCoreConnector disabled, serving no hits: %s", self.disabled)
        elif invalid:
            self.taint.resolve_step(self.acked, invalid)
        failed_recving = set(getattr(output, "failed_recving", None) or ())
        for req_id in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(req_id)
            if req_id in failed_recving and st is not None:
                # Several KV-cache groups: the load failed as a whole (no block-level
                # report); vLLM recomputes the request from its start.
                self.taint.resolve_async(req_id, st.async_blocks)
                failed = st.async_failed or {st.lookup_local // self.ctx.chunk_size}
                cap = min(failed)
                st.load_cap = cap if st.load_cap is None else min(st.load_cap, cap)
                st.async_failed = set(failed)
            else:
                self.taint.resolve_async(req_id, ())
            if self.lookups is not None:
                self.lookups.release(req_id)
            if st is None:
                continue
            st.loading_async = False
            st.async_blocks = []
            if st.async_failed:
                c.load_failures += 1
                c.failed_chunks += len(st.async_failed)
                st.stored_upto = min(st.stored_upto, min(st.async_failed))
                st.async_failed.clear()
        for req_id, chunk in self.taint.take_resets().items():
            st = self.reqs.get(req_id)
            if st is not None and chunk < st.stored_upto:
                st.stored_upto = chunk
                c.save_resets += 1

    def request_finished(self, request: Any, block_ids: Sequence[list[int]]) -> bool:
        """Forget the request (``block_ids``: its blocks in every KV-cache group). ``True``:
        vLLM must keep its blocks until the workers report its last saves gathered
        (through ``get_finished``)."""
        req_id = request.request_id
        st = self.reqs.get(req_id)
        delay = False
        if st is not None and self.taint is not None and not self.disabled and not st.loading_async:
            planned = self._plan_saves(
                self._final_saves,
                st,
                int(request.num_computed_tokens),
                lambda: [list(g) for g in block_ids],
                {s.chunk_hash for s in self._final_saves},
            )
            in_flight = st.last_save_step > self.acked + (0 if self._device_gathers_async() else 1)
            delay = planned or in_flight
        self.reqs.pop(req_id, None)
        if self.taint is not None:
            self.taint.drop(req_id)
        if self.lookups is not None:
            self.lookups.release(req_id)
        if delay:
            self._finish_after.append(req_id)
            self.counters.delayed_finishes += 1
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            c = self.counters
            log.info(
                "LMCacheCoreConnector: %d requests, %d hit, %d/%d prompt tokens loaded, "
                "%d load failures, %d stale hits, %d unkeyable",
                c.requests,
                c.hit_requests,
                c.hit_tokens,
                c.queried_tokens,
                c.load_failures,
                c.stale_hits,
                c.unkeyable,
            )
        self.write_stats()
        return delay

    def _device_gathers_async(self) -> bool:
        return self.ctx.layout is not None and self.ctx.layout.device_type != "cpu"

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        d: dict[str, Any] = {
            "role": "scheduler",
            "pid": os.getpid(),
            "disabled": self.disabled,
            "policy": self.ctx.failure_policy,
            "requests": c.requests,
            "unkeyable": c.unkeyable,
            "unkeyable_reasons": dict(self.keyer.unkeyable) if self.keyer else {},
            "queried_tokens": c.queried_tokens,
            "hit_tokens": c.hit_tokens,
            "hit_requests": c.hit_requests,
            "sync_loads": c.sync_loads,
            "async_loads": c.async_loads,
            "loads_planned": c.loads_planned,
            "saves_planned": c.saves_planned,
            "decode_saves_planned": c.decode_saves_planned,
            "load_failures": c.load_failures,
            "failed_chunks": c.failed_chunks,
            "stale_hits": c.stale_hits,
            "lookup_errors": c.lookup_errors
            + (self.lookups.errors if self.lookups is not None else 0),
            "lookups_started": self.lookups.started if self.lookups is not None else 0,
            "lookup_deadline_misses": self.lookups.deadline_misses
            if self.lookups is not None
            else 0,
            "saves_held_back": c.saves_held_back,
            "saves_outside_window": c.saves_outside_window,
            "save_resets": c.save_resets,
            "dropped_saves": c.dropped_saves,
            "unplannable_loads": c.unplannable_loads,
            "delayed_finishes": c.delayed_finishes,
            "preempted_requests": c.preempted_requests,
            "resets": c.resets,
            "active_requests": len(self.reqs),
            "index_chunks": len(self.index),
            "step": self.step,
            "acked_step": self.acked,
        }
        if self.taint is not None:
            d.update(self.taint.stats())
        if self.ctx.namespace is not None:
            d["namespace"] = json.loads(self.ctx.namespace.to_json())
        return d

    def kv_connector_stats(self) -> ConnectorStats | None:
        """Request-level counts since the last call, for vLLM's statistics (the workers
        report tokens and bytes)."""
        c, dl = self.counters, self._delta
        data: dict[str, Any] = {}
        for key, total in (
            ("failed_loads", c.load_failures),
            ("stale_loads", c.stale_hits),
            ("dropped_saves", c.dropped_saves),
            ("unkeyable_requests", c.unkeyable),
        ):
            n = dl.flat(key, total)
            if n:
                data[key] = n
        return ConnectorStats(data=data) if data else None

    def take_events(self) -> list[Any]:
        """KV events since the last call (see :mod:`.kv_events`)."""
        return self.events.take() if self.events is not None else []

    def reset_cache(self) -> bool:
        """Forget what the workers' memory tiers hold, at once, and order every worker to
        clear its private tiers in the next step, before that step's loads. Shared tiers
        are untouched unless ``reset_shared_tiers`` is set (then rank 0 deletes this
        namespace's chunks from them too)."""
        self.index.clear()
        if self.events is not None:
            self.events.removed_all()
        for st in self.reqs.values():
            st.stored_upto = 0
            st.chunk_tiers = {}
        self._sync_loads = []  # (none between steps: vLLM resets between steps)
        self._reset_pending = True
        self.counters.resets += 1
        log.info("LMCacheCoreConnector: cache reset; workers clear their private tiers")
        return True

    def write_stats(self) -> None:
        stats_dir = self.ctx.settings.options.stats_dir
        if stats_dir:
            write_stats(stats_dir, f"scheduler-{os.getpid()}.json", self.stats())

    def close(self) -> None:
        self.write_stats()
        if self.lookups is not None:
            self.lookups.close()
        if self.view is not None:
            self.view.close()
            self.view = None
