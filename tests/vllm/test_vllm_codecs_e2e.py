"""Tier codecs end to end on real vLLM (CPU build), float32 model: two engine processes.

* ``lossless``: a disk-only storage whose tier has the ``lossless`` codec. The warm run
  loads every prefix chunk from disk through the codec; its tokens are identical to the
  cold run's, which computed everything (no codec), and its logprobs agree to 1e-4.
* ``lossy``: the same with ``int8`` on the disk tier, in the **same directory**: the
  lossy namespace never sees the lossless engine's chunks (the first run is a miss), then
  its own chunks load (decoded) and the engine generates on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm_cases as c
from conftest import EngineRun, Models, connector_config, engine_env, requires_vllm, run_engine

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def _spec(model: Path, disk: Path, stats: Path, codec: str) -> dict[str, Any]:
    storage = {
        "chunk_size": c.CHUNK,
        "tiers": [
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(disk), "max_bytes": "256MiB"},
                "codec": codec,
            }
        ],
    }
    return {
        "engine": {
            "model": str(model),
            "dtype": "float32",
            "block_size": c.BLOCK,
            "max_model_len": 1024,
            "max_num_batched_tokens": 96,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "seed": 0,
            "kv_transfer_config": connector_config(storage, stats),
        },
        "steps": [
            {"op": "generate", "name": "cold", "prompts": [{"tokens": c.LONG}, {"tokens": c.MID}]},
            {"op": "generate", "name": "warm", "prompts": [{"tokens": c.LONG}, {"tokens": c.MID}]},
        ],
        "stats_dir": str(stats),
        "disk_dir": str(disk),
    }


@pytest.fixture(scope="module")
def runs(vllm_models: Models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, EngineRun]:
    work = tmp_path_factory.mktemp("codecs-e2e")
    disk = work / "disk"
    out = {}
    for codec in ("lossless", "int8"):
        spec = _spec(vllm_models.main, disk, work / f"stats-{codec}", codec)
        out[codec] = run_engine(work, codec, spec, engine_env(multiprocessing=False))
        out[codec].results["disk_dir"] = str(disk)
    return out


def _hits(run: EngineRun, step: str) -> list[int]:
    return [o["num_cached_tokens"] for o in run.outputs(step)]


def test_lossless_codec_outputs_identical_to_no_codec(runs: dict[str, EngineRun]) -> None:
    run = runs["lossless"]
    assert _hits(run, "cold") == [0, 0]
    assert _hits(run, "warm") == [c.expected_hit(len(c.LONG)), c.expected_hit(len(c.MID))]
    for a, b in zip(run.outputs("cold"), run.outputs("warm"), strict=True):
        assert a["tokens"] == b["tokens"]
        # bit-exact KV; vLLM's prefill with a loaded prefix rounds a little differently
        # from a full prefill (as without a codec: test_vllm_e2e allows 1e-3)
        for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
            assert abs(x - y) <= 1e-4
    w = run.worker("warm")
    assert w["failed_chunks"] == 0


def test_lossy_disk_tier_works_and_is_isolated(runs: dict[str, EngineRun]) -> None:
    run = runs["int8"]
    # the same directory holds the lossless engine's chunks: int8's namespace is another
    assert _hits(run, "cold") == [0, 0]
    assert _hits(run, "warm") == [c.expected_hit(len(c.LONG)), c.expected_hit(len(c.MID))]
    for a, b in zip(run.outputs("cold"), run.outputs("warm"), strict=True):
        assert len(b["tokens"]) == len(a["tokens"]) == c.MAX_TOKENS
        # int8 KV moves logprobs a little, not a lot (the tiny model's margins hold)
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 0.5
    assert run.worker("warm")["failed_chunks"] == 0
    disk = Path(run.results["disk_dir"])
    assert len([p for p in disk.iterdir() if p.name.startswith(("ns-", "ns2-"))]) == 2
