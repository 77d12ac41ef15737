"""KV codecs: the interface a codec plugin implements, and the framing codecs share.

A codec turns one chunk's KV tensor into bytes and back. It is chosen per tier in the
configuration (``codec: {name: ..., options: {...}}``), provided by a plugin through the
``lmcache_register_codecs`` hook, and recorded (name and options) in every object's
header; a lossy codec also marks its hierarchy's namespace, so exact and lossy instances
sharing a tier never see each other's chunks.

Contract of :class:`KVCodec` (the first-party codecs' tests check it):

* ``encode(tensor)`` returns the encoded bytes as a buffer that stays valid until the
  next ``encode`` call *in the same thread* (codecs keep grow-only scratch buffers per
  thread; a caller that keeps the bytes copies them, which a tier does anyway when it
  writes an object).
* ``decode_into(buf, out)`` fills the caller's contiguous tensor ``out`` (the dtype and
  shape that were encoded) without allocating an output-sized buffer per call: scratch
  buffers are reused. Bytes that are truncated, corrupted, from another codec or for
  another dtype/size raise :class:`CodecError` (a :class:`~lmcache_core.errors.FormatError`,
  so a tier reports a miss); after it the contents of ``out`` are unspecified.
* A lossless codec restores every bit, for every dtype it accepts; a lossy one declares
  ``lossless = False`` and documents its error bound.
* Codecs are safe to call from several threads at once (scratch buffers are per thread).

Every codec stream starts with the same 40-byte frame (:func:`write_frame`,
:func:`read_frame`): magic, the codec's 4-byte tag, a version, the dtype, the element
count, flags and the body's length, and an ``xxh3_64`` checksum of those and the body. A damaged stream is therefore a
:class:`CodecError` before any decompressor sees it.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from xxhash import xxh3_64

from .errors import FormatError

__all__ = [
    "FRAME_BYTES",
    "CodecError",
    "Envelope",
    "Frame",
    "KVCodec",
    "Scratch",
    "byte_view",
    "codec_label",
    "dtype_code",
    "envelope_codec",
    "read_envelope",
    "read_frame",
    "read_stream_into",
    "unwrap_envelope_into",
    "wrap_envelope",
    "write_frame",
]


class CodecError(FormatError):
    """Encoded KV bytes cannot be decoded: truncated, corrupted, another codec's, or for
    a tensor of another dtype or size. A :class:`FormatError`, so tiers count a miss."""


@runtime_checkable
class KVCodec(Protocol):
    """The interface of a KV codec (see the module docstring for the contract).

    ``name`` is the registered name (``lossless``, ``int8``, ``cachegen`` ...);
    ``lossless`` says whether ``decode_into`` restores every bit; ``options()`` returns
    the codec's options as a JSON-serialisable dict (recorded in each object's header and,
    for a lossy codec, in the namespace: two settings that decode differently must differ
    here).
    """

    name: str
    lossless: bool

    def options(self) -> dict[str, Any]:
        """The options this instance encodes with (JSON-serialisable, canonical)."""
        ...

    def encode(self, tensor: torch.Tensor) -> memoryview:
        """Encode a contiguous CPU tensor; the view is valid until this thread's next call."""
        ...

    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Decode ``buf`` into ``out`` (contiguous, the encoded dtype and element count).

        Raises :class:`CodecError` for bytes it cannot decode into ``out``."""
        ...


def codec_label(name: str, options: Mapping[str, Any] | None = None) -> str:
    """The canonical text of a codec and its options: ``name`` or ``name {json}``.

    This is what an object's header and a lossy namespace record; it is stable (keys
    sorted, compact separators) so equal settings give equal labels."""
    if not options:
        return name
    return f"{name} {json.dumps(dict(options), sort_keys=True, separators=(',', ':'))}"


# ---------------------------------------------------------------------------- dtypes
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
}
for _i, _name in enumerate(("float8_e4m3fn", "float8_e5m2")):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = 10 + _i


def dtype_code(dtype: torch.dtype) -> int:
    """The frame's one-byte code for ``dtype``; raises :class:`CodecError` for others."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise CodecError(f"codecs do not handle dtype {dtype}") from None


