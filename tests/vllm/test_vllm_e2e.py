"""End-to-end tests of LMCacheCoreConnector on real vLLM (CPU build), float32 model.

Four engine processes, each running many cases (see the ``engine_*`` fixtures):

* ``e1`` (engine core in-process, prefix caching off, cpu + disk tiers): cold vs warm,
  short prompts, exact chunk multiples, cache salts, a batch sharing a prefix, aborts;
  vLLM's Prometheus series against the worker's counters (hits under ``host``), and
  ``reset_prefix_cache(reset_connector=True)``; two LoRA adapters loaded as ids 1, 2;
* ``e2`` (a **new** multiprocess engine, prefix caching on, no ``PYTHONHASHSEED``, same
  disk directory): reuse from disk, a corrupted chunk, a local + external hit, reuse
  from the CPU tier after resetting vLLM's prefix cache, chunks gone from every tier;
  the connector's KV events received over vLLM's ZMQ publisher; the same two LoRA
  adapters loaded in the opposite order (ids 2, 1): hits for each, none across them;
* ``e3``: a model with the same ``config.json`` but other weights on the same disk (the
  connector selected through ``kv_connector_module_path``);
* ``e4``: tensor parallel 2 (worker connectors in two other processes), including a
  background load whose chunk is missing on one rank; hit tokens on vLLM's series
  counted once, bytes summed over the ranks.

Sliding-window, hybrid and MLA models are in ``test_vllm_models_e2e.py``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import vllm_cases as c
from conftest import EngineRun, Models, connector_config, engine_env, requires_vllm, run_engine

from lmcache_core.integrations.vllm.local_lora import LoraSpec

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

DATA_OFFSET = 4096  # object format: the tensor bytes start here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _series(metrics: list[dict[str, Any]], name: str, **labels: str) -> float:
    """Sum of the samples of series ``name`` whose labels include ``labels``."""
    return sum(
        float(m.get("value", m.get("sum", 0)))
        for m in metrics
        if m["name"] == name and all(m["labels"].get(k) == v for k, v in labels.items())
    )


def _block_hashes(tokens: list[int]) -> list[int]:
    """vLLM's block hashes of ``tokens`` (sha256, its default), as its KV events carry
    them (64-bit ints)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    seed = os.environ.pop("PYTHONHASHSEED", None)  # the engine runs without it
    try:
        init_none_hash(sha256)
    finally:
        if seed is not None:
            os.environ["PYTHONHASHSEED"] = seed
    out, parent = [], None
    for i in range(len(tokens) // c.BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i * c.BLOCK : (i + 1) * c.BLOCK])
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def _engine(
    model: Path,
    ktc: dict[str, Any],
    *,
    prefix_caching: bool,
    tp: int = 1,
    log_stats: bool = False,
    lora: bool = False,
) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "disable_log_stats": not log_stats,  # on: vLLM's Prometheus series in-process
        "model": str(model),
        "dtype": "float32",
        "block_size": c.BLOCK,
        "max_model_len": 1024,
        "max_num_batched_tokens": 96,
        "enable_prefix_caching": prefix_caching,
        "enforce_eager": True,
        "seed": 0,
        "tensor_parallel_size": tp,
        "kv_transfer_config": ktc,
    }
    if lora:
        engine.update(enable_lora=True, max_loras=2, max_lora_rank=LoraSpec().rank)
    return engine


def _storage(cpu_bytes: str, disk: Path | None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": cpu_bytes}}
    ]
    if disk is not None:
        tiers.append(
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(disk), "max_bytes": "256MiB"},
            }
        )
    return {"chunk_size": c.CHUNK, "tiers": tiers}


def _gen(name: str, *prompts: list[int], salt: str | None = None) -> dict[str, Any]:
    return {
        "op": "generate",
        "name": name,
        "prompts": [{"tokens": p, "cache_salt": salt} for p in prompts],
    }


def _lora_gen(name: str, *prompts: tuple[list[int], dict[str, Any] | None]) -> dict[str, Any]:
    return {
        "op": "generate",
        "name": name,
        "prompts": [{"tokens": p, "lora": lora} for p, lora in prompts],
    }


