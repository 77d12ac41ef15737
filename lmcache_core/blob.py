"""The byte-store base class: write five byte operations, get a complete backend.

A backend that keeps objects in something that stores named byte strings (an object
store, a directory, a key-value database) subclasses :class:`BlobBackend` and implements
only these methods, each either a plain ``def`` (it then runs on the base's I/O threads,
never on the event loop) or an ``async def`` (it then runs on the event loop and must not
block it):

``read_object(name) -> bytes-like | None``
    The whole object, or ``None`` when there is none.
``write_object(name, data) -> None``
    Store ``data`` (a read-only ``memoryview`` of the whole object) under ``name``,
    replacing any object there. The store may keep ``data``: the base never reuses it. **Atomic**: a reader sees the old object, the new one, or
    nothing, never a part (object stores give this for free; a directory needs a
    temporary file and a rename).
``delete_object(name) -> bool``
    Delete; ``True`` when something was deleted.
``stat_object(name) -> ObjectStat | None``
    Size and modification time without reading the object.
``list_objects(prefix) -> Iterable[ObjectStat]``
    Every object whose name starts with ``prefix`` (a sync method returns a list or any
    iterable; an async one may be an async generator, which lets huge listings stream).

Optionally ``read_range(name, start, length)`` (default: ``read_object`` sliced),
``open_store()`` / ``close_store()`` (connect and check at :meth:`~BaseBackend.start`,
release at ``close``), and ``describe_store()`` (how errors name the store, secrets
left out).

What the base provides on top of :class:`~lmcache_core.backend.BaseBackend`:

* **Layout.** Object names are ``ns-<16 hex>/ab/cd/<32 hex>``: the namespace's digest,
  then :meth:`CacheEngineKey.to_path` (hex digits and ``/`` only, whatever a key
  contains). ``ns-<16 hex>/namespace.json`` records the namespace in clear for
  ``inspect`` and ``gc --namespace``. The names are the disk tier's, so the same
  maintenance commands read both.
* **Format and verification.** Objects are in the core format of
  :mod:`lmcache_core.format` (safetensors, 4 KiB-aligned data, header with key,
  namespace and an xxh3-128 checksum). Every read checks the header, the identity (key
  and namespace) and the checksum: a corrupt, truncated or foreign object is a miss,
  counted in ``stats()["corrupt_objects"]``, and deleted (``removed_corrupt``).
* **Threads.** Encoding, decoding, checksums and sync store calls run on a private
  pool of ``max_concurrency`` threads; the event loop only schedules.
* **Batching.** Batched operations run up to ``max_concurrency`` single operations at
  once, in order.
* **Prefix lookups.** :meth:`BlobBackend.contains_prefix` answers "how many leading
  keys are stored" in at most ``ceil(log2(n)) + 1`` existence checks (a binary search;
  chunks of a prompt are stored first to last, so the stored ones form a prefix), with a
  short positive/negative cache of existence answers. Requests per lookup are counted.
* **Maintenance.** :meth:`scan`, :meth:`check_entry`, :meth:`verify_entry`,
  :meth:`delete_entry` and :meth:`namespaces` implement
  :class:`~lmcache_core.maintenance.MaintainableBackend`, so ``lmcache-core inspect``,
  ``verify`` and ``gc`` work on every byte store.

Options the base reads from the subclass's ``Options`` when present (all optional):
``max_concurrency`` (default 16), ``lookup_cache_s`` (positive answers, default 10),
``negative_cache_s`` (negative answers, default 1; 0 turns a cache off), ``io_nice``
(niceness added to the I/O threads; default 0, and best left there: the threads run
Python, see :func:`lower_thread_priority`). A minimal
backend::

    @dataclass(frozen=True)
    class DictOptions:
        max_concurrency: int = option(4, doc="operations in flight")

    class DictBackend(BlobBackend):
        Options = DictOptions
        capabilities = Capabilities()

        def __init__(self, options=None, *, namespace=None, name=None):
            super().__init__(build_options(DictOptions, options), namespace=namespace,
                             name=name)
            self.objects: dict[str, bytes] = {}

        def read_object(self, name):
            return self.objects.get(name)

        def write_object(self, name, data):
            self.objects[name] = bytes(data)   # one assignment: atomic

        def delete_object(self, name):
            return self.objects.pop(name, None) is not None

        def stat_object(self, name):
            data = self.objects.get(name)
            return None if data is None else ObjectStat(name, len(data), 0.0)

        def list_objects(self, prefix):
            return [ObjectStat(n, len(d), 0.0) for n, d in list(self.objects.items())
                    if n.startswith(prefix)]
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import inspect
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from . import format as fmt
from .backend import BaseBackend
from .codecs import envelope_codec
from .cuda_sync import device_copy, host_copy, ready_event
from .errors import BufferMismatchError, ConfigError, FormatError
from .keys import CacheEngineKey, Namespace
from .maintenance import EntryInfo, ProgressCallback
from .memory import as_bytes, copy_into

__all__ = [
    "NAMESPACE_MARKER",
    "BlobBackend",
    "ObjectStat",
    "decode_object",
    "encode_object",
    "is_object_name",
    "lower_thread_priority",
    "namespace_dir",
    "object_name",
]

log = logging.getLogger("lmcache_core.blob")
T = TypeVar("T")

#: Name of the file recording a namespace directory's namespace (JSON).
NAMESPACE_MARKER = "namespace.json"
_OBJECT_NAME = re.compile(r"ns-[0-9a-f]{16}/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}")
_NS_DIR = re.compile(r"ns-[0-9a-f]{16}")
#: Bytes read to parse a header (the core format pads headers to 4096 bytes).
_HEADER_PROBE = fmt.DATA_ALIGN
#: Bound on the entries of the existence cache.
_CACHE_ENTRIES = 1 << 16
#: Objects up to this size are decoded on the event loop (a thread hop costs more).
_INLINE_DECODE_BYTES = 64 << 10


@dataclass(frozen=True)
class ObjectStat:
    """One stored object as a byte store reports it."""

    name: str  # relative to the store's root
    size: int  # bytes
    mtime: float  # unix time of the last write


def namespace_dir(namespace: Namespace | str | None) -> str:
    """The directory of a namespace's objects: ``ns-`` + 16 hex digits of its digest."""
    text = namespace.to_json() if isinstance(namespace, Namespace) else (namespace or "")
    return "ns-" + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def object_name(namespace: Namespace | str | None, key: CacheEngineKey | str) -> str:
    """The name of ``key``'s object: ``ns-<16 hex>/ab/cd/<32 hex>``."""
    if not isinstance(key, CacheEngineKey):
        key = CacheEngineKey.from_string(key)
    return f"{namespace_dir(namespace)}/{key.to_path()}"


