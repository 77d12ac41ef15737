"""The vLLM connector's load before the forward pass, without an engine: one hit of N
chunks from the ``cpu`` tier into a synthetic paged KV cache laid out as vLLM 0.32 lays
it out on CPU (every layer in one allocation, ``[layers, blocks, heads, tokens, K|V]``).

Two ways, each registered twice (the A/A pair), interleaved in blocks:

* ``staged``: what tiers that cannot lend still do -- ``get_into`` from the tier into
  reused staging buffers, then the scatter into the cache (two copies per chunk);
* ``borrowed``: what the connector does with the ``cpu`` tier -- borrow a read-only view
  of each stored chunk (``ThreadSafeBorrows``), scatter from it, end the borrows (one
  copy per chunk).

Defaults match the hit scenario of ``bench_vllm.py``: the demo model's 8 layers, 4 KV
heads of 64, float32, blocks of 128 tokens, chunks of 256 tokens (4 MiB), 8 chunks per
hit (a 2048-token prompt, 32 MiB).

Run: .venv/bin/python benchmarks/bench_load_copy.py [--chunks 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread, interleaved_samples, pct

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.config import load_config
from lmcache_core.integrations.vllm.layout import BlockCopier
from lmcache_core.integrations.vllm.storage import Storage


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=3)
    args = ap.parse_args()

    layers, heads, block_tokens, kv = args.layers, 4, 128, 2 * 64
    blocks_per_chunk = 2
    num_blocks = 2 * blocks_per_chunk * args.chunks + 16
    backing = torch.zeros(layers, num_blocks, heads, block_tokens, kv)
    copier = BlockCopier([backing[i] for i in range(layers)], num_blocks)
    ns = Namespace(model_name="bench", chunk_size=256, block_size=block_tokens)
    db = ChunkedTokenDatabase(namespace=ns)
    cfg = load_config(
        {
            "chunk_size": 256,
            "tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "1GiB"}}],
        }
    )
    storage = Storage(cfg, ns)
    shape = copier.chunk_shape(blocks_per_chunk)
    keys = [db.make_key(i) for i in range(args.chunks)]
    for k in keys:
        assert storage.put([k], [torch.randn(shape)]) == [True]
    staging = [torch.empty(shape) for _ in keys]
    # every other run of blocks, as a fresh request's blocks usually are not one run
    block_ids = [
        [2 * blocks_per_chunk * j + b for b in range(blocks_per_chunk)] for j in range(len(keys))
    ]

    def staged() -> None:
        hits = storage.get_into_memory(keys, staging)
        assert all(hits)
        for buf, ids in zip(staging, block_ids, strict=True):
            copier.scatter_from_host(buf, ids)

    def borrowed() -> None:
        res = storage.borrow_from_memory(keys)
        assert res is not None
        try:
            for b, ids in zip(res, block_ids, strict=True):
                assert b is not None
                copier.scatter_from_host(b[1], ids)
        finally:
            storage.end_borrows([b[0] for b in res if b is not None])

    samples = interleaved_samples(
        {"staged": staged, "staged2": staged, "borrowed": borrowed, "borrowed2": borrowed},
        rounds=args.rounds,
        block=args.block,
    )
    storage.close()
    nbytes = args.chunks * copier.block_nbytes * blocks_per_chunk
    print(
        f"load of {args.chunks} chunks ({nbytes / 2**20:.0f} MiB) from the cpu tier into a "
        f"synthetic paged cache; torch threads {torch.get_num_threads()}, load average "
        f"{os.getloadavg()[0]:.1f}; {len(samples['staged'])} samples each"
    )
    for name in ("staged", "borrowed"):
        s = samples[name]
        print(
            f"  {name:<9} median {pct(s, 50) * 1e3:6.2f} ms  p90 {pct(s, 90) * 1e3:6.2f} ms  "
            f"({nbytes / pct(s, 50) / 1e9:.1f} GB/s); A/A spread "
            f"{aa_spread(s, samples[name + '2']):.2f}"
        )
    ratio = pct(samples["borrowed"], 50) / pct(samples["staged"], 50)
    print(f"  borrowed / staged: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
