"""The connector in vLLM's own observability, without an engine: statistics payloads and
their merging (over ranks, steps and the scheduler), the Prometheus series, hit sources,
KV events and ``reset_cache``.

The scenarios run vLLM's real Scheduler with both halves of the connector in-process
(``sched_harness.py``): the statistics are what the scheduler sends the front-end
(``SchedulerStats``), the KV events what it hands its publisher. The engine-level checks
(``/metrics`` over HTTP, tensor parallel 2, events over ZMQ) are in ``test_vllm_e2e.py``
and ``test_vllm_serve_e2e.py``.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import Models, requires_vllm
from engine_driver import wait_disk_stable
from sched_harness import Harness, storage_config

pytestmark = [requires_vllm, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64
BLOCK = 32
RNG = random.Random(23)
A = [RNG.randrange(4, 500) for _ in range(3 * CHUNK + 10)]  # 3 chunks
B = [RNG.randrange(4, 500) for _ in range(3 * CHUNK + 10)]


def _storage(cpu: str = "8MiB", disk: Path | None = None) -> dict[str, Any]:
    return storage_config(CHUNK, cpu, disk)


def _run(h: Harness, req_id: str, tokens: list[int]) -> None:
    h.add(req_id, tokens)
    h.drain()
    h.settle()


def _merged(h: Harness) -> dict[str, Any]:
    """Every ``kv_connector_stats`` payload the scheduler sent, merged like vLLM's logger."""
    from lmcache_core.integrations.vllm.connector import LMCacheCoreConnector

    acc = LMCacheCoreConnector.build_kv_connector_stats({})
    for s in h.scheduler_stats:
        if s.kv_connector_stats:
            acc = acc.aggregate(LMCacheCoreConnector.build_kv_connector_stats(s.kv_connector_stats))
    return dict(acc.data)


def _hits_by_source(h: Harness) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in h.scheduler_stats:
        cps = s.connector_prefix_cache_stats
        if cps is not None:
            for src, n in cps.hits_by_source.items():
                out[src.value] = out.get(src.value, 0) + n
    return out


# ------------------------------------------------------------------ payloads, no vLLM run
def _payloads() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    rank0 = {
        "hit_tokens": {"cpu": 128},
        "load_bytes": {"cpu": 1000},
        "load_obs": [["cpu", 1000, 0.01]],
        "save_bytes": 500,
        "saved_chunks": 1,
        "save_obs": [[500, 0.002]],
        "tier_health": {"cpu": {"0": 1}},
    }
    rank1 = {  # rank 1 loads the same chunks (its shard): bytes, no tokens
        "load_bytes": {"cpu": 1000},
        "load_obs": [["cpu", 1000, 0.02]],
        "save_bytes": 500,
        "saved_chunks": 1,
        "tier_health": {"cpu": {"1": 0}},
    }
    sched = {"failed_loads": 1, "stale_loads": 2, "unkeyable_requests": 3}
    return rank0, rank1, sched


def test_aggregation_counts_tokens_once_and_sums_bytes_over_ranks() -> None:
    from lmcache_core.integrations.vllm.connector import LMCacheCoreConnector

    build = LMCacheCoreConnector.build_kv_connector_stats
    rank0, rank1, sched = _payloads()
    # the worker aggregator merges the ranks, the scheduler adds its own, the logger
    # merges the steps: in any order the totals are the same
    step = build(dict(rank0)).aggregate(build(dict(rank1))).aggregate(build(dict(sched)))
    other = build(dict(sched)).aggregate(build(dict(rank1))).aggregate(build(dict(rank0)))

    def canon(d: dict[str, Any]) -> dict[str, Any]:
        return {k: sorted(v) if isinstance(v, list) else v for k, v in d.items()}

    assert canon(step.data) == canon(other.data)
    assert (rank0, rank1, sched) == _payloads()  # the inputs are not modified
    d = step.data
    assert d["hit_tokens"] == {"cpu": 128}  # not 256
    assert d["load_bytes"] == {"cpu": 2000}
    assert d["save_bytes"] == 1000 and d["saved_chunks"] == 2
    assert len(d["load_obs"]) == 2 and len(d["save_obs"]) == 1
    assert d["tier_health"] == {"cpu": {"0": 1, "1": 0}}
    two_steps = build({}).aggregate(step).aggregate(build(dict(rank0)))
    assert two_steps.data["hit_tokens"] == {"cpu": 256}
    r = step.reduce()
    assert r["hit_tokens_cpu"] == 128 and r["load_bytes"] == 2000 and r["loads"] == 2
    assert r["tier_healthy_cpu"] == 0  # down on rank 1
    assert r["failed_loads"] == 1 and r["stale_loads"] == 2 and r["unkeyable_requests"] == 3
    assert build({}).is_empty() and not step.is_empty()
    step.reset()
    assert step.is_empty()


