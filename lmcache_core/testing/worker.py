"""Child process of the contract suite's multi-process mixins.

``python -m lmcache_core.testing.worker SPEC_JSON MODE`` opens the backend described by
``SPEC_JSON`` (``{"target": "pkg.mod:Class", "options": {...}, "namespace": JSON|null}``)
and then, by ``MODE``:

``put``      stores :func:`shared_value` ``i`` under :func:`shared_key` ``i`` for i in 0..3;
``check``    exits 0 when key 4 holds value 4 bit-exactly, 3 otherwise;
``forever``  stores big values under keys 0..3 in a loop (each key alternates between two
             known values), printing ``ready`` after the first round, until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import torch

from ..keys import CacheEngineKey, Namespace
from ..plugins.registry import load_backend_class
from .contract import random_tensor, same_bits

__all__ = ["killed_writer_candidates", "open_from_spec", "shared_key", "shared_value"]

#: Bytes of each value the ``forever`` writer stores (large, so a kill lands mid-put).
BIG = 4 << 20


def shared_key(i: int, tag: str = "proc") -> CacheEngineKey:
    """Key ``i`` of the multi-process tests (the same in every process)."""
    return CacheEngineKey(
        "contract-model", 1, 0, (0xC0FFEE << 64) + (hash_tag(tag) << 8) + i, "uint8"
    )


def hash_tag(tag: str) -> int:
    """A small stable number for ``tag`` (never Python's ``hash()``)."""
    return sum((i + 1) * b for i, b in enumerate(tag.encode())) % (1 << 40)


def shared_value(i: int, nbytes: int = 64 << 10) -> torch.Tensor:
    """Value ``i`` of the multi-process tests."""
    return random_tensor((nbytes,), torch.uint8, seed=1000 + i)


def killed_writer_candidates(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two values the ``forever`` writer alternates between for key ``j``."""
    return shared_value(10 + 2 * j, BIG), shared_value(11 + 2 * j, BIG)


def open_from_spec(spec: dict[str, Any]) -> Any:
    """A new, unstarted backend from a spec (see the module docstring)."""
    cls: Any = load_backend_class(spec["target"])
    ns = spec.get("namespace")
    namespace = Namespace.from_json(ns) if ns else None
    return cls(spec.get("options") or {}, namespace=namespace, name=spec.get("name"))


async def _main(spec: dict[str, Any], mode: str) -> int:
    backend = open_from_spec(spec)
    await backend.start()
    try:
        if mode == "put":
            for i in range(4):
                assert await backend.put(shared_key(i), shared_value(i))
            return 0
        if mode == "check":
            return 0 if same_bits(await backend.get(shared_key(4)), shared_value(4)) else 3
        if mode == "forever":
            values = [killed_writer_candidates(j) for j in range(4)]
            rnd = 0
            while True:
                for j in range(4):
                    await backend.put(shared_key(j, "killed"), values[j][rnd % 2])
                if rnd == 0:
                    print("ready", flush=True)
                rnd += 1
        raise SystemExit(f"unknown mode {mode!r}")
    finally:
        await backend.close()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    return asyncio.run(_main(spec, argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
