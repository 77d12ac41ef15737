"""Helpers shared by the gds backend's tests."""

from __future__ import annotations

import os

import torch
from lmcache_backend_gds import GdsBackend

from lmcache_core import format as fmt
from lmcache_core.keys import CacheEngineKey


def object_path(backend: GdsBackend, key: CacheEngineKey) -> str:
    """Absolute path of ``key``'s object file (in the stripe that holds it)."""
    stripe = backend.stripes[backend.stripe_index(key)]
    return os.path.join(stripe.root, stripe._rel(key))


def corrupt_file(path: str, kind: str, key: CacheEngineKey) -> None:
    """Damage the object file at ``path`` in place on the medium: ``flip`` one data byte,
    ``truncate`` it mid-data, or replace it with a valid ``foreign`` object of another
    key (same namespace, same shape)."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    header = fmt.decode_header(raw, total_size=len(raw))
    if kind == "flip":
        raw[header.data_offset + header.data_nbytes // 2] ^= 0x5A
    elif kind == "truncate":
        raw = raw[: header.data_offset + header.data_nbytes // 2]
    elif kind == "foreign":
        other = CacheEngineKey(
            key.model_name, key.world_size, key.worker_id, (key.chunk_hash + 1) % (1 << 128),
            key.dtype,
        )  # fmt: skip
        value = torch.empty(header.shape, dtype=header.dtype)
        fmt.tensor_bytes(value)[:] = raw[header.data_offset : header.total_size]
        raw = bytearray(fmt.encode(other, header.namespace, value))
    else:
        raise ValueError(f"unknown corruption {kind!r}")
    tmp = path + ".corrupt"
    with open(tmp, "wb") as f:
        f.write(raw)
    os.replace(tmp, path)
