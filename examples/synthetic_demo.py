"""Store and reload synthetic KV chunks through lmcache-core's public API (no vLLM).

A prompt is cut into 256-token chunks with prefix-chained keys; each chunk's "KV" (a
random tensor shaped like a small model's) is stored in the cpu backend; a second prompt
sharing the first half is then looked up, and the shared chunks are hits loaded into
reused buffers. Run: .venv/bin/python examples/synthetic_demo.py
"""

from __future__ import annotations

import time

import torch

from lmcache_core import ChunkedTokenDatabase, CPUBackend, SyncBackend, format_bytes

CHUNK = 256
KV_SHAPE = (4, 2, CHUNK, 2, 64)  # layers, K/V, tokens, kv heads, head size


def main() -> None:
    db = ChunkedTokenDatabase(chunk_size=CHUNK, model_name="synthetic-demo", dtype="float16")
    store = SyncBackend(CPUBackend({"max_bytes": "256MiB"}))
    store.start()
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(0, 32000, (4096,), generator=gen).tolist()

    t0 = time.perf_counter()
    keys = [key for _, _, key in db.process_tokens(doc)]
    values = [torch.randn(KV_SHAPE, generator=gen).half() for _ in keys]
    stored = store.batched_put(keys, values)
    print(
        f"stored {sum(stored)} chunks ({format_bytes(sum(v.nbytes for v in values))}) "
        f"in {(time.perf_counter() - t0) * 1e3:.1f} ms"
    )

    follow_up = doc[:2048] + torch.randint(0, 32000, (2048,), generator=gen).tolist()
    keys2 = [key for _, _, key in db.process_tokens(follow_up)]
    present = store.batched_contains(keys2)
    prefix = next((i for i, p in enumerate(present) if not p), len(present))
    outs = [torch.empty(KV_SHAPE, dtype=torch.float16) for _ in range(prefix)]
    t1 = time.perf_counter()
    hits = store.batched_get_into(keys2[:prefix], outs)
    dt = time.perf_counter() - t1
    assert all(hits) and all(torch.equal(o, v) for o, v in zip(outs, values, strict=False))
    print(
        f"follow-up prompt: {prefix} of {len(keys2)} chunks hit ({prefix * CHUNK} tokens), "
        f"loaded {format_bytes(sum(o.nbytes for o in outs))} in {dt * 1e3:.2f} ms, bit-exact"
    )
    print(
        "backend stats:",
        {
            k: v
            for k, v in store.stats().items()
            if k in ("hits", "misses", "entries", "used_bytes")
        },
    )
    store.close()


if __name__ == "__main__":
    main()