def test_observations_are_capped_and_counted() -> None:
    from lmcache_core.integrations.vllm.connector_stats import MAX_OBSERVATIONS, merge_stats

    d: dict[str, Any] = {}
    merge_stats(d, {"save_obs": [[1, 0.1]] * (MAX_OBSERVATIONS - 1), "save_bytes": 1})
    merge_stats(d, {"save_obs": [[1, 0.1]] * 3, "save_bytes": 3})
    assert len(d["save_obs"]) == MAX_OBSERVATIONS
    assert d["observations_dropped"] == 2
    assert d["save_bytes"] == 4  # counters stay exact


def _prom(per_engine: dict[int, list[object]]) -> tuple[Any, Any]:
    """:class:`PromMetrics` on a private registry (vLLM passes its own metric classes)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from lmcache_core.integrations.vllm.connector import LMCacheCoreConnector

    reg = CollectorRegistry()

    def bind(cls: Any) -> Any:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*args, registry=reg, **kw)

        return Bound

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    from types import SimpleNamespace

    prom = LMCacheCoreConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        types,
        ["model_name", "engine"],
        per_engine,
    )
    return prom, reg


def test_prometheus_series_record_the_payload() -> None:
    prom, reg = _prom({0: ["m", "0"]})
    rank0, rank1, sched = _payloads()
    from lmcache_core.integrations.vllm.connector_stats import merge_stats

    prom.observe(merge_stats(merge_stats(dict(rank0), rank1), sched), 0)
    lab = {"model_name": "m", "engine": "0"}
    v = reg.get_sample_value
    assert v("vllm:lmcache_core_hit_tokens_total", {**lab, "tier": "cpu"}) == 128
    assert v("vllm:lmcache_core_load_bytes_total", {**lab, "tier": "cpu"}) == 2000
    assert v("vllm:lmcache_core_save_bytes_total", lab) == 1000
    assert v("vllm:lmcache_core_load_seconds_count", {**lab, "tier": "cpu"}) == 2
    assert v("vllm:lmcache_core_load_seconds_sum", {**lab, "tier": "cpu"}) == pytest.approx(0.03)
    assert v("vllm:lmcache_core_load_size_bytes_sum", {**lab, "tier": "cpu"}) == 2000
    assert v("vllm:lmcache_core_save_seconds_count", lab) == 1
    assert v("vllm:lmcache_core_save_size_bytes_sum", lab) == 500
    assert v("vllm:lmcache_core_failed_loads_total", lab) == 1
    assert v("vllm:lmcache_core_stale_loads_total", lab) == 2
    assert v("vllm:lmcache_core_dropped_saves_total", lab) == 0  # present from the start
    assert v("vllm:lmcache_core_unkeyable_requests_total", lab) == 3
    assert v("vllm:lmcache_core_tier_healthy", {**lab, "tier": "cpu"}) == 0
    prom.observe({"tier_health": {"cpu": {"1": 1}}}, 0)
    assert v("vllm:lmcache_core_tier_healthy", {**lab, "tier": "cpu"}) == 1


def test_docs_name_every_series_and_only_those() -> None:
    from lmcache_core.integrations.vllm.prom_metrics import SERIES

    _, reg = _prom({0: ["m", "0"]})
    registered = {m.name for m in reg.collect()}
    # prometheus_client strips the _total of counters in collect(): compare base names
    assert registered == {s.name for s in SERIES}
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(vllm:lmcache_core_\w+)`", section))
    assert documented == {s.name for s in SERIES}, documented ^ {s.name for s in SERIES}
    for s in SERIES:  # every label is documented on the series' row
        row = next(line for line in section.splitlines() if f"`{s.name}`" in line)
        for label in s.labels:
            assert f"`{label}`" in row, (s.name, label)


def test_hit_source_of_each_backend_type() -> None:
    from lmcache_core.integrations.vllm.scheduler_side import hit_source_of

    assert hit_source_of("cpu") == "host"
    assert hit_source_of("disk") == "disk"
    assert hit_source_of("gds") == "disk"
    assert hit_source_of("s3") == "external_unspecified"
    assert hit_source_of("sqlite") == "external_unspecified"


def test_events_off_when_block_hashes_differ_between_processes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lmcache_core.integrations.vllm.kv_events import KVEvents

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.lmcache_core.connector"):
        ev = KVEvents(
            enabled=True,
            medium="cpu",
            block_size=BLOCK,
            blocks_per_chunk=2,
            hash_block_size=BLOCK,
            hash_algo="builtin",
        )
    assert not ev.enabled and ev.off_reason
    assert [r for r in caplog.records if "KV events off" in r.getMessage()]
    ev.planned(1, object(), 0)
    ev.stored(1)
    assert ev.take() == []
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    kw = {"medium": "cpu", "block_size": BLOCK, "blocks_per_chunk": 2, "hash_block_size": BLOCK}
    assert KVEvents(enabled=True, hash_algo="builtin", **kw).enabled  # type: ignore[arg-type]
    assert KVEvents(enabled=True, hash_algo="sha256", **kw).enabled  # type: ignore[arg-type]


# ------------------------------------------------------------------ vLLM's scheduler
def test_stats_reach_the_front_end_as_the_workers_counted_them(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    """A repeated prompt loads from the cpu tier: the payloads the scheduler sends add up
    to the worker's own counters, and vLLM's hit-source split says ``host``."""
    h = Harness(
        vllm_models.main, _storage(), async_scheduling=False, prefix_caching=False, log_stats=True
    )
    harnesses.append(h)
    _run(h, "a0", A)
    _run(h, "a1", A)
    w = h.worker_side.stats()
    loaded = w["loaded_tokens_by_tier"]["cpu"]
    assert loaded == 3 * CHUNK
    d = _merged(h)
    assert d["hit_tokens"] == {"cpu": loaded}
    assert d["load_bytes"] == {"cpu": w["loaded_bytes"]}
    assert sum(o[1] for o in d["load_obs"]) == w["loaded_bytes"]
    assert d["save_bytes"] == w["saved_bytes"] > 0
    assert d["saved_chunks"] == w["saved_chunks"] == 3
    assert len(d["save_obs"]) == 3
    assert d["tier_health"] == {"cpu": {"0": 1}}
    assert _hits_by_source(h) == {"host": 3 * CHUNK}


def test_the_worker_rewrites_its_stats_file_only_when_the_document_changed(
    vllm_models: Models,
    harnesses: list[Harness],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine steps that load and store nothing (a short request decoding) do not rewrite
    the worker's statistics file; the steps after new saves do, with the new counts."""
    import json

    from lmcache_core.integrations.vllm import worker_side

    writes: list[str] = []
    real = worker_side.write_stats_text

    def counted(directory: str, name: str, text: str) -> bool:
        writes.append(name)
        return real(directory, name, text)

    monkeypatch.setattr(worker_side, "write_stats_text", counted)
    stats = tmp_path / "stats"
    h = Harness(
        vllm_models.main,
        _storage(),
        async_scheduling=False,
        prefix_caching=False,
        options={"stats_dir": str(stats)},
    )
    harnesses.append(h)
    _run(h, "a0", A)
    (worker,) = stats.glob("worker0-*.json")
    assert json.loads(worker.read_text())["saved_chunks"] == 3
    assert writes
    # a request shorter than a chunk decodes for a few steps: nothing to load or store
    writes.clear()
    steps = len(h.steps)
    h.add("d0", B[:20], max_tokens=8)
    h.drain()
    assert {"d0"} <= h.finished and len(h.steps) - steps >= 8
    assert writes == []
    _run(h, "b0", B)
    assert writes
    assert json.loads(worker.read_text())["saved_chunks"] == 6