def is_object_name(name: str) -> bool:
    """Whether ``name`` has the shape of a chunk object's name (not a marker or a stray)."""
    return _OBJECT_NAME.fullmatch(name) is not None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_DUMMY_CHECKSUM = "xxh3_128:" + "0" * 32


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load_xxh3() -> Any:
    """``XXH3_128bits`` of the xxhash extension, called through ctypes (which releases the
    GIL: the Python binding holds it while hashing, stalling the event loop)."""
    try:
        import xxhash._xxhash as ext

        fn = ctypes.CDLL(ext.__file__).XXH3_128bits
    except (ImportError, OSError, AttributeError):  # pragma: no cover - other builds
        return None
    fn.restype = _XXH128
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return fn


_XXH3_128 = _load_xxh3()


def checksum_at(address: int, nbytes: int, view: Any = None) -> str:
    """The core format's checksum of ``nbytes`` at ``address`` (``view``: the same bytes,
    for the fallback when the extension's symbol is unavailable), without the GIL."""
    if _XXH3_128 is None or nbytes == 0:
        return fmt.checksum(view if view is not None else b"")
    h = _XXH3_128(address, nbytes)
    return f"xxh3_128:{h.high64:016x}{h.low64:016x}"


def encode_object(
    key: CacheEngineKey,
    namespace: Namespace | str | None,
    value: torch.Tensor,
    buffer: Callable[[int], torch.Tensor] | None = None,
) -> memoryview:
    """``value`` as an object of the core format (a read-only view of its bytes).

    The object is written into ``buffer(nbytes)`` (a uint8 tensor of exactly that many
    bytes) or a new buffer. The tensor bytes are copied once with ``memmove`` (the GIL is
    released) and the checksum is taken of the copy, so the object is consistent even if
    the caller's tensor changes meanwhile."""
    src = value.contiguous()
    shape = tuple(src.shape)
    codec = envelope_codec(src)  # "raw", or the codec of a coded chunk's envelope
    hlen = len(fmt.encode_header(key, namespace, src.dtype, shape, _DUMMY_CHECKSUM, codec))
    n = _nbytes(src)
    buf = torch.empty(hlen + n, dtype=torch.uint8) if buffer is None else buffer(hlen + n)
    if n:
        copy_into(buf[hlen:], as_bytes(src))
    view = fmt.tensor_bytes(buf)
    digest = checksum_at(buf.data_ptr() + hlen, n, view[hlen:])
    header = fmt.encode_header(key, namespace, src.dtype, shape, digest, codec)
    view[:hlen] = header
    return view.toreadonly()


