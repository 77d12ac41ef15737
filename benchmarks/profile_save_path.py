"""Where the CPU of the vLLM connector's save path goes, without vLLM (a profile, not a race).

The connector saves a chunk by gathering it into memory reserved in the cpu tier (on
vLLM's engine thread), publishing that memory (``put_reserved``, on the storage's IO
loop) and writing it through to the disk tier in the background. This script does the
same with the connector's own ``Storage`` (cpu + disk tiers) and no engine: per batch,
``--chunks`` chunks of the demo model's shape (8 layers x K/V x 256 tokens x 4 heads x 64,
float32: 4 MiB) are reserved, filled with ``copy_`` from the calling thread (torch at one
thread, as a stand-in for the gather) and stored; the batch ends when every store and
write-through is done. ``--warm`` unrecorded batches fill the cpu tier first (its
reservations then recycle evicted memory, as in a server after its warm-up).

Printed per batch (mean of ``--batches``, each measurement ``--repeats`` times to show
its spread): wall time; CPU time and context switches per thread group (from
``/proc/self/task``, 100 Hz tick accounting, so a few ms of resolution); the CPU time of
the disk put path's phases (``time.thread_time`` around the backend's methods, wrapped
by this script; the phases nest: ``store._write_sync`` holds ``objects._write``, which holds
the checksum and the ``pwritev``); and the reservations' time on the calling thread. Nothing here is
compared with a baseline: it says where the time goes, not how fast it is.

Run: .venv/bin/python benchmarks/profile_save_path.py [--chunks 40] [--batches 5]
     [--warm 13] [--concurrency N] [--young | --steady]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmcache_core import CacheEngineKey, Namespace  # noqa: E402
from lmcache_core.integrations.vllm.storage import Storage, load_storage_config  # noqa: E402

SHAPE = (8, 2, 256, 4, 64)  # the demo model's chunk: 4 MiB of float32

_PHASES: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
_PHASE_LOCK = threading.Lock()


def _record(label: str, dt: float) -> None:
    with _PHASE_LOCK:
        s = _PHASES[label]
        s[0] += 1
        s[1] += dt


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(label, time.thread_time() - t0)

    return wrapper


def instrument_disk() -> None:
    """Wrap the disk backend's put phases with CPU-time accounting (this process only)."""
    from lmcache_backend_disk import objects, sandbox, store

    for name in ("_reserve_sync", "_write_sync", "_publish_sync", "_sync_published"):
        setattr(store.DiskStore, name, _timed(f"store.{name}", getattr(store.DiskStore, name)))
    for name in ("_write", "_create"):
        setattr(objects.ObjectIO, name, _timed(f"objects.{name}", getattr(objects.ObjectIO, name)))
    for name in ("rename", "fsync_dir", "make_dirs"):
        setattr(sandbox.TierDir, name, _timed(f"tier.{name}", getattr(sandbox.TierDir, name)))
    # module-level helpers the object writer calls by name
    objects.xxh3_128_hexdigest = _timed(  # type: ignore[attr-defined]
        "checksum (xxh3_128)",
        objects.xxh3_128_hexdigest,  # type: ignore[attr-defined]
    )
    objects._pwrite_all = _timed("pwritev (O_DIRECT)", objects._pwrite_all)  # type: ignore[attr-defined]


def thread_stats() -> dict[int, tuple[str, int, int]]:
    """Per thread id: (name without its pool number, CPU ms, context switches)."""
    names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        switches = sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
        ms = ticks * 1000 // os.sysconf("SC_CLK_TCK")
        out[int(tid)] = (names.get(int(tid), "other"), ms, switches)
    return out


class Saver:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.src = torch.randn(SHAPE)
        self.n = 0
        self.reserve_s = 0.0

    def batch(self, chunks: int) -> None:
        futs = []
        for _ in range(chunks):
            self.n += 1
            key = CacheEngineKey("profile", 1, 0, self.n, "float32")
            t0 = time.thread_time()
            res = self.storage.reserve_in_memory(torch.float32, SHAPE)
            self.reserve_s += time.thread_time() - t0
            if res is None:  # the tier's fill-up: a buffer of our own, copied in
                futs.append(self.storage.put_async(key, self.src.clone()))
            else:
                res.value.copy_(self.src)
                futs.append(self.storage.submit(self.storage.hierarchy.put_reserved(key, res)))
        for f in futs:
            assert f.result(), "a store was refused"
        self.storage.submit(self.storage.hierarchy.flush()).result()