def test_hit_sources_split_a_load_by_tier_type(
    vllm_models: Models, harnesses: list[Harness], tmp_path: Path
) -> None:
    """A prompt whose first chunks are in this process's memory tier and the last one
    only on the shared disk (stored by another process): the planned tokens split into
    ``host`` and ``disk``."""
    disk = tmp_path / "kv"
    h = Harness(
        vllm_models.main,
        _storage(disk=disk),
        async_scheduling=False,
        prefix_caching=False,
        log_stats=True,
    )
    harnesses.append(h)
    _run(h, "b01", B[: 2 * CHUNK + 5])  # B's first 2 chunks: cpu (indexed) and disk
    wait_disk_stable(str(disk), at_least=2)
    other = Harness(vllm_models.main, _storage(disk=disk), async_scheduling=False)
    harnesses.append(other)
    _run(other, "b", B)  # loads B's first 2 chunks from disk, stores the third there
    wait_disk_stable(str(disk), at_least=3)
    h.scheduler_stats.clear()
    _run(h, "b2", B)
    assert _hits_by_source(h) == {"host": 2 * CHUNK, "disk": CHUNK}
    # what the worker actually read: the connector's own series
    assert _merged(h)["hit_tokens"] == {"cpu": 2 * CHUNK, "disk": CHUNK}