@dataclass(frozen=True)
class Adapters:
    """Two local LoRA adapters and each one's greedy continuations (``transformers`` on
    the merged weights, float32) of ``c.LORA_P`` and ``c.LORA_Q``."""

    a: Path
    b: Path
    reference: dict[str, list[list[int]]]

    def request(self, which: str, int_id: int) -> dict[str, Any]:
        return {"name": f"adapter-{which}", "id": int_id, "path": str(getattr(self, which))}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert len(a["logprobs"]) == len(b["logprobs"]) == c.MAX_TOKENS
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert abs(x - y) <= 1e-3


# ---------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_e2e")


#: These engines assert exact hit counts, so a slow first lookup in a fresh process (its
#: disk index opened under a loaded machine) must not turn a hit into a deadline miss:
#: the 20 ms default is a production latency guard, tested in test_vllm_slow_e2e.py.
EXACT = {"lookup_deadline_ms": 5000}


@pytest.fixture(scope="module")
def adapters(vllm_models: Models, workdir: Path) -> Adapters:
    import torch
    from transformers import AutoModelForCausalLM

    from lmcache_core.integrations.vllm.local_lora import make_local_lora, merge_lora

    made = {
        w: make_local_lora(workdir / "loras" / w, vllm_models.main, LoraSpec(seed=s))
        for w, s in (("a", 1), ("b", 2))
    }
    reference: dict[str, list[list[int]]] = {}
    for which, path in made.items():
        model = AutoModelForCausalLM.from_pretrained(str(vllm_models.main), dtype=torch.float32)
        model = merge_lora(model.eval(), path)
        reference[which] = []
        with torch.no_grad():
            for prompt in (c.LORA_P, c.LORA_Q):
                ids, toks = torch.tensor([prompt]), []
                for _ in range(c.MAX_TOKENS):
                    logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
                    top = torch.topk(logp, 2)
                    margin = float(top.values[0] - top.values[1])
                    assert margin > c.MARGIN, f"adapter {which}: top-1 margin {margin}"
                    toks.append(int(top.indices[0]))
                    ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
                reference[which].append(toks)
    assert reference["a"][0] != reference["b"][0]  # the adapters change the outputs
    return Adapters(made["a"], made["b"], reference)


@pytest.fixture(scope="module")
def e1(vllm_models: Models, workdir: Path, adapters: Adapters) -> EngineRun:
    disk = workdir / "disk"
    stats = workdir / "stats-e1"
    ktc = connector_config(_storage("8MiB", disk), stats, **EXACT)
    steps = [
        _gen("cold", c.LONG, c.MID, c.SHORT, c.ONE),
        _gen("cold_corrupt", c.CORRUPT),
        _gen("cold_local_ext", c.LOCAL_EXT),
        _gen("warm", c.LONG, c.MID, c.SHORT, c.ONE),
        _gen("salt_a", c.SALTED, salt="a"),
        _gen("salt_b", c.SALTED, salt="b"),
        _gen("salt_a_again", c.SALTED, salt="a"),
        _gen("no_salt", c.SALTED),
        _gen("batch", *c.BATCH),
        _gen("batch_again", *c.BATCH),
        {
            "op": "abort",
            "name": "abort_before_load",
            "prompt": {"tokens": c.ABORT},
            "steps_before_abort": 0,
        },
        _gen("abort_cold", c.ABORT),
        {
            "op": "abort",
            "name": "abort_mid_load",
            "prompt": {"tokens": c.ABORT},
            "steps_before_abort": 1,
        },
        _gen("after_abort", c.ABORT),
        # vLLM's metrics, then a connector reset: the memory tier is cleared, disk is not
        {"op": "metrics", "name": "metrics"},
        {"op": "reset_prefix_cache", "name": "reset_connector", "reset_connector": True},
        _gen("after_reset", c.LONG),
        {"op": "metrics", "name": "metrics_after_reset"},
        # LoRA adapters a (id 1) and b (id 2); e2 loads them the other way round
        _lora_gen(
            "lora",
            (c.LORA_P, adapters.request("a", 1)),
            (c.LORA_P, adapters.request("b", 2)),
            (c.LORA_Q, adapters.request("a", 1)),
        ),
    ]
    spec = {
        "engine": _engine(vllm_models.main, ktc, prefix_caching=False, log_stats=True, lora=True),
        "steps": steps,
        "stats_dir": str(stats),
        "disk_dir": str(disk),
    }
    return run_engine(workdir, "e1", spec, engine_env(multiprocessing=False))


