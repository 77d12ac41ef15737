"""Unit tests of the connector's parts: model identity, settings, request keys, the
scheduler's stored-chunk index and load/save planning, worker reports, the vLLM plugin.

Requests are real ``vllm.v1.request.Request`` objects; only the scheduler output of the
planning tests is a stand-in (a plain namespace with the fields the connector reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import requires_vllm

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.errors import ConfigError

pytestmark = [requires_vllm, pytest.mark.vllm]

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# ---------------------------------------------------------------------------- identity
def _model_dir(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_hub_snapshot_gives_repo_and_commit(tmp_path: Path) -> None:
    from lmcache_core.integrations.vllm.identity import model_identity

    snap = _model_dir(tmp_path / "models--org--name" / "snapshots" / COMMIT, b"w")
    ident = model_identity(str(snap))
    assert (ident.name, ident.revision, ident.source) == ("org/name", COMMIT, "hub-snapshot")


def test_local_dir_revision_is_weights_digest_not_path(tmp_path: Path) -> None:
    from lmcache_core.integrations.vllm.identity import model_identity

    a = model_identity(str(_model_dir(tmp_path / "x" / "tiny", b"weights-1")))
    b = model_identity(str(_model_dir(tmp_path / "y" / "tiny", b"weights-1")))
    c = model_identity(str(_model_dir(tmp_path / "z" / "tiny", b"weights-2")))
    assert a.name == b.name == c.name == "tiny"
    assert a.revision == b.revision != c.revision
    assert a.revision.startswith("sha256:") and str(tmp_path) not in a.revision


def test_weights_digest_is_cached_by_names_sizes_mtimes(tmp_path: Path) -> None:
    from lmcache_core.integrations.vllm.identity import SIDECAR_NAME, weights_digest

    d = _model_dir(tmp_path / "m", b"AAAA")
    first = weights_digest(d)
    assert json.loads((d / SIDECAR_NAME).read_text())["revision"] == first
    w = d / "model.safetensors"
    st = w.stat()
    w.write_bytes(b"BBBB")  # same name and size, mtime restored: the sidecar still matches
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(d) == first
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed mtime: rehashed
    assert weights_digest(d) != first


def test_overrides_and_unknown_revision(tmp_path: Path) -> None:
    from lmcache_core.integrations.vllm.identity import UnknownRevision, model_identity

    d = _model_dir(tmp_path / "m", b"w")
    ident = model_identity(str(d), served_name="served", revision_override="v7")
    assert (ident.name, ident.revision, ident.source) == ("served", "v7", "config")
    assert model_identity(str(d), name_override="n").name == "n"
    assert model_identity("org/absent-model", revision=COMMIT).revision == COMMIT
    with pytest.raises(UnknownRevision, match="model_revision"):
        model_identity("org/absent-model-xyz")


# ---------------------------------------------------------------------------- settings
def test_settings_inline_file_and_errors(tmp_path: Path) -> None:
    from lmcache_core.integrations.vllm.settings import DEFAULT_STORAGE_CONFIG, parse_settings

    s = parse_settings({"config": {"chunk_size": 128}, "model_revision": "r1"})
    assert s.storage == {"chunk_size": 128} and s.options.model_revision == "r1"
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 512\ntiers: [{name: cpu, backend: cpu}]\n")
    assert parse_settings({"config_file": str(f)}).storage["chunk_size"] == 512
    assert parse_settings(None).storage == DEFAULT_STORAGE_CONFIG
    with pytest.raises(ConfigError, match="not both"):
        parse_settings({"config": {}, "config_file": str(f)})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.*bogus"):
        parse_settings({"bogus": 1})
    with pytest.raises(ConfigError, match="config_file"):
        parse_settings({"config_file": str(tmp_path / "missing.yaml")})


# ---------------------------------------------------------------------------- keys
def _db(chunk: int = 4) -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(namespace=Namespace(model_name="m", chunk_size=chunk))


def _request(tokens: list[int] | None, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r", tokens, SamplingParams(max_tokens=1), None, **kw)


def _hashes(req: Any, keyer: Any = None) -> tuple[int, ...]:
    from lmcache_core.integrations.vllm.keying import RequestKeyer

    keyer = keyer or RequestKeyer(_db(), block_size=2)
    keys = keyer.keys(req)
    assert keys.reason is None
    return keys.hashes


def test_tokens_and_salt_key_the_chain() -> None:
    toks = list(range(10, 22))  # 3 chunks of 4
    plain = _hashes(_request(toks))
    assert len(plain) == 3
    assert _hashes(_request(toks)) == plain
    a, b = _hashes(_request(toks, cache_salt="a")), _hashes(_request(toks, cache_salt="b"))
    assert len({plain[0], a[0], b[0]}) == 3
    assert not set(a) & set(plain) and not set(a) & set(b)  # the salt reaches every chunk
    assert _hashes(_request(toks[:3])) == ()  # shorter than a chunk


def test_multimodal_items_key_the_chunks_they_overlap() -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    toks = list(range(10, 22))

    def feat(ident: str) -> Any:
        return MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=5, length=2),
        )

    plain = _hashes(_request(toks))
    img1 = _hashes(_request(toks, mm_features=[feat("img-1")]))
    img2 = _hashes(_request(toks, mm_features=[feat("img-2")]))
    assert img1[0] == plain[0]  # the image sits in chunk 1
    assert img1[1] != plain[1] and img1[1] != img2[1]


def _adapter(path: Path, weights: bytes, alpha: int = 16) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": alpha}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_lora_and_prompt_embeds(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from lmcache_core.integrations.vllm.keying import RequestKeyer

    toks = list(range(10, 18))
    a = _adapter(tmp_path / "lora-a", b"adapter-a")
    b = _adapter(tmp_path / "lora-b", b"adapter-b")
    plain = _hashes(_request(toks))
    la = _hashes(_request(toks, lora_request=LoRARequest("ad", 1, str(a))))
    lb = _hashes(_request(toks, lora_request=LoRARequest("ad", 1, str(b))))
    assert len({plain[0], la[0], lb[0]}) == 3  # same name, other weights: other keys

    keyer = RequestKeyer(_db(), block_size=2)
    refused = keyer.keys(
        _request(toks, lora_request=LoRARequest("remote", 2, str(tmp_path / "not-here")))
    )
    assert refused.hashes == () and "LoRA" in (refused.reason or "")
    assert sum(keyer.unkeyable.values()) == 1

    emb = torch.randn(8, 16)
    e1 = _hashes(_request(None, prompt_embeds=emb))
    e2 = _hashes(_request(None, prompt_embeds=emb.clone()))
    emb2 = emb.clone()
    emb2[6, 0] += 1.0
    e3 = _hashes(_request(None, prompt_embeds=emb2))
    assert e1 == e2 and e1[0] == e3[0] and e1[1] != e3[1]
    mixed = keyer.keys(
        _request(toks, prompt_embeds=emb, prompt_is_token_ids=[True] * 4 + [False] * 4)
    )
    assert mixed.hashes == ()


def test_lora_adapter_is_its_name_and_files_not_the_servers_integer_id(tmp_path: Path) -> None:
    """Issue 14: two servers that loaded the same adapters in another order give them
    other integer ids; the keys must not change with it."""
    from vllm.lora.request import LoRARequest

    toks = list(range(10, 18))
    a = _adapter(tmp_path / "lora-a", b"adapter-a")

    def lora(name: str, int_id: int, path: Path) -> tuple[int, ...]:
        return _hashes(_request(toks, lora_request=LoRARequest(name, int_id, str(path))))

    first = lora("a", 1, a)
    assert lora("a", 2, a) == lora("a", 7, a) == first  # the integer id is not identity
    copy = _adapter(tmp_path / "elsewhere" / "copy", b"adapter-a")
    assert lora("a", 3, copy) == first  # the files are, wherever they are
    assert lora("other-name", 1, a) != first  # and the name
    other_alpha = _adapter(tmp_path / "lora-a-alpha", b"adapter-a", alpha=32)
    assert lora("a", 1, other_alpha) != first  # adapter_config.json is hashed with them
    # Known answer: ("lora", name, revision) in the first chunk's extra keys, with the
    # namespace of ``_db`` (changing it breaks every stored LoRA chunk).
    assert f"{first[0]:032x}" == KNOWN_LORA_FIRST_CHUNK


KNOWN_LORA_FIRST_CHUNK = "f5af10afe7d84c2d758533678d73d441"


def test_adapter_files_replaced_and_registered_under_a_new_id_get_new_keys(
    tmp_path: Path,
) -> None:
    """One keyer (as in a running server): replacing an adapter's files at the same path
    and registering it again (vLLM loads files once per integer id) must not reuse the
    old files' revision, or chunks computed with the new weights would be stored under
    the old adapter's keys."""
    from vllm.lora.request import LoRARequest

    from lmcache_core.integrations.vllm.keying import RequestKeyer

    keyer = RequestKeyer(_db(), block_size=2)
    toks = list(range(10, 18))
    path = _adapter(tmp_path / "lora", b"weights-v1")

    def lora(int_id: int) -> tuple[int, ...]:
        req = _request(toks, lora_request=LoRARequest("ad", int_id, str(path)))
        return _hashes(req, keyer)

    old = lora(1)
    (path / "adapter_model.safetensors").write_bytes(b"weights-v2, another length")
    assert lora(2) != old  # registered again: the new files' revision
    assert lora(1) == old  # the id vLLM loaded the first files under keeps their keys


