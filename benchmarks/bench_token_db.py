"""Token database throughput on a 32k-token prompt in 256-token chunks.

Prints, measured in the same run (interleaved, medians):
* list input: full ``process_tokens`` (real keys) against list-to-int32 conversion alone,
  both with numpy (``np.array(tokens, dtype=np.int32)``) and with ``struct.pack`` (the
  fastest pure-Python conversion found here); and full ``process_tokens`` with the
  compiled ``lmcache_core._speedups.int32_le`` (the default where it was built) against
  the same with it turned off (the ``struct`` fallback);
* array input: tokens/s of full ``process_tokens``;
* the hash loop alone against raw xxh3_128 over the same chunk bytes.

Run: .venv/bin/python benchmarks/bench_token_db.py
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
from xxhash import xxh3_128_digest

sys.path.insert(0, str(Path(__file__).parent))
from _util import interleaved

from lmcache_core import ChunkedTokenDatabase, token_db

N, CHUNK = 32768, 256


def main() -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 150_000, N, dtype=np.int32)
    lst = arr.tolist()
    db = ChunkedTokenDatabase(chunk_size=CHUNK, model_name="bench")
    data = memoryview(arr.tobytes())
    cb = CHUNK * 4
    pack = struct.Struct(f"<{N}i").pack

    def full_list() -> None:
        for _ in db.process_tokens(lst):
            pass

    native = token_db._native_int32_le

    def full_list_fallback() -> None:  # the struct path, as without a C compiler
        token_db._native_int32_le = None
        try:
            for _ in db.process_tokens(lst):
                pass
        finally:
            token_db._native_int32_le = native

    def full_array() -> None:
        for _ in db.process_tokens(arr):
            pass

    def conv_numpy() -> None:
        np.array(lst, dtype=np.int32)

    def conv_struct() -> None:
        pack(*lst)

    def raw_xxh3() -> None:
        for i in range(0, N * 4, cb):
            xxh3_128_digest(data[i : i + cb])

    def hash_loop() -> None:  # the chain as process_tokens computes it, without keys
        p = b"\0" * 16
        for i in range(0, N * 4, cb):
            p = xxh3_128_digest(p + data[i : i + cb], CHUNK)

    t = interleaved(
        {
            "full_list": full_list,
            "full_list_b": full_list,
            "full_list_fallback": full_list_fallback,
            "full_array": full_array,
            "conv_numpy": conv_numpy,
            "conv_struct": conv_struct,
            "raw_xxh3": raw_xxh3,
            "hash_loop": hash_loop,
        },
        repeat=60,
    )
    us = {k: v * 1e6 for k, v in t.items()}
    print(f"32k tokens, chunk {CHUNK} ({N // CHUNK} chunks), medians of 60 interleaved runs")
    for k, v in us.items():
        print(f"  {k:18s} {v:9.1f} us")
    print(
        f"list input: full / numpy conversion alone   = {t['conv_numpy'] / t['full_list']:.2f}x"
        " (>= 0.9x target; >1 means faster than converting with numpy)"
    )
    print(f"list input: full / struct conversion alone  = {t['conv_struct'] / t['full_list']:.2f}x")
    print(
        f"list input: compiled helper {'on' if native else 'NOT BUILT'}, speed vs the "
        f"struct fallback = {t['full_list_fallback'] / t['full_list']:.2f}x (A/A of the "
        f"full list path: {max(t['full_list'], t['full_list_b']) / min(t['full_list'], t['full_list_b']):.2f})"
    )
    print(f"array input: {N / t['full_array'] / 1e6:.0f} M tokens/s (target >= 300)")
    print(
        f"hash loop vs raw xxh3_128 over same bytes  = {t['raw_xxh3'] / t['hash_loop']:.2f}x (target >= 0.8x)"
    )


if __name__ == "__main__":
    main()
