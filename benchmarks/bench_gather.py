"""The vLLM connector's host copies between a chunk and vLLM's paged KV cache on CPU,
without an engine, from and into a synthetic cache laid out as vLLM 0.32 lays it out on
CPU (every layer in one allocation, ``[layers, blocks, heads, tokens, K|V]``); three ways
each (a run: consecutive block ids):

- gathers (saves; ``--ops gather``): ``indexed``, the library's gather (one
  ``index_select`` over every layer at once); ``runs``, one torch ``copy_`` per run,
  every layer at once (torch splits it across its OpenMP threads); ``memmove``, one
  single-threaded ``memmove`` per run and layer;
- scatters (loads that are not copied layer by layer: async loads, beside the forward
  pass; ``--ops scatter``): ``indexed`` (one ``index_copy_`` over every layer at once),
  ``runs`` (one ``copy_`` per run, the library's way before 3 December 2026) and
  ``memmove`` (one per run and layer, the library's way since: ``BlockCopier.scatter``).

The gather runs on vLLM's engine thread once per saved chunk (``wait_for_save``), so its
time is added to every step that saves; async loads scatter in helper threads while vLLM
computes. Defaults: the demo model's 8 layers, 4 KV heads
of 64, float32, chunks of 256 tokens (4 MiB); block sizes 16, 32, 64 and 128 tokens (128
is vLLM's CPU default); per block size three shapes of a chunk's block ids: one run,
runs of two blocks, single blocks at random places. Each gather reads blocks at random
places of a cache far larger than the CPU caches (``--cache-mib``).

Per case the three ways, each registered twice (the A/A pairs), are measured round-robin
(``interleaved_samples``); printed per way: median and 90th percentile per chunk; then
the speed ratios indexed / runs and indexed / memmove of the medians (> 1: the
alternative is faster) with the largest A/A spread of the case beside them and a verdict
each (inside the spread: within noise). Two conditions, as in ``bench_copy.py``: quiet
(nothing else started by this benchmark), and loaded (one busy process per core
computing float32 matmuls: other engines or jobs on the machine), where a two-thread
``copy_`` waits for its descheduled thread.

Run: .venv/bin/python benchmarks/bench_gather.py [--rounds 15] [--cache-mib 1024]
[--conditions quiet loaded] [--ops gather scatter]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread, interleaved_samples, pct
from bench_copy import start_load, stop_load

from lmcache_core.integrations.vllm.layout import BlockCopier, block_runs

CHUNK_TOKENS = 256
WAYS = ("indexed", "runs", "memmove")


def _ids(rng: random.Random, num_blocks: int, per_chunk: int, run: int) -> list[int]:
    """A chunk's block ids: runs of ``run`` consecutive blocks at random places."""
    ids: list[int] = []
    while len(ids) < per_chunk:
        k = min(run, per_chunk - len(ids))
        b = rng.randrange(0, num_blocks - k)
        if any(b <= x < b + k for x in ids):
            continue  # vLLM never gives one block twice to a request
        ids += range(b, b + k)
    return ids


def _gather_indexed(copier: BlockCopier, ids: Iterator[list[int]], out: torch.Tensor) -> None:
    copier.gather(next(ids), out)


def _gather_runs(combined: torch.Tensor, ids: Iterator[list[int]], out: torch.Tensor) -> None:
    for j, b, k in block_runs(next(ids)):
        out[:, j : j + k].copy_(combined[:, b : b + k])


def _gather_memmove(combined: torch.Tensor, ids: Iterator[list[int]], out: torch.Tensor) -> None:
    # every layer's blocks are contiguous in the synthetic cache and in ``out``
    esize = combined.element_size()
    src, s_layer, s_block = combined.data_ptr(), combined.stride(0), combined.stride(1)
    dst, d_layer, d_block = out.data_ptr(), out.stride(0), out.stride(1)
    for j, b, k in block_runs(next(ids)):
        n = k * s_block * esize
        for layer in range(combined.shape[0]):
            ctypes.memmove(
                dst + (layer * d_layer + j * d_block) * esize,
                src + (layer * s_layer + b * s_block) * esize,
                n,
            )


def _scatter_indexed(combined: torch.Tensor, ids: Iterator[list[int]], src: torch.Tensor) -> None:
    combined.index_copy_(1, torch.tensor(next(ids)), src)


def _scatter_runs(combined: torch.Tensor, ids: Iterator[list[int]], src: torch.Tensor) -> None:
    for j, b, k in block_runs(next(ids)):
        combined[:, b : b + k].copy_(src[:, j : j + k])


def _scatter_library(copier: BlockCopier, ids: Iterator[list[int]], src: torch.Tensor) -> None:
    copier.scatter(src, next(ids))


