"""Chunked token database: cut a prompt into chunks and give each a prefix-chained key.

The chain is ``h_0 = H("lmcache-core/h0" || sha256(namespace JSON))`` and
``h_i = H_{n_i}(h_{i-1} || int32le(tokens_i) || extra_i)`` where ``n_i`` is the number of
tokens in chunk ``i``, so a chunk's key depends on every token before it, on the namespace
(model, layout, chunk size, ...) and on the chunk's extra keys (LoRA, multimodal hashes,
cache salt, ...). Knowing ``n_i`` fixes where the tokens end and the extra keys begin, so
the encoding is unambiguous. ``H_n`` is one of:

``xxh3_128`` (default)
    fast, 128-bit, non-cryptographic; ``n`` is the xxh3 seed (no extra copy on the hot
    path). Stable across processes, machines and versions.
``sha256``
    cryptographic, 256-bit keys; ``H_n(x) = sha256(u64le(n) || x)``.
keyed BLAKE2b
    used automatically when a secret ``hash_salt`` is given: only instances with the same
    salt produce the same keys (for tiers shared between tenants). 128-bit for
    ``xxh3_128``, 256-bit for ``sha256``.

Python's ``hash()`` is never used, so keys are identical in every process whatever
``PYTHONHASHSEED`` is.

Input rules (the same for every form): token ids are integers in ``[-2**31, 2**31)``
given as a list or tuple of ints (numpy integer scalars allowed), a one-dimensional
numpy array of an integer dtype or a one-dimensional torch tensor of an integer dtype.
Anything else raises :class:`~lmcache_core.errors.TokenTypeError` (bools, floats,
strings, bytes, sets, mappings, 0-d or 2-D arrays: a ``TypeError`` and a ``ValueError``);
an id out of range (a ``uint32`` id ``>= 2**31`` included: it never wraps) raises
:class:`~lmcache_core.errors.TokenInputError` (a ``ValueError``), as do a mask that does
not fit and extra keys or block hashes that cannot be encoded. These two are the only
errors bad input raises; the constructor raises ``ValueError`` for bad settings.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, Literal

import numpy as np
from xxhash import xxh3_128_digest

from .errors import TokenInputError, TokenTypeError
from .keys import CacheEngineKey, Namespace, dtype_name

_native_int32_le: Callable[[object], bytes | None] | None
try:  # the optional compiled helper (setup.py); None: the struct path below does it all
    from ._speedups import int32_le as _native_int32_le
except ImportError:  # pragma: no cover - exercised by builds without a C compiler
    _native_int32_le = None

_tuple_new = tuple.__new__

__all__ = ["HASH_ALGORITHMS", "ChunkedTokenDatabase", "encode_extra_keys"]

HASH_ALGORITHMS = ("xxh3_128", "sha256")

ExtraKeys = Sequence[Any] | Callable[[int, int], Any] | None
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_BIG: Literal["big"] = "big"


@functools.lru_cache(maxsize=256)
def _int32_packer(n: int) -> Callable[..., bytes]:
    """``Struct("<{n}i").pack``: a compiled Struct packs a list of ints ~2x faster than
    module-level ``struct.pack`` (which copies its argument tuple)."""
    return struct.Struct(f"<{n}i").pack


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def encode_extra_keys(value: Any) -> bytes:
    """Canonical, unambiguous bytes for one chunk's extra keys.

    Accepts ``None``, bools, ints, floats, str, bytes and (nested) lists/tuples and dicts
    of these. Every item is type-tagged and length-prefixed, so two values that differ
    (``1`` and ``"1"``, ``{1: "a"}`` and ``{"1": "a"}``, ``b"1"`` and ``"1"``) never encode
    alike; dict items are ordered by their encoded keys. A list and a tuple with the same
    items encode alike (a JSON round trip turns one into the other). Raises
    :class:`~lmcache_core.errors.TokenTypeError` for anything else and
    :class:`~lmcache_core.errors.TokenInputError` beyond :data:`MAX_EXTRA_DEPTH` levels.
    """
    if value is None:
        return b""
    out = bytearray()
    _encode_into(value, out, 0)
    return bytes(out)


#: Extra keys nested deeper than this are refused (a structure that contains itself too).
MAX_EXTRA_DEPTH = 32


def _encode_into(value: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_EXTRA_DEPTH:
        raise TokenInputError(f"extra keys are nested deeper than {MAX_EXTRA_DEPTH} levels")
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        v = int(value)  # an int subclass (IntEnum) encodes as its value
        raw = v.to_bytes(v.bit_length() // 8 + 1, "big", signed=True)
        out += b"i" + _U32.pack(len(raw)) + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"s" + _U32.pack(len(raw)) + raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += b"b" + _U32.pack(len(raw)) + raw
    elif isinstance(value, (list, tuple)):
        out += b"l" + _U32.pack(len(value))
        for item in value:
            _encode_into(item, out, depth + 1)
    elif isinstance(value, Mapping):
        items: list[tuple[bytes, Any]] = []
        for k, v in value.items():
            encoded = bytearray()
            _encode_into(k, encoded, depth + 1)
            items.append((bytes(encoded), v))
        items.sort(key=lambda kv: kv[0])
        out += b"d" + _U32.pack(len(items))
        for key_bytes, v in items:
            out += key_bytes
            _encode_into(v, out, depth + 1)
    else:
        raise TokenTypeError(f"cannot encode extra key of type {type(value).__name__}")


class ChunkedTokenDatabase:
    """Chunking and prefix-chained hashing of token sequences.

    ``ChunkedTokenDatabase(chunk_size=8)`` works with every other argument defaulted. Keys
    carry ``model_name``, ``world_size``, ``worker_id``, ``dtype`` and ``tags``; the
    namespace (built from these arguments unless given) seeds the chain.

    Parameters
    ----------
    chunk_size:
        tokens per chunk (default 256, or the namespace's when one is given).
    namespace:
        identity of the stored bytes; its ``chunk_size``, ``hash_algorithm`` and
        ``hash_salt_id`` must agree with the other arguments.
    hash_algorithm:
        ``"xxh3_128"`` (default) or ``"sha256"``.
    hash_salt:
        optional secret (bytes or str); makes ``H`` a keyed BLAKE2b.
    dtype:
        the KV dtype in keys and the namespace: a string or a ``torch.dtype`` (as LMCache
        code passes it; stored by name, ``torch.bfloat16`` -> ``"bfloat16"``).
    save_unfull_chunk:
        also emit the trailing chunk shorter than ``chunk_size``.
    """

    def __init__(
        self,
        chunk_size: int | None = None,
        *,
        namespace: Namespace | None = None,
        model_name: str | None = None,
        world_size: int = 1,
        worker_id: int = 0,
        dtype: str | Any = "",
        tags: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        hash_algorithm: str | None = None,
        hash_salt: bytes | str | None = None,
        save_unfull_chunk: bool = False,
    ) -> None:
        if chunk_size is None:
            chunk_size = namespace.chunk_size if namespace is not None else 256
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if hash_algorithm is None:
            hash_algorithm = namespace.hash_algorithm if namespace is not None else "xxh3_128"
        if hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm {hash_algorithm!r} is not one of {HASH_ALGORITHMS}")
        dtype = dtype_name(dtype)  # LMCache code passes a torch.dtype
        salt = hash_salt.encode("utf-8") if isinstance(hash_salt, str) else hash_salt
        if salt is not None and len(salt) == 0:
            raise ValueError("hash_salt must not be empty (pass None for no salt)")
        salt_id = self.salt_id(salt) if salt else ""

        if namespace is None:
            namespace = Namespace(
                model_name=model_name or "",
                kv_dtype=dtype,
                chunk_size=chunk_size,
                hash_algorithm=hash_algorithm,
                hash_salt_id=salt_id,
            )
        else:
            for what, ours, theirs in (
                ("chunk_size", chunk_size, namespace.chunk_size),
                ("hash_algorithm", hash_algorithm, namespace.hash_algorithm),
                ("hash_salt_id", salt_id, namespace.hash_salt_id),
            ):
                if ours != theirs:
                    raise ValueError(f"{what} {ours!r} disagrees with the namespace's {theirs!r}")
            if model_name is None:
                model_name = namespace.model_name
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.hash_algorithm = hash_algorithm
        self.save_unfull_chunk = save_unfull_chunk
        probe = CacheEngineKey(model_name or "", world_size, worker_id, 0, dtype, tags)
        self._base = probe._base
        self._hash: Callable[[bytes], bytes]
        self._fast = salt is None and hash_algorithm == "xxh3_128"
        if salt:
            digest_size = 16 if hash_algorithm == "xxh3_128" else 32
            key = hashlib.sha256(b"lmcache-core/salt-key\x00" + salt).digest()

            def keyed(data: bytes) -> bytes:
                return hashlib.blake2b(data, key=key, digest_size=digest_size).digest()

            self._hash = keyed
        else:
            self._hash = xxh3_128_digest if hash_algorithm == "xxh3_128" else _sha256
        ns_digest = hashlib.sha256(namespace.to_json().encode("utf-8")).digest()
        self._h0 = self._hash(b"lmcache-core/h0\x00" + ns_digest)

    # ------------------------------------------------------------------ helpers
    def _link(self, prev: bytes, n: int, body: Any) -> bytes:
        """One step of the chain: ``H_n(prev || body)``."""
        if self._fast:
            return xxh3_128_digest(prev + body, n)
        return self._hash(_U64.pack(n) + prev + body)

    @staticmethod
    def salt_id(salt: bytes | str) -> str:
        """A public, non-secret id of a salt (recorded in the namespace)."""
        raw = salt.encode("utf-8") if isinstance(salt, str) else salt
        return hashlib.sha256(b"lmcache-core/salt-id\x00" + raw).hexdigest()[:12]

    @property
    def key_base(self) -> tuple[str, int, int, str, tuple[tuple[str, str], ...]]:
        """Identity fields shared by every key this database makes."""
        return self._base

    def make_key(self, chunk_hash: int) -> CacheEngineKey:
        """A key of this database's model/worker/dtype with the given chunk hash."""
        return CacheEngineKey._make(self._base, chunk_hash)

    def for_worker(self, worker_id: int, world_size: int | None = None) -> ChunkedTokenDatabase:
        """A shallow copy whose keys name another worker (same hashes)."""
        other = object.__new__(ChunkedTokenDatabase)
        other.__dict__.update(self.__dict__)
        m, ws, _, dt, tags = self._base
        other._base = CacheEngineKey(m, world_size or ws, worker_id, 0, dt, tags)._base
        return other

    # ------------------------------------------------------------------ tokens
    def _token_bytes(self, tokens: Any) -> memoryview | np.ndarray:
        """int32 token ids of ``tokens`` (see the module docstring for the rules): the
        little-endian bytes of a list, or a one-dimensional integer array whose values are
        known to fit in int32 (converted when hashed: one copy, not two)."""
        if isinstance(tokens, (list, tuple)):
            return _list_bytes(tokens)
        if isinstance(tokens, np.ndarray):
            return _checked_array(tokens)
        torch = _torch()
        if torch is not None and isinstance(tokens, torch.Tensor):
            if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
                raise TokenTypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
            if tokens.dim() != 1:
                raise TokenTypeError(
                    f"token ids must be one-dimensional, got a {tokens.dim()}-d tensor"
                )
            try:
                arr = tokens.detach().cpu().numpy()
            except (TypeError, RuntimeError) as exc:  # a dtype numpy does not have
                raise TokenTypeError(f"cannot read a {tokens.dtype} tensor: {exc}") from None
            return _checked_array(arr)
        if isinstance(tokens, (str, bytes, bytearray, memoryview, Mapping, set, frozenset)):
            raise TokenTypeError(
                f"token ids must be a sequence of ints, got {type(tokens).__name__}"
            )
        try:
            as_list = list(tokens)
        except TypeError:
            raise TokenTypeError(
                f"token ids must be a sequence of ints, got {type(tokens).__name__}"
            ) from None
        return _list_bytes(as_list)

    @staticmethod
    def _prefix_len(mask: Any, n: int) -> int:
        """Number of leading masked-out (already computed) tokens; they must be a prefix."""
        try:
            raw = mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask
            m = np.asarray(raw)
        except Exception as exc:
            raise TokenTypeError(f"mask cannot be read as booleans: {exc}") from None
        if m.dtype != np.bool_:
            raise TokenTypeError(f"mask must hold booleans, got dtype {m.dtype}")
        if m.shape != (n,):
            raise TokenInputError(f"mask has shape {m.shape}, expected ({n},) to match the tokens")
        k = int(n - m.sum())
        if k and (m[:k].any() or not m[k:].all()):
            raise TokenInputError("mask must be False on a prefix of the tokens and True after it")
        return k

    def process_tokens(
        self,
        tokens: Any,
        mask: Any = None,
        extra_keys: ExtraKeys = None,
        *,
        save_unfull_chunk: bool | None = None,
    ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yield ``(start, end, key)`` for each chunk of ``tokens``.

        ``mask`` (optional, one bool per token): ``False`` marks already computed tokens;
        they must form a prefix, and chunks lying entirely inside it are not yielded
        (their hashes are still chained). ``extra_keys`` is a sequence with one entry per
        chunk, or a callable ``(start, end) -> extra`` (see :func:`encode_extra_keys`).
        The trailing partial chunk is yielded only with ``save_unfull_chunk``.
        """
        data = self._token_bytes(tokens)
        n = len(data) // 4 if isinstance(data, memoryview) else len(data)
        skip = 0 if mask is None else self._prefix_len(mask, n)
        unfull = self.save_unfull_chunk if save_unfull_chunk is None else save_unfull_chunk
        cs = self.chunk_size
        link = self._link
        make = CacheEngineKey._make
        base = self._base
        frombytes = int.from_bytes
        p = self._h0
        n_full = n // cs
        stop = n if unfull else n_full * cs

        def body(i: int, start: int, end: int) -> Any:
            """The bytes chunk ``i`` contributes: its tokens, then its extra keys."""
            raw = _bytes_of(data, start, end)
            if extra_keys is None:
                return raw
            return bytes(raw) + encode_extra_keys(_extra_for(extra_keys, i, start, end))

        if extra_keys is None and self._fast:
            # The hot path: every full chunk hashed in one tight loop over a staging
            # buffer, keys made by C-level maps (no Python-level work per chunk but the
            # hash and one 16-byte store).
            digests = _chain_xxh3(p, data, n_full, cs)
            if digests:
                p = digests[-1]
            first = min(skip // cs, n_full)
            new = _tuple_new
            yield from zip(
                range(first * cs, n_full * cs, cs),
                range(first * cs + cs, n_full * cs + cs, cs),
                map(
                    new,
                    repeat(CacheEngineKey),
                    zip(repeat(base), map(frombytes, digests[first:], repeat(_BIG))),
                ),
                strict=True,
            )
        else:
            for i, start in enumerate(range(0, n_full * cs, cs)):
                end = start + cs
                p = link(p, cs, body(i, start, end))
                if end > skip:
                    yield start, end, make(base, frombytes(p, "big"))
        if stop > n_full * cs:
            start = n_full * cs
            p = link(p, n - start, body(n_full, start, n))
            if n > skip:
                yield start, n, make(base, frombytes(p, "big"))

    def keys(self, tokens: Any, extra_keys: ExtraKeys = None) -> list[CacheEngineKey]:
        """The keys of every (full) chunk of ``tokens``, in order."""
        return [k for _, _, k in self.process_tokens(tokens, extra_keys=extra_keys)]

    def num_chunks(self, num_tokens: int) -> int:
        """How many chunks :meth:`process_tokens` yields for ``num_tokens`` tokens."""
        full, rest = divmod(num_tokens, self.chunk_size)
        return full + (1 if rest and self.save_unfull_chunk else 0)

    # ------------------------------------------------------------------ block hashes
    def keys_from_block_hashes(
        self,
        block_hashes: Sequence[bytes | int],
        block_size: int,
        extra_keys: ExtraKeys = None,
    ) -> list[CacheEngineKey]:
        """Chunk keys from block hashes an engine already computed (one per full block).

        Only valid when those hashes are reproducible across processes (a cryptographic
        algorithm, or a fixed seed); record the engine's algorithm in the namespace's
        ``extra`` so keys made with different algorithms never mix. ``chunk_size`` must
        be a multiple of ``block_size``; one key per full chunk.
        """
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TokenTypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size < 1 or self.chunk_size % block_size:
            raise TokenInputError(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {block_size}"
            )
        if isinstance(block_hashes, (str, bytes, bytearray, memoryview, Mapping)):
            raise TokenTypeError(
                f"block_hashes must be a sequence, got {type(block_hashes).__name__}"
            )
        per = self.chunk_size // block_size
        out: list[CacheEngineKey] = []
        p = self._h0
        for i in range(len(block_hashes) // per):
            parts = [b"blk\x00"]
            for bh in block_hashes[i * per : (i + 1) * per]:
                parts.append(_block_hash_bytes(bh))
            if extra_keys is not None:
                start = i * self.chunk_size
                extra = _extra_for(extra_keys, i, start, start + self.chunk_size)
                parts.append(encode_extra_keys(extra))
            # n >= 2**32 never occurs for token chunks: a separate domain for block mode
            p = self._link(p, (1 << 32) | per, b"".join(parts))
            out.append(CacheEngineKey._make(self._base, int.from_bytes(p, "big")))
        return out


def _block_hash_bytes(value: Any) -> bytes:
    """Typed bytes of one block hash: ``b"b"`` + length + bytes, or ``b"i"`` + length + int.

    The tag keeps the int ``1`` and the bytes ``b"\\x01"`` apart.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return b"b" + _U32.pack(len(raw)) + raw
    if not isinstance(value, int) or isinstance(value, bool):
        raise TokenTypeError(
            f"block hash must be bytes or a non-negative int, got {type(value).__name__}"
        )
    if value < 0:
        raise TokenInputError("block hash must be bytes or a non-negative int, got a negative int")
    raw = int(value).to_bytes(max(1, (value.bit_length() + 7) // 8), "big")
    return b"i" + _U32.pack(len(raw)) + raw


def _extra_for(extra_keys: Any, i: int, start: int, end: int) -> Any:
    """Chunk ``i``'s extra keys from a per-chunk sequence or a ``(start, end)`` callable."""
    if callable(extra_keys):
        return extra_keys(start, end)
    try:
        return extra_keys[i]
    except IndexError:
        raise TokenInputError(
            f"extra_keys has {len(extra_keys)} entries, chunk {i} has none"
        ) from None
    except (TypeError, KeyError):
        raise TokenTypeError(
            "extra_keys must be a sequence with one entry per chunk, or a callable"
        ) from None


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch


def _list_bytes(tokens: Sequence[Any]) -> memoryview:
    """int32 bytes of a list or tuple of token ids.

    ``struct`` takes ints and whatever has ``__index__`` (numpy integer scalars) and
    refuses the rest; it also takes bools, which are refused here. A bool packs to 0 or
    1, so only the (few) elements whose packed value is 0 or 1 have their type looked at:
    a type check of every element would cost twice the packing itself.

    The compiled :func:`lmcache_core._speedups.int32_le` (when built) converts a list or
    tuple of exact ints ~3.5x faster; it takes no bools by construction and declines
    (``None``) anything else, which then takes the path below with its errors.
    """
    native = _native_int32_le
    if native is not None:
        fast = native(tokens)
        if fast is not None:
            return memoryview(fast)
    try:
        packed = _int32_packer(len(tokens))(*tokens)
    except struct.error:
        for t in tokens:
            if isinstance(t, (bool, np.bool_)) or not hasattr(type(t), "__index__"):
                raise TokenTypeError(f"token ids must be ints, got a {type(t).__name__}") from None
        raise TokenInputError("token ids must be in the int32 range [-2**31, 2**31)") from None
    if packed:
        values = np.frombuffer(packed, dtype="<i4")
        for i in np.flatnonzero((values >> 1) == 0).tolist():  # the 0s and 1s
            if isinstance(tokens[i], bool):
                raise TokenTypeError("token ids must be ints, got a bool")
    return memoryview(packed)


def _checked_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself once it is known to be a one-dimensional integer array whose values
    fit in int32 (any byte order, any stride); converting it is left to the hashing."""
    if arr.dtype.kind not in "iu":
        raise TokenTypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise TokenTypeError(f"token ids must be one-dimensional, got a {arr.ndim}-d array")
    wide = arr.dtype.itemsize > 4 or (arr.dtype.kind == "u" and arr.dtype.itemsize == 4)
    if wide and arr.size:  # uint32 (ids >= 2**31 would wrap), int64, uint64
        low = int(arr.min()) if arr.dtype.kind == "i" else 0
        if low < _INT32_MIN or int(arr.max()) > _INT32_MAX:
            raise TokenInputError("token ids must be in the int32 range [-2**31, 2**31)")
    return arr


def _bytes_of(data: memoryview | np.ndarray, start: int, end: int) -> bytes | memoryview:
    """int32 little-endian bytes of tokens ``[start, end)`` of ``data``."""
    if isinstance(data, memoryview):
        return data[start * 4 : end * 4]
    return np.ascontiguousarray(data[start:end], dtype="<i4").tobytes()


#: Per-thread staging rows reused by :func:`_chain_xxh3`, by chunk size (a buffer is
#: grown to the longest prompt seen, up to this many bytes; longer prompts get their own).
_STAGING_MAX_BYTES = 1 << 20
_staging = threading.local()
_HEAD = slice(0, 16)


def _staging_rows(n_full: int, cs: int) -> tuple[np.ndarray, list[memoryview]]:
    """Rows of ``16 + 4 * cs`` bytes for ``n_full`` chunks and one memoryview per row.

    Slicing a memoryview costs about as much as hashing a 1 KiB chunk, so the row views
    are made once per thread and buffer, not once per call. Each thread has its own
    buffers: :func:`_chain_xxh3` never yields while it uses them.
    """
    cache: dict[int, tuple[np.ndarray, list[memoryview]]] | None = getattr(_staging, "rows", None)
    if cache is None:
        cache = _staging.rows = {}
    hit = cache.get(cs)
    if hit is not None and len(hit[1]) >= n_full:
        return hit
    rows = np.empty((n_full, cs + 4), dtype="<i4")
    mv = rows.data.cast("B")
    row = 4 * cs + 16
    views = [mv[o : o + row] for o in range(0, n_full * row, row)]
    if rows.nbytes <= _STAGING_MAX_BYTES:
        cache[cs] = (rows, views)
    return rows, views


def _chain_xxh3(h0: bytes, data: memoryview | np.ndarray, n_full: int, cs: int) -> list[bytes]:
    """The chain's digests of the first ``n_full`` full chunks: ``xxh3_128(prev || tokens,
    seed=cs)`` each, ``prev`` starting at ``h0``.

    The tokens are copied once (converting them to int32 little-endian) into rows of a
    staging array with 16 free bytes in front of each chunk; each step stores the
    previous digest there and hashes the row in place, so no bytes are concatenated.
    """
    if n_full == 0:
        return []
    src = np.frombuffer(data, dtype="<i4") if isinstance(data, memoryview) else data
    rows, views = _staging_rows(n_full, cs)
    rows[:n_full, 4:] = src[: n_full * cs].reshape(n_full, cs)  # values checked to fit
    digests: list[bytes] = []
    append = digests.append
    p = h0
    head = _HEAD
    for r in views[:n_full] if len(views) > n_full else views:
        r[head] = p
        p = xxh3_128_digest(r, cs)
        append(p)
    return digests