@pytest.fixture(scope="module")
def e2(vllm_models: Models, workdir: Path, e1: EngineRun, adapters: Adapters) -> EngineRun:
    disk = workdir / "disk"
    # Corrupt the stored chunks of CORRUPT: the lookup still finds the files.
    corrupted = e1.step("cold_corrupt")["new_disk_objects"]
    assert len(corrupted) == len(c.CORRUPT) // c.CHUNK
    for rel in corrupted:
        with open(disk / rel, "r+b") as f:
            f.seek(DATA_OFFSET + 100)
            b = f.read(1)
            f.seek(DATA_OFFSET + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    stats = workdir / "stats-e2"
    ktc = connector_config(_storage("512KiB", disk), stats, **EXACT)  # 8 chunks of 64 KiB
    steps = [
        _gen("disk_reuse", c.LONG, c.MID),
        _gen("corrupted", c.CORRUPT),
        _gen("head", c.LOCAL_EXT_HEAD),
        _gen("local_ext", c.LOCAL_EXT),
        _gen("cpu_cold", c.CPU_REUSE),
        {"op": "reset_prefix_cache", "name": "reset1"},
        _gen("cpu_warm", c.CPU_REUSE),
        _gen("evict_cold", c.EVICT),
        # another instance sharing the disk tier removes them (through the tier's index)
        {"op": "delete_chunks", "name": "delete", "tokens": c.EVICT, "chunks": [0, 1, 2]},
        _gen("fill", *c.FILLERS),
        {"op": "reset_prefix_cache", "name": "reset2"},
        _gen("evict_warm", c.EVICT),
        {"op": "reset_prefix_cache", "name": "reset3"},
        _gen("evict_again", c.EVICT),
        # their files unlinked behind the index (by hand): the index, and so the disk
        # tier's in-memory view of it, still lists them - a stale positive
        {"op": "delete_disk_objects", "name": "unlink", "from_step": "evict_warm"},
        _gen("fill2", *c.FILLERS2),
        {"op": "reset_prefix_cache", "name": "reset4"},
        _gen("stale", c.EVICT),
        {"op": "reset_prefix_cache", "name": "reset5"},
        _gen("stale_again", c.EVICT),
        # the adapters e1 loaded as a=1, b=2 loaded here as b=1 (first), a=2
        _lora_gen("lora_b", (c.LORA_P, adapters.request("b", 1))),
        _lora_gen("lora_a", (c.LORA_P, adapters.request("a", 2))),
        # LORA_Q was stored with adapter a only; LORA_P with both, never without one
        _lora_gen("lora_cross", (c.LORA_Q, adapters.request("b", 1)), (c.LORA_P, None)),
    ]
    # vLLM's KV events over ZMQ: its publisher connects to the driver's 127.0.0.1 socket
    # (a short prompt, never stored, runs one more step: the last stores reach the scheduler)
    at = steps.index(_gen("fill", *c.FILLERS)) + 1
    steps[at:at] = [_gen("nudge", c.SHORT), {"op": "events", "name": "events"}]
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    engine = _engine(vllm_models.main, ktc, prefix_caching=True, lora=True)
    engine["kv_events_config"] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
    }
    spec = {
        "engine": engine,
        "steps": steps,
        "stats_dir": str(stats),
        "disk_dir": str(disk),
        "kv_events_endpoint": endpoint,
    }
    return run_engine(workdir, "e2", spec, engine_env(multiprocessing=True))


@pytest.fixture(scope="module")
def e3(vllm_models: Models, workdir: Path, e1: EngineRun) -> EngineRun:
    disk = workdir / "disk"
    stats = workdir / "stats-e3"
    # No failure policy: vLLM's default ("fail").
    # Selected by module path rather than by the registered name.
    ktc = connector_config(_storage("8MiB", disk), stats, policy=None, by_module_path=True, **EXACT)
    spec = {
        "engine": _engine(vllm_models.twin, ktc, prefix_caching=False),
        "steps": [_gen("other_weights", c.LONG, c.MID)],
        "stats_dir": str(stats),
        "disk_dir": str(disk),
    }
    return run_engine(workdir, "e3", spec, engine_env(multiprocessing=False))


