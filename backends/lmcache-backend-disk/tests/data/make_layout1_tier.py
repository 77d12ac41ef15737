"""Write ``layout1_tier.tar.gz``: a disk tier as versions before layout 2 wrote it.

Run with an older version's code first on the path (the committed archive was written by
commit db9079e)::

    git archive db9079e lmcache_core backends/lmcache-backend-disk/src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:/tmp/old/backends/lmcache-backend-disk/src \\
        .venv/bin/python backends/lmcache-backend-disk/tests/data/make_layout1_tier.py

The values are :func:`value` of each key, so tests check every byte read back.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tarfile
import tempfile

import torch

NAMESPACES = {
    "a": {"model_name": "layout1-a", "kv_dtype": "float16", "block_size": 16},
    "b": {"model_name": "layout1-b", "kv_dtype": "float16", "block_size": 16},
}
KEYS = {"a": range(4), "b": range(2)}


def value(ns: str, i: int) -> torch.Tensor:
    """The stored value of chunk ``i`` of namespace ``ns`` (1,024 float16 values)."""
    base = 1000 * (ord(ns) - ord("a")) + 10 * i
    return (torch.arange(1024, dtype=torch.float32) + base).to(torch.float16)


async def main(out: str) -> None:
    from lmcache_backend_disk import DiskBackend

    from lmcache_core.keys import CacheEngineKey, Namespace

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "tier")
        for ns, fields in NAMESPACES.items():
            b = DiskBackend({"path": root, "max_bytes": "64MiB"}, namespace=Namespace(**fields))
            await b.start()
            try:
                keys = [
                    CacheEngineKey(fields["model_name"], 1, 0, i + 1, "float16") for i in KEYS[ns]
                ]
                assert all(await b.batched_put(keys, [value(ns, i) for i in KEYS[ns]]))
                print(ns, [b._rel(k) for k in keys])
            finally:
                await b.close()
        with tarfile.open(out, "w:gz") as tar:
            tar.add(root, arcname="tier")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    asyncio.run(
        main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "layout1_tier.tar.gz"))
    )