def _cases(
    args: argparse.Namespace, op: str, rng: random.Random
) -> Iterator[tuple[str, dict[str, Callable[[], None]]]]:
    """Per block size and shape of the ids: its label and the three ways, ready to race."""
    heads, kv = 4, 2 * 64
    for tokens in args.blocks:
        per_chunk = CHUNK_TOKENS // tokens
        block_bytes = args.layers * heads * tokens * kv * 4
        num_blocks = max(4 * per_chunk, args.cache_mib * 2**20 // block_bytes)
        backing = torch.rand(args.layers, num_blocks, heads, tokens, kv)
        copier = BlockCopier([backing[i] for i in range(args.layers)], num_blocks)
        combined = copier.combined
        assert combined is not None and combined.stride(1) == heads * tokens * kv
        out = torch.empty(copier.chunk_shape(per_chunk))
        shapes = {"one run": per_chunk, "runs of 2": 2, "single": 1}
        for label, run in shapes.items():
            if run > per_chunk or (label == "runs of 2" and per_chunk < 4):
                continue
            pool = [_ids(rng, num_blocks, per_chunk, run) for _ in range(64)]
            if op == "gather":
                fns = {
                    "indexed": functools.partial(_gather_indexed, copier),
                    "runs": functools.partial(_gather_runs, combined),
                    "memmove": functools.partial(_gather_memmove, combined),
                }
                # every way gives every block's bytes (checked once per case, untimed)
                for fn in fns.values():
                    out.zero_()
                    fn(iter(pool), out)
                    assert torch.equal(out, backing[:, pool[0]])
            else:
                assert copier._memmove_scatters  # the library's scatter is the memmove way
                fns = {
                    "indexed": functools.partial(_scatter_indexed, combined),
                    "runs": functools.partial(_scatter_runs, combined),
                    "memmove": functools.partial(_scatter_library, copier),
                }
                out.copy_(torch.rand(out.shape))
                for fn in fns.values():
                    backing[:, pool[0]] = 0.0
                    fn(iter(pool), out)
                    assert torch.equal(backing[:, pool[0]], out)
            cycle = itertools.cycle(pool)
            yield (
                f"{tokens:>5} {label:<10}",
                {w: functools.partial(fn, cycle, out) for w, fn in fns.items()},
            )
        del backing, copier, combined


def _verdict(ratio: float, aa: float) -> str:
    if max(ratio, 1 / ratio) <= aa:
        return "within noise"
    return "faster" if ratio > 1 else "slower"


def _race(args: argparse.Namespace, op: str) -> None:
    print(
        f"  {'op':<8} {'block':>5} {'ids':<10} {'indexed':>13} {'runs':>13} {'memmove':>13}"
        f"  {'A/A':>4}  {'indexed/runs':<26} indexed/memmove"
    )
    for label, ways in _cases(args, op, random.Random(5)):
        contenders: dict[str, Callable[[], object]] = {}
        for w, fn in ways.items():
            contenders[w] = contenders[w + "2"] = fn
        s = interleaved_samples(contenders, rounds=args.rounds, block=args.block)
        aa = max(aa_spread(s[w], s[w + "2"]) for w in WAYS)
        med = {w: pct(s[w], 50) for w in WAYS}
        times = [f"{med[w] * 1e6:5.0f} / {pct(s[w], 90) * 1e6:5.0f}" for w in WAYS]
        cols = []
        for w in ("runs", "memmove"):
            r = med["indexed"] / med[w]
            cols.append(f"{r:6.2f}x {w} {_verdict(r, aa):<12}")
        print(
            f"  {op:<8} {label} {' '.join(f'{t:>13}' for t in times)}  {aa:4.2f}  {'  '.join(cols)}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--cache-mib", type=int, default=1024, help="size of the synthetic cache")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=5, help="calls per way per round")
    ap.add_argument(
        "--ops", nargs="+", choices=("gather", "scatter"), default=["gather", "scatter"]
    )
    ap.add_argument(
        "--conditions",
        nargs="+",
        choices=("quiet", "loaded"),
        default=["quiet", "loaded"],
        help="loaded: one busy process per core (bench_copy.py's load) during the race",
    )
    args = ap.parse_args()

    print(
        f"copies of one {CHUNK_TOKENS}-token chunk ({args.layers} layers, 4 KV heads of "
        f"64, float32) from and into a {args.cache_mib} MiB synthetic cache; torch threads "
        f"{torch.get_num_threads()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}; times per chunk in us, median / p90"
    )
    for cond in args.conditions:
        procs = start_load(3600) if cond == "loaded" else []
        try:
            if procs:
                print(f"loaded: {len(procs)} processes, each float32 1024x1024 matmuls on 1 thread")
            else:
                print("quiet: nothing else started by this benchmark")
            for op in args.ops:
                _race(args, op)
        finally:
            stop_load(procs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
