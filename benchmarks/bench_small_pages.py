"""Aligned caller memory in 4 KiB pages: the disk tier's transfers used directly
(``small_pages=direct``) against staged through its huge-page buffers (``stage``), with
the raw ``O_DIRECT`` loop into huge pages and into the same small pages as baselines.

``--chunks`` objects of ``--mib`` MiB (4 KiB-aligned tensors, so alignment alone would
send them straight to the device). "Small pages": private anonymous memory with
``MADV_NOHUGEPAGE``, faulted in a shuffled order, so its physical pages are scattered as
in a long-lived ``malloc`` heap; "huge pages": ``aligned_empty`` (``MADV_HUGEPAGE``).
A device takes a bounded number of memory segments per request (``max_segments`` of its
queue), so a transfer from scattered 4 KiB pages becomes more device requests; the
device requests per object (``/proc/diskstats``) are printed beside each time.

Contenders, each timed over the whole batch, medians of ``--repeats`` interleaved
repetitions (the order rotates):

* ``raw, huge pages`` (the baseline) / ``raw, small pages``: the raw loop
  (``benchmarks/_storage``): cold ``preadv`` of files of the objects' size, 4 requests in
  flight; durable ``pwritev`` (fallocate, write, fsync each file, fsync the directory);
* ``tier, direct`` / ``tier, stage`` (twice, for the A/A spread): cold
  ``batched_get_into`` into small-page tensors, and ``batched_put`` of small-page values
  (fresh keys, durable), through two disk tiers that differ only in ``small_pages``.

Every read is compared with what was written. Before each cold read its files leave the
page cache (checked with ``mincore``).

    flock /tmp/lmcache-heavy.lock .venv/bin/python benchmarks/bench_small_pages.py --dir /var/tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from lmcache_backend_disk import DiskBackend, aligned_empty
from lmcache_backend_disk.aligned import (
    auto_stage_over_bytes,
    huge_backed,
    scattered_small_pages,
)

sys.path.insert(0, str(Path(__file__).parent))
from _storage import disk_counters, files_under, make_cold, raw_read, raw_write

from lmcache_core import CacheEngineKey, Namespace, SyncBackend

MiB = 1 << 20
QD = 4


def _mv(t: torch.Tensor) -> memoryview:
    return t.numpy().data.cast("B")


class Run:
    def __init__(self, work: str, n: int, mib: int) -> None:
        self.work, self.n, self.nbytes = work, n, mib * MiB
        g = torch.Generator().manual_seed(0)
        values = [torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=g)
                  for _ in range(n)]  # fmt: skip
        self.small_src = [scattered_small_pages(self.nbytes, 100 + i) for i in range(n)]
        self.small_dst = [scattered_small_pages(self.nbytes, 200 + i) for i in range(n)]
        self.huge_src = [aligned_empty((self.nbytes,), torch.uint8) for _ in range(n)]
        self.huge_dst = [aligned_empty((self.nbytes,), torch.uint8) for _ in range(n)]
        for s, h, v, d in zip(self.small_src, self.huge_src, values, self.huge_dst, strict=True):
            s.copy_(v)
            h.copy_(v)
            d.fill_(0)
        self.values = values
        huge = [huge_backed(t.data_ptr(), self.nbytes) for t in self.huge_dst]
        small = [huge_backed(t.data_ptr(), self.nbytes) for t in self.small_dst]
        self.pages_note = (
            f"huge-page buffers mapped by huge pages: {sum(h is True for h in huge)}/{n}; "
            f"small-page buffers: {sum(s is True for s in small)}/{n}"
            if None not in huge + small
            else "page sizes unknown here (no PAGEMAP_SCAN)"
        )
        ns = Namespace(model_name="small-pages")
        self.tiers: dict[str, SyncBackend] = {}
        for mode in ("direct", "stage"):
            b = DiskBackend(
                {"path": os.path.join(work, mode), "max_bytes": 8 * n * self.nbytes,
                 "direct_io": "true", "small_pages": mode},
                namespace=ns,
            )  # fmt: skip
            self.tiers[mode] = SyncBackend(b)
            self.tiers[mode].start()
        # the objects every read contender reads (written once, untimed)
        self.read_keys = [CacheEngineKey("small-pages", 1, 0, i, "uint8") for i in range(n)]
        for t in self.tiers.values():
            assert all(t.batched_put(self.read_keys, values))
        names = [f"o{i}" for i in range(n)]
        self.raw_files = raw_write(
            os.path.join(work, "raw"), names, [_mv(h) for h in self.huge_src], QD
        )
        self.times: dict[str, list[float]] = {}
        self.requests: dict[str, list[float]] = {}

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()

    def _timed(self, name: str, fn: Callable[[], object], counter: int) -> None:
        c0 = disk_counters(self.work)
        t0 = time.perf_counter()
        fn()
        self.times.setdefault(name, []).append(time.perf_counter() - t0)
        c1 = disk_counters(self.work)
        if c0 is not None and c1 is not None:
            self.requests.setdefault(name, []).append((c1[counter] - c0[counter]) / self.n)

    def _check(self, outs: list[torch.Tensor], what: str) -> None:
        for o, v in zip(outs, self.values, strict=True):
            if not torch.equal(o, v):
                raise AssertionError(f"{what}: a read was not bit-exact")
            o.fill_(0)

    def _raw_read(self, dsts: list[torch.Tensor]) -> None:
        raw_read(self.raw_files, [_mv(d) for d in dsts], QD)

    def _tier_read(self, tier: SyncBackend) -> None:
        assert_all(tier.batched_get_into(self.read_keys, self.small_dst))

    def _raw_put(self, d: str, src: list[torch.Tensor]) -> None:
        raw_write(d, [f"o{i}" for i in range(self.n)], [_mv(s) for s in src], QD)

    def _tier_put(self, tier: SyncBackend, keys: list[CacheEngineKey]) -> None:
        assert_all(tier.batched_put(keys, self.small_src))

    @staticmethod
    def _tier_remove(tier: SyncBackend, keys: list[CacheEngineKey]) -> None:
        for key in keys:
            tier.remove(key)

    def reads(self, r: int) -> None:
        tier_files = {m: files_under(os.path.join(self.work, m), self.nbytes) for m in self.tiers}
        contenders: list[tuple[str, Callable[[], object], list[str], list[torch.Tensor]]] = [
            ("read raw, huge pages", partial(self._raw_read, self.huge_dst), self.raw_files,
             self.huge_dst),
            ("read raw, small pages", partial(self._raw_read, self.small_dst), self.raw_files,
             self.small_dst),
        ]  # fmt: skip
        for name, mode in (("direct", "direct"), ("stage", "stage"), ("stage (A/A)", "stage")):
            contenders.append(
                (f"read tier, {name}", partial(self._tier_read, self.tiers[mode]),
                 tier_files[mode], self.small_dst)
            )  # fmt: skip
        k = r % len(contenders)
        for name, fn, files, outs in contenders[k:] + contenders[:k]:
            make_cold(files)
            self._timed(name, fn, 0)
            self._check(outs, name)

    def puts(self, r: int) -> None:
        base = 1_000_000 * (r + 1)
        contenders: list[tuple[str, Callable[[], object], Callable[[], object]]] = []
        for name, src in (("huge pages", self.huge_src), ("small pages", self.small_src)):
            d = os.path.join(self.work, f"raw-put-{name[:4]}-{r}")
            contenders.append(
                (f"put raw, {name}", partial(self._raw_put, d, src), partial(shutil.rmtree, d))
            )
        modes = (("direct", "direct"), ("stage", "stage"), ("stage (A/A)", "stage"))
        for j, (name, mode) in enumerate(modes):
            t = self.tiers[mode]
            keys = [
                CacheEngineKey("small-pages", 1, 0, base + 1000 * j + i, "uint8")
                for i in range(self.n)
            ]
            contenders.append(
                (f"put tier, {name}", partial(self._tier_put, t, keys),
                 partial(self._tier_remove, t, keys))
            )  # fmt: skip
        k = r % len(contenders)
        for name, fn, clean in contenders[k:] + contenders[:k]:
            self._timed(name, fn, 4)
            clean()


def auto_note(work: str) -> str:
    """What ``small_pages: auto`` does on this device (this benchmark's tensors start on a
    page boundary, so ``auto`` would leave them direct even where it stages)."""
    over = auto_stage_over_bytes(os.stat(work).st_dev)
    if not over:
        return "stages nothing"
    return f"stages tensors that start inside a page, over {over // 1024} KiB"


def assert_all(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError("the tier refused or missed a chunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32, help="objects per batch (32)")
    ap.add_argument("--mib", type=int, default=4, help="MiB per object (4)")
    ap.add_argument("--repeats", type=int, default=9, help="repetitions per contender (9)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-small-pages-", dir=args.dir)
    try:
        run = Run(work, args.chunks, args.mib)
        try:
            print(
                f"{args.chunks} objects of {args.mib} MiB, {args.repeats} repetitions, in "
                f"{work}; {run.pages_note}; small_pages=auto here: {auto_note(work)}; "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            for r in range(args.repeats):
                run.reads(r)
                run.puts(r)
        finally:
            run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {n: statistics.median(v) for n, v in run.times.items()}
    total = args.chunks * args.mib * MiB / 1e9
    for kind in ("read", "put"):
        base = med[f"{kind} raw, huge pages"]
        aa_pair = (med[f"{kind} tier, stage"], med[f"{kind} tier, stage (A/A)"])
        print(
            f"\n| {kind} of the batch | median ms | GB/s | device requests per object | raw huge / this |"
        )
        print("|---|---|---|---|---|")
        for n in med:
            if not n.startswith(kind + " "):
                continue
            reqs = f"{statistics.median(run.requests[n]):.1f}" if run.requests.get(n) else "n/a"
            print(
                f"| {n[len(kind) + 1 :]} | {med[n] * 1e3:.1f} | {total / med[n]:.2f} | {reqs} | "
                f"{base / med[n]:.2f}x |"
            )
        print(f"{kind}: A/A spread (stage against itself) {max(aa_pair) / min(aa_pair):.2f}; "
              f"stage / direct speed {med[f'{kind} tier, direct'] / med[f'{kind} tier, stage']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
