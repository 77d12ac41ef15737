"""The worker-side half of the connector (one per tensor-parallel rank, in vLLM's worker
process): it owns this rank's storage hierarchy, loads hit chunks into vLLM's paged KV
cache before the forward pass and stores newly computed chunks after it.

Loads and saves go through reused staging buffers (``[layers, blocks_per_chunk,
*block]``, bounded by ``max_staging_bytes``). A chunk that fails to load on any rank
(missing, evicted by another process, corrupted) fails on every rank — the ranks agree
through one small all-reduce — so its blocks are reported to vLLM for recomputation and
nothing computed from it in that step is saved.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from .context import ConnectorContext
from .layout import BlockCopier, UnsupportedModel, check_attention_backends
from .metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from .stats_file import write_stats
from .storage import Storage

__all__ = ["WorkerSide"]

log = logging.getLogger("vllm.lmcache_core.connector")

LEASE_S = 60.0


@dataclass
class _Counters:
    loaded_chunks: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed_chunks: int = 0
    saved_chunks: int = 0
    saved_bytes: int = 0
    rejected_saves: int = 0
    skipped_saves: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    lookup_seconds: float = 0.0
    read_seconds: float = 0.0
    scatter_seconds: float = 0.0
    gather_seconds: float = 0.0
    write_seconds: float = 0.0
    steps_with_loads: int = 0


class WorkerSide:
    """Loads and saves for one rank."""

    def __init__(self, ctx: ConnectorContext, vllm_config: Any, kv_cache_config: Any) -> None:
        self.ctx = ctx
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.disabled = ctx.disabled
        self.rank = 0
        self.copier: BlockCopier | None = None
        self.storage: Storage | None = None
        self.db: Any = None
        self.counters = _Counters()
        self._staging: list[torch.Tensor] = []
        self._max_staging = 1
        self._errors: set[int] = set()
        self._failed_reqs: dict[str, int] = {}
        self._report = WorkerReport()
        self._reported_disabled = False
        self._dirty = False

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
            self.copier = BlockCopier(
                [kv_caches[n] for n in layers], int(self.kv_cache_config.num_blocks)
            )
        except UnsupportedModel as exc:
            self._disable(str(exc))
            return
        self.db = ctx.db.for_worker(self.rank, ctx.world_size)
        chunk_bytes = self.copier.block_nbytes * ctx.blocks_per_chunk
        self._max_staging = max(1, ctx.settings.options.max_staging_bytes // chunk_bytes)
        self.storage = Storage(
            ctx.storage_config, ctx.namespace, timeout_s=ctx.settings.options.io_timeout_s
        )
        log.info(
            "LMCacheCoreConnector worker side: pid=%d rank=%d/%d layers=%d chunk=%s %s "
            "(%.1f KiB) tiers=%s",
            os.getpid(),
            self.rank,
            ctx.world_size,
            self.copier.num_layers,
            list(self.copier.chunk_shape(ctx.blocks_per_chunk)),
            self.copier.dtype,
            chunk_bytes / 1024,
            list(self.storage.tier_names),
        )

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.error(
            "LMCacheCoreConnector disabled on rank %d, serving no hits: %s", self.rank, reason
        )
        self._report.disabled[self.rank] = reason

    def _buffers(self, n: int) -> list[torch.Tensor]:
        assert self.copier is not None
        shape = self.copier.chunk_shape(self.ctx.blocks_per_chunk)
        while len(self._staging) < n:
            self._staging.append(torch.empty(shape, dtype=self.copier.dtype))
        return self._staging[:n]

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: StepMetadata) -> None:
        loads = meta.loads
        if not loads:
            return
        t0 = time.perf_counter()
        ok = [False] * len(loads)
        if not self.disabled:
            try:
                ok = self._load(loads)
            except Exception:
                log.exception("LMCacheCoreConnector: loading failed; the chunks are recomputed")
                ok = [False] * len(loads)
        ok = self._agree(ok)
        first_fail: dict[str, int] = {}
        for load, good in zip(loads, ok, strict=True):
            if not good:
                self._errors.update(load.block_ids)
                first_fail[load.req_id] = min(
                    load.chunk_index, first_fail.get(load.req_id, load.chunk_index)
                )
        self._failed_reqs = first_fail
        self._report.failed_loads.update(first_fail)
        c = self.counters
        c.failed_chunks += sum(1 for g in ok if not g)
        c.steps_with_loads += 1
        c.load_seconds += time.perf_counter() - t0
        self._dirty = True

    def _load(self, loads: list[ChunkLoad]) -> list[bool]:
        assert self.copier is not None and self.storage is not None
        keys = [self.db.make_key(ld.chunk_hash) for ld in loads]
        # Pin every chunk of the step before reading any (a promotion from a lower tier
        # must not evict a chunk a later request of this step needs).
        tiers: list[str | None] = [None] * len(loads)
        by_req: dict[str, list[int]] = defaultdict(list)
        for i, ld in enumerate(loads):
            by_req[ld.req_id].append(i)
        leased = []
        c = self.counters
        t0 = time.perf_counter()
        for idxs in by_req.values():
            found = self.storage.lookup([keys[i] for i in idxs], lease_s=LEASE_S)
            for j, i in enumerate(idxs[: found.num_hit]):
                tiers[i] = found.tiers[j]
                leased.append(keys[i])
        c.lookup_seconds += time.perf_counter() - t0
        ok = [False] * len(loads)
        try:
            todo = [i for i in range(len(loads)) if tiers[i] is not None]
            for s in range(0, len(todo), self._max_staging):
                batch = todo[s : s + self._max_staging]
                bufs = self._buffers(len(batch))
                t1 = time.perf_counter()
                hits = self.storage.get_into([keys[i] for i in batch], bufs)
                t2 = time.perf_counter()
                for i, buf, hit in zip(batch, bufs, hits, strict=True):
                    if not hit:
                        continue
                    ld = loads[i]
                    n = len(ld.block_ids)
                    self.copier.scatter(buf[:, ld.skip : ld.skip + n], ld.block_ids)
                    ok[i] = True
                c.read_seconds += t2 - t1
                c.scatter_seconds += time.perf_counter() - t2
        finally:
            self.storage.release(leased)
        bs = self.ctx.block_size
        missing = []
        for i, ld in enumerate(loads):
            if ok[i]:
                c.loaded_chunks += 1
                c.loaded_tokens += len(ld.block_ids) * bs
                c.loaded_bytes += len(ld.block_ids) * self.copier.block_nbytes
                c.loaded_tokens_by_tier[str(tiers[i])] += len(ld.block_ids) * bs
            else:
                missing.append(ld.chunk_hash)
        if missing:
            self._report.missing.setdefault(self.rank, []).extend(missing)
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
        saves = [s for s in meta.saves if s.req_id not in self._failed_reqs]
        self.counters.skipped_saves += len(meta.saves) - len(saves)
        self._failed_reqs = {}
        if not saves or self.disabled:
            return
        assert self.copier is not None and self.storage is not None
        t0 = time.perf_counter()
        try:
            self._save(saves)
        except Exception:
            log.exception("LMCacheCoreConnector: saving failed; these chunks are not cached")
        self.counters.save_seconds += time.perf_counter() - t0
        self._dirty = True

    def _save(self, saves: list[ChunkSave]) -> None:
        assert self.copier is not None and self.storage is not None
        stored = []
        for s in range(0, len(saves), self._max_staging):
            batch = saves[s : s + self._max_staging]
            bufs = self._buffers(len(batch))
            t0 = time.perf_counter()
            for sv, buf in zip(batch, bufs, strict=True):
                self.copier.gather(sv.block_ids, buf)
            t1 = time.perf_counter()
            res = self.storage.put([self.db.make_key(sv.chunk_hash) for sv in batch], bufs)
            self.counters.gather_seconds += t1 - t0
            self.counters.write_seconds += time.perf_counter() - t1
            for sv, good, buf in zip(batch, res, bufs, strict=True):
                if good:
                    stored.append(sv.chunk_hash)
                    self.counters.saved_chunks += 1
                    self.counters.saved_bytes += buf.numel() * buf.element_size()
                else:
                    self.counters.rejected_saves += 1
        if stored:
            self._report.stored.setdefault(self.rank, []).extend(stored)

    # ------------------------------------------------------------------ results
    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        if report.disabled and self._reported_disabled:
            report.disabled = {}
        if report.disabled:
            self._reported_disabled = True
        if self._dirty:
            self._dirty = False
            self.write_stats()
        return None if report.is_empty() else report

    def stats(self) -> dict[str, Any]:
        c = self.counters
        d: dict[str, Any] = {
            "role": "worker",
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.ctx.world_size,
            "disabled": self.disabled,
            "loaded_chunks": c.loaded_chunks,
            "loaded_tokens": c.loaded_tokens,
            "loaded_bytes": c.loaded_bytes,
            "loaded_tokens_by_tier": dict(c.loaded_tokens_by_tier),
            "failed_chunks": c.failed_chunks,
            "saved_chunks": c.saved_chunks,
            "saved_bytes": c.saved_bytes,
            "rejected_saves": c.rejected_saves,
            "skipped_saves": c.skipped_saves,
            "load_seconds": round(c.load_seconds, 6),
            "save_seconds": round(c.save_seconds, 6),
            "load_breakdown_seconds": {
                "lookup": round(c.lookup_seconds, 6),
                "read": round(c.read_seconds, 6),
                "scatter": round(c.scatter_seconds, 6),
            },
            "save_breakdown_seconds": {
                "gather": round(c.gather_seconds, 6),
                "write": round(c.write_seconds, 6),
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
            write_stats(stats_dir, f"worker{self.rank}-{os.getpid()}.json", self.stats())

    def close(self) -> None:
        self.write_stats()
        if self.storage is not None:
            self.storage.close()
            self.storage = None