def test_lora_adapter_given_as_a_hub_id_is_resolved_offline_like_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants
    from vllm.lora.request import LoRARequest

    from lmcache_core.integrations.vllm.identity import adapter_revision
    from lmcache_core.integrations.vllm.keying import RequestKeyer

    cache = tmp_path / "hub"
    repo = cache / "models--org--adapter"
    _adapter(repo / "snapshots" / COMMIT, b"adapter-a")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert adapter_revision("org/adapter") == COMMIT
    assert adapter_revision(str(repo / "snapshots" / COMMIT)) == COMMIT
    toks = list(range(10, 18))
    by_id = _hashes(_request(toks, lora_request=LoRARequest("a", 1, "org/adapter")))
    by_path = _request(toks, lora_request=LoRARequest("a", 2, str(repo / "snapshots" / COMMIT)))
    assert _hashes(by_path) == by_id

    # Not downloaded yet (vLLM's worker fetches it): refused, and looked for again later.
    keyer = RequestKeyer(_db(), block_size=2)
    absent = _request(toks, lora_request=LoRARequest("b", 1, "org/later"))
    assert keyer.keys(absent).hashes == ()
    later = cache / "models--org--later"
    _adapter(later / "snapshots" / COMMIT, b"adapter-b")
    (later / "refs").mkdir()
    (later / "refs" / "main").write_text(COMMIT)
    assert keyer.keys(absent).hashes == ()  # within ADAPTER_RETRY_S: not looked up again
    monkeypatch.setattr("lmcache_core.integrations.vllm.keying.ADAPTER_RETRY_S", 0.0)
    assert len(keyer.keys(absent).hashes) == 2


