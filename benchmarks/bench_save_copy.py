"""The vLLM connector's saves, without an engine: CPU spent per saved chunk.

A worker's :class:`~lmcache_core.integrations.vllm.saves.SaveQueue` saves chunks from a
synthetic paged KV cache laid out as vLLM 0.32 lays it out on CPU (every layer in one
allocation) into the connector's default tiers: ``cpu`` (full, recycling evicted memory,
as a server's after its warm-up) with a write-through ``disk`` tier below (real files).
Each sample saves ``--chunks`` new chunks, ``--per-step`` per ``submit`` (one step's
saves), and waits until every tier holds them. Two ways, each registered twice (the A/A
pair), in random order per round:

* ``copy``: gather into the worker's staging buffers; the store copies the chunk into
  the cpu tier and once more into a staging copy for the disk writer (what the
  connector did before reserved puts, and still does without recycled memory at hand);
* ``reserve``: gather into memory the cpu tier reserved (``put_reserved``): the tier
  publishes that memory and the disk writer reads it, borrowed: one copy per chunk.

Per sample: the calling thread's CPU (the gathers: vLLM's engine thread in a server) and
the CPU of every other thread (the IO loop, copy, disk and staging threads: what
competes with vLLM's forward pass for the cores), each per chunk; medians over samples,
each way's A/A beside it, and the per-round ratio reserve / copy with a bootstrap 95%
interval.

Run: .venv/bin/python benchmarks/bench_save_copy.py [--chunks 16] [--rounds 12]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.config import load_config
from lmcache_core.integrations.vllm.layout import BlockCopier
from lmcache_core.integrations.vllm.saves import SaveItem, SaveQueue
from lmcache_core.integrations.vllm.staging import ChunkBuffers
from lmcache_core.integrations.vllm.storage import Storage

WAYS = ("copy", "copy2", "reserve", "reserve2")


def _ci(ratios: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(7)
    meds = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", type=int, default=16, help="chunks saved per sample")
    ap.add_argument("--per-step", type=int, default=4, help="chunks per submit")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cpu-bytes", default="256MiB")
    ap.add_argument("--disk-bytes", default="1GiB")
    ap.add_argument("--dir", default=None, help="where the disk tier's files go")
    args = ap.parse_args()

    layers, heads, block_tokens, kv = args.layers, 4, 128, 2 * 64
    bpc = 2  # blocks per chunk: 256-token chunks
    num_blocks = bpc * args.chunks * 2 + 8
    backing = torch.randn(layers, num_blocks, heads, block_tokens, kv)
    copier = BlockCopier([backing[i] for i in range(layers)], num_blocks)
    shape = copier.chunk_shape(bpc)
    chunk_bytes = copier.block_nbytes * bpc
    ns = Namespace(model_name="bench-save", chunk_size=256, block_size=block_tokens)
    db = ChunkedTokenDatabase(namespace=ns)
    tmp = tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-save-")
    cfg = load_config(
        {
            "chunk_size": 256,
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": args.cpu_bytes}},
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": {"path": str(Path(tmp.name) / "kv"), "max_bytes": args.disk_bytes},
                },
            ],
        }
    )
    storage = Storage(cfg, ns)
    saves = SaveQueue(storage, ChunkBuffers(shape, copier.dtype, args.chunks), copier)
    counter = iter(range(1, 1 << 40))

    def items() -> list[SaveItem]:
        out = []
        for j in range(args.chunks):
            h = next(counter)
            # every other run of blocks, as a fresh request's blocks usually are not one run
            ids = [2 * bpc * (j % (args.chunks)) + b for b in range(bpc)]
            out.append(SaveItem(db.make_key(h), h, f"r{h // args.chunks}", j, ids))
        return out

    def settle() -> None:
        saves.drain(120.0)
        storage.submit(storage.hierarchy.flush()).result(timeout=120.0)

    def sample(reserve: bool) -> tuple[float, float, float, int]:
        saves.use_reservations = reserve
        todo = items()
        before = saves.reserved
        settle()
        w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        for i in range(0, len(todo), args.per_step):
            dropped = saves.submit(todo[i : i + args.per_step])
            assert not dropped, "staging buffers ran out: raise --chunks' buffers"
        t1 = time.thread_time()
        settle()
        p1, w1 = time.process_time(), time.perf_counter()
        main_cpu = t1 - t0  # (settle waits on futures: no CPU of this thread)
        return w1 - w0, main_cpu, (p1 - p0) - main_cpu, saves.reserved - before

    # Fill the cpu tier (and a bit more) so that it recycles evicted memory, as it does
    # once a server has run for a while.
    fill = int(cfg.tiers[0].options.max_bytes) // chunk_bytes + args.chunks
    for _ in range(-(-fill // args.chunks)):
        sample(False)
    for _ in range(2):  # warm-up of both ways
        sample(False)
        sample(True)

    n = args.chunks
    res: dict[str, dict[str, list[float]]] = {w: {"wall": [], "main": [], "bg": []} for w in WAYS}
    reserved_share: list[float] = []
    rng = random.Random(1)
    for _ in range(args.rounds):
        order = list(WAYS)
        rng.shuffle(order)
        for w in order:
            wall, main_cpu, bg, reserved = sample(w.startswith("reserve"))
            res[w]["wall"].append(wall / n)
            res[w]["main"].append(main_cpu / n)
            res[w]["bg"].append(bg / n)
            if w.startswith("reserve"):
                reserved_share.append(reserved / n)
    stats = storage.stats()
    storage.close()
    tmp.cleanup()

    print(
        f"saves of {n} chunks of {chunk_bytes / 2**20:.0f} MiB per sample ({args.per_step} per "
        f"step) into cpu ({args.cpu_bytes}, full) + write-through disk; {args.rounds} rounds, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  reserve arm: {statistics.median(reserved_share):.0%} of chunks gathered into "
        "reserved memory (median per sample)"
    )
    for metric, label in (
        ("bg", "other threads' CPU per chunk"),
        ("main", "calling thread's CPU per chunk (gathers)"),
        ("wall", "wall time per chunk until in every tier"),
    ):
        print(f"  {label}:")
        for w in ("copy", "reserve"):
            a, b = res[w][metric], res[w + "2"][metric]
            print(
                f"    {w:<8} median {statistics.median(a) * 1e3:6.2f} ms "
                f"(A/A {statistics.median(a) / statistics.median(b):.3f}x)"
            )
        ratios = [
            r / c for r, c in zip(res["reserve"][metric], res["copy"][metric], strict=True) if c
        ]
        aa = [r / c for r, c in zip(res["copy2"][metric], res["copy"][metric], strict=True) if c]
        lo, hi = _ci(ratios)
        alo, ahi = _ci(aa)
        print(
            f"    reserve / copy, per round: {statistics.median(ratios):.3f}x "
            f"(95% CI {lo:.3f}-{hi:.3f}x); A/A copy2 / copy {statistics.median(aa):.3f}x "
            f"(CI {alo:.3f}-{ahi:.3f}x)"
        )
    cpu_stats = next(t for t in stats["tiers"] if t["name"] == "cpu")["backend_stats"]
    print(
        "  cpu tier: reservations committed "
        f"{cpu_stats.get('reservations_committed')}, aborted "
        f"{cpu_stats.get('reservations_aborted')}, open {cpu_stats.get('reservations')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
