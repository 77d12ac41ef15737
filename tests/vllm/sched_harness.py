"""vLLM's real (Async)Scheduler driven in-process with both halves of the connector and a
stand-in model (no engine, no weights run): the harness plays the model runner.

The stand-in forward pass writes into a real, vLLM-laid-out KV cache the value ``v(p) =
f(tokens[:p+1])`` for each computed position ``p``, but only when every slot the
request attends to holds its expected value; otherwise (it computes over wrong KV) it
writes garbage. Requests in one step that rewrite a block before another reads it are
handled like a real forward pass (each layer writes before it reads). So the KV cache
is an oracle of what a real model would have computed, and every chunk the connector
stores can be checked against the values its tokens imply (:meth:`Harness.check_stored`).

Asynchronous scheduling is reproduced as vLLM's engine core does it: step N+1 is
scheduled (and executed by the worker) before step N's output reaches the scheduler.

With ``sliding_window`` the stand-in has a second KV-cache group of sliding-window layers
(vLLM's hybrid KV-cache manager, group 0 as for Gemma-2, full attention group 1, both
over one block pool and aliasing the same memory as vLLM lays them out): a position
reads every earlier position in the full-attention group and the last ``window`` ones in
the sliding-window group.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GARBAGE = -1.0
LAYERS, HEADS, HEAD = 2, 2, 8


def value(tokens: list[int]) -> float:
    """The KV value of the last of ``tokens`` given all before it (in [0, 1))."""
    h = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


@dataclass
class _Req:
    """The harness's view of a request: its token at every position (the prompt, then
    greedy tokens, a function of the tokens before them, so a step vLLM discards and
    recomputes samples the same token again) and its block table."""

    tokens: list[int]
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    sw_blocks: list[int] = field(default_factory=list)  # the sliding-window group's

    def upto(self, n: int) -> list[int]:
        while len(self.tokens) < n:
            self.tokens.append(4 + int(value(self.tokens) * 400))
        return self.tokens[:n]


class Harness:
    """One scheduler, one worker-side connector, a stand-in model (see module doc)."""

    def __init__(
        self,
        model: Path,
        storage: dict[str, Any],
        *,
        async_scheduling: bool,
        block_size: int = 32,
        num_blocks: int = 96,
        max_batched_tokens: int = 160,
        policy: str = "recompute",
        options: dict[str, Any] | None = None,
        prefix_caching: bool = True,
        kv_events: bool = False,
        log_stats: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
            compute_layout_strides,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager

        from lmcache_core.integrations.vllm.connector import LMCacheCoreConnector

        self.bs = block_size
        ktc = KVTransferConfig(
            kv_connector="LMCacheCoreConnector",
            kv_connector_module_path="lmcache_core.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "config": storage,
                "lookup_deadline_ms": 5000,
                **(options or {}),
            },
        )
        vc = VllmConfig(
            model_config=ModelConfig(
                model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_batched_tokens,
                max_num_seqs=8,
                max_model_len=1024,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=ktc,
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if kv_events
            else None,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
        )
        layout = KVCacheLayout["LBHNC"]
        layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, LAYERS, layout)
        size = LAYERS * num_blocks * spec.page_size_bytes
        tensor = KVCacheTensor(
            size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
        )
        tensors, groups = [tensor], [KVCacheGroupSpec(names, spec)]
        self.window = sliding_window
        self.full_gid, self.sw_gid = 0, -1
        if sliding_window is not None:
            sw_names = [f"model.layers.{LAYERS + i}.self_attn.attn" for i in range(LAYERS)]
            sw_spec = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=HEADS,
                head_size=HEAD,
                dtype=torch.float32,
                sliding_window=sliding_window,
            )
            sw_tensor = KVCacheTensor(  # aliases the full group's bytes, as vLLM lays it out
                size=size, layers=sw_names, layer_stride=layer_stride, block_stride=block_stride
            )
            tensors = [sw_tensor, tensor]
            groups = [KVCacheGroupSpec(sw_names, sw_spec), KVCacheGroupSpec(names, spec)]
            self.full_gid, self.sw_gid = 1, 0
        self.layer_names = [n for g in groups for n in g.layer_names]
        kv_cfg = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=tensors,
            kv_cache_groups=groups,
            kv_cache_layout="LBHNC",
        )
        raw = torch.zeros(size, dtype=torch.int8)
        self.views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
        for v in self.views:
            v.fill_(GARBAGE)
        self.sw_views: list[torch.Tensor] = []
        caches = dict(zip(names, self.views, strict=True))
        if sliding_window is not None:
            self.sw_views = create_kv_cache_views(raw, sw_spec, num_blocks, layout, sw_tensor)
            caches.update(zip(sw_names, self.sw_views, strict=True))
        #: computations of a request that read wrong KV (the stand-in wrote garbage)
        self.bad_computes = 0
        vc.cache_config.num_gpu_blocks = num_blocks
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = cls(
            vc, kv_cfg, StructuredOutputManager(vc), block_size=block_size, log_stats=log_stats
        )
        #: what the scheduler sent the front-end each step (``log_stats``), and the KV
        #: event batches it published (``kv_events``)
        self.scheduler_stats: list[Any] = []
        self.event_batches: list[Any] = []
        if kv_events:
            self.sched.kv_event_publisher.publish = self.event_batches.append  # type: ignore[method-assign]
        self.worker = LMCacheCoreConnector(vc, KVConnectorRole.WORKER, kv_cfg)
        self.worker.register_kv_caches(caches)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.async_scheduling = async_scheduling
        self.reqs: dict[str, _Req] = {}
        self._inflight: deque[tuple[Any, Any]] = deque()
        self.steps: list[dict[str, Any]] = []
        self.finished: set[str] = set()

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(req_id, list(tokens), sp, None, block_hasher=self._hasher)
        self.sched.add_request(req)
        self.reqs[req_id] = _Req(list(tokens), len(tokens))

    @property
    def scheduler_side(self) -> Any:
        return self.sched.connector._scheduler  # type: ignore[union-attr]

    @property
    def worker_side(self) -> Any:
        return self.worker._worker

    # ------------------------------------------------------------------ stepping
    def step(self) -> Any:
        """Schedule one step, run it on the worker, deliver outputs like the engine."""
        so = self.sched.schedule()
        if not so.total_num_scheduled_tokens:
            time.sleep(0.002)  # an idle engine step is not instantaneous either
        out = self._execute(so)
        self._inflight.append((so, out))
        depth = 2 if self.async_scheduling else 1
        while len(self._inflight) >= depth:
            self._deliver()
        return so

    def _deliver(self) -> None:
        so, out = self._inflight.popleft()
        for eco in self.sched.update_from_output(so, out).values():
            if eco.scheduler_stats is not None:
                self.scheduler_stats.append(eco.scheduler_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    def drain(self, max_steps: int = 200) -> None:
        """Step until every request finished and the connector has nothing pending."""
        for _ in range(max_steps):
            if not self.sched.has_requests() and not self._inflight:
                return
            if not self.sched.has_requests():
                self._deliver()
                continue
            self.step()
        raise AssertionError("requests did not finish")

    def settle(self) -> None:
        """Wait for the worker's background stores, then let one (empty) step carry its
        report to the scheduler."""
        self.worker_side.saves.drain(10.0)
        self.step()
        while self._inflight:
            self._deliver()

    def _execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        w = self.worker
        meta = so.kv_connector_metadata
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        g, sg = self.full_gid, self.sw_gid
        for rid in so.finished_req_ids:
            if rid in self.reqs:
                self.reqs[rid].blocks = []
                self.reqs[rid].sw_blocks = []
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id].blocks = list(new.block_ids[g])
            if sg >= 0:
                self.reqs[new.req_id].sw_blocks = list(new.block_ids[sg])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.reqs[rid].blocks = list(nb[g]) if nb else []
                if sg >= 0:
                    self.reqs[rid].sw_blocks = list(nb[sg]) if nb else []
            elif nb:
                self.reqs[rid].blocks.extend(nb[g])
                if sg >= 0:
                    self.reqs[rid].sw_blocks.extend(nb[sg])
            if sg >= 0:  # vLLM nulls the blocks that left the window: follow its table
                ids = self.sched.kv_cache_manager.get_block_ids(rid)
                self.reqs[rid].sw_blocks = list(ids[sg])
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in self.layer_names:  # as each attention layer does before reading
            w.wait_for_layer_load(name)
        self._forward(so, computed)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=errors,
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.reqs[rid]
            done = computed[rid] + so.num_scheduled_tokens[rid]
            # Like the model runner: a step ending the prefill or decoding samples one.
            sampled.append([r.upto(done + 1)[done]] if done >= r.prompt_len else [])
        self.steps.append(
            {
                "meta": meta,
                "errors": set(errors),
                "failed_recving": set(results.failed_recving),
                "scheduled": dict(so.num_scheduled_tokens),
            }
        )
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    # ------------------------------------------------------------------ the stand-in model
    def _slot(self, block: int, s: int) -> float:
        return float(self.views[0][block, 0, s, 0])

    def _write(self, block: int, s: int, v: float, views: list[torch.Tensor] | None = None) -> None:
        for view in self.views if views is None else views:
            view[block, :, s, :] = v

    def _reads_ok(self, r: _Req, upto: int) -> bool:
        bs = self.bs
        toks = r.upto(upto)
        for p in range(upto):
            if self._slot(r.blocks[p // bs], p % bs) != _f32(value(toks[: p + 1])):
                return False
        if self.window is not None:  # the window before the first computed position
            for p in range(max(0, upto - self.window + 1), upto):
                b = r.sw_blocks[p // bs] if p // bs < len(r.sw_blocks) else 0
                if b == 0 or float(self.sw_views[0][b, 0, p % bs, 0]) != _f32(value(toks[: p + 1])):
                    return False
        return True

    def _forward(self, so: Any, computed: dict[str, int]) -> None:
        pending = [rid for rid, n in so.num_scheduled_tokens.items() if n > 0]
        progress = True
        while progress and pending:  # writers over good KV first: they clean shared blocks
            progress = False
            for rid in list(pending):
                r = self.reqs[rid]
                if self._reads_ok(r, computed[rid]):
                    self._compute(r, computed[rid], so.num_scheduled_tokens[rid], good=True)
                    pending.remove(rid)
                    progress = True
        for rid in pending:
            self._compute(self.reqs[rid], computed[rid], so.num_scheduled_tokens[rid], good=False)

    def _compute(self, r: _Req, start: int, n: int, good: bool) -> None:
        bs = self.bs
        toks = r.upto(start + n)
        if not good:
            self.bad_computes += 1
        for p in range(start, start + n):
            v = value(toks[: p + 1]) if good else GARBAGE
            self._write(r.blocks[p // bs], p % bs, v)
            if self.window is not None:
                assert r.sw_blocks[p // bs] != 0, "computing into vLLM's null block"
                self._write(r.sw_blocks[p // bs], p % bs, v, self.sw_views)

    # ------------------------------------------------------------------ checks
    def stored_chunks(self, sequences: list[list[int]]) -> tuple[int, list[str]]:
        """Check every chunk of ``sequences`` found in the worker's storage against the
        values its tokens imply; returns (chunks found, descriptions of wrong ones)."""
        ws = self.worker_side
        db, storage, copier = ws.db, ws.storage, ws.copier
        cs = ws.ctx.chunk_size
        bpc = ws.ctx.blocks_per_chunk
        found, wrong = 0, []
        seen: set[int] = set()
        for seq in sequences:
            for c, key in enumerate(db.keys(seq)):
                if key.chunk_hash in seen:
                    continue
                seen.add(key.chunk_hash)
                out = torch.empty(copier.chunk_shape(bpc), dtype=torch.float32)
                if not storage.get_into([key], [out])[0]:
                    continue
                found += 1
                for j in range(bpc):
                    for s in range(self.bs):
                        p = c * cs + j * self.bs + s
                        want = _f32(value(seq[: p + 1]))
                        if not bool((out[:, j, :, s, :] == want).all()):
                            wrong.append(f"chunk {c} of a {len(seq)}-token sequence, pos {p}")
                            break
                    else:
                        continue
                    break
        return found, wrong

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def storage_config(chunk: int, cpu: str = "8MiB", disk: Path | None = None) -> dict[str, Any]:
    """A connector storage section: a cpu tier of ``cpu`` bytes, then a disk tier at ``disk``."""
    tiers: list[dict[str, Any]] = [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": cpu}}]
    if disk is not None:
        tiers.append({"name": "disk", "backend": "disk", "options": {"path": str(disk)}})
    return {"chunk_size": chunk, "tiers": tiers}