def test_lora_with_vllm_block_hashes_adds_the_adapters_files(tmp_path: Path) -> None:
    """vLLM's block hashes hold an adapter's name and path: the same path with other
    files (another machine, a replaced adapter) must not share keys."""
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from lmcache_core.integrations.vllm.keying import RequestKeyer

    init_none_hash(sha256)
    hasher = get_request_block_hasher(2, sha256)
    keyer = RequestKeyer(_db(), block_size=2, vllm_block_hashes=True)
    toks = list(range(10, 18))
    path = tmp_path / "adapter"

    def keys(int_id: int) -> tuple[int, ...]:
        req = _request(toks, block_hasher=hasher, lora_request=LoRARequest("a", int_id, str(path)))
        return _hashes(req, RequestKeyer(_db(), block_size=2, vllm_block_hashes=True))

    _adapter(path, b"v1")
    v1 = keys(1)
    assert keys(5) == v1
    _adapter(path, b"v2-other-size")
    v2 = keys(1)
    assert not set(v1) & set(v2)
    assert not set(v1) & set(_hashes(_request(toks, block_hasher=hasher), keyer))


def test_quantization_enters_the_namespace(tmp_path: Path) -> None:
    """Online ``--quantization`` (vLLM's ``model_config.quantization``) changes what the
    weights compute: another namespace, so another hash chain."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from lmcache_core.integrations.vllm.context import build_context

    model = _model_dir(tmp_path / "m", b"weights")

    def namespace(**model_kw: Any) -> Any:
        spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
        kv_cfg = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])],
            kv_cache_layout="LBHNC",
            hash_block_size=4,
        )
        vc = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config={
                    "config": {"chunk_size": 4, "tiers": [{"name": "cpu", "backend": "cpu"}]}
                },
                kv_load_failure_policy="recompute",
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            device_config=SimpleNamespace(device_type="cpu"),
            cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
            model_config=SimpleNamespace(model=str(model), revision=None, **model_kw),
        )
        ctx = build_context(vc, kv_cfg)
        assert ctx.disabled is None, ctx.disabled
        return ctx.namespace

    plain = namespace()
    fp8 = namespace(quantization="fp8")
    assert dict(fp8.extra)["quantization"] == "fp8" and "quantization" not in dict(plain.extra)
    assert fp8.digest() != plain.digest()
    by_hand = namespace(quantization="fp8", quantization_config={"linear": {"scheme": "x"}})
    assert by_hand.digest() != fp8.digest()


def test_vllm_block_hashes_only_when_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_core.integrations.vllm.keying import vllm_hash_reproducible

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm_hash_reproducible("sha256")[0]
    ok, why = vllm_hash_reproducible("xxhash")
    assert not ok and "PYTHONHASHSEED" in why
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_hash_reproducible("xxhash")[0]


# ---------------------------------------------------------------------------- scheduler
def test_stored_index_masks_and_lru() -> None:
    from lmcache_core.integrations.vllm.scheduler_side import StoredIndex

    idx = StoredIndex(max_chunks=3)
    idx.add(0, [1, 2])
    idx.add(1, [2])
    assert idx.mask(1) == 0b01 and idx.mask(2) == 0b11
    idx.discard(0, [2])
    assert idx.mask(2) == 0b10
    idx.add(0, [3, 4])
    assert len(idx) == 3 and idx.mask(1) == 0  # 1 was the least recently added


def test_worker_reports_aggregate_over_ranks() -> None:
    from lmcache_core.integrations.vllm.metadata import WorkerReport

    a = WorkerReport(step=3, stored={0: [1, 2]}, failed_loads={"r": 3}, async_failed={"q": [2]})
    b = WorkerReport(
        step=3,
        stored={1: [1]},
        missing={1: [2]},
        failed_loads={"r": 1},
        async_failed={"q": [0, 2]},
        dropped_saves={"s": 4},
        disabled={1: "x"},
    )
    m = a.aggregate(b)
    assert isinstance(m, WorkerReport)
    assert m.step == 3 and m.stored == {0: [1, 2], 1: [1]} and m.missing == {1: [2]}
    assert m.failed_loads == {"r": 1} and m.disabled == {1: "x"}
    assert m.async_failed == {"q": [0, 2]} and m.dropped_saves == {"s": 4}
    assert a.stored == {0: [1, 2]}  # inputs untouched
    assert WorkerReport().is_empty() and not WorkerReport(step=0).is_empty()


def _scheduler(
    chunk: int = 128,
    block: int = 32,
    world_size: int = 1,
    policy: str = "recompute",
    config: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    from lmcache_core.integrations.vllm.context import ConnectorContext
    from lmcache_core.integrations.vllm.layout import LayoutInfo
    from lmcache_core.integrations.vllm.scheduler_side import SchedulerSide
    from lmcache_core.integrations.vllm.settings import parse_settings
    from lmcache_core.integrations.vllm.storage import load_storage_config

    settings = parse_settings(
        {"config": {"chunk_size": chunk, **(config or {})}, **(options or {})}
    )
    ns = Namespace(model_name="m", chunk_size=chunk, block_size=block)
    ctx = ConnectorContext(
        settings=settings,
        storage_config=load_storage_config(settings.storage),
        world_size=world_size,
        failure_policy=policy,
        layout=LayoutInfo("cpu", "LBHNC", block, 2, 32, 32, "float32", "auto", ("l0",)),
        namespace=ns,
        db=ChunkedTokenDatabase(namespace=ns, world_size=world_size),
        block_size=block,
    )
    return SchedulerSide(ctx)


def _blocks(ids: list[int]) -> Any:
    """Stand-in for vLLM's KVCacheBlocks (the connector only reads the block ids)."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _output(req_id: str, computed: int, scheduled: int, blocks: list[int]) -> Any:
    new = SimpleNamespace(req_id=req_id, num_computed_tokens=computed, block_ids=(blocks,))
    cached = SimpleNamespace(
        req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set()
    )
    state = SimpleNamespace(get_block_ids=lambda rid: (blocks,) if rid == req_id else None)
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: scheduled},
        kv_connector_block_state=state,
        preempted_req_ids=set(),
    )


