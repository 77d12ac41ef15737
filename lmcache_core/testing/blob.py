"""Test helpers for byte-store backends (:class:`lmcache_core.blob.BlobBackend`)."""

from __future__ import annotations

import torch

from .. import format as fmt
from ..blob import BlobBackend
from ..keys import CacheEngineKey

__all__ = ["corrupt_blob"]


async def corrupt_blob(backend: BlobBackend, key: CacheEngineKey, kind: str) -> None:
    """Damage ``key``'s stored object through the backend's own byte operations.

    ``kind``: ``"flip"`` changes one byte of the tensor data, ``"truncate"`` cuts the
    object in the middle of its data, ``"foreign"`` replaces it with a valid object of
    another key. The fixture ``corrupt_entry`` of
    :class:`~lmcache_core.testing.CorruptionContract` for any byte store.
    """
    name = backend.object_name(key)
    data = await backend._op("read_object", name)
    assert data is not None, f"no object {name} to corrupt"
    raw = bytearray(bytes(data))
    if kind == "flip":
        header = fmt.decode_header(raw, total_size=len(raw))
        pos = header.data_offset + header.data_nbytes // 2
        raw[pos] ^= 0x5A
    elif kind == "truncate":
        header = fmt.decode_header(raw, total_size=len(raw))
        raw = raw[: header.data_offset + header.data_nbytes // 2]
    elif kind == "foreign":
        header = fmt.decode_header(raw, total_size=len(raw))
        other = CacheEngineKey(key.model_name, key.world_size, key.worker_id,
                               (key.chunk_hash + 1) % (1 << 128), key.dtype)  # fmt: skip
        value = torch.empty(header.shape, dtype=header.dtype)
        fmt.tensor_bytes(value)[:] = raw[header.data_offset : header.total_size]
        raw = bytearray(fmt.encode(other, header.namespace, value))
    else:
        raise ValueError(f"unknown corruption {kind!r}")
    # deleted first: a store may skip writing an object whose header checksum it already has
    await backend._op("delete_object", name)
    await backend._op("write_object", name, memoryview(bytes(raw)))
    backend._presence.forget(name)