@pytest.fixture(scope="module")
def e4(vllm_models: Models, workdir: Path) -> EngineRun:
    disk = workdir / "disk-tp2"
    stats = workdir / "stats-e4"
    control = workdir / "control-e4.json"
    storage = _storage("256KiB", None)  # 8 chunks of 32 KiB per rank
    storage["tiers"].append(
        {
            "name": "disk",
            "backend_class": "kv_test_backends:SlowDiskBackend",
            "options": {"path": str(disk), "max_bytes": "256MiB", "control": str(control)},
        }
    )
    ktc = connector_config(storage, stats, **EXACT)
    steps = [
        _gen("cold", c.LONG, c.MID),
        _gen("warm", c.LONG, c.MID),
        # CORRUPT's chunks leave the memory tiers (evicted by the fillers) but stay on
        # disk, where rank 1's copy of chunk 1 then cannot be read: a background load
        # that fails on one rank only.
        _gen("q_cold", c.CORRUPT),
        _gen("fill", *c.FILLERS),
        _gen("settle", c.SHORT),  # a few more steps: the evictions reach the scheduler
        {
            "op": "control",
            "name": "lose_rank1",
            "fail": {"tokens": c.CORRUPT, "chunks": [1], "rank": 1, "world_size": 2},
        },
        _gen("q_async", c.CORRUPT),
        {"op": "metrics", "name": "metrics"},
    ]
    spec = {
        "engine": _engine(vllm_models.main, ktc, prefix_caching=False, tp=2, log_stats=True),
        "steps": steps,
        "stats_dir": str(stats),
        "disk_dir": str(disk),
        "control_file": str(control),
    }
    return run_engine(workdir, "e4", spec, engine_env(multiprocessing=True, tp=2), timeout=540)


# ---------------------------------------------------------------------------------- e1
def test_cold_vs_warm_identical_with_expected_hits(e1: EngineRun) -> None:
    cold, warm = e1.outputs("cold"), e1.outputs("warm")
    assert [o["num_cached_tokens"] for o in cold] == [0, 0, 0, 0]
    assert (
        [o["num_cached_tokens"] for o in warm]
        == [c.expected_hit(len(c.LONG)), c.expected_hit(len(c.MID)), 0, c.expected_hit(len(c.ONE))]
        == [255, 192, 0, 63]
    )
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    w = e1.worker("warm")
    assert w["loaded_tokens"] >= 255 + 192 + 63
    assert w["failed_chunks"] == 0
    assert w["one_copy_per_chunk"]  # vLLM's one backing allocation: one copy for all layers


def test_prompt_shorter_than_a_chunk_never_hits(e1: EngineRun) -> None:
    # SHORT (40 tokens) has no full chunk: nothing to save or load for it.
    assert e1.outputs("cold")[2]["num_cached_tokens"] == 0
    assert e1.outputs("warm")[2]["num_cached_tokens"] == 0
    _same(e1.outputs("cold")[2], e1.outputs("warm")[2])
    # The cold batch stored the full chunks of LONG, MID and ONE only (4 + 3 + 1).
    assert e1.worker("cold")["saved_chunks"] == 8
    assert e1.scheduler("warm")["unkeyable"] == 0


def test_cache_salt_separates_tenants(e1: EngineRun) -> None:
    assert e1.outputs("salt_a")[0]["num_cached_tokens"] == 0
    assert e1.outputs("salt_b")[0]["num_cached_tokens"] == 0
    assert e1.outputs("salt_a_again")[0]["num_cached_tokens"] == 128
    assert e1.outputs("no_salt")[0]["num_cached_tokens"] == 0
    _same(e1.outputs("salt_a")[0], e1.outputs("salt_a_again")[0])
    _same(e1.outputs("salt_a")[0], e1.outputs("salt_b")[0])