def test_plan_partial_local_hit_then_saves_and_a_failed_load() -> None:
    from lmcache_core.integrations.vllm.metadata import WorkerReport

    sched = _scheduler()
    toks = list(range(4, 4 + 400))  # 3 chunks of 128 + 16
    req = _request(toks)
    hashes = sched.keyer.keys(req).hashes
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=WorkerReport(step=0, stored={0: list(hashes[:2])}))
    )
    # vLLM's own prefix cache holds 2 blocks (64 tokens); 2 chunks (256) are in memory.
    n, is_async = sched.get_num_new_matched_tokens(req, 64)
    assert (n, is_async) == (256 - 64, False)
    blocks = list(range(100, 113))
    sched.update_state_after_alloc(req, _blocks(blocks), n)
    meta = sched.build_meta(_output("r", 256, 144, blocks))
    loads = [(ld.chunk_index, ld.skip, ld.block_ids) for ld in meta.loads]
    assert loads == [(0, 2, [102, 103]), (1, 0, [104, 105, 106, 107])]
    # The rest of the prompt is computed this step: chunk 2 is saved, not the 16-token
    # tail; its computation read the blocks loaded this step, whose outcome is unknown.
    assert [(sv.chunk_index, sv.block_ids) for sv in meta.saves] == [(2, [108, 109, 110, 111])]
    assert sorted(meta.saves[0].reads) == list(range(102, 108))
    # Chunk 1 failed to load: everything computed over it is poisoned, the save
    # progress goes back to chunk 1, and nothing is saved until it is recomputed.
    sched.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=WorkerReport(
                step=meta.step, failed_loads={"r": 1}, missing={0: [hashes[1]]}
            ),
            invalid_block_ids={104, 105, 106, 107},
        )
    )
    assert sched.taint.poisoned.keys() >= {104, 108, 111}
    # vLLM recomputes from block 4 (token 128) to the end: the rewrite cleans the
    # blocks, so chunks 1 and 2 are saved again, from clean data.
    again = sched.build_meta(_output("r", 128, 272, blocks))
    assert again.acked == meta.step
    assert [sv.chunk_index for sv in again.saves] == [1, 2]
    assert all(sv.reads == [] for sv in again.saves)
    assert list(sched.taint.poisoned.items()) == [(112, 16)]  # the 16-token tail, rewritten


