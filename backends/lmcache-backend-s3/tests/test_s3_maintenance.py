"""Capacity across hosts and lookups on the s3 tier: ``lmcache-core gc``/``verify`` on a
bucket (oldest first, by namespace, by age, with progress), and prefix lookups that cost
at most ceil(log2 n) + 1 requests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import torch
from lmcache_backend_s3 import S3Backend
from lmcache_backend_s3.s3server import LocalS3

from lmcache_core import TieredHierarchy
from lmcache_core.blob import namespace_dir
from lmcache_core.cli.maint import GcRules, gc_tier
from lmcache_core.keys import Namespace
from lmcache_core.testing import make_key, random_tensor, run_async

NS_A = Namespace(model_name="gc-a", chunk_size=64)
NS_B = Namespace(model_name="gc-b", chunk_size=64)
CHUNK = 64 * 1024


async def _fill(s3: LocalS3, prefix: str, ns: Namespace, n: int, tag: str) -> list[str]:
    b = S3Backend(s3.options(prefix), namespace=ns)
    await b.start()
    keys = [make_key(f"{tag}{i}") for i in range(n)]
    await b.batched_put(keys, [random_tensor((CHUNK,), torch.uint8, seed=i) for i in range(n)])
    names = [b.object_name(k) for k in keys]
    await b.close()
    return names


def _cli(s3: LocalS3, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID=s3.access_key_id,
        AWS_SECRET_ACCESS_KEY=s3.secret_access_key,
        AWS_DEFAULT_REGION=s3.region,
    )
    return subprocess.run(
        [sys.executable, "-m", "lmcache_core.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _remaining(s3: LocalS3, prefix: str) -> set[str]:
    resp = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/")  # type: ignore[attr-defined]
    return {o["Key"][len(prefix) + 1 :] for o in resp.get("Contents", [])}


def test_gc_cli_by_url_trims_oldest_first_and_purges_a_namespace(s3: LocalS3, prefix: str) -> None:
    old = run_async(_fill(s3, prefix, NS_A, 4, "old"))
    time.sleep(1.2)  # S3 times have one-second resolution
    new = run_async(_fill(s3, prefix, NS_A, 2, "new"))
    other = run_async(_fill(s3, prefix, NS_B, 2, "other"))
    url = f"s3://{s3.bucket}/{prefix}"
    target = ["--url", url, "--option", f"endpoint_url={s3.endpoint_url}"]

    res = _cli(s3, "gc", *target, "--namespace", namespace_dir(NS_B), "--json")
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["gc"]
    assert row["purged"]["entries"] == 2
    assert not set(other) & _remaining(s3, prefix)

    size = CHUNK + 4096
    res = _cli(s3, "gc", *target, "--max-bytes", str(3 * size), "--progress", "--json")
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["gc"]
    assert row["trimmed"]["entries"] == 3 and row["remaining"]["entries"] == 3
    left = _remaining(s3, prefix)
    assert set(new) <= left, "gc deleted a newer object before the older ones"
    assert len(set(old) & left) == 1
    assert f"gc {url} [###" in res.stderr  # the progress bar

    res = _cli(s3, "verify", *target, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verify"][0]["checked"] == 3


def test_gc_older_than_deletes_by_write_time(s3: LocalS3, prefix: str) -> None:
    old = run_async(_fill(s3, prefix, NS_A, 3, "age-old"))
    time.sleep(3.0)
    new = run_async(_fill(s3, prefix, NS_A, 2, "age-new"))

    async def body() -> dict[str, Any]:
        b = S3Backend(s3.options(prefix))
        await b.start()
        try:
            return await gc_tier(b, GcRules(older_than_s=2.0))
        finally:
            await b.close()

    report = run_async(body())
    assert report["expired"]["entries"] == 3
    left = _remaining(s3, prefix)
    assert set(new) <= left and not set(old) & left


def test_hierarchy_prefix_lookup_requests_are_logarithmic(s3: LocalS3, prefix: str) -> None:
    async def body() -> None:
        cfg = {
            "tiers": [
                {
                    "name": "remote",
                    "backend": f"s3://{s3.bucket}/{prefix}",
                    "options": {k: v for k, v in s3.options(prefix).items() if k != "url"},
                }
            ]
        }
        h = TieredHierarchy.from_config(cfg, namespace=NS_A)
        await h.start()
        try:
            n = 64
            keys = [make_key(f"pl{i}") for i in range(n)]
            await h.batched_put(keys[:37], [random_tensor((256,), seed=i) for i in range(37)])
            backend = h.tiers[0].backend
            backend._presence = type(backend._presence)(0.0, 0.0)  # no cache: count requests
            before = backend.stats()["requests"]["head"]
            assert (await h.lookup_prefix(keys)).num_hit == 37
            used = backend.stats()["requests"]["head"] - before
            assert used <= math.ceil(math.log2(n)) + 1 == 7
            assert h.stats()["tiers"][0]["backend_stats"]["prefix_lookup_requests_max"] == used
        finally:
            await h.close()

    run_async(body())