# ---------------------------------------------------------------------------- scratch
class Scratch:
    """Grow-only scratch buffers, one set per thread.

    ``get(slot, n, dtype)`` returns a tensor of ``n`` elements backed by the slot's
    buffer, which is reallocated only when a larger one is needed: after the first call
    of a given size, codecs allocate nothing output-sized. ``data_ptr`` identity of the
    returned tensors is what the codec tests check."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _slots(self) -> dict[str, torch.Tensor]:
        slots: dict[str, torch.Tensor] | None = getattr(self._local, "slots", None)
        if slots is None:
            slots = {}
            self._local.slots = slots
        return slots

    def get(self, slot: str, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A 1-D tensor of ``n`` elements of ``dtype`` from the slot's reused buffer."""
        slots = self._slots()
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = max(n * itemsize, 1)
        buf = slots.get(slot)
        if buf is None or buf.numel() < need:
            # grow by 1/8 beyond the need so slightly larger chunks do not reallocate
            buf = torch.empty(need + need // 8 + 64, dtype=torch.uint8)
            slots[slot] = buf
        return buf[: n * itemsize].view(dtype)

    def numpy(self, slot: str, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """``get(slot, n)`` as a numpy uint8 array (same memory)."""
        return self.get(slot, n).numpy()


def byte_view(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A zero-copy numpy uint8 view of a contiguous CPU tensor's bytes."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise CodecError("codecs need a contiguous CPU tensor")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def read_stream_into(reader: Any, target: memoryview, what: str) -> None:
    """Fill ``target`` from a decompressing ``reader`` (an object with ``readinto`` and
    ``read``, e.g. ``zstandard``'s ``stream_reader``) with no output-sized allocation.

    The stream must hold exactly ``len(target)`` bytes: fewer, or one byte more, raise
    :class:`CodecError` naming ``what``. Errors the reader itself raises propagate, so a
    caller can translate its library's own exception type."""
    got = 0
    size = len(target)
    while got < size:
        n = reader.readinto(target[got:])
        if not n:
            break
        got += n
    if got != size or reader.read(1):
        raise CodecError(f"{what} holds other than {size} bytes")


# ---------------------------------------------------------------------------- framing
_FRAME = struct.Struct("<4s4sBBHQQQI")  # 40 bytes: bodies start 8-aligned
#: Size of the frame that starts every codec stream.
FRAME_BYTES = _FRAME.size
_MAGIC = b"LMKC"
_DIGEST_AT = 28  # the checksum covers the frame's fields before it and the body


class Frame:
    """What :func:`read_frame` found: the body (a view into the stream) and its fields."""

    __slots__ = ("body", "flags", "numel", "version")

    def __init__(self, body: memoryview, version: int, flags: int, numel: int) -> None:
        self.body = body
        self.version = version
        self.flags = flags
        self.numel = numel


def write_frame(
    stream: Any,
    tag: bytes,
    version: int,
    dtype: torch.dtype,
    numel: int,
    body_len: int,
    flags: int = 0,
) -> int:
    """Write the frame into ``stream[:FRAME_BYTES]`` for a body already at
    ``stream[FRAME_BYTES:FRAME_BYTES + body_len]``; return the stream's total length."""
    view = memoryview(stream).cast("B")
    _FRAME.pack_into(view, 0, _MAGIC, tag, version, dtype_code(dtype), flags, numel, body_len, 0, 0)
    digest = _digest(view[:_DIGEST_AT], view[FRAME_BYTES : FRAME_BYTES + body_len])
    _FRAME.pack_into(
        view, 0, _MAGIC, tag, version, dtype_code(dtype), flags, numel, body_len, digest, 0
    )
    return FRAME_BYTES + body_len


def _digest(fields: memoryview, body: memoryview) -> int:
    h = xxh3_64()
    h.update(fields)
    h.update(body)
    return int(h.intdigest())


def read_frame(buf: Any, tag: bytes, versions: tuple[int, ...], out: torch.Tensor) -> Frame:
    """Check the frame of ``buf`` against this codec (``tag``, ``versions``) and ``out``.

    Raises :class:`CodecError` for a truncated, corrupted or foreign stream, or one
    encoded for another dtype or element count than ``out``."""
    try:
        view = memoryview(buf).cast("B")
    except TypeError as exc:
        raise CodecError(f"encoded KV must be a bytes-like object: {exc}") from None
    if len(view) < FRAME_BYTES:
        raise CodecError(f"encoded KV is truncated: {len(view)} bytes, no frame")
    magic, got_tag, version, dcode, flags, numel, body_len, digest, reserved = _FRAME.unpack_from(
        view, 0
    )
    if magic != _MAGIC:
        raise CodecError("not an encoded KV stream (bad magic)")
    if got_tag != tag:
        raise CodecError(f"encoded with codec tag {got_tag!r}, this codec reads {tag!r}")
    if reserved:
        raise CodecError("encoded KV frame is corrupted (reserved field set)")
    if version not in versions:
        raise CodecError(f"unsupported {tag.decode(errors='replace')} stream version {version}")
    if dcode != dtype_code(out.dtype):
        raise CodecError(f"stream holds another dtype than the output tensor's {out.dtype}")
    if numel != out.numel():
        raise CodecError(f"stream holds {numel} elements, output tensor has {out.numel()}")
    if not out.is_contiguous() or out.device.type != "cpu":
        raise CodecError("output tensor must be a contiguous CPU tensor")
    if len(view) != FRAME_BYTES + body_len:
        raise CodecError(
            f"encoded KV is {len(view)} bytes, its frame says {FRAME_BYTES + body_len} (truncated?)"
        )
    body = view[FRAME_BYTES:]
    if _digest(view[:_DIGEST_AT], body) != digest:
        raise CodecError("encoded KV checksum mismatch: corrupted")
    return Frame(body, version, flags, numel)


# ---------------------------------------------------------------------------- envelope
# A tier with a codec stores, as the object's tensor, a uint8 *envelope*: this magic, the
# JSON length, a JSON document naming the codec, its options and the decoded tensor's
# dtype and shape, padding to 8 bytes, then the codec's stream. Backends store it like
# any tensor; the object header records the codec (:func:`envelope_codec`).
_ENV_MAGIC = b"LMKE"
_ENV_HEAD = struct.Struct("<4sI")
_ENV_MAX_JSON = 1 << 16


class Envelope:
    """What :func:`read_envelope` found: codec label parts, decoded dtype/shape, stream."""

    __slots__ = ("codec", "dtype", "options", "shape", "stream")

    def __init__(
        self,
        codec: str,
        options: dict[str, Any],
        dtype: str,
        shape: tuple[int, ...],
        stream: memoryview,
    ) -> None:
        self.codec = codec
        self.options = options
        self.dtype = dtype
        self.shape = shape
        self.stream = stream

    @property
    def label(self) -> str:
        """``codec_label(codec, options)``."""
        return codec_label(self.codec, self.options)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wrap_envelope(codec: KVCodec, tensor: torch.Tensor) -> torch.Tensor:
    """Encode ``tensor`` with ``codec`` into a new uint8 tensor (the stored value)."""
    stream = codec.encode(tensor)
    doc = json.dumps(
        {
            "codec": codec.name,
            "options": codec.options(),
            "dtype": _dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode("utf-8")
    head = _ENV_HEAD.size + len(doc)
    head += -head % 8
    out = torch.empty(head + len(stream), dtype=torch.uint8)
    view = out.numpy()
    view[: _ENV_HEAD.size] = np.frombuffer(_ENV_HEAD.pack(_ENV_MAGIC, len(doc)), dtype=np.uint8)
    view[_ENV_HEAD.size : _ENV_HEAD.size + len(doc)] = np.frombuffer(doc, dtype=np.uint8)
    view[_ENV_HEAD.size + len(doc) : head] = 0
    view[head:] = np.frombuffer(stream, dtype=np.uint8)
    return out


def read_envelope(value: Any) -> Envelope:
    """Parse an envelope (a uint8 tensor or bytes); :class:`CodecError` if it is not one."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise CodecError(
                f"not a coded chunk (a {value.dtype} tensor of shape {list(value.shape)})"
            )
        view = memoryview(byte_view(value).data).cast("B")
    else:
        view = memoryview(value).cast("B")
    if len(view) < _ENV_HEAD.size:
        raise CodecError("coded chunk is truncated")
    magic, n = _ENV_HEAD.unpack_from(view, 0)
    if magic != _ENV_MAGIC or n > _ENV_MAX_JSON or _ENV_HEAD.size + n > len(view):
        raise CodecError("not a coded chunk (bad envelope)")
    try:
        doc = json.loads(bytes(view[_ENV_HEAD.size : _ENV_HEAD.size + n]).decode("utf-8"))
        codec = doc["codec"]
        options = doc["options"]
        dtype = doc["dtype"]
        shape = tuple(int(s) for s in doc["shape"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"coded chunk has a bad envelope: {exc}") from None
    if not isinstance(codec, str) or not isinstance(options, dict) or not isinstance(dtype, str):
        raise CodecError("coded chunk has a bad envelope")
    head = _ENV_HEAD.size + n
    head += -head % 8
    return Envelope(codec, options, dtype, shape, view[head:])


def envelope_codec(value: torch.Tensor) -> str:
    """The codec label of a stored value: ``raw`` unless it is a coded chunk's envelope
    (what an object's header records as its ``codec``)."""
    if value.dtype != torch.uint8 or value.dim() != 1 or value.numel() < _ENV_HEAD.size:
        return "raw"
    head = value[:4]
    if value.device.type != "cpu":
        # A device tensor (a CUDA value put into the gds tier): its first bytes are looked
        # at on the host, the rest copied only when they are an envelope's magic.
        try:
            head = head.cpu()
        except (RuntimeError, NotImplementedError):  # no data to read (the meta device)
            return "raw"
    if bytes(byte_view(head)) != _ENV_MAGIC:
        return "raw"
    if value.device.type != "cpu":
        value = value.cpu()
    try:
        return read_envelope(value).label
    except CodecError:
        return "raw"


def unwrap_envelope_into(codec: KVCodec, value: Any, out: torch.Tensor) -> None:
    """Decode a stored envelope into ``out`` with ``codec``.

    Raises :class:`CodecError` when the value is not an envelope of this codec with these
    options, or was encoded from a tensor of another dtype or shape than ``out``."""
    env = read_envelope(value)
    if env.codec != codec.name or env.options != codec.options():
        raise CodecError(
            f"chunk was coded with {env.label}, this tier decodes {codec_label(codec.name, codec.options())}"
        )
    if env.dtype != _dtype_name(out.dtype) or env.shape != tuple(out.shape):
        raise CodecError(
            f"coded chunk holds {env.dtype}{list(env.shape)}, the buffer is {_dtype_name(out.dtype)}{list(out.shape)}"
        )
    codec.decode_into(env.stream, out)
