"""Reading what an engine left in a disk tier, and comparing chunks with a tolerance.

Every object is decoded and verified with the project's own object format; its key says
which chunk it is. A chunk is identified by computing, in the test process, the keys the
connector gives a token sequence (with a ``cache_salt``: the same tokens computed cold
under another key, the reference).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from engine_driver import disk_objects

from lmcache_core.format import decode
from lmcache_core.keys import Namespace
from lmcache_core.token_db import ChunkedTokenDatabase


def namespace_of(scheduler_stats: dict[str, Any]) -> Namespace:
    return Namespace.from_json(json.dumps(scheduler_stats["namespace"]))


def chunk_keys(
    ns: Namespace, tokens: list[int], salt: str | None = None, rank: int = 0, world_size: int = 1
) -> list[str]:
    """Key strings of the full chunks of ``tokens`` (the connector's keying: a
    ``cache_salt`` enters chunk 0's extra keys, and the chain carries it on)."""
    db = ChunkedTokenDatabase(
        namespace=ns, world_size=world_size, worker_id=rank, dtype=ns.kv_dtype
    )
    n = len(tokens) // ns.chunk_size
    extra: list[Any] | None = None
    if salt:
        extra = [[("salt", salt)]] + [None] * (n - 1)
    return [str(k) for k in db.keys(tokens[: n * ns.chunk_size], extra_keys=extra)]


def read_tier(disk: Path) -> dict[str, torch.Tensor]:
    """Every object in a disk tier, verified, by key string."""
    out = {}
    for rel in disk_objects(str(disk)):
        header, tensor = decode((disk / rel).read_bytes())
        out[header.key] = tensor
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())
