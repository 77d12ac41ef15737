"""The one object format used by every file and object tier (version 1).

An object is a valid `safetensors <https://github.com/huggingface/safetensors>`_ file
holding one tensor named ``"kv"``::

    [u64 little-endian N][JSON header, N bytes, space padded][data region]
    ^ offset 0                                                ^ offset 4096 (or a multiple)

The JSON header is padded with spaces so the data region starts on a 4096-byte boundary
(friendly to ``O_DIRECT`` and GPUDirect Storage). Its ``__metadata__`` holds:

``format``          ``"lmcache-core"``
``format_version``  ``"1"``
``key``             the :class:`~lmcache_core.CacheEngineKey` string
``namespace``       the :class:`~lmcache_core.Namespace` JSON
``checksum``        ``xxh3_128:<32 hex>`` of the data region
``codec``           ``"raw"`` (the tensor is the chunk), or the codec label (name and
                    options JSON, :func:`lmcache_core.codecs.codec_label`) of a coded
                    chunk, whose tensor is then a uint8 envelope its tier decodes

Readers check all of it: a truncated, corrupted or foreign object raises
:class:`~lmcache_core.errors.FormatError`, which backends turn into a miss. Encoding and
decoding work on caller-provided buffers: the tensor bytes are copied exactly once.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from xxhash import xxh3_128_hexdigest

from .errors import BufferMismatchError, FormatError
from .keys import FORMAT_VERSION, CacheEngineKey, Namespace

__all__ = [
    "DATA_ALIGN",
    "MAX_HEADER_BYTES",
    "TENSOR_NAME",
    "ObjectHeader",
    "checksum",
    "decode",
    "decode_header",
    "decode_into",
    "encode",
    "encode_header",
    "read_header_length",
    "tensor_bytes",
    "verify_data",
]

DATA_ALIGN = 4096
TENSOR_NAME = "kv"
MAX_HEADER_BYTES = 1 << 20
_FORMAT_NAME = "lmcache-core"
_U64 = struct.Struct("<Q")

_TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _TORCH_TO_ST[getattr(torch, _name)] = _st
_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}


@dataclass(frozen=True)
class ObjectHeader:
    """What :func:`decode_header` read from an object."""

    key: str
    namespace: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int
    data_nbytes: int
    checksum: str
    codec: str
    format_version: int
    metadata: Mapping[str, str]

    @property
    def total_size(self) -> int:
        """Size in bytes of the whole object."""
        return self.data_offset + self.data_nbytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if tensor.device.type != "cpu":
        raise BufferMismatchError(f"expected a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise BufferMismatchError("expected a contiguous tensor")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return flat.view(torch.uint8).numpy().data.cast("B")


def checksum(data: Any) -> str:
    """``xxh3_128:<hex>`` checksum of a bytes-like object or a contiguous CPU tensor."""
    if isinstance(data, torch.Tensor):
        data = tensor_bytes(data)
    return "xxh3_128:" + xxh3_128_hexdigest(data)


def _st_dtype(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise BufferMismatchError(f"dtype {dtype} cannot be stored in the object format") from None


def encode_header(
    key: CacheEngineKey | str,
    namespace: Namespace | str | None,
    dtype: torch.dtype,
    shape: tuple[int, ...] | torch.Size,
    checksum_value: str,
    codec: str = "raw",
    extra_metadata: Mapping[str, str] | None = None,
) -> bytes:
    """The header bytes (``8 + N``, a multiple of 4096) for an object of this tensor."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * _itemsize(dtype)
    meta = {
        "format": _FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "key": key.to_string() if isinstance(key, CacheEngineKey) else str(key),
        "namespace": namespace.to_json() if isinstance(namespace, Namespace) else (namespace or ""),
        "checksum": checksum_value,
        "codec": codec,
    }
    if extra_metadata:
        for k, v in extra_metadata.items():
            if k in meta:
                raise ValueError(f"metadata key {k!r} is reserved")
            meta[k] = str(v)
    doc = {
        "__metadata__": meta,
        TENSOR_NAME: {"dtype": _st_dtype(dtype), "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    total = 8 + len(body)
    padded = -(-total // DATA_ALIGN) * DATA_ALIGN
    n = padded - 8
    return _U64.pack(n) + body + b" " * (n - len(body))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def encode(
    key: CacheEngineKey | str,
    namespace: Namespace | str | None,
    tensor: torch.Tensor,
    out: Any = None,
    codec: str = "raw",
) -> memoryview:
    """Encode ``tensor`` as an object; return a view of the encoded bytes.

    With ``out`` (a writable bytes-like object or uint8 tensor at least as large as the
    object) the object is written there and the tensor bytes are copied once; otherwise a
    new buffer is allocated.
    """
    src = tensor_bytes(tensor.contiguous())
    header = encode_header(key, namespace, tensor.dtype, tuple(tensor.shape), checksum(src), codec)
    total = len(header) + len(src)
    if out is None:
        buf = memoryview(bytearray(total))
    else:
        buf = tensor_bytes(out) if isinstance(out, torch.Tensor) else memoryview(out).cast("B")
        if buf.readonly:
            raise BufferMismatchError("output buffer is read-only")
        if len(buf) < total:
            raise BufferMismatchError(f"output buffer holds {len(buf)} bytes, object needs {total}")
    buf[: len(header)] = header
    buf[len(header) : total] = src
    return buf[:total]


def read_header_length(prefix: Any) -> int:
    """From the first 8 bytes, the offset of the data region (``8 + N``)."""
    view = memoryview(prefix).cast("B")
    if len(view) < 8:
        raise FormatError(f"object is truncated: {len(view)} bytes, no header length")
    (n,) = _U64.unpack_from(view, 0)
    if n < 2 or n > MAX_HEADER_BYTES:
        raise FormatError(f"implausible header length {n}")
    return 8 + int(n)


def decode_header(buf: Any, total_size: int | None = None) -> ObjectHeader:
    """Parse and validate the header at the start of ``buf``.

    ``buf`` must hold at least the header; ``total_size`` (the object's full size, when
    known) is checked against the size the header implies.
    """
    view = memoryview(buf).cast("B")
    offset = read_header_length(view)
    if len(view) < offset:
        raise FormatError(f"object is truncated inside its header ({len(view)} < {offset} bytes)")
    try:
        doc = json.loads(bytes(view[8:offset]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"object header is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise FormatError("object header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT_NAME:
        raise FormatError("not an lmcache-core object (missing or foreign __metadata__.format)")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise FormatError(f"unsupported format_version {meta.get('format_version')!r}")
    if set(doc) != {TENSOR_NAME}:
        raise FormatError(f"expected exactly one tensor {TENSOR_NAME!r}, found {sorted(doc)}")
    info = doc[TENSOR_NAME]
    try:
        dtype = _ST_TO_TORCH[info["dtype"]]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"bad tensor entry in header: {exc!r}") from exc
    nbytes = math.prod(shape) * _itemsize(dtype)
    if begin != 0 or end != nbytes or any(s < 0 for s in shape):
        raise FormatError("tensor data offsets disagree with its shape and dtype")
    for field in ("key", "namespace", "checksum", "codec"):
        if not isinstance(meta.get(field), str):
            raise FormatError(f"header metadata lacks {field!r}")
    if total_size is not None and total_size != offset + nbytes:
        raise FormatError(
            f"object is {total_size} bytes, header implies {offset + nbytes} (truncated?)"
        )
    return ObjectHeader(
        key=meta["key"],
        namespace=meta["namespace"],
        dtype=dtype,
        shape=shape,
        data_offset=offset,
        data_nbytes=nbytes,
        checksum=meta["checksum"],
        codec=meta["codec"],
        format_version=FORMAT_VERSION,
        metadata=meta,
    )


def verify_data(header: ObjectHeader, data: Any) -> None:
    """Raise :class:`FormatError` unless ``data`` matches the header's size and checksum."""
    view = tensor_bytes(data) if isinstance(data, torch.Tensor) else memoryview(data).cast("B")
    if len(view) != header.data_nbytes:
        raise FormatError(f"data region is {len(view)} bytes, header says {header.data_nbytes}")
    if checksum(view) != header.checksum:
        raise FormatError("checksum mismatch: object data is corrupted")


def check_identity(
    header: ObjectHeader,
    expected_key: CacheEngineKey | str | None,
    expected_namespace: Namespace | str | None,
) -> None:
    """Raise :class:`FormatError` when the object belongs to another key or namespace."""
    if expected_key is not None:
        want = (
            expected_key.to_string() if isinstance(expected_key, CacheEngineKey) else expected_key
        )
        if header.key != want:
            raise FormatError("object belongs to another key")
    if expected_namespace is not None:
        want_ns = (
            expected_namespace.to_json()
            if isinstance(expected_namespace, Namespace)
            else expected_namespace
        )
        if header.namespace != want_ns:
            raise FormatError("object belongs to another namespace")


def check_out(header: ObjectHeader, out: torch.Tensor) -> None:
    """Raise :class:`BufferMismatchError` unless ``out`` can receive this object's tensor."""
    if out.dtype != header.dtype or tuple(out.shape) != header.shape:
        raise BufferMismatchError(
            f"output tensor is {out.dtype}{list(out.shape)}, stored chunk is "
            f"{header.dtype}{list(header.shape)}"
        )
    if not out.is_contiguous():
        raise BufferMismatchError("output tensor must be contiguous")


def decode_into(
    buf: Any,
    out: torch.Tensor,
    expected_key: CacheEngineKey | str | None = None,
    expected_namespace: Namespace | str | None = None,
) -> ObjectHeader:
    """Validate the object in ``buf`` (the whole object) and copy its tensor into ``out``.

    Raises :class:`FormatError` (corrupt, truncated, foreign) or
    :class:`BufferMismatchError` (``out`` has the wrong dtype/shape). After a
    ``FormatError`` the contents of ``out`` are unspecified.
    """
    view = memoryview(buf).cast("B")
    header = decode_header(view, total_size=len(view))
    check_identity(header, expected_key, expected_namespace)
    check_out(header, out)
    data = view[header.data_offset : header.total_size]
    dst = tensor_bytes(out)
    dst[:] = data
    verify_data(header, dst)
    return header


def decode(
    buf: Any,
    expected_key: CacheEngineKey | str | None = None,
    expected_namespace: Namespace | str | None = None,
) -> tuple[ObjectHeader, torch.Tensor]:
    """Validate the object in ``buf`` and return its header and a new tensor."""
    view = memoryview(buf).cast("B")
    header = decode_header(view, total_size=len(view))
    check_identity(header, expected_key, expected_namespace)
    out = torch.empty(header.shape, dtype=header.dtype)
    dst = tensor_bytes(out)
    dst[:] = view[header.data_offset : header.total_size]
    verify_data(header, dst)
    return header, out
