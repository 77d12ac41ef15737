"""The vLLM connector's save gather on CPU, without an engine: one indexed copy of a
chunk's blocks (``index_select`` over every layer at once) against one plain copy per run
of consecutive blocks, from a synthetic paged KV cache laid out as vLLM 0.32 lays it out
on CPU (every layer in one allocation, ``[layers, blocks, heads, tokens, K|V]``).

The gather runs on vLLM's engine thread once per saved chunk (``wait_for_save``), so its
time is added to every step that saves. Defaults: the demo model's 8 layers, 4 KV heads
of 64, float32, chunks of 256 tokens (4 MiB); block sizes 16, 32, 64 and 128 tokens (128
is vLLM's CPU default); per block size three shapes of a chunk's block ids: one run,
runs of two blocks, single blocks at random places. Each gather reads blocks at random
places of a cache far larger than the CPU caches (``--cache-mib``).

Per case the two ways, each registered twice (the A/A pair), are measured round-robin
(``interleaved_samples``); printed: medians per chunk, the speed ratio indexed / runs
(> 1: runs faster) with the larger of the two A/A spreads beside it, a verdict (inside
the spread: within noise), and which way ``BlockCopier.gather`` picks there
(:func:`~lmcache_core.integrations.vllm.layout.runs_pay`).

Run: .venv/bin/python benchmarks/bench_gather.py [--rounds 15] [--cache-mib 1024]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread, interleaved_samples, pct

from lmcache_core.integrations.vllm.layout import BlockCopier, block_runs, runs_pay

CHUNK_TOKENS = 256


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
    copier.gather_indexed(torch.tensor(next(ids)), out)


def _gather_runs(copier: BlockCopier, ids: Iterator[list[int]], out: torch.Tensor) -> None:
    copier.gather_runs(block_runs(next(ids)), out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--cache-mib", type=int, default=1024, help="size of the synthetic cache")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=5, help="calls per way per round")
    args = ap.parse_args()

    heads, kv = 4, 2 * 64
    rng = random.Random(5)
    print(
        f"gather of one {CHUNK_TOKENS}-token chunk ({args.layers} layers, {heads} KV heads of "
        f"64, float32) from a {args.cache_mib} MiB synthetic cache; torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  {'block':>5} {'ids':<14} {'indexed':>9} {'runs':>9} {'indexed/runs':>12} "
        f"{'A/A':>5}  verdict          gather picks"
    )
    for tokens in args.blocks:
        per_chunk = CHUNK_TOKENS // tokens
        block_bytes = args.layers * heads * tokens * kv * 4
        num_blocks = max(4 * per_chunk, args.cache_mib * 2**20 // block_bytes)
        backing = torch.rand(args.layers, num_blocks, heads, tokens, kv)
        copier = BlockCopier([backing[i] for i in range(args.layers)], num_blocks)
        assert copier.one_view
        out = torch.empty(copier.chunk_shape(per_chunk))
        ref = torch.empty_like(out)
        shapes = {"one run": per_chunk, "runs of 2": 2, "single": 1}
        for label, run in shapes.items():
            if run > per_chunk or (label == "runs of 2" and per_chunk < 4):
                continue
            pool = [_ids(rng, num_blocks, per_chunk, run) for _ in range(64)]
            # both ways give the same bytes (checked once per case, outside the timing)
            ids0 = pool[0]
            copier.gather_runs(block_runs(ids0), out)
            copier.gather_indexed(torch.tensor(ids0), ref)
            assert torch.equal(out, ref) and torch.equal(out[:, 0], backing[:, ids0[0]])
            cycle = itertools.cycle(pool)
            indexed = functools.partial(_gather_indexed, copier, cycle, out)
            runs = functools.partial(_gather_runs, copier, cycle, out)
            s = interleaved_samples(
                {"indexed": indexed, "indexed2": indexed, "runs": runs, "runs2": runs},
                rounds=args.rounds,
                block=args.block,
            )
            ratio = pct(s["indexed"], 50) / pct(s["runs"], 50)
            aa = max(aa_spread(s["indexed"], s["indexed2"]), aa_spread(s["runs"], s["runs2"]))
            if max(ratio, 1 / ratio) <= aa:
                verdict = "within noise"
            else:
                verdict = "runs faster" if ratio > 1 else "indexed faster"
            n_runs = len(block_runs(pool[0]))
            picks = "runs" if runs_pay(n_runs, per_chunk * copier.block_nbytes) else "indexed"
            print(
                f"  {tokens:>5} {label:<14} {pct(s['indexed'], 50) * 1e6:7.0f}us "
                f"{pct(s['runs'], 50) * 1e6:7.0f}us {ratio:11.2f}x {aa:5.2f}  {verdict:<16} "
                f"{picks}"
            )
        del backing, copier
    return 0


if __name__ == "__main__":
    sys.exit(main())