def decode_object(
    data: Any,
    key: CacheEngineKey | str | None,
    namespace: Namespace | str | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Check the object in ``data`` (header, identity, size, checksum) and copy its tensor
    into ``out`` (or a new tensor); raise :class:`FormatError` for a bad object and
    :class:`~lmcache_core.errors.BufferMismatchError` for a wrong ``out``."""
    view = memoryview(data).cast("B")
    header = fmt.decode_header(view, total_size=len(view))
    fmt.check_identity(header, key, namespace)
    if out is None:
        out = torch.empty(header.shape, dtype=header.dtype)
    else:
        fmt.check_out(header, out)
        if out.device.type != "cpu":  # (memmove below: host memory only)
            raise BufferMismatchError(f"objects decode into host memory, not {out.device}")
    if header.data_nbytes:
        src = np.frombuffer(view, dtype=np.uint8, count=header.data_nbytes,
                            offset=header.data_offset)  # fmt: skip
        ctypes.memmove(out.data_ptr(), src.ctypes.data, header.data_nbytes)
    n = header.data_nbytes
    digest = checksum_at(out.data_ptr(), n, fmt.tensor_bytes(out) if n else None)
    if digest != header.checksum:
        raise FormatError("checksum mismatch: object data is corrupted")
    return out


def lower_thread_priority(increment: int) -> None:
    """Make the calling thread nicer by ``increment`` (Linux: per thread; at most 19).

    Every default that calls this passes 0 (nothing happens): a niced thread that runs
    Python takes the GIL, and when other processes (or the process's own compute
    threads) load every core the kernel gives a nice-10 or nice-19 thread so little CPU
    that it holds the GIL, or is handed it, while it waits for a CPU, and the event loop
    and every other thread of the process wait with it (a priority inversion through the
    GIL: loop stalls up to ~1 s under two busy-loop processes on 2 cores, see
    docs/architecture.md, "Threads run at the process's priority"). Niceness only helps a thread whose work never needs the GIL.
    """
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except (OSError, AttributeError):
        pass


class _BufferPool:
    """Encoding buffers kept for reuse, by exact size (KV chunks come in few sizes)."""

    def __init__(self, max_buffers: int) -> None:
        self.max_buffers = max_buffers
        self._free: dict[int, list[torch.Tensor]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._count -= 1
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._count >= self.max_buffers:
                # make room: drop a buffer of another size first (sizes change rarely)
                for size, free in self._free.items():
                    if free and size != buf.numel():
                        free.pop()
                        self._count -= 1
                        break
                else:
                    return
            self._free.setdefault(buf.numel(), []).append(buf)
            self._count += 1


class _PresenceCache:
    """Short-lived existence answers (bounded, oldest dropped first)."""

    def __init__(self, positive_s: float, negative_s: float) -> None:
        self.positive_s = positive_s
        self.negative_s = negative_s
        self._d: OrderedDict[str, tuple[bool, float]] = OrderedDict()

    def get(self, name: str) -> bool | None:
        item = self._d.get(name)
        if item is None:
            return None
        present, expiry = item
        if time.monotonic() >= expiry:
            del self._d[name]
            return None
        return present

    def put(self, name: str, present: bool) -> None:
        ttl = self.positive_s if present else self.negative_s
        if ttl <= 0:
            self._d.pop(name, None)
            return
        self._d[name] = (present, time.monotonic() + ttl)
        self._d.move_to_end(name)
        while len(self._d) > _CACHE_ENTRIES:
            self._d.popitem(last=False)

    def forget(self, name: str) -> None:
        self._d.pop(name, None)


class BlobBackend(BaseBackend):
    """Base class of backends over a byte store (see the module docstring).

    Subclasses set ``Options`` and ``capabilities``, call ``super().__init__`` with their
    validated options, and implement the byte operations.
    """

    #: Default of ``max_concurrency`` when the options have none.
    default_concurrency: int = 16
    #: ``False`` when ``write_object`` (sync) never keeps ``data`` after it returns: the
    #: base then reuses encoding buffers (fresh memory costs page faults: ~0.5 CPU s/GB).
    keeps_written_data: bool = True

    def __init__(
        self,
        options: Any = None,
        *,
        namespace: Namespace | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(options, namespace=namespace, name=name)
        self.batch_concurrency = int(
            getattr(options, "max_concurrency", None) or self.default_concurrency
        )
        self.io_nice = int(getattr(options, "io_nice", 0))
        self._ns_json = namespace.to_json() if namespace is not None else ""
        self._ns_dir = namespace_dir(self._ns_json)
        self._presence = _PresenceCache(
            float(getattr(options, "lookup_cache_s", 10.0)),
            float(getattr(options, "negative_cache_s", 1.0)),
        )
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = _BufferPool(2 * self.batch_concurrency)
        self._sync_ops = {
            op: not inspect.iscoroutinefunction(getattr(self, op))
            and not inspect.isasyncgenfunction(getattr(self, op))
            for op in (
                "read_object",
                "read_range",
                "write_object",
                "delete_object",
                "stat_object",
                "list_objects",
                "open_store",
                "close_store",
            )
        }
        s = self._stats.extra
        s.update(
            corrupt_objects=0,
            removed_corrupt=0,
            prefix_lookups=0,
            prefix_lookup_requests=0,
            prefix_lookup_requests_max=0,
            exists_requests=0,
            exists_cache_hits=0,
        )

    # ------------------------------------------------------------------ to implement
    def read_object(self, name: str) -> Any:
        """The whole object ``name`` (bytes-like), or ``None`` when there is none."""
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> Any:
        """``length`` bytes of ``name`` from ``start`` (fewer at its end), or ``None``.

        Used to read headers (``scan(read_headers=True)``). The default reads the whole
        object with a sync ``read_object``; override it where the store can read a part,
        and always when ``read_object`` is async."""
        data = self.read_object(name)
        if inspect.isawaitable(data):
            raise TypeError("an async read_object needs an async read_range override")
        return None if data is None else memoryview(data)[start : start + length]

    def write_object(self, name: str, data: memoryview) -> None:
        """Store ``data`` under ``name`` atomically (never a partial object)."""
        raise NotImplementedError

    def delete_object(self, name: str) -> bool:
        """Delete ``name``; ``True`` when an object was deleted."""
        raise NotImplementedError

    def stat_object(self, name: str) -> ObjectStat | None:
        """Size and modification time of ``name``, or ``None`` when it does not exist."""
        raise NotImplementedError

    def list_objects(self, prefix: str) -> Any:
        """Every object whose name starts with ``prefix`` (``ObjectStat`` items)."""
        raise NotImplementedError

    def open_store(self) -> None:
        """Connect and check the store (called once by ``start``). Raise on a problem:
        the base turns it into one :class:`~lmcache_core.errors.ConfigError` naming the
        tier, the store and the cause."""

    def close_store(self) -> None:
        """Release the store's resources (called once by ``close`` after a start)."""

    def describe_store(self) -> str:
        """How messages name the store (never with secrets). Default: the class name."""
        return type(self).__name__

    # ------------------------------------------------------------------ plumbing
    async def _op(self, op: str, *args: Any) -> Any:
        """Call a byte operation: off the loop when the author wrote it sync."""
        fn = getattr(self, op)
        if self._sync_ops[op]:
            return await self._in_thread(fn, *args)
        return await fn(*args)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        pool = self._pool
        if pool is None:
            raise RuntimeError(f"backend {self.name!r} has no I/O threads (not started)")
        return await asyncio.get_running_loop().run_in_executor(pool, partial(fn, *args))

    def object_name(self, key: CacheEngineKey) -> str:
        """The name of ``key``'s object in this backend's namespace."""
        return f"{self._ns_dir}/{key.to_path()}"

    def _error_prefix(self) -> str:
        return f"tier {self.name!r} ({self.describe_store()})"

    # ------------------------------------------------------------------ life cycle
    async def _start(self) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=self.batch_concurrency,
            thread_name_prefix=f"lmcache-{self.name}",
            initializer=lower_thread_priority,
            initargs=(self.io_nice,),
        )
        try:
            await self._op("open_store")
            if self.namespace is not None:  # (maintenance opens a tier without one)
                await self._write_marker()
        except asyncio.CancelledError:
            self._shutdown_pool()
            raise
        except Exception as exc:
            self._shutdown_pool()
            with contextlib.suppress(Exception):
                await self._op_after_failed_start()
            reason = exc.reason if isinstance(exc, ConfigError) else str(exc)
            raise ConfigError(f"{self._error_prefix()}: cannot open: {reason}") from None

    async def _op_after_failed_start(self) -> None:
        fn: Any = self.close_store
        result = fn()  # sync: done here (the pool is gone); async: a coroutine to await
        if inspect.isawaitable(result):
            await result

    async def _write_marker(self) -> None:
        """Record the namespace in clear once per namespace directory (for inspect/gc)."""
        name = f"{self._ns_dir}/{NAMESPACE_MARKER}"
        if await self._op("stat_object", name) is not None:
            return
        doc = json.dumps({"namespace": self._ns_json}).encode("utf-8")
        try:
            await self._op("write_object", name, memoryview(doc))
        except Exception as exc:  # a read-only consumer still works
            log.warning("%s: cannot write %s (%s)", self._error_prefix(), name, exc)

    async def _close(self) -> None:
        try:
            await self._op("close_store")
        finally:
            self._shutdown_pool()

    def _shutdown_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------ existence
    async def _contains(self, key: CacheEngineKey) -> bool:
        return await self._exists(self.object_name(key))

    async def _exists(self, name: str) -> bool:
        cached = self._presence.get(name)
        if cached is not None:
            self._stats.extra["exists_cache_hits"] += 1
            return cached
        self._stats.extra["exists_requests"] += 1
        present = await self._op("stat_object", name) is not None
        self._presence.put(name, present)
        return present

    async def contains_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` are stored, in at most ``ceil(log2(n)) + 1`` checks.

        Chunks of a prompt are stored first to last, so the stored ones form a prefix: the
        first key is checked, then a binary search finds the end of the prefix. Answers
        from the short existence cache cost nothing. Where the stored keys are not a
        prefix (a later chunk stored, an earlier one deleted), the answer may count a
        missing key; its load then misses (objects are verified) and the caller
        recomputes it. Counted in ``prefix_lookups`` and ``prefix_lookup_requests``.
        """
        self._check()
        n = len(keys)
        s = self._stats.extra
        s["prefix_lookups"] += 1
        before = s["exists_requests"]
        try:
            if n == 0 or not await self._contains(keys[0]):
                return 0
            lo, hi = 1, n  # keys[:lo] are stored; the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                if await self._contains(keys[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            return lo
        finally:
            used = s["exists_requests"] - before
            s["prefix_lookup_requests"] += used
            s["prefix_lookup_requests_max"] = max(s["prefix_lookup_requests_max"], used)

    @staticmethod
    def max_prefix_requests(n: int) -> int:
        """The most existence checks :meth:`contains_prefix` makes for ``n`` keys."""
        return 0 if n <= 0 else math.ceil(math.log2(n)) + 1

    # ------------------------------------------------------------------ loads
    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        name = self.object_name(key)
        if self._sync_ops["read_object"]:
            res = await self._in_thread(self._read_decode_sync, name, key)
        else:
            data = await self._op("read_object", name)
            res = None if data is None else await self._decode(data, key)
        return await self._settle(name, res)

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        if out.device.type != "cpu":
            # a device buffer: decoded into host memory, then copied after the caller's
            # queued work on ``out`` (objects are decoded with memmove and hashed in place)
            ready = ready_event(out)
            host = torch.empty(out.shape, dtype=out.dtype)
            if not await self._get_into(key, host):
                return False
            await self._in_thread(device_copy, ready, out, host)
            return True
        name = self.object_name(key)
        if self._sync_ops["read_object"]:
            res = await self._in_thread(self._read_decode_into_sync, name, key, out)
        else:
            data = await self._op("read_object", name)
            if data is None:
                res = None
            elif len(data) <= _INLINE_DECODE_BYTES:
                res = self._decode_into(data, key, out)
            else:
                res = await self._in_thread(self._decode_into, data, key, out)
        return await self._settle(name, res) is not None

    async def _decode(self, data: Any, key: CacheEngineKey) -> torch.Tensor | FormatError:
        if len(data) <= _INLINE_DECODE_BYTES:
            return self._decode_new(data, key)
        return await self._in_thread(self._decode_new, data, key)

    def _decode_new(self, data: Any, key: CacheEngineKey) -> torch.Tensor | FormatError:
        try:
            return decode_object(data, key, self._ns_json, None)
        except FormatError as exc:
            return exc

    def _decode_into(self, data: Any, key: CacheEngineKey, out: torch.Tensor) -> bool | FormatError:
        try:
            decode_object(data, key, self._ns_json, out)
        except FormatError as exc:
            return exc
        return True

    def _read_decode_sync(
        self, name: str, key: CacheEngineKey
    ) -> torch.Tensor | FormatError | None:
        data = self.read_object(name)
        return None if data is None else self._decode_new(data, key)

    def _read_decode_into_sync(
        self, name: str, key: CacheEngineKey, out: torch.Tensor
    ) -> bool | FormatError | None:
        data = self.read_object(name)
        return None if data is None else self._decode_into(data, key, out)

    async def _settle(self, name: str, res: T | FormatError | None) -> T | None:
        """Turn a read's outcome into a value or a miss; a bad object is counted and deleted."""
        if res is None:
            self._presence.put(name, False)
            return None
        if isinstance(res, FormatError):
            await self._drop_corrupt(name, res)
            return None
        self._presence.put(name, True)
        return res

    async def _drop_corrupt(self, name: str, why: Exception) -> None:
        self._stats.extra["corrupt_objects"] += 1
        self._presence.forget(name)
        log.warning("%s: object %s is unusable (%s); deleting it", self._error_prefix(), name, why)
        try:
            if await self._op("delete_object", name):
                self._stats.extra["removed_corrupt"] += 1
        except Exception as exc:
            log.warning("%s: cannot delete %s: %s", self._error_prefix(), name, exc)

    # ------------------------------------------------------------------ stores
    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        name = self.object_name(key)
        if value.device.type != "cpu":  # after the caller's queued work that makes it
            value = await self._in_thread(host_copy, ready_event(value), value)
        if self._sync_ops["write_object"]:
            await self._in_thread(self._encode_write_sync, name, key, value)
        else:
            if _nbytes(value) <= _INLINE_DECODE_BYTES:
                data = self._encode(key, value)
            else:
                data = await self._in_thread(self._encode, key, value)
            await self._op("write_object", name, data)
        self._presence.put(name, True)
        return True

    def _encode(self, key: CacheEngineKey, value: torch.Tensor) -> memoryview:
        return encode_object(key, self._ns_json, value)

    def _encode_write_sync(self, name: str, key: CacheEngineKey, value: torch.Tensor) -> None:
        if self.keeps_written_data:
            self.write_object(name, self._encode(key, value))
            return
        taken: list[torch.Tensor] = []

        def buffer(nbytes: int) -> torch.Tensor:
            taken.append(self._buffers.take(nbytes))
            return taken[-1]

        try:
            self.write_object(name, encode_object(key, self._ns_json, value, buffer))
        finally:
            for t in taken:
                self._buffers.give(t)

    async def _remove(self, key: CacheEngineKey) -> bool:
        name = self.object_name(key)
        removed = bool(await self._op("delete_object", name))
        self._presence.put(name, False)
        return removed

    # ------------------------------------------------------------------ maintenance
    async def _list(self, prefix: str) -> AsyncIterator[ObjectStat]:
        if inspect.isasyncgenfunction(self.list_objects):
            async for st in self.list_objects(prefix):
                yield st
            return
        if self._sync_ops["list_objects"]:
            items = await self._in_thread(lambda: list(self.list_objects(prefix)))
        else:
            items = await self.list_objects(prefix)
        for st in items:
            yield st

    async def scan(
        self, *, read_headers: bool = False, progress: ProgressCallback | None = None
    ) -> AsyncIterator[EntryInfo]:
        """Every chunk object (key and namespace from its header when ``read_headers``;
        ``None`` when unreadable). Last access is the object's write time: byte stores
        record no read times. ``progress(done, None)``: the total is not known."""
        self._check()
        done = 0
        batch: list[ObjectStat] = []
        async for st in self._list(""):
            if not is_object_name(st.name):
                continue
            batch.append(st)
            if len(batch) >= 256:
                for info in await self._entries(batch, read_headers):
                    yield info
                done += len(batch)
                batch = []
                if progress is not None:
                    progress(done, None)
        if batch:
            for info in await self._entries(batch, read_headers):
                yield info
            done += len(batch)
        if progress is not None:
            progress(done, done)

    async def _entries(self, batch: list[ObjectStat], read_headers: bool) -> list[EntryInfo]:
        if not read_headers:
            return [EntryInfo(st.name, st.size, st.mtime) for st in batch]
        headers = await self._bounded([partial(self._header_of, st.name) for st in batch])
        return [
            EntryInfo(
                st.name,
                st.size,
                st.mtime,
                key=None if h is None else h.key,
                namespace=None if h is None else h.namespace,
            )
            for st, h in zip(batch, headers, strict=True)
        ]

    async def _header_of(self, name: str) -> fmt.ObjectHeader | None:
        try:
            head = await self._op("read_range", name, 0, _HEADER_PROBE)
            if head is None:
                return None
            need = fmt.read_header_length(head)
            if need > len(head):
                head = await self._op("read_range", name, 0, need)
                if head is None:
                    return None
            return fmt.decode_header(head)
        except FormatError:
            return None

    async def check_entry(self, entry: EntryInfo) -> str | None:
        """Read the object fully; ``None`` when sound, ``"missing"`` when gone, else why
        not (corrupt, truncated, or stored at another key's or namespace's name)."""
        self._check()
        if not is_object_name(entry.location):
            return "not an object name of this tier"
        data = await self._op("read_object", entry.location)
        if data is None:
            return "missing"
        return await self._in_thread(self._check_bytes, entry.location, data)

    @staticmethod
    def _check_bytes(name: str, data: Any) -> str | None:
        try:
            view = memoryview(data).cast("B")
            header = fmt.decode_header(view, total_size=len(view))
            try:
                where = object_name(header.namespace, header.key)
            except ValueError:
                return "header holds an invalid key"
            if where != name:
                return f"object of another key or namespace (belongs at {where})"
            fmt.verify_data(header, view[header.data_offset : header.total_size])
        except FormatError as exc:
            return str(exc)
        return None

    async def verify_entry(self, entry: EntryInfo) -> bool:
        """Read the object fully and check size, header, name and checksum."""
        return await self.check_entry(entry) is None

    async def delete_entry(self, entry: EntryInfo) -> bool:
        """Delete one object; ``True`` when something was deleted."""
        self._check()
        self._presence.forget(entry.location)
        return bool(await self._op("delete_object", entry.location))

    async def namespaces(self) -> dict[str, str | None]:
        """Namespace JSON of each namespace directory (``None`` when its marker is gone)."""
        self._check()
        dirs: set[str] = set()
        async for st in self._list(""):
            top = st.name.split("/", 1)[0]
            if _NS_DIR.fullmatch(top):
                dirs.add(top)
        out: dict[str, str | None] = {}
        for d in sorted(dirs):
            value: str | None = None
            try:
                raw = await self._op("read_object", f"{d}/{NAMESPACE_MARKER}")
                if raw is not None:
                    got = json.loads(bytes(raw).decode("utf-8")).get("namespace")
                    value = got if isinstance(got, str) else None
            except (ValueError, AttributeError):
                value = None
            out[d] = value
        return out

    async def usage(self) -> dict[str, Any]:
        """Bytes and entries of every chunk object (a full listing; unbounded: no bound)."""
        self._check()
        used = entries = 0
        async for st in self._list(""):
            if is_object_name(st.name):
                used += st.size
                entries += 1
        return {"used_bytes": used, "entries": entries, "max_bytes": None}
