"""The vLLM connector's background (``load_async``) load path without an engine.

The worker's real pieces: a ``cpu`` + ``disk`` hierarchy opened as the connector opens it
(``Storage``: the demo's configuration, write-through disk), :class:`AsyncLoads` with its
staging buffers, and a :class:`BlockCopier` over a synthetic paged KV cache laid out as
vLLM 0.32 lays it out on CPU (the demo model's 8 layers, 4 KV heads of 64, float32,
blocks of 128 tokens, chunks of 256 tokens: 4 MiB). A "document" is one request of
``--chunks`` chunks (7: 28 MiB, as in ``make demo``), read from a disk tier whose files
were dropped from the page cache, each load driven as an idle engine drives it
(``wait_progress`` then ``poll`` until ``get_finished`` would report it). Every load's
blocks are checked against the stored values afterwards.

Two parts (both by default; ``--part first`` or ``--part promote`` for one):

* ``first``: the first load of a fresh worker process against its later loads. Each run
  is a new process that opens the storage, optionally warms the load path as the
  connector does at ``register_kv_caches`` (``--part first`` variants ``lazy``: nothing
  warmed, ``warm``: :meth:`AsyncLoads.warm`, waited for, as an engine's start-up leaves
  it time), then loads ``--docs`` documents one after the other. Variants alternate
  process by process (``lazy``, ``lazy2`` (its A/A twin), ``warm``, ``warm2``). Printed:
  median first-load and later-load times per variant, and where the first load's time
  went (:attr:`AsyncLoads.spans`).
* ``promote``: in one process, a document loaded from the disk tier with the cpu tier
  above it and the disk hit promoted into the cpu tier after its copy into the blocks
  (``deferred``, the connector's way, registered twice for the A/A pair), promoted before
  that copy (``inline``, the old way), or not promoted (``off``: ``promote: false``).
  Before each load the cpu tier is emptied (so the chunks are disk hits) and the files
  dropped from the page cache. Rounds alternate the variants; medians of each.

Run: .venv/bin/python benchmarks/bench_async_load.py [--procs 4] [--rounds 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread, drop_page_cache, pct

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.config import load_config
from lmcache_core.integrations.vllm.layout import BlockCopier
from lmcache_core.integrations.vllm.loads import AsyncLoads
from lmcache_core.integrations.vllm.metadata import ChunkLoad
from lmcache_core.integrations.vllm.staging import ChunkBuffers
from lmcache_core.integrations.vllm.storage import Storage

LAYERS, HEADS, BLOCK, KV, BLOCKS_PER_CHUNK = 8, 4, 128, 2 * 64, 2
NS = Namespace(model_name="bench-async-load", chunk_size=256, block_size=BLOCK)
IDLE_WAIT_S = 0.005  # the worker's wait between idle steps (worker_side.IDLE_WAIT_S)


def config(root: str, tiers: str, promote: bool = True) -> Any:
    cpu = {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
    disk: dict[str, Any] = {
        "name": "disk",
        "backend": "disk",
        "options": {"path": root, "max_bytes": "8GiB"},
        "write": {"policy": "through"},
    }
    if not promote:
        disk["promote"] = False
    return load_config({"chunk_size": 256, "tiers": [cpu, disk] if tiers == "cpu+disk" else [disk]})


def chunk_value(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape, generator=g)


def populate(root: str, nchunks: int, shape: tuple[int, ...]) -> None:
    storage = Storage(config(root, "disk"), NS)
    try:
        db = ChunkedTokenDatabase(namespace=NS)
        for i in range(nchunks):
            assert storage.put([db.make_key(i + 1)], [chunk_value(i, shape)]) == [True]
    finally:
        storage.close()


class Worker:
    """The worker side's load machinery over a synthetic cache."""

    def __init__(self, storage: Storage, chunks: int, defer_promotion: bool = True) -> None:
        self.chunks = chunks
        self.num_blocks = 2 * BLOCKS_PER_CHUNK * chunks + 16
        self.backing = torch.zeros(LAYERS, self.num_blocks, HEADS, BLOCK, KV)
        self.copier = BlockCopier([self.backing[i] for i in range(LAYERS)], self.num_blocks)
        self.shape = self.copier.chunk_shape(BLOCKS_PER_CHUNK)
        self.db = ChunkedTokenDatabase(namespace=NS)
        self.loads = AsyncLoads(
            storage,
            ChunkBuffers(self.shape, torch.float32, 16),
            self.copier,
            deadline_s=60.0,
            block_nbytes=self.copier.block_nbytes,
            defer_promotion=defer_promotion,
        )
        self.n = 0

    def load(self, doc: int) -> tuple[float, dict[str, float]]:
        """Load document ``doc``; seconds to ``get_finished`` and the load's spans."""
        first = doc * self.chunks
        # every other run of blocks, as a fresh request's blocks usually are not one run
        ids = [
            [2 * BLOCKS_PER_CHUNK * j + b for b in range(BLOCKS_PER_CHUNK)]
            for j in range(self.chunks)
        ]
        req = f"req-{self.n}"
        self.n += 1
        loads = [ChunkLoad(req, j, first + j + 1, 0, ids[j]) for j in range(self.chunks)]
        keys = [self.db.make_key(first + j + 1) for j in range(self.chunks)]
        t0 = time.perf_counter()
        self.loads.start(req, loads, keys)
        while True:
            self.loads.wait_progress(IDLE_WAIT_S)
            out = self.loads.poll()
            if req in out.finished:
                break
        took = time.perf_counter() - t0
        if out.failed_chunks:
            raise SystemExit(f"load of document {doc} failed: {out.failed_chunks}")
        for j in range(self.chunks):  # the blocks hold exactly what was stored
            want = chunk_value(first + j, self.shape)
            got = self.backing[:, ids[j][0] : ids[j][0] + BLOCKS_PER_CHUNK]
            if not torch.equal(got, want):
                raise SystemExit(f"document {doc} chunk {j}: wrong KV in the blocks")
        return took, self.loads.spans[-1] if self.loads.spans else {}