def test_batch_sharing_a_prefix(e1: EngineRun) -> None:
    first, again = e1.outputs("batch"), e1.outputs("batch_again")
    # Within the first batch a request admitted after another saved some of the shared
    # chunks (chunked prefill: 96 tokens per step) hits them; the first one cannot.
    assert first[0]["num_cached_tokens"] == 0
    assert all(o["num_cached_tokens"] in (0, 64, 128) for o in first)
    assert [o["num_cached_tokens"] for o in again] == [128, 128, 128]
    for a, b in zip(first, again, strict=True):
        _same(a, b)
    assert len({tuple(o["tokens"]) for o in again}) > 1  # different suffixes, different answers


def test_abort_before_and_during_load(e1: EngineRun) -> None:
    assert not e1.step("abort_before_load")["unfinished"]
    assert not e1.step("abort_mid_load")["unfinished"]
    assert not e1.step("abort_mid_load")["finished_before_abort"]
    cold, after = e1.outputs("abort_cold")[0], e1.outputs("after_abort")[0]
    assert after["num_cached_tokens"] == c.expected_hit(len(c.ABORT)) == 319
    _same(cold, after)
    s = e1.scheduler("after_abort")
    assert s["active_requests"] == 0  # aborted requests left no state behind
    assert e1.worker("after_abort")["failed_chunks"] == 0


def test_connector_pids_are_logged(e1: EngineRun) -> None:
    sched = re.findall(r"LMCacheCoreConnector scheduler side: pid=(\d+)", e1.log)
    work = re.findall(r"LMCacheCoreConnector worker side: pid=(\d+) rank=0/1", e1.log)
    assert sched and work
    # In-process engine core: both sides live in the driver process.
    assert int(sched[0]) == int(work[0]) == e1.results["pid"]


# ---------------------------------------------------------------------------------- e2
def test_reuse_from_disk_in_a_new_process(e1: EngineRun, e2: EngineRun) -> None:
    assert e2.results["pid"] != e1.results["pid"]
    cold = e1.outputs("cold")
    reuse = e2.outputs("disk_reuse")
    assert [o["num_cached_tokens"] for o in reuse] == [255, 192]
    _same(cold[0], reuse[0])
    _same(cold[1], reuse[1])
    assert e2.worker("disk_reuse")["loaded_tokens_by_tier"].get("disk", 0) >= 255 + 192


def test_corrupted_chunk_is_recomputed(e1: EngineRun, e2: EngineRun) -> None:
    out = e2.outputs("corrupted")[0]
    assert out["finish_reason"] == "length"
    _same(e1.outputs("cold_corrupt")[0], out)
    before = e2.worker("disk_reuse")["failed_chunks"]
    assert e2.worker("corrupted")["failed_chunks"] > before
    assert e2.scheduler("corrupted")["load_failures"] >= 1


def test_local_plus_external_hit_with_prefix_caching_on(e1: EngineRun, e2: EngineRun) -> None:
    assert e2.outputs("head")[0]["num_cached_tokens"] == 128  # two chunks from disk
    out = e2.outputs("local_ext")[0]
    assert out["num_cached_tokens"] == 255
    _same(e1.outputs("cold_local_ext")[0], out)
    hit = e2.scheduler("local_ext")["hit_tokens"] - e2.scheduler("head")["hit_tokens"]
    assert hit == 255 - 128  # vLLM's prefix cache supplied the first 128 tokens


def test_reuse_from_cpu_tier_after_prefix_cache_reset(e2: EngineRun) -> None:
    cold, warm = e2.outputs("cpu_cold")[0], e2.outputs("cpu_warm")[0]
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == c.expected_hit(len(c.CPU_REUSE)) == 191
    _same(cold, warm)
    before = e2.worker("cpu_cold")["loaded_tokens_by_tier"].get("cpu", 0)
    assert e2.worker("cpu_warm")["loaded_tokens_by_tier"]["cpu"] - before == 192


