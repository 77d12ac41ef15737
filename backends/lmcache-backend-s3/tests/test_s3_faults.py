"""Faults of the s3 tier inside a hierarchy, against the real local S3 server.

The server paused (SIGSTOP) and a proxy resetting every connection: loads and lookups are
misses within their deadlines and nothing raises into the hierarchy; once the server is
back, the tier serves the same objects again. A corrupted object is a miss, counted and
deleted. Wrong credentials, a missing bucket or an unreachable endpoint: one clear error
at start() naming the tier and the cause, never a secret.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch
from lmcache_backend_s3 import S3Backend
from lmcache_backend_s3.s3server import LocalS3
from tcp_proxy import DroppingProxy

from lmcache_core import TieredHierarchy
from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError
from lmcache_core.keys import Namespace
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits

NS = Namespace(model_name="s3-faults", chunk_size=64)
DEADLINE_MS = 400
T = TypeVar("T")


def _hierarchy(options: dict[str, Any]) -> TieredHierarchy:
    cfg = {
        "tiers": [
            {
                "name": "remote",
                "backend": "s3",
                "options": {
                    "read_timeout_s": 1.0,
                    "connect_timeout_s": 0.5,
                    "retries": 0,
                    "lookup_cache_s": 0,
                    "negative_cache_s": 0,
                    **options,
                },
                "load_deadline_ms": DEADLINE_MS,
                "lookup_deadline_ms": DEADLINE_MS,
                "retry_backoff_ms": 100,
                "retry_backoff_max_ms": 400,
            }
        ]
    }
    return TieredHierarchy.from_config(cfg, namespace=NS)


async def _timed(coro: Awaitable[T]) -> tuple[T, float]:
    t0 = time.monotonic()
    res = await coro
    return res, time.monotonic() - t0


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the tier was not used again after the fault ended")


async def _outage_then_recovery(
    h: TieredHierarchy, start_fault: Callable[[], None], end_fault: Callable[[], None]
) -> None:
    keys = [make_key(f"f{i}") for i in range(4)]
    vals = [random_tensor((64 * 1024,), torch.float16, seed=i) for i in range(4)]
    assert all(await h.batched_put(keys, vals))
    assert (await h.lookup_prefix(keys)).num_hit == 4
    limit = DEADLINE_MS / 1000 + 0.6  # the deadline plus scheduling slack on a busy machine
    start_fault()
    try:
        for _ in range(3):
            out = torch.empty_like(vals[0])
            hit, took = await _timed(h.get_into(keys[0], out))
            assert hit is False and took < limit, (hit, took)
            hits, took = await _timed(h.batched_get_into(keys, [torch.empty_like(v) for v in vals]))
            assert hits == [False] * 4 and took < limit, (hits, took)
            found, took = await _timed(h.lookup_prefix(keys))
            assert found.num_hit == 0 and took < limit, (found, took)
    finally:
        end_fault()

    async def served() -> bool:
        outs = [torch.empty_like(v) for v in vals]
        hits = await h.batched_get_into(keys, outs)
        return hits == [True] * 4 and all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))

    await _eventually(served)
    assert (await h.lookup_prefix(keys)).num_hit == 4
    tier = h.stats()["tiers"][0]
    assert tier["timeouts"] + tier["errors"] > 0, tier
    assert tier["backend_stats"]["prefix_lookups"] >= 1  # the hierarchy used the native lookup


def test_paused_server_gives_misses_within_deadline_then_recovers(s3: LocalS3, prefix: str) -> None:
    async def body() -> None:
        h = _hierarchy(s3.options(prefix))
        await h.start()
        try:
            await _outage_then_recovery(h, s3.pause, s3.resume)
        finally:
            s3.resume()
            await h.close()

    run_async(body())


@pytest.fixture
def proxy(s3: LocalS3) -> Iterator[DroppingProxy]:
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    p = DroppingProxy(port)
    yield p
    p.close()


def test_proxy_dropping_connections_gives_misses_then_recovers(
    s3: LocalS3, prefix: str, proxy: DroppingProxy
) -> None:
    async def body() -> None:
        h = _hierarchy(s3.options(prefix, endpoint_url=proxy.url))
        await h.start()
        try:
            await _outage_then_recovery(h, proxy.drop, proxy.forward)
        finally:
            await h.close()
        assert proxy.dropped > 0

    run_async(body())


def test_corrupted_object_is_a_miss_through_the_hierarchy(s3: LocalS3, prefix: str) -> None:
    async def body() -> None:
        h = _hierarchy(s3.options(prefix))
        await h.start()
        try:
            key = make_key("bad")
            value = random_tensor((4096,), torch.float32, seed=3)
            assert await h.put(key, value)
            backend = h.tiers[0].backend
            name = f"{prefix}/{backend.object_name(key)}"
            raw = bytearray(s3.client().get_object(Bucket=s3.bucket, Key=name)["Body"].read())  # type: ignore[attr-defined]
            raw[-100] ^= 0xFF  # a flipped bit on the medium, written by someone else
            s3.client().put_object(Bucket=s3.bucket, Key=name, Body=bytes(raw))  # type: ignore[attr-defined]
            assert await h.get(key) is None
            stats = h.stats()["tiers"][0]["backend_stats"]
            assert stats["corrupt_objects"] == 1 and stats["removed_corrupt"] == 1
            assert await h.get(key) is None  # deleted: a plain miss now
        finally:
            await h.close()

    run_async(body())


# ---------------------------------------------------------------------------- start errors
def _start_error(options: dict[str, Any]) -> str:
    h = _hierarchy(options)
    with pytest.raises(ConfigError) as info:
        run_async(h.start())
    return str(info.value)


def test_wrong_credentials_one_clear_error(
    s3: LocalS3, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "wrong-secret-value-123"
    msg = _start_error(s3.options(prefix, secret_access_key=secret))
    assert msg.startswith("tier 'remote' (s3://lmcache-test/")
    assert "credentials are not accepted" in msg
    assert secret not in msg and secret not in caplog.text


def test_missing_bucket_one_clear_error(s3: LocalS3) -> None:
    msg = _start_error({**s3.options(), "url": "s3://no-such-bucket/kv"})
    assert "tier 'remote'" in msg and "bucket 'no-such-bucket' does not exist" in msg


def test_unreachable_endpoint_one_clear_error(s3: LocalS3) -> None:
    from lmcache_backend_s3.s3server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    msg = _start_error(s3.options("x", endpoint_url=url))
    assert "tier 'remote'" in msg and f"cannot reach {url}" in msg


def test_secrets_never_shown(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("KV_SECRET", s3.secret_access_key)
    raw = {
        "tiers": [
            {
                "name": "remote",
                "backend": f"s3://{s3.bucket}/kv",
                "options": {
                    "endpoint_url": s3.endpoint_url,
                    "access_key_id": {"$env": "KV_KEY_ID"},
                    "secret_access_key": {"$env": "KV_SECRET"},
                },
            }
        ]
    }
    cfg = load_config(raw)
    shown = str(cfg.to_dict()) + repr(cfg) + repr(cfg.tiers[0].options)
    backend = cfg.tiers[0].create_backend(NS)
    assert isinstance(backend, S3Backend)

    async def body() -> str:
        await backend.start()
        try:
            await backend.put(make_key("s"), random_tensor((8,)))
            return repr(backend) + str(backend.stats())
        finally:
            await backend.close()

    shown += run_async(body())
    assert s3.secret_access_key not in shown and s3.access_key_id not in shown
    assert "<redacted>" in repr(cfg.tiers[0].options)


def test_deadline_load_into_inference_mode_buffers(s3: LocalS3, prefix: str) -> None:
    """vLLM's buffers are inference tensors: a load with a deadline (staged, then copied)
    must fill them (it raised 'Inplace update to inference tensor' and missed)."""

    async def body() -> None:
        h = _hierarchy(s3.options(prefix))
        await h.start()
        try:
            key = make_key("inference")
            value = random_tensor((4096,), torch.float32, seed=5)
            assert await h.put(key, value)
            with torch.inference_mode():
                outs = [torch.empty(4096), torch.empty(4096)]
            assert await h.get_into(key, outs[0])
            assert await h.batched_get_into([key], outs[1:]) == [True]
            assert all(same_bits(o, value) for o in outs)
            assert h.stats()["tiers"][0]["errors"] == 0
        finally:
            await h.close()

    run_async(body())