def test_full_hit_leaves_the_last_token_and_needs_every_rank() -> None:
    from lmcache_core.integrations.vllm.metadata import WorkerReport

    sched = _scheduler(world_size=2)
    req = _request(list(range(4, 4 + 256)))
    hashes = list(sched.keyer.keys(req).hashes)
    report = WorkerReport(step=0, stored={0: hashes})
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # rank 1 has nothing
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=WorkerReport(step=0, stored={1: hashes}))
    )
    assert sched.get_num_new_matched_tokens(req, 0) == (255, False)
    sched.update_state_after_alloc(req, _blocks(list(range(8))), 255)
    meta = sched.build_meta(_output("r", 255, 1, list(range(8))))
    assert [(ld.chunk_index, ld.block_ids) for ld in meta.loads] == [
        (0, [0, 1, 2, 3]),
        (1, [4, 5, 6, 7]),
    ]
    assert meta.saves == []  # already stored
    assert sched.request_finished(req, (list(range(8)),)) is False  # one KV-cache group
    assert sched.stats()["active_requests"] == 0


def test_saves_of_one_chunk_are_deduplicated_within_a_step() -> None:
    sched = _scheduler()
    a, b = _request(list(range(4, 4 + 130))), _request(list(range(4, 4 + 130)))
    b.request_id = "s"
    for r in (a, b):
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    out = _output("r", 0, 130, list(range(5)))
    out.kv_connector_block_state = None
    out.scheduled_new_reqs.append(
        SimpleNamespace(req_id="s", num_computed_tokens=0, block_ids=([9, 8, 7, 6, 5],))
    )
    out.num_scheduled_tokens["s"] = 130
    out.kv_connector_block_state = None
    meta = sched.build_meta(out)
    assert [(sv.req_id, sv.chunk_index) for sv in meta.saves] == [("r", 0)]


