"""The s3 backend against raw boto3 on one local S3 API server, in one run.

Usage::

    flock /tmp/lmcache-heavy.lock .venv/bin/python benchmarks/bench_s3.py [--reps 5] [--json]

A local S3 server (moto's server mode, its own process, authentication on) is started.
For 4 MiB and 32 MiB chunks at concurrency 1, 4 and 16, each repetition runs, in rotating
order, raw boto3 ``put_object``/``get_object`` of the same bytes twice (``raw`` and
``raw2``: the A/A pair) and the backend (``batched_put``, then ``batched_get_into`` into
reused tensors: the hot path, checksum verification included). Both use the same
botocore configuration (:func:`lmcache_backend_s3.store_boto.botocore_config`) and the
same number of threads. Reported per case: medians over repetitions of throughput and of
client CPU seconds per GB (``getrusage`` of this process only; the server runs in its own
process), the backend/raw ratios, and the A/A spread (|raw - raw2| / raw) that says how
much of a ratio is noise.

Then: s3fs's async API (``_pipe_file``/``_cat_file`` on one event loop) against boto3 in
a thread pool with the same botocore settings -- the measurement that chose the hot path
-- and the requests a prefix lookup costs (``contains_prefix`` vs one HEAD per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from lmcache_backend_s3 import S3Backend
from lmcache_backend_s3.s3server import LocalS3, start_local_s3
from lmcache_backend_s3.store_boto import botocore_config

from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.testing import random_tensor

MiB = 1 << 20
NS = Namespace(model_name="bench-s3", chunk_size=256)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(fn: Callable[[], None], nbytes: int) -> dict[str, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"gbps": nbytes / wall / 1e9, "cpu_s_per_gb": cpu / (nbytes / 1e9)}


class Raw:
    """boto3 put_object/get_object of prepared bytes in a thread pool."""

    def __init__(self, s3: LocalS3, conc: int, prefix: str) -> None:
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint_url,
            region_name=s3.region,
            aws_access_key_id=s3.access_key_id,
            aws_secret_access_key=s3.secret_access_key,
            config=botocore_config(max_pool_connections=conc),
        )
        self.bucket = s3.bucket
        self.prefix = prefix
        self.pool = ThreadPoolExecutor(conc)

    def put(self, blobs: list[bytes], rnd: int = 0) -> None:
        def one(i: int) -> None:
            key = f"{self.prefix}/{rnd}/{i}"
            self.client.put_object(Bucket=self.bucket, Key=key, Body=blobs[i])

        list(self.pool.map(one, range(len(blobs))))

    def get(self, n: int, rnd: int = 0) -> None:
        def one(i: int) -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{rnd}/{i}")
            body["Body"].read()
            body["Body"].close()

        list(self.pool.map(one, range(n)))

    def delete(self, n: int, rnd: int = 0) -> None:
        for i in range(n):
            self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{rnd}/{i}")

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


class Ours:
    """The backend: batched_put of tensors, batched_get_into reused tensors."""

    def __init__(self, s3: LocalS3, conc: int, prefix: str) -> None:
        self.loop = asyncio.new_event_loop()
        # io_nice 0: the raw baseline's threads run at normal priority too
        self.backend = S3Backend(s3.options(prefix, max_concurrency=conc, io_nice=0), namespace=NS)
        self.loop.run_until_complete(self.backend.start())

    def put(self, keys: list[CacheEngineKey], values: list[torch.Tensor]) -> None:
        ok = self.loop.run_until_complete(self.backend.batched_put(keys, values))
        assert all(ok)

    def get(self, keys: list[CacheEngineKey], outs: list[torch.Tensor]) -> None:
        hits = self.loop.run_until_complete(self.backend.batched_get_into(keys, outs))
        assert all(hits)

    def remove(self, keys: list[CacheEngineKey]) -> None:
        for k in keys:
            self.loop.run_until_complete(self.backend.remove(k))

    def close(self) -> None:
        self.loop.run_until_complete(self.backend.close())
        self.loop.close()


def bench_case(s3: LocalS3, size: int, conc: int, reps: int) -> dict[str, Any]:
    n = max(conc, (64 * MiB) // size) if size <= 4 * MiB else max(conc, 4)
    values = [random_tensor((size,), torch.uint8, seed=i) for i in range(n)]
    blobs = [bytes(v.numpy().tobytes()) for v in values]
    outs = [torch.empty_like(v) for v in values]
    nbytes = n * size
    tag = f"{size // MiB}m-c{conc}"
    raw_a, raw_b = Raw(s3, conc, f"raw-a-{tag}"), Raw(s3, conc, f"raw-b-{tag}")
    ours = Ours(s3, conc, f"ours-{tag}")

    def keys_of(rnd: int) -> list[CacheEngineKey]:
        return [CacheEngineKey("bench", 1, 0, 1000 * (rnd + 1) + i, "uint8") for i in range(n)]

    # Each repetition writes new objects (as a cache does; a rewrite of an existing chunk
    # would be a conditional-put conflict), removed afterwards outside the measurement.
    runners: dict[str, dict[str, Callable[[int], None]]] = {
        "raw": {"put": lambda r: raw_a.put(blobs, r), "get": lambda r: raw_a.get(n, r),
                "clean": lambda r: raw_a.delete(n, r)},
        "raw2": {"put": lambda r: raw_b.put(blobs, r), "get": lambda r: raw_b.get(n, r),
                 "clean": lambda r: raw_b.delete(n, r)},
        "s3": {"put": lambda r: ours.put(keys_of(r), values),
               "get": lambda r: ours.get(keys_of(r), outs), "clean": lambda r: ours.remove(keys_of(r))},
    }  # fmt: skip
    for r in runners.values():  # warm-up: connections, first objects
        r["put"](-1)
        r["get"](-1)
        r["clean"](-1)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {"put": [], "get": []} for name in runners
    }
    names = list(runners)
    for rep in range(reps):
        order = names[rep % 3 :] + names[: rep % 3]
        for op in ("put", "get"):
            for name in order:
                samples[name][op].append(_measure(lambda: runners[name][op](rep), nbytes))  # noqa: B023
        for name in order:
            runners[name]["clean"](rep)
    for x in (raw_a, raw_b, ours):
        x.close()
    out: dict[str, Any] = {"size_mib": size // MiB, "concurrency": conc, "objects": n}
    for op in ("put", "get"):
        med = {
            name: {
                m: statistics.median(s[m] for s in samples[name][op])
                for m in ("gbps", "cpu_s_per_gb")
            }
            for name in names
        }
        out[op] = {
            "raw_gbps": med["raw"]["gbps"],
            "s3_gbps": med["s3"]["gbps"],
            "throughput_ratio": med["s3"]["gbps"] / med["raw"]["gbps"],
            "aa_throughput_spread": abs(med["raw"]["gbps"] - med["raw2"]["gbps"])
            / med["raw"]["gbps"],
            "raw_cpu_s_per_gb": med["raw"]["cpu_s_per_gb"],
            "s3_cpu_s_per_gb": med["s3"]["cpu_s_per_gb"],
            "cpu_ratio": med["s3"]["cpu_s_per_gb"] / med["raw"]["cpu_s_per_gb"],
            "aa_cpu_spread": abs(med["raw"]["cpu_s_per_gb"] - med["raw2"]["cpu_s_per_gb"])
            / med["raw"]["cpu_s_per_gb"],
        }
    return out


def bench_s3fs(s3: LocalS3, size: int, conc: int, reps: int) -> dict[str, Any]:
    """s3fs async (one event loop, ``conc`` requests in flight) vs boto3 threads."""
    import s3fs

    n = max(conc, (32 * MiB) // size)
    blobs = [bytes(random_tensor((size,), torch.uint8, seed=i).numpy().tobytes()) for i in range(n)]
    nbytes = n * size
    cfg = botocore_config(max_pool_connections=conc)
    config_kwargs = {
        k: getattr(cfg, k)
        for k in ("connect_timeout", "read_timeout", "retries", "max_pool_connections", "s3",
                  "request_checksum_calculation", "response_checksum_validation")
    }  # fmt: skip
    loop = asyncio.new_event_loop()

    async def make() -> Any:
        fs = s3fs.S3FileSystem(
            asynchronous=True,
            key=s3.access_key_id,
            secret=s3.secret_access_key,
            endpoint_url=s3.endpoint_url,
            client_kwargs={"region_name": s3.region},
            config_kwargs=config_kwargs,
            use_listings_cache=False,
        )
        await fs.set_session()
        return fs

    fs = loop.run_until_complete(make())
    sem_holder: list[asyncio.Semaphore] = []

    async def bounded(coros: list[Any]) -> None:
        if not sem_holder:
            sem_holder.append(asyncio.Semaphore(conc))
        sem = sem_holder[0]

        async def one(c: Any) -> None:
            async with sem:
                await c

        await asyncio.gather(*(one(c) for c in coros))

    base = f"{s3.bucket}/s3fs-{size // MiB}m-c{conc}"

    def fs_put() -> None:
        loop.run_until_complete(bounded([fs._pipe_file(f"{base}/{i}", blobs[i]) for i in range(n)]))

    def fs_get() -> None:
        loop.run_until_complete(bounded([fs._cat_file(f"{base}/{i}") for i in range(n)]))

    raw = Raw(s3, conc, f"s3fs-raw-{size // MiB}m-c{conc}")
    runners: dict[str, dict[str, Callable[[], None]]] = {
        "boto3": {"put": lambda: raw.put(blobs), "get": lambda: raw.get(n)},
        "s3fs": {"put": fs_put, "get": fs_get},
    }
    for r in runners.values():
        r["put"]()
        r["get"]()
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        k: {"put": [], "get": []} for k in runners
    }
    for rep in range(reps):
        for op in ("put", "get"):
            for name in ["boto3", "s3fs"] if rep % 2 == 0 else ["s3fs", "boto3"]:
                samples[name][op].append(_measure(runners[name][op], nbytes))
    raw.close()
    loop.run_until_complete(fs._s3creator.__aexit__(None, None, None))
    loop.close()
    out: dict[str, Any] = {"size_mib": size // MiB, "concurrency": conc}
    for op in ("put", "get"):
        for name in runners:
            for m in ("gbps", "cpu_s_per_gb"):
                out[f"{op}_{name}_{m}"] = statistics.median(s[m] for s in samples[name][op])
        out[f"{op}_s3fs_over_boto3_gbps"] = out[f"{op}_s3fs_gbps"] / out[f"{op}_boto3_gbps"]
    return out


def bench_lookup(s3: LocalS3, n: int = 64, stored: int = 37) -> dict[str, Any]:
    """Requests of one prefix lookup of ``n`` chunks (existence cache off)."""

    async def body() -> dict[str, Any]:
        b = S3Backend(s3.options("lookup", lookup_cache_s=0, negative_cache_s=0), namespace=NS)
        await b.start()
        keys = [CacheEngineKey("bench", 1, 0, 50_000 + i, "uint8") for i in range(n)]
        await b.batched_put(keys[:stored], [torch.zeros(16, dtype=torch.uint8)] * stored)
        h0 = b.stats()["requests"]["head"]
        t0 = time.perf_counter()
        found = await b.contains_prefix(keys)
        t_prefix = time.perf_counter() - t0
        h1 = b.stats()["requests"]["head"]
        t0 = time.perf_counter()
        flags = await b.batched_contains(keys)
        t_all = time.perf_counter() - t0
        h2 = b.stats()["requests"]["head"]
        await b.close()
        assert found == stored and sum(flags) == stored
        return {
            "chunks": n,
            "stored": stored,
            "prefix_lookup_requests": h1 - h0,
            "bound": math.ceil(math.log2(n)) + 1,
            "prefix_lookup_ms": t_prefix * 1e3,
            "head_each_requests": h2 - h1,
            "head_each_ms": t_all * 1e3,
        }

    return asyncio.run(body())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default="4,32", help="chunk sizes in MiB")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    s3 = start_local_s3("bench")
    try:
        cases = [
            bench_case(s3, int(mb) * MiB, int(c), args.reps)
            for mb in args.sizes.split(",")
            for c in args.concurrency.split(",")
        ]
        engines = [bench_s3fs(s3, 4 * MiB, c, args.reps) for c in (4, 16)]
        lookup = bench_lookup(s3)
    finally:
        s3.stop()
    if args.json:
        print(json.dumps({"cases": cases, "engines": engines, "lookup": lookup}, indent=2))
        return
    print(
        "size conc op   | raw GB/s  s3 GB/s  ratio (A/A) | raw CPU s/GB  s3 CPU s/GB  ratio (A/A)"
    )
    for c in cases:
        for op in ("put", "get"):
            d = c[op]
            print(
                f"{c['size_mib']:>3}M {c['concurrency']:>4} {op} | {d['raw_gbps']:8.3f} {d['s3_gbps']:8.3f} "
                f"{d['throughput_ratio']:6.2f} ({d['aa_throughput_spread']:.2f}) | "
                f"{d['raw_cpu_s_per_gb']:12.2f} {d['s3_cpu_s_per_gb']:12.2f} "
                f"{d['cpu_ratio']:6.2f} ({d['aa_cpu_spread']:.2f})"
            )
    print("\nhot-path choice: s3fs async vs boto3 threads (4 MiB objects)")
    for e in engines:
        for op in ("put", "get"):
            print(
                f"  conc {e['concurrency']:>2} {op}: boto3 {e[f'{op}_boto3_gbps']:.3f} GB/s "
                f"{e[f'{op}_boto3_cpu_s_per_gb']:.2f} CPU s/GB | s3fs {e[f'{op}_s3fs_gbps']:.3f} GB/s "
                f"{e[f'{op}_s3fs_cpu_s_per_gb']:.2f} CPU s/GB | s3fs/boto3 {e[f'{op}_s3fs_over_boto3_gbps']:.2f}"
            )
    lk = lookup
    print(
        f"\nprefix lookup of {lk['chunks']} chunks ({lk['stored']} stored): "
        f"{lk['prefix_lookup_requests']} requests (bound {lk['bound']}), {lk['prefix_lookup_ms']:.1f} ms; "
        f"one HEAD per chunk: {lk['head_each_requests']} requests, {lk['head_each_ms']:.1f} ms"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
