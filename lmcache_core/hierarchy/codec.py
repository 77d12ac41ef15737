"""A tier's KV codec: encodes what the tier stores, decodes what it loads, counts both.

A tier configured with ``codec:`` stores every chunk as a coded envelope (a uint8
tensor, :func:`lmcache_core.codecs.wrap_envelope`) and decodes it into the caller's
buffer on load. A stored value that does not decode (damaged, another codec's or
options', another dtype or shape) is a miss, counted in ``decode_errors``; a chunk the
codec refuses to encode (non-finite values for a lossy codec) is not stored, counted in
``encode_errors``. The work runs on a thread, off the event loop.

Every codec of a hierarchy is recorded in its namespace (:func:`namespace_codec`): a
coded tier's objects are envelopes, which a hierarchy without that codec must never be
offered, and a lossy codec's chunks are not the exact KV, which an exact instance must
never load. Two hierarchies sharing a disk path or bucket with different codecs (or
none) therefore never see each other's chunks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..codecs import (
    CodecError,
    KVCodec,
    codec_label,
    read_envelope,
    unwrap_envelope_into,
    wrap_envelope,
)

__all__ = ["CodedBackendView", "TierCodec", "namespace_codec"]

log = logging.getLogger("lmcache_core.codecs")


def namespace_codec(labels: Sequence[tuple[str, bool]]) -> str:
    """The namespace's ``codec`` field for a hierarchy whose tiers use these codecs
    (``(label, lossless)`` pairs): empty without codecs, else ``lossy:`` or
    ``lossless:`` followed by the sorted, distinct labels joined with ``+``."""
    if not labels:
        return ""
    kind = "lossless" if all(lossless for _, lossless in labels) else "lossy"
    return f"{kind}:" + "+".join(sorted({label for label, _ in labels}))


class TierCodec:
    """One tier's codec with its counters (thread-safe)."""

    def __init__(self, codec: KVCodec) -> None:
        self.codec = codec
        self.label = codec_label(codec.name, codec.options())
        self.lossless = bool(codec.lossless)
        self._lock = threading.Lock()
        self._counts = {
            "encoded": 0,
            "decoded": 0,
            "encode_errors": 0,
            "decode_errors": 0,
            "raw_bytes_encoded": 0,
            "coded_bytes_written": 0,
            "coded_bytes_read": 0,
        }

    def _add(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self._counts[k] += v

    def encode(self, value: torch.Tensor) -> torch.Tensor | None:
        """The envelope to store for ``value``, or ``None`` (counted) if it cannot be coded."""
        try:
            # vLLM's buffers are inference tensors, and the codec's scratch buffers become
            # ones too: every codec call of a tier runs in inference mode
            with torch.inference_mode():
                env = wrap_envelope(self.codec, value)
        except CodecError as exc:
            self._add(encode_errors=1)
            log.debug("codec %s refused a chunk: %s", self.label, exc)
            return None
        except Exception:  # a codec plugin's bug: the chunk is not stored, the tier goes on
            self._add(encode_errors=1)
            log.exception("codec %s failed to encode a chunk (not stored)", self.label)
            return None
        self._add(encoded=1, raw_bytes_encoded=value.nbytes, coded_bytes_written=env.nbytes)
        return env

    def decode_into(self, stored: torch.Tensor, out: torch.Tensor) -> bool:
        """Decode a stored envelope into ``out``; ``False`` (a miss, counted) if it cannot."""
        try:
            with torch.inference_mode():
                unwrap_envelope_into(self.codec, stored, out)
        except CodecError as exc:
            self._add(decode_errors=1)
            log.warning("codec %s: a stored chunk does not decode (a miss): %s", self.label, exc)
            return False
        except Exception:  # a codec plugin's bug: a miss, never wrong KV served
            self._add(decode_errors=1)
            log.exception("codec %s failed to decode a chunk (a miss)", self.label)
            return False
        self._add(decoded=1, coded_bytes_read=stored.nbytes)
        return True

    def decode_new(self, stored: torch.Tensor) -> torch.Tensor | None:
        """Decode a stored envelope into a new tensor; ``None`` (counted) if it cannot."""
        try:
            env = read_envelope(stored)
            out = torch.empty(env.shape, dtype=getattr(torch, env.dtype))
        except (CodecError, AttributeError, TypeError, RuntimeError, ValueError) as exc:
            self._add(decode_errors=1)
            log.warning("codec %s: a stored chunk does not decode (a miss): %s", self.label, exc)
            return None
        return out if self.decode_into(stored, out) else None

    async def encode_async(self, value: torch.Tensor) -> torch.Tensor | None:
        """:meth:`encode` on a thread."""
        return await asyncio.get_running_loop().run_in_executor(None, self.encode, value)

    async def decode_into_async(self, stored: torch.Tensor, out: torch.Tensor) -> bool:
        """:meth:`decode_into` on a thread."""
        return await asyncio.get_running_loop().run_in_executor(None, self.decode_into, stored, out)

    def stats(self) -> dict[str, Any]:
        """The codec's label and counters."""
        with self._lock:
            return {"codec": self.label, "lossless": self.lossless, **self._counts}


class CodedBackendView:
    """The data operations of a backend seen through a tier's codec: stores write
    envelopes, loads decode them (into the caller's buffer, or a new tensor). Presence,
    pins and everything else go to the backend itself."""

    def __init__(self, backend: Any, codec: TierCodec) -> None:
        self.backend = backend
        self.codec = codec

    async def get(self, key: Any) -> torch.Tensor | None:
        """The decoded chunk, or ``None`` (missing or not decodable)."""
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[Any]) -> list[torch.Tensor | None]:
        """``get`` for each key (one thread hop for the batch's decoding)."""
        stored = list(await self.backend.batched_get(keys))
        codec = self.codec

        def decode_all() -> list[torch.Tensor | None]:
            return [None if s is None else codec.decode_new(s) for s in stored]

        if not any(s is not None for s in stored):
            return [None] * len(keys)
        return await asyncio.get_running_loop().run_in_executor(None, decode_all)

    async def get_into(self, key: Any, out: torch.Tensor) -> bool:
        """Decode ``key``'s chunk into ``out``; ``False`` on a miss."""
        return (await self.batched_get_into([key], [out]))[0]

    async def batched_get_into(
        self, keys: Sequence[Any], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        """``get_into`` for each pair (one thread hop for the batch's decoding)."""
        stored = list(await self.backend.batched_get(keys))
        codec = self.codec

        def decode_all() -> list[bool]:
            return [
                s is not None and codec.decode_into(s, o) for s, o in zip(stored, outs, strict=True)
            ]

        if not any(s is not None for s in stored):
            return [False] * len(keys)
        return await asyncio.get_running_loop().run_in_executor(None, decode_all)

    async def put(self, key: Any, value: torch.Tensor, donate: bool = False) -> bool:
        """Encode ``value`` and store the envelope (a new tensor: donated to the backend)."""
        env = await self.codec.encode_async(value)
        if env is None:
            return False
        return bool(await self.backend.put(key, env, donate=True))