# ---------------------------------------------------------------------- part 1: first load
def child_first(root: str, variant: str, docs: int, chunks: int) -> dict[str, Any]:
    drop_page_cache(root)
    storage = Storage(config(root, "cpu+disk"), NS, copy_nice=10)
    worker = Worker(storage, chunks)
    warm_s = 0.0
    if variant.startswith("warm"):
        t0 = time.perf_counter()
        worker.loads.warm()
        warm_s = time.perf_counter() - t0
    time.sleep(0.5)  # (an engine compiles and profiles for seconds after registering)
    times, spans = [], []
    for d in range(docs):
        took, sp = worker.load(d)
        times.append(took)
        spans.append(sp)
    storage.close()
    return {"times": times, "spans": spans, "warm_s": warm_s}


def part_first(root: str, procs: int, docs: int, chunks: int) -> None:
    variants = ["lazy", "warm", "lazy2", "warm2"]
    res: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for _ in range(procs):
        for v in variants:
            cmd = [sys.executable, __file__, "--child", json.dumps([root, v, docs, chunks])]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"child {v} failed:\n{out.stderr[-3000:]}")
            res[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = chunks * 4
    print(
        f"first load of a fresh process: {procs} processes per variant, {docs} documents of "
        f"{chunks} x 4 MiB each from a cold disk tier under a cpu tier; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    firsts = {v: [r["times"][0] for r in res[v]] for v in variants}
    laters = {v: [t for r in res[v] for t in r["times"][1:]] for v in variants}
    for v in variants:
        f, later = firsts[v], laters[v]
        warm = statistics.median(r["warm_s"] for r in res[v])
        print(
            f"  {v:<6} first {pct(f, 50) * 1e3:7.1f} ms (max {max(f) * 1e3:7.1f})  later "
            f"{pct(later, 50) * 1e3:6.1f} ms  first/later {pct(f, 50) / pct(later, 50):5.2f}x  "
            f"({mib / 1024 / pct(f, 50):.2f} GB/s first)"
            + (f"  warm-up {warm * 1e3:.0f} ms (off the engine's thread)" if warm else "")
        )
    lazy = firsts["lazy"] + firsts["lazy2"]
    warm = firsts["warm"] + firsts["warm2"]
    print(
        f"  first load warm / lazy: {pct(warm, 50) / pct(lazy, 50):.2f}x; A/A spread lazy "
        f"{aa_spread(firsts['lazy'], firsts['lazy2']):.2f}, warm "
        f"{aa_spread(firsts['warm'], firsts['warm2']):.2f}"
    )
    for v in ("lazy", "warm"):
        runs = res[v] + res[v + "2"]
        for label, rows in (
            ("first load", [r["spans"][0] for r in runs if r["spans"]]),
            ("later loads", [s for r in runs for s in r["spans"][1:]]),
        ):
            if rows:
                keys = [k for k in rows[0] if k != "bytes"]
                print(
                    f"  {v} {label}, median ms: "
                    + ", ".join(
                        f"{k} {statistics.median(r.get(k, 0.0) for r in rows):.1f}" for k in keys
                    )
                )


# ---------------------------------------------------------------------- part 2: promotion
def part_promote(root: str, rounds: int, chunks: int) -> None:
    on = Storage(config(root, "cpu+disk"), NS, copy_nice=10)
    off = Storage(config(root, "cpu+disk", promote=False), NS, copy_nice=10)
    workers = {
        "deferred": Worker(on, chunks),
        "inline": Worker(on, chunks, defer_promotion=False),
        "off": Worker(off, chunks),
        "deferred2": Worker(on, chunks),
    }
    for w in workers.values():
        w.loads.warm()
    samples: dict[str, list[float]] = {v: [] for v in workers}
    promoted: dict[str, int] = {v: 0 for v in workers}
    for r in range(rounds + 1):
        for v, w in workers.items():
            on.clear_private()
            off.clear_private()
            drop_page_cache(root)
            took, _ = w.load(0)
            # wait for the promotions to land (not timed: off the load's path)
            w.loads.storage.submit(w.loads.storage.hierarchy.flush()).result(timeout=60)
            n = len(list(w.loads.storage.hierarchy.tiers[0].backend.keys()))
            if r:  # (round 0 warms every variant up)
                samples[v].append(took)
                promoted[v] = n
    on.close()
    off.close()
    mib = chunks * 4
    print(
        f"promotion of disk hits into the cpu tier: {rounds} rounds, one document of {chunks} "
        f"x 4 MiB per load from a cold disk tier; load average {os.getloadavg()[0]:.1f}"
    )
    base = pct(samples["off"], 50)
    for v, s in samples.items():
        print(
            f"  {v:<9} median {pct(s, 50) * 1e3:6.1f} ms  p90 {pct(s, 90) * 1e3:6.1f} ms  "
            f"({mib / 1024 / pct(s, 50):.2f} GB/s)  {pct(s, 50) / base:.2f}x off  "
            f"chunks in the cpu tier after: {promoted[v]}"
        )
    print(
        f"  deferred / inline: {pct(samples['deferred'], 50) / pct(samples['inline'], 50):.2f}x; "
        f"A/A spread {aa_spread(samples['deferred'], samples['deferred2']):.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["first", "promote", "both"], default="both")
    ap.add_argument("--procs", type=int, default=4, help="processes per variant (first)")
    ap.add_argument("--docs", type=int, default=4, help="documents per process (first)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (promote)")
    ap.add_argument("--chunks", type=int, default=7, help="4 MiB chunks per document")
    ap.add_argument("--dir", default=None, help="where the disk tier lives (default: temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, variant, docs, chunks = json.loads(args.child)
        print(json.dumps(child_first(root, variant, docs, chunks)))
        return 0
    shape = (LAYERS, BLOCKS_PER_CHUNK, HEADS, BLOCK, KV)
    with tempfile.TemporaryDirectory(prefix="bench-async-load-", dir=args.dir) as tmp:
        root = os.path.join(tmp, "kv")
        populate(root, args.docs * args.chunks, shape)
        if args.part in ("first", "both"):
            part_first(root, args.procs, args.docs, args.chunks)
        if args.part in ("promote", "both"):
            part_promote(root, args.rounds, args.chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