def _expected_block_hashes(tokens: list[int]) -> list[int]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def _connector_events(h: Harness) -> list[Any]:
    return [e for b in h.event_batches for e in b.events if getattr(e, "medium", None) == "cpu"]


def test_kv_events_carry_vllm_block_hashes_for_stored_and_evicted_chunks(
    vllm_models: Models, harnesses: list[Harness]
) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    # the cpu tier holds 4 chunks (16 KiB of KV + 1 KiB of bookkeeping each)
    h = Harness(vllm_models.main, _storage(cpu="72KiB"), async_scheduling=False, kv_events=True)
    harnesses.append(h)
    _run(h, "a", A)
    stored = [e for e in _connector_events(h) if isinstance(e, BlockStored)]
    hashes = _expected_block_hashes(A)
    assert len(stored) == 3
    got = sorted(stored, key=lambda e: A.index(e.token_ids[0]) if e.parent_block_hash else -1)
    for c, ev in enumerate(got):
        assert ev.block_hashes == hashes[2 * c : 2 * c + 2]
        assert ev.parent_block_hash == (hashes[2 * c - 1] if c else None)
        assert ev.token_ids == A[c * CHUNK : (c + 1) * CHUNK]
        assert ev.block_size == BLOCK and ev.medium == "cpu"
    # vLLM's own events for its KV cache are there too, with the same hashes
    own = [e for b in h.event_batches for e in b.events if isinstance(e, BlockStored)]
    assert {x for e in own if e.medium != "cpu" for x in e.block_hashes} >= set(hashes[:6])
    h.event_batches.clear()
    _run(h, "b", B)  # 3 more chunks: 2 of A's are evicted
    events = _connector_events(h)
    removed = [x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert len(removed) == 2 * 2 and set(removed) <= set(hashes[:6])
    assert len([e for e in events if isinstance(e, BlockStored)]) == 3


def test_reset_cache_clears_the_memory_tier_before_the_next_loads(
    vllm_models: Models, harnesses: list[Harness], tmp_path: Path
) -> None:
    """``reset_prefix_cache(reset_connector=True)``: the scheduler forgets at once, the
    worker clears its cpu tier in the next step; the shared disk tier is untouched, so
    the prompt then loads from disk."""
    from vllm.distributed.kv_events import BlockRemoved

    h = Harness(
        vllm_models.main,
        _storage(disk=tmp_path / "kv"),
        async_scheduling=False,
        prefix_caching=False,
        kv_events=True,
    )
    harnesses.append(h)
    _run(h, "a0", A)
    wait_disk_stable(str(tmp_path / "kv"), at_least=3)  # write-through runs in the background
    assert h.scheduler_side.stats()["index_chunks"] == 3
    h.event_batches.clear()
    assert h.sched.reset_prefix_cache(reset_connector=True)
    assert h.scheduler_side.stats()["index_chunks"] == 0  # at once
    assert h.worker_side.storage.hierarchy.tiers[0].backend.keys()  # not yet
    removed = [e for e in h.scheduler_side.take_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 6
    h.add("a1", A)
    so = h.step()
    assert so.kv_connector_metadata.reset
    h.drain()
    h.settle()
    w = h.worker_side.stats()
    assert w["resets"] == 1 and w["reset_removed_chunks"] == 3
    assert w["loaded_tokens_by_tier"] == {"disk": 3 * CHUNK}  # not from the cleared cpu
    found, wrong = h.stored_chunks([A])
    assert found == 3 and not wrong
    assert h.scheduler_side.stats()["resets"] == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_chunk_promoted_from_disk_is_then_a_memory_hit_loaded_before_the_forward_pass(
    vllm_models: Models, harnesses: list[Harness], tmp_path: Path, policy: str
) -> None:
    """A prompt read back from disk (the cpu tier cleared, as after a restart) is loaded
    in the background and promoted into the cpu tier; the worker reports the promoted
    chunks as held in memory (pinned under policy ``fail``, as its saves), so the next
    request with that prompt loads it before the forward pass, from memory."""
    h = Harness(
        vllm_models.main,
        _storage(disk=tmp_path / "kv"),
        async_scheduling=False,
        prefix_caching=False,
        policy=policy,
    )
    harnesses.append(h)
    _run(h, "a0", A)
    wait_disk_stable(str(tmp_path / "kv"), at_least=3)
    assert h.sched.reset_prefix_cache(reset_connector=True)
    _run(h, "a1", A)  # from disk, in the background; then promoted
    w = h.worker_side.stats()
    assert w["loaded_tokens_by_tier"] == {"disk": 3 * CHUNK}
    assert (w["sync_loaded_chunks"], w["async_loaded_chunks"]) == (0, 3)
    h.step()  # (carries the promotions' report to the scheduler)
    while h._inflight:
        h._deliver()
    assert h.scheduler_side.stats()["index_chunks"] == 3
    _run(h, "a2", A)
    w = h.worker_side.stats()
    assert (w["sync_loaded_chunks"], w["async_loaded_chunks"]) == (3, 3)
    assert w["failed_chunks"] == 0 and h.scheduler_side.stats()["load_failures"] == 0
    found, wrong = h.stored_chunks([A])
    assert found == 3 and not wrong
    # a reset drops every pin the worker held on them (policy fail) and forgets them
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.step()
    while h._inflight:
        h._deliver()
    top = h.worker_side.storage.hierarchy.tiers[0].backend
    assert not list(top.keys()) and top.stats().get("pinned_entries", 0) == 0
    assert h.scheduler_side.stats()["index_chunks"] == 0


def test_reset_cache_deletes_from_shared_tiers_when_asked(
    vllm_models: Models, harnesses: list[Harness], tmp_path: Path
) -> None:
    """With ``reset_shared_tiers`` the reset also deletes the namespace's chunks from
    the disk tier: the prompt is then computed, not loaded, and stored again."""
    from engine_driver import disk_objects

    disk = tmp_path / "kv"
    h = Harness(
        vllm_models.main,
        _storage(disk=disk),
        async_scheduling=False,
        prefix_caching=False,
        options={"reset_shared_tiers": True},
    )
    harnesses.append(h)
    _run(h, "a0", A)
    first = wait_disk_stable(str(disk), at_least=3)
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.add("a1", A)
    assert h.step().kv_connector_metadata.reset
    assert not disk_objects(str(disk))  # gone before the step's loads
    h.drain()
    h.settle()
    w = h.worker_side.stats()
    assert w["reset_removed_chunks"] == 3 + 3  # cpu and disk
    assert w["loaded_tokens_by_tier"] == {}  # recomputed
    # nothing was offered from the tier being purged: no load failed
    assert h.scheduler_side.stats()["load_failures"] == 0 and w["failed_chunks"] == 0
    assert sorted(wait_disk_stable(str(disk), at_least=3)) == sorted(first)  # stored again
