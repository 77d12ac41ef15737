"""A tier that stays down for 10**5 consecutive calls: the hierarchy keeps answering.

Issue 10: the health backoff computed ``initial * 2**(n-1)``; after ~1,024 consecutive
failures every ``lookup_prefix``/``put``/``get`` raised ``OverflowError``.
"""

from __future__ import annotations

import math
import time

import torch
from core_faults import DownBackend, make_registry, report, trials

from lmcache_core import TieredHierarchy
from lmcache_core.testing import make_key, run_async, same_bits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def outage(failures: int, backoff_ms: float) -> dict[str, object]:
    cfg = {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": "16MiB"}},
            {"name": "remote", "backend": "down", "retry_backoff_ms": backoff_ms},
        ]
    }
    h = TieredHierarchy.from_config(cfg, registry=make_registry())
    await h.start()
    remote = h.tier("remote")
    down = remote.backend
    assert isinstance(down, DownBackend)
    clock = FakeClock()
    remote.health._clock = clock  # the backoff really applies; the test skips the waiting
    stored = make_key("kept")
    value = torch.arange(256, dtype=torch.float32)
    assert await h.put(stored, value)
    keys = [stored, make_key("gone")]
    answered = 0
    t0 = time.perf_counter()
    op = 0
    while down.calls < failures:
        clock.now = remote.health.retry_at + 0.001  # the retry time has come
        kind = op % 4
        if kind == 0:
            res = await h.lookup_prefix(keys)
            ok = res.num_hit == 1
        elif kind == 1:
            ok = await h.get(keys[1]) is None
        elif kind == 2:
            ok = await h.get_into(keys[1], torch.empty(256)) is False
        else:
            ok = await h.contains(keys[1]) is False
        answered += ok
        op += 1
    elapsed = time.perf_counter() - t0
    health = remote.health
    backoff = health.retry_at - clock.now
    still = same_bits(await h.get(stored), value)  # the top tier serves what it holds
    await h.close()
    return {
        "failures": down.calls,
        "consecutive_errors": health.consecutive_errors,
        "answered": answered,
        "ops": op,
        "backoff_s": backoff,
        "top_tier_still_serves": still,
        "seconds": round(elapsed, 1),
    }


def test_a_tier_down_for_1e5_calls_never_breaks_the_hierarchy() -> None:
    failures = trials(ci=100_000, full=100_000)
    for backoff_ms in (500.0, 0.0):  # the default doubling, and no backoff at all
        res = run_async(outage(failures, backoff_ms))
        assert res["failures"] >= failures
        assert res["consecutive_errors"] >= failures
        assert res["answered"] == res["ops"], res
        assert res["top_tier_still_serves"] is True
        assert math.isfinite(float(res["backoff_s"]))  # type: ignore[arg-type]
        assert float(res["backoff_s"]) <= 30.0 + 1e-6  # type: ignore[arg-type]
        report(f"tier down (retry_backoff_ms={backoff_ms:g})", **res)