def test_chunks_gone_from_every_tier_are_a_clean_miss(e2: EngineRun) -> None:
    # EVICT's chunks were removed from disk by another process (through the shared
    # index, as another instance evicting them would) and evicted from the memory tier
    # by the fillers; the memory tier reported the evictions and the disk tier's view
    # of the index caught up, so the scheduler promises nothing: a miss, not a failed
    # load.
    assert e2.step("delete")["removed"] == len(e2.step("evict_cold")["new_disk_objects"]) == 3
    cold, warm, again = (e2.outputs(n)[0] for n in ("evict_cold", "evict_warm", "evict_again"))
    assert warm["finish_reason"] == "length"
    _same(cold, warm)
    assert warm["num_cached_tokens"] == 0
    assert e2.worker("evict_warm")["failed_chunks"] == e2.worker("fill")["failed_chunks"]
    assert e2.scheduler("evict_warm")["stale_hits"] == e2.scheduler("fill")["stale_hits"]
    # The recomputed chunks were stored again.
    assert again["num_cached_tokens"] == c.expected_hit(len(c.EVICT)) == 191
    _same(cold, again)


def test_files_unlinked_behind_the_index_are_a_failed_load_recomputed_and_stored_again(
    e2: EngineRun,
) -> None:
    # EVICT's files were unlinked behind the index, and the memory tier evicted them: the
    # disk tier's view of the index still lists them (a stale positive). The load finds no
    # file: a miss at load, reported as a failed load that the connector accounts for
    # (stale hits, failed chunks; vLLM recomputes under the "recompute" policy - under
    # "fail" only leased chunks are offered, see the e3 test), never wrong KV.
    unlinked = e2.step("unlink")["deleted"]
    assert len(unlinked) == 3
    cold, stale, again = (e2.outputs(n)[0] for n in ("evict_cold", "stale", "stale_again"))
    assert stale["finish_reason"] == "length"
    _same(cold, stale)
    assert stale["num_cached_tokens"] == 0
    w0, w1 = e2.worker("fill2"), e2.worker("stale")
    assert w1["failed_chunks"] - w0["failed_chunks"] == len(unlinked)
    s0, s1 = e2.scheduler("fill2"), e2.scheduler("stale")
    assert s1["stale_hits"] - s0["stale_hits"] == len(unlinked)
    assert s1["load_failures"] == s0["load_failures"] + 1
    # The load dropped the stale rows; the recomputed chunks were stored again and serve
    # the next run, with no further failure.
    assert again["num_cached_tokens"] == c.expected_hit(len(c.EVICT)) == 191
    _same(cold, again)
    assert e2.worker("stale_again")["failed_chunks"] == w1["failed_chunks"]


def test_multiprocess_pids_differ(e2: EngineRun) -> None:
    sched = re.findall(r"LMCacheCoreConnector scheduler side: pid=(\d+)", e2.log)
    work = re.findall(r"LMCacheCoreConnector worker side: pid=(\d+) rank=0/1", e2.log)
    assert sched and work and sched[0] != work[0]


def test_lora_adapters_hit_across_processes_whatever_their_integer_ids(
    e1: EngineRun, e2: EngineRun, adapters: Adapters
) -> None:
    """Issue 14 "Keys": e1 loaded adapters a, b as ids 1, 2 and e2 as 2, 1. Each
    adapter's chunks are found by the other process (by name and files), never by the
    other adapter nor without an adapter."""
    cold = e1.outputs("lora")
    assert [o["num_cached_tokens"] for o in cold] == [0, 0, 0]
    ref = adapters.reference
    assert [o["tokens"] for o in cold] == [ref["a"][0], ref["b"][0], ref["a"][1]]
    b, a = e2.outputs("lora_b")[0], e2.outputs("lora_a")[0]
    hit = c.expected_hit(len(c.LORA_P))
    assert (b["num_cached_tokens"], a["num_cached_tokens"]) == (hit, hit)
    _same(cold[1], b)
    _same(cold[0], a)
    cross = e2.outputs("lora_cross")
    assert [o["num_cached_tokens"] for o in cross] == [0, 0]
    assert cross[0]["tokens"] == ref["b"][1]  # computed with b, not a's stored chunks
    assert e2.scheduler("lora_cross")["unkeyable"] == 0
    disk_tokens = [
        e2.worker(step)["loaded_tokens_by_tier"].get("disk", 0)
        for step in ("stale_again", "lora_a")
    ]
    assert disk_tokens[1] - disk_tokens[0] >= 2 * hit  # both read from e1's disk tier
    ns = e2.scheduler("lora_cross")["namespace"]
    assert ns == e1.scheduler("lora")["namespace"]  # one namespace, adapters in the keys