def make_leaf_dirs(root: str, ns: Namespace) -> None:
    from lmcache_backend_disk import layout

    top = os.path.join(root, layout.namespace_dir(layout.namespace_json(ns)))
    for a in range(256):
        for b in range(256):
            os.makedirs(os.path.join(top, f"{a:02x}", f"{b:02x}"), exist_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=40, help="chunks per batch (default 40)")
    ap.add_argument("--batches", type=int, default=5, help="measured batches per repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm", type=int, default=13, help="unrecorded batches first")
    ap.add_argument("--cpu-bytes", default="2GiB", help="the cpu tier's max_bytes")
    ap.add_argument("--concurrency", type=int, default=None, help="the disk tier's option")
    ap.add_argument(
        "--steady",
        action="store_true",
        help="make every ab/cd leaf directory before the puts (a tier that holds many "
        "objects); default: a young tier, where most puts make their leaf directory",
    )
    ap.add_argument("--dir", default=None, help="the disk tier's parent directory")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ns = Namespace(model_name="profile")
    with tempfile.TemporaryDirectory(prefix="profile-save-", dir=args.dir) as tmp:
        disk: dict[str, Any] = {"path": tmp}
        if args.concurrency is not None:
            disk["concurrency"] = args.concurrency
        if args.steady:
            make_leaf_dirs(tmp, ns)
        cfg = load_storage_config(
            {
                "chunk_size": 256,
                "tiers": [
                    {"name": "cpu", "backend": "cpu", "options": {"max_bytes": args.cpu_bytes}},
                    {"name": "disk", "backend": "disk", "options": disk},
                ],
            }
        )
        instrument_disk()
        storage = Storage(cfg, ns)
        try:
            saver = Saver(storage)
            for _ in range(args.warm):
                saver.batch(args.chunks)
            mib = args.chunks * 4
            print(
                f"save path: {args.chunks} x 4 MiB chunks per batch ({mib} MiB), cpu + disk "
                f"tiers ({'steady' if args.steady else 'young'} tier, disk concurrency "
                f"{args.concurrency or 'default'}), {args.warm} warm-up batches"
            )
            for rep in range(args.repeats):
                _PHASES.clear()
                saver.reserve_s = 0.0
                before = thread_stats()
                t0 = time.perf_counter()
                for _ in range(args.batches):
                    saver.batch(args.chunks)
                wall = (time.perf_counter() - t0) / args.batches
                after = thread_stats()
                cpu: collections.Counter[str] = collections.Counter()
                switches: collections.Counter[str] = collections.Counter()
                for tid, (name, ms, cs) in after.items():
                    _, ms0, cs0 = before.get(tid, (name, 0, 0))
                    cpu[name] += ms - ms0
                    switches[name] += cs - cs0
                nb = args.batches
                print(f"\nrepeat {rep + 1}: wall {wall * 1000:.0f} ms per batch")
                print(f"  {'thread group':28s} {'CPU ms/batch':>12s} {'switches/batch':>15s}")
                for name, ms in cpu.most_common():
                    if ms or switches[name]:
                        print(f"  {name:28s} {ms / nb:12.1f} {switches[name] / nb:15.0f}")
                print(f"  reservations on the calling thread: {saver.reserve_s / nb * 1000:.1f} ms")
                print(
                    f"  {'disk put phase (CPU)':28s} {'calls/batch':>12s} {'ms/batch':>9s} {'us/call':>8s}"
                )
                for label, (calls, secs) in sorted(_PHASES.items(), key=lambda x: -x[1][1]):
                    print(
                        f"  {label:28s} {calls / nb:12.1f} {secs / nb * 1000:9.1f} "
                        f"{secs / max(calls, 1) * 1e6:8.0f}"
                    )
        finally:
            storage.close()


if __name__ == "__main__":
    main()