# ---------------------------------------------------------------------------- plugin
def test_plugin_registers_the_name_once_and_lazily() -> None:
    code = (
        "import sys\n"
        "from lmcache_core.integrations.vllm import plugin\n"
        "plugin.register(); plugin.register()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "heavy = [m for m in ('lmcache_core.integrations.vllm.connector', 'lmcache_core.hierarchy.tiered',"
        " 'lmcache_backend_disk') if m in sys.modules]\n"
        "from lmcache_core.plugins import registry\n"
        "print(heavy, registry._registry is None)\n"
        "cls = KVConnectorFactory.get_connector_class_by_name('LMCacheCoreConnector')\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "[] True"  # nothing heavy imported, no lmcache plugin loaded
    assert lines[-1] == "lmcache_core.integrations.vllm.connector LMCacheCoreConnector"


def test_keys_from_vllm_block_hashes() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from lmcache_core.integrations.vllm.keying import RequestKeyer

    init_none_hash(sha256)
    hasher = get_request_block_hasher(2, sha256)
    keyer = RequestKeyer(_db(), block_size=2, vllm_block_hashes=True)
    toks = list(range(10, 22))

    def keys(**kw: Any) -> tuple[int, ...]:
        return _hashes(_request(toks, block_hasher=hasher, **kw), keyer)

    plain = keys()
    assert len(plain) == 3 and keys() == plain
    assert plain != _hashes(_request(toks))  # another chain than the token hashes
    salted = keys(cache_salt="s")
    assert not set(salted) & set(plain)  # vLLM's hashes carry the salt
    refused = keyer.keys(_request(toks))  # no block hasher: vLLM computed no hashes
    assert refused.hashes == () and "block hashes" in (refused.reason or "")


def test_a_failing_shared_tier_lookup_is_a_miss() -> None:
    import concurrent.futures

    from lmcache_core.integrations.vllm.lookups import ViewLookups

    sched = _scheduler()

    class Broken:
        def lookup_ranks(self, keys: Any, lease_s: Any) -> Any:
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            fut.set_exception(TimeoutError("tier hung"))
            return fut

        def release_soon(self, keys: Any) -> None:
            pass

    sched.lookups = ViewLookups(Broken(), deadline_s=1.0, lease_s=10.0, reuse_s=5.0)  # type: ignore[arg-type]
    req = _request(list(range(4, 4 + 300)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats()["lookup_errors"] == 1


def test_the_first_poll_waits_briefly_for_a_running_lookup_and_only_once() -> None:
    """A lookup that finishes within ``first_wait_s`` answers vLLM's first question (no
    empty scheduler steps while the IO thread waits for the GIL); a slower one answers
    "not yet" after that bound, and later polls of the request do not wait again."""
    import concurrent.futures
    import threading
    import time

    from lmcache_core.hierarchy.tiered import PrefixLookup
    from lmcache_core.integrations.vllm.lookups import ViewLookups

    class Delayed:
        def __init__(self, delay_s: float) -> None:
            self.delay_s = delay_s

        def lookup_ranks(self, keys: Any, lease_s: Any) -> Any:
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            res = [PrefixLookup(1, (0,), ("cpu",), pinned=(False,)) for _ in keys]
            threading.Timer(self.delay_s, fut.set_result, (res,)).start()
            return fut

        def release_soon(self, keys: Any) -> None:
            pass

    keys = [[object(), object()]]
    fast = ViewLookups(Delayed(0.002), deadline_s=5.0, lease_s=10.0, reuse_s=5.0, first_wait_s=0.5)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    res = fast.poll("r", [0], keys)  # type: ignore[arg-type]
    assert res is not None and res.found == [1]
    assert time.perf_counter() - t0 < 0.4  # woken by the lookup, not by the bound
    slow = ViewLookups(Delayed(1.0), deadline_s=5.0, lease_s=10.0, reuse_s=5.0, first_wait_s=0.05)  # type: ignore[arg-type]
    slow.prefetch("q", [0], keys)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    assert slow.poll("q", [0], keys) is None  # type: ignore[arg-type]
    assert time.perf_counter() - t0 >= 0.04  # waited its bound once
    t1 = time.perf_counter()
    for _ in range(5):
        assert slow.poll("q", [0], keys) is None  # type: ignore[arg-type]
    assert time.perf_counter() - t1 < 0.04  # and never again
    off = ViewLookups(Delayed(1.0), deadline_s=5.0, lease_s=10.0, reuse_s=5.0, first_wait_s=0)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    assert off.poll("s", [0], keys) is None  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 0.04


@pytest.mark.parametrize(
    ("options", "first_wait_s"),
    [({}, 0.005), ({"lookup_first_wait_ms": 0.5}, 0.0005), ({"lookup_first_wait_ms": 0}, 0.0),
     ({"lookup_first_wait_ms": 50, "lookup_deadline_ms": 2}, 0.002)],
)  # fmt: skip
def test_the_first_poll_wait_is_a_connector_option(
    tmp_path: Path, options: dict[str, Any], first_wait_s: float
) -> None:
    """``lookup_first_wait_ms`` reaches the shared-tier lookups (5 ms by default, never
    beyond the lookup deadline); a negative value is refused with the option's name."""
    from lmcache_core.integrations.vllm.settings import parse_settings

    tiers = {"tiers": [{"name": "cpu", "backend": "cpu"},
                       {"name": "disk", "backend": "disk", "options": {"path": str(tmp_path)}}]}  # fmt: skip
    sched = _scheduler(config=tiers, options=options)
    try:
        assert sched.lookups is not None
        assert sched.lookups.first_wait_s == pytest.approx(first_wait_s)
    finally:
        sched.close()
    with pytest.raises(ValueError, match="lookup_first_wait_ms"):
        parse_settings({"lookup_first_wait_ms": -1})


@pytest.mark.parametrize("exchange", [True, False])
def test_stats_file_is_replaced_whole_and_leaves_no_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    from lmcache_core.integrations.vllm import stats_file

    if not exchange:  # systems or filesystems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(stats_file, "_renameat2", None)
    elif stats_file._renameat2 is None:
        pytest.skip("renameat2 is not available on this system")
    d = str(tmp_path / "stats")
    for i in range(5):
        stats_file.write_stats(d, "worker0.json", {"role": "worker", "i": i, "pad": "x" * i})
        docs = stats_file.read_stats(d)
        assert [(doc["role"], doc["i"], doc["file"]) for doc in docs] == [
            ("worker", i, "worker0.json")
        ]
        assert sorted(os.listdir(d)) == ["worker0.json"]  # the previous document is gone
    assert os.stat(os.path.join(d, "worker0.json")).st_mode & 0o077 == 0


def test_buffer_count_charges_pinned_buffers_what_the_allocator_keeps() -> None:
    from lmcache_core.integrations.vllm.staging import buffer_count

    mib = 1 << 20
    assert buffer_count(64 * mib, 4 * mib, pinned=False) == 16
    assert buffer_count(64 * mib, 4 * mib, pinned=True) == 16  # a power of two already
    assert buffer_count(80 * mib, 5 * mib, pinned=False) == 16
    assert buffer_count(80 * mib, 5 * mib, pinned=True) == 10  # 8 MiB each
    assert buffer_count(1 * mib, 5 * mib, pinned=True) == 4  # never fewer than 4