# ---------------------------------------------------------------------------------- e3
def test_same_config_other_weights_never_hit(e1: EngineRun, e3: EngineRun) -> None:
    assert [o["num_cached_tokens"] for o in e3.outputs("other_weights")] == [0, 0]
    assert e3.worker("other_weights")["loaded_chunks"] == 0
    ns1 = e1.scheduler("cold")["namespace"]
    ns3 = e3.scheduler("other_weights")["namespace"]
    assert ns1["model_name"] == ns3["model_name"] == "tiny"
    assert ns1["model_revision"] != ns3["model_revision"]


def test_fail_policy_is_served_from_tiers_that_can_pin(e1: EngineRun, e3: EngineRun) -> None:
    # Under vLLM's default policy a failed load fails the request: the connector offers
    # only chunks it holds until they are loaded. cpu and disk tiers both pin, so no
    # tier is left out (it would be named in a WARNING) and nothing is an ERROR.
    assert re.search(r"LMCacheCoreConnector scheduler side: .* policy=fail", e3.log)
    assert "cannot hold them until they are loaded" not in e3.log
    assert not re.search(r"ERROR .*LMCacheCoreConnector", e3.log)
    assert re.search(r"LMCacheCoreConnector scheduler side: .* policy=recompute", e1.log)


def test_metrics_equal_the_workers_counts_and_hits_are_host(e1: EngineRun) -> None:
    """vLLM's Prometheus series (in-process registry): the connector's hit tokens per
    tier equal the worker's own counters; vLLM's hit-source counter puts every
    connector hit (all from the cpu tier in this process) under ``host``."""
    m = e1.step("metrics")["metrics"]
    w = e1.worker("metrics")
    loaded = w["loaded_tokens_by_tier"]
    assert set(loaded) == {"cpu"} and loaded["cpu"] > 0
    assert _series(m, "vllm:lmcache_core_hit_tokens", tier="cpu") == loaded["cpu"]
    assert _series(m, "vllm:lmcache_core_hit_tokens") == loaded["cpu"]
    assert _series(m, "vllm:lmcache_core_load_bytes") == w["loaded_bytes"]
    # (a store completing after the last step is in the file, not yet on the series)
    assert 0 < _series(m, "vllm:lmcache_core_save_bytes") <= w["saved_bytes"]
    external = _series(m, "vllm:external_prefix_cache_hits")
    host = _series(m, "vllm:prompt_tokens_cached_by_source", source="host")
    assert host == external > 0
    assert _series(m, "vllm:prompt_tokens_cached_by_source", source="external_unspecified") == 0
    assert _series(m, "vllm:lmcache_core_tier_healthy", tier="disk") == 1
    assert _series(m, "vllm:lmcache_core_save_seconds") > 0  # histogram sum


def test_reset_connector_clears_the_cpu_tier_not_the_disk(e1: EngineRun) -> None:
    """``LLM.reset_prefix_cache(reset_connector=True)``: LONG was in the cpu tier; after
    the reset it loads from disk, with the same output."""
    assert e1.step("reset_connector")["ok"]
    _same(e1.outputs("cold")[0], e1.outputs("after_reset")[0])
    assert e1.outputs("after_reset")[0]["num_cached_tokens"] == 255
    before, after = e1.worker("metrics"), e1.worker("metrics_after_reset")
    assert after["resets"] == 1 and after["reset_removed_chunks"] > 0
    gained = {
        t: n - before["loaded_tokens_by_tier"].get(t, 0)
        for t, n in after["loaded_tokens_by_tier"].items()
    }
    assert gained == {"cpu": 0, "disk": 256}
    m0, m1 = e1.step("metrics")["metrics"], e1.step("metrics_after_reset")["metrics"]
    assert (
        _series(m1, "vllm:prompt_tokens_cached_by_source", source="disk")
        - _series(m0, "vllm:prompt_tokens_cached_by_source", source="disk")
        == 255
    )
    assert _series(m1, "vllm:lmcache_core_hit_tokens", tier="disk") == 256
    assert e1.scheduler("after_reset")["resets"] == 1


