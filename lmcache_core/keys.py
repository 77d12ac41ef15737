"""Cache keys and namespaces.

A :class:`CacheEngineKey` names one stored chunk of KV cache. A :class:`Namespace` names
everything that changes the bytes of a chunk or the meaning of its hash (model, revision,
KV layout, block and chunk size, hash algorithm, ...): it seeds the hash chain of the
token database and is written into every stored object, so two incompatible
configurations can never read each other's data.

String form of a key (nothing to escape)::

    model@world_size@worker_id@hash_hex@dtype[@tag=value]*

Text parts (model, dtype, tag names and values) are escaped by replacing ``%``, ``@``,
``=`` and control characters with ``%XX`` escapes of their UTF-8 bytes (upper-case hex).
Because ``%`` itself is escaped, an escaped part can never contain a bare separator and
the decoding is unique; non-canonical escapes are rejected so every key has exactly one
string form.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import KeyFormatError

__all__ = [
    "FORMAT_VERSION",
    "MAX_KEY_BYTES",
    "NAMESPACE_VERSION",
    "CacheEngineKey",
    "Namespace",
    "check_key_size",
    "dtype_name",
    "escape_part",
    "unescape_part",
]

#: Version of the stored-object layout (:mod:`lmcache_core.format`).
FORMAT_VERSION = 1
#: Version of the key scheme: how the token database turns tokens, extra keys and block
#: hashes into chunk hashes. It is :attr:`Namespace.format_version` (so it seeds every
#: hash chain and is compared on every read): chunks stored under another version are
#: never looked up. 2: extra keys and block hashes are typed (``{1: "a"}`` and
#: ``{"1": "a"}``, ``1`` and ``b"\x01"`` differ; version 1 encoded them alike).
NAMESPACE_VERSION = 2
#: Longest key string (UTF-8 bytes) a backend stores: the object header (1 MiB at most)
#: must hold it, JSON-escaped, beside the namespace.
MAX_KEY_BYTES = 64 << 10
#: Longest namespace JSON (UTF-8 bytes), for the same reason.
MAX_NAMESPACE_BYTES = 256 << 10

_MAX_HASH = 1 << 256
_NEEDS_ESCAPE = re.compile(r"[%@=\x00-\x1f\x7f-\x9f]")
_ESCAPE_RUN = re.compile(r"(?:%[0-9A-F]{2})+")
_BAD_PERCENT = re.compile(r"%(?![0-9A-F]{2})")
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
_HEX = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")


def _escape_char(m: re.Match[str]) -> str:
    return "".join(f"%{b:02X}" for b in m.group(0).encode("utf-8"))


def escape_part(text: str) -> str:
    """Escape one text part of a key string (see the module docstring)."""
    return _NEEDS_ESCAPE.sub(_escape_char, text)


def unescape_part(text: str, what: str = "part") -> str:
    """Invert :func:`escape_part`; raise :class:`KeyFormatError` on a bad or non-canonical escape."""
    if _BAD_PERCENT.search(text):
        raise KeyFormatError(
            f"{what} {text!r}: '%' must start an escape of two upper-case hex digits"
        )

    def dec(m: re.Match[str]) -> str:
        raw = bytes.fromhex(m.group(0).replace("%", ""))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KeyFormatError(f"{what} {text!r}: escape is not valid UTF-8") from exc

    out = _ESCAPE_RUN.sub(dec, text)
    if escape_part(out) != text:
        raise KeyFormatError(f"{what} {text!r}: non-canonical escaping")
    return out


def _check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise KeyFormatError(f"{what} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KeyFormatError(f"{what} {value!r} is not encodable as UTF-8") from exc
    return value


def dtype_name(dtype: Any) -> str:
    """The key's ``dtype`` text: a string as given, a ``torch.dtype`` by its name.

    LMCache code passes ``torch.dtype`` objects (``torch.bfloat16``); they become the
    name torch prints without its ``torch.`` prefix (``"bfloat16"``; aliases such as
    ``torch.half`` give their canonical name, ``"float16"``), so a key made from a dtype
    equals the key made from its name. torch is not imported for this.
    """
    if isinstance(dtype, str):
        return dtype
    cls = type(dtype)
    if cls.__module__ == "torch" and cls.__name__ == "dtype":
        return str(dtype).removeprefix("torch.")
    raise KeyFormatError(f"dtype must be a str or a torch.dtype, got {cls.__name__}")


def _normalize_tags(
    tags: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, str], ...]:
    if not tags:
        return ()
    items = list(tags.items()) if isinstance(tags, Mapping) else [tuple(t) for t in tags]
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for item in items:
        if len(item) != 2:
            raise KeyFormatError(f"tag {item!r} must be a (name, value) pair")
        name = _check_text(item[0], "tag name")
        value = _check_text(item[1], f"tag {name!r} value")
        if name in seen:
            raise KeyFormatError(f"tag {name!r} given twice")
        seen.add(name)
        out.append((name, value))
    out.sort()
    return tuple(out)


class CacheEngineKey(tuple):  # type: ignore[type-arg]
    """Immutable, hashable name of one stored KV chunk.

    Identity is ``(model_name, world_size, worker_id, chunk_hash, dtype, tags)``.
    ``request_configs`` travels with the key (for backends that route or prioritise by
    request) but is excluded from ``==``, ``hash`` and the string form.

    ``chunk_hash`` is a non-negative int below ``2**256`` (bytes are accepted and read
    big-endian). ``dtype`` is a string or a ``torch.dtype`` (stored as its name, see
    :func:`dtype_name`: ``torch.bfloat16`` and ``"bfloat16"`` make the same key). ``tags`` is a mapping or an iterable of ``(name, value)`` string pairs;
    it is stored sorted by name.

    Implementation note: a key is a tuple subclass ``(base, chunk_hash)``: the cheapest
    immutable object CPython builds (the token database makes one per chunk on the hot
    path), hashed and compared by the tuple's own C code (keys are dict keys everywhere).
    ``request_configs``, when given, lives in the instance ``__dict__`` and so takes no
    part in identity. Treat keys as opaque and use the properties.
    """

    def __new__(
        cls,
        model_name: str,
        world_size: int,
        worker_id: int,
        chunk_hash: int | bytes,
        dtype: str | Any,
        tags: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        request_configs: Mapping[str, Any] | None = None,
    ) -> CacheEngineKey:
        _check_text(model_name, "model_name")
        dtype = _check_text(dtype_name(dtype), "dtype")
        for name, v in (("world_size", world_size), ("worker_id", worker_id)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise KeyFormatError(f"{name} must be an int, got {type(v).__name__}")
        if world_size < 1:
            raise KeyFormatError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= worker_id < world_size:
            raise KeyFormatError(f"worker_id must be in [0, {world_size}), got {worker_id}")
        if isinstance(chunk_hash, (bytes, bytearray, memoryview)):
            raw = bytes(chunk_hash)
            if len(raw) > 32:
                raise KeyFormatError(f"chunk_hash has {len(raw)} bytes, at most 32 allowed")
            chunk_hash = int.from_bytes(raw, "big")
        if not isinstance(chunk_hash, int) or isinstance(chunk_hash, bool):
            raise KeyFormatError(
                f"chunk_hash must be an int or bytes, got {type(chunk_hash).__name__}"
            )
        if not 0 <= chunk_hash < _MAX_HASH:
            raise KeyFormatError("chunk_hash must be in [0, 2**256)")
        base = (model_name, world_size, worker_id, dtype, _normalize_tags(tags))
        key: CacheEngineKey = _tuple_new(cls, (base, chunk_hash))
        if request_configs is not None:
            object.__setattr__(key, "_request_configs", request_configs)
        return key

    # -- fast construction (token database hot path) -------------------------------
    @classmethod
    def _make(
        cls,
        base: tuple[str, int, int, str, tuple[tuple[str, str], ...]],
        chunk_hash: int,
        request_configs: Mapping[str, Any] | None = None,
    ) -> CacheEngineKey:
        """Build a key from an already validated base tuple, skipping validation."""
        key: CacheEngineKey = _tuple_new(cls, (base, chunk_hash))
        if request_configs is not None:
            object.__setattr__(key, "_request_configs", request_configs)
        return key

    # -- fields ---------------------------------------------------------------------
    @property
    def _base(self) -> tuple[str, int, int, str, tuple[tuple[str, str], ...]]:
        return tuple.__getitem__(self, 0)  # type: ignore[no-any-return]

    @property
    def model_name(self) -> str:
        return self._base[0]

    @property
    def world_size(self) -> int:
        return self._base[1]

    @property
    def worker_id(self) -> int:
        return self._base[2]

    @property
    def chunk_hash(self) -> int:
        return tuple.__getitem__(self, 1)  # type: ignore[no-any-return]

    @property
    def dtype(self) -> str:
        return self._base[3]

    @property
    def tags(self) -> tuple[tuple[str, str], ...]:
        return self._base[4]

    @property
    def request_configs(self) -> Mapping[str, Any] | None:
        return self.__dict__.get("_request_configs")

    @property
    def chunk_hash_hex(self) -> str:
        """The chunk hash as 32 (128-bit) or 64 (256-bit) lower-case hex digits."""
        h = self.chunk_hash
        return f"{h:032x}" if h < (1 << 128) else f"{h:064x}"

    # -- identity (==, hash: the tuple's own) ----------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CacheEngineKey is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("CacheEngineKey is immutable")

    def __repr__(self) -> str:
        return f"CacheEngineKey({self.to_string()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_key, (self._base, self.chunk_hash, self.request_configs))

    def with_request_configs(self, request_configs: Mapping[str, Any] | None) -> CacheEngineKey:
        """The same key carrying other ``request_configs``."""
        return CacheEngineKey._make(self._base, self.chunk_hash, request_configs)

    def with_worker(self, worker_id: int, world_size: int | None = None) -> CacheEngineKey:
        """The same chunk as seen by another worker (tensor-parallel rank)."""
        m, ws, _, dt, tags = self._base
        return CacheEngineKey(
            m,
            ws if world_size is None else world_size,
            worker_id,
            self.chunk_hash,
            dt,
            tags,
            self.request_configs,
        )

    # -- string and path forms --------------------------------------------------------
    def to_string(self) -> str:
        """The unique string form ``model@world_size@worker_id@hash_hex@dtype[@tag=value]*``."""
        m, ws, wid, dt, tags = self._base
        parts = [escape_part(m), str(ws), str(wid), self.chunk_hash_hex, escape_part(dt)]
        parts.extend(f"{escape_part(k)}={escape_part(v)}" for k, v in tags)
        return "@".join(parts)

    def __str__(self) -> str:
        return self.to_string()

    @classmethod
    def from_string(
        cls, text: str, request_configs: Mapping[str, Any] | None = None
    ) -> CacheEngineKey:
        """Parse :meth:`to_string` output; raise :class:`KeyFormatError` naming the bad part."""
        if not isinstance(text, str):
            raise KeyFormatError(f"key string must be a str, got {type(text).__name__}")
        parts = text.split("@")
        if len(parts) < 5:
            raise KeyFormatError(
                f"key string {text!r} has {len(parts)} '@'-separated parts, expected at least 5 "
                "(model@world_size@worker_id@hash_hex@dtype)"
            )
        model = unescape_part(parts[0], "model part")
        ints = []
        for name, raw in (("world_size", parts[1]), ("worker_id", parts[2])):
            if not _DECIMAL.fullmatch(raw):
                raise KeyFormatError(
                    f"{name} part {raw!r} of key string is not a canonical decimal integer"
                )
            ints.append(int(raw))
        if not _HEX.fullmatch(parts[3]):
            raise KeyFormatError(
                f"hash part {parts[3]!r} of key string is not 32 or 64 lower-case hex digits"
            )
        chunk_hash = int(parts[3], 16)
        if len(parts[3]) == 64 and chunk_hash < (1 << 128):
            raise KeyFormatError(f"hash part {parts[3]!r} is not canonical (fits in 32 hex digits)")
        dtype = unescape_part(parts[4], "dtype part")
        tags = []
        for raw in parts[5:]:
            name, sep, value = raw.partition("=")
            if not sep:
                raise KeyFormatError(f"tag part {raw!r} of key string has no '='")
            tags.append((unescape_part(name, "tag name"), unescape_part(value, "tag value")))
        names = [t[0] for t in tags]
        if names != sorted(names):
            raise KeyFormatError(f"tags in key string {text!r} are not sorted by name")
        return cls(model, ints[0], ints[1], chunk_hash, dtype, tags, request_configs)

    def to_path(self) -> str:
        """A short relative path (``ab/cd/<32 hex>``) of hex digits and ``/`` only.

        Derived from a 128-bit BLAKE2b digest of the string form, so it can never escape
        a root directory whatever the key contains. Stored objects carry the full key
        string and readers compare it, so a digest collision is a miss, never a wrong hit.
        """
        h = hashlib.blake2b(self.to_string().encode("utf-8"), digest_size=16).hexdigest()
        return f"{h[:2]}/{h[2:4]}/{h}"


_tuple_new = tuple.__new__


def check_key_size(key: CacheEngineKey) -> None:
    """Raise :class:`KeyFormatError` when ``key``'s string is longer than :data:`MAX_KEY_BYTES`.

    Such a key could be written but never read back (the object header could not hold
    it), so backends refuse it at ``put``. Cheap for ordinary keys: the string is only
    built when its parts could come near the limit.
    """
    m, _, _, dt, tags = key._base
    chars = len(m) + len(dt)
    if tags:
        chars += sum(len(a) + len(b) for a, b in tags)
    if chars * 12 + 256 <= MAX_KEY_BYTES:  # an escaped char takes at most 12 bytes
        return
    size = len(key.to_string().encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise KeyFormatError(
            f"key string is {size} bytes, longer than the {MAX_KEY_BYTES} an object header "
            "holds (a model name, dtype or tag that long?)"
        )


def _rebuild_key(
    base: tuple[str, int, int, str, tuple[tuple[str, str], ...]],
    chunk_hash: int,
    request_configs: Mapping[str, Any] | None,
) -> CacheEngineKey:
    m, ws, wid, dt, tags = base
    return CacheEngineKey(m, ws, wid, chunk_hash, dt, tags, request_configs)


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a chunk or the meaning of its hash.

    The namespace seeds the hash chain (``h_0 = H(namespace.digest())``) and its JSON is
    stored in every object, so data written under one configuration can never be read as
    another's. ``extra`` holds further identity (for example vLLM's block-hash algorithm)
    as string pairs.
    """

    model_name: str = ""
    model_revision: str = ""
    kv_layout: str = ""
    kv_dtype: str = ""
    block_size: int = 0
    chunk_size: int = 256
    hash_algorithm: str = "xxh3_128"
    hash_salt_id: str = ""
    codec: str = ""
    format_version: int = NAMESPACE_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in (
            "model_name",
            "model_revision",
            "kv_layout",
            "kv_dtype",
            "hash_algorithm",
            "hash_salt_id",
            "codec",
        ):
            if not isinstance(getattr(self, name), str):
                raise KeyFormatError(f"Namespace.{name} must be a str")
        for name in ("block_size", "chunk_size", "format_version"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
                shown = repr(v) if not isinstance(v, int) or v.bit_length() < 128 else "a huge int"
                raise KeyFormatError(f"Namespace.{name} must be an int in [0, 2**63), got {shown}")
        extra = self.extra
        if isinstance(extra, Mapping):
            extra = tuple(extra.items())
        norm = tuple(sorted((str(k), str(v)) for k, v in extra))
        object.__setattr__(self, "extra", norm)
        try:
            size = len(self.to_json().encode("utf-8"))
        except UnicodeEncodeError:
            raise KeyFormatError("namespace fields must be valid UTF-8 text") from None
        if size > MAX_NAMESPACE_BYTES:
            raise KeyFormatError(
                f"namespace JSON is {size} bytes, at most {MAX_NAMESPACE_BYTES} fit an object header"
            )

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace, UTF-8 text."""
        d = asdict(self)
        d["extra"] = dict(self.extra)
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Namespace:
        """Parse :meth:`to_json` output (unknown fields raise :class:`KeyFormatError`)."""
        try:
            d = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise KeyFormatError(f"namespace JSON is invalid: {exc}") from exc
        if not isinstance(d, dict):
            raise KeyFormatError("namespace JSON must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise KeyFormatError(f"namespace JSON has unknown fields: {sorted(unknown)}")
        if isinstance(d.get("extra"), dict):
            d["extra"] = tuple(d["extra"].items())
        return cls(**d)

    def digest(self) -> str:
        """A short (16 hex digits) stable id of this namespace."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]