def test_kv_events_over_zmq(e2: EngineRun) -> None:
    """vLLM's ZMQ publisher carries the connector's events: a ``BlockStored`` (medium
    ``cpu``) with vLLM's block hashes for every chunk stored in the memory tier, and a
    ``BlockRemoved`` for the chunks the fillers evicted."""
    events = [e for e in e2.step("events")["events"] if e.get("medium") == "cpu"]
    stored = {}
    for e in events:
        if e["type"] == "BlockStored":
            stored[tuple(e["block_hashes"])] = e
    removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    per = c.CHUNK // c.BLOCK
    for tokens in (c.CPU_REUSE, c.EVICT, *c.FILLERS):
        hashes = _block_hashes(tokens)
        for ch in range(len(tokens) // c.CHUNK):
            ev = stored[tuple(hashes[ch * per : (ch + 1) * per])]
            assert ev["parent_block_hash"] == (hashes[ch * per - 1] if ch else None)
            assert ev["token_ids"] == tokens[ch * c.CHUNK : (ch + 1) * c.CHUNK]
            assert ev["block_size"] == c.BLOCK
    # EVICT's chunks left the 8-chunk memory tier when the 12 filler chunks came in
    assert set(_block_hashes(c.EVICT)) <= removed
    # every removed block was announced before
    assert removed <= {h for hs in stored for h in hs}
    assert "KV events off" not in e2.log


# ---------------------------------------------------------------------------------- e4
def test_tensor_parallel_2_metrics_count_tokens_once(e4: EngineRun) -> None:
    """Both ranks load every chunk (each its half of the heads): the hit tokens on
    vLLM's series equal one rank's count, the bytes both ranks' sum."""
    m = e4.step("metrics")["metrics"]
    r0, r1 = e4.worker("metrics", 0), e4.worker("metrics", 1)
    t0 = sum(r0["loaded_tokens_by_tier"].values())
    t1 = sum(r1["loaded_tokens_by_tier"].values())  # less: one chunk failed on rank 1
    assert t0 >= t1 > 0
    assert _series(m, "vllm:lmcache_core_hit_tokens") == t0  # not t0 + t1
    for tier, n in r0["loaded_tokens_by_tier"].items():
        assert _series(m, "vllm:lmcache_core_hit_tokens", tier=tier) == n
    assert _series(m, "vllm:lmcache_core_load_bytes") == sum(
        sum(r["loaded_bytes_by_tier"].values()) for r in (r0, r1)
    )
    assert _series(m, "vllm:lmcache_core_failed_loads") == e4.scheduler("metrics")["load_failures"]


def test_tensor_parallel_2(e4: EngineRun) -> None:
    cold, warm = e4.outputs("cold"), e4.outputs("warm")
    assert [o["num_cached_tokens"] for o in warm] == [255, 192]
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    sched = {int(p) for p in re.findall(r"scheduler side: pid=(\d+) world_size=2", e4.log)}
    ranks = dict(re.findall(r"worker side: pid=(\d+) rank=(\d)/2", e4.log))
    assert len(sched) == 1 and len(ranks) == 2 and set(ranks.values()) == {"0", "1"}
    assert not sched & {int(p) for p in ranks}
    for rank in (0, 1):
        w = e4.worker("warm", rank)
        assert w["world_size"] == 2 and w["loaded_tokens"] >= 255 + 192


def test_tensor_parallel_2_background_load_missing_on_one_rank(e4: EngineRun) -> None:
    assert e4.step("lose_rank1")["values"]["fail_keys"]
    _same(e4.outputs("q_cold")[0], e4.outputs("q_async")[0])
    before, after = e4.scheduler("lose_rank1"), e4.scheduler("q_async")
    assert after["async_loads"] - before["async_loads"] == 1
    assert after["load_failures"] - before["load_failures"] == 1  # counted once
    assert after["stale_hits"] - before["stale_hits"] == 1
    r0 = e4.worker("q_async", 0)["failed_chunks"] - e4.worker("lose_rank1", 0)["failed_chunks"]
    r1 = e4.worker("q_async", 1)["failed_chunks"] - e4.worker("lose_rank1", 1)["failed_chunks"]
    assert (r0, r1) == (0, 1)
