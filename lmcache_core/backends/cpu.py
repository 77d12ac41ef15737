"""The built-in ``cpu`` backend: a byte-bounded LRU of host-memory buffers.

* Bounded by ``max_bytes`` (live entries + recycled buffers never exceed it), each entry
  charged what it really takes: its buffer as allocated plus a per-entry overhead, so
  0-byte values are bounded too (:mod:`.host_buffers`). The least recently used entries
  are evicted to make room, never one that is being read or written.
* Buffers are recycled (by size, or a freed memory map resized), so steady-state stores do
  not allocate (fresh memory costs page faults: ~2 GB/s here against ~11 GB/s for a copy
  into reused memory); large buffers are memory maps, returned to the system when dropped,
  so RSS follows the bound under mixed sizes.
* Pinned (page-locked) memory when CUDA is available (``pin_memory: auto``), pageable
  otherwise: CPU-only torch raises on pinning.
* Copies up to ``inline_copy_bytes`` run on the event loop (a thread hop would cost more
  than the copy); larger ones run in a worker thread. The loop yields at least every
  ``yield_every_bytes`` of inline copying so other tasks are never starved.
* ``pin(key)`` / ``unpin(handle)`` keep an entry from eviction (the hierarchy's lookup
  leases use them). ``try_batched_get_into_threadsafe``, ``try_batched_contains_threadsafe``
  and ``try_batched_put_threadsafe`` serve loads, lookups and stores from any thread
  without the event loop (:class:`~lmcache_core.SyncBackend` uses them; see
  the thread-safe protocols of :mod:`lmcache_core.interface`): the index, reference counts and byte
  accounting are guarded by a lock that the loop-side bookkeeping also takes; the copies
  themselves run outside it, into buffers no reader can see yet.
* Reserved puts (:class:`~lmcache_core.interface.ReservedPuts`): ``try_reserve_threadsafe``
  lends memory the tier keeps (recycled, already faulted in with ``fresh=False``), the
  caller fills it (the vLLM connector gathers a chunk straight into it) and
  ``commit_reserved`` publishes it under a key, optionally borrowed so a write-through
  to a lower tier reads the same memory; ``abort_reserved`` ends it with nothing
  visible. A value stored this way is never copied inside the tier.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch

from ..backend import BaseBackend, Capabilities
from ..config.options import build_options, option
from ..cuda_sync import device_copy, host_copy, ready_event
from ..errors import BufferMismatchError, ConfigError, KeyFormatError
from ..interface import EvictionListener, VictimSelector
from ..keys import CacheEngineKey, Namespace, check_key_size
from ..memory import copy_into
from .host_buffers import Buffer, BufferPool

__all__ = ["CPUBackend", "CPUOptions"]

log = logging.getLogger("lmcache_core.cpu")

_KEY_TYPES = {CacheEngineKey}


@dataclass(frozen=True)
class CPUOptions:
    """Options of the ``cpu`` backend."""

    max_bytes: int = option(
        "1GiB",
        doc="Capacity in bytes (accepts '8GiB'), counting each entry's overhead (~1 KiB); "
        "LRU eviction beyond it.",
        kind="bytes",
        minimum=1,
    )
    pin_memory: str = option(
        "auto",
        doc="Page-locked buffers: auto (when CUDA is available), true, false.",
        choices=("auto", "true", "false"),
    )
    inline_copy_bytes: int = option(
        "32MiB",
        doc="Copies up to this size run on the event loop; larger ones in a thread.",
        kind="bytes",
    )
    yield_every_bytes: int = option(
        "4MiB",
        doc="At most this many bytes of inline copying per event-loop iteration.",
        kind="bytes",
        minimum=1,
    )


#: Install counter shared by every cpu backend of the process (pin_order of an entry).
_INSTALLS = itertools.count(1)


class _Entry:
    __slots__ = ("dtype", "mem", "nbytes", "pin_order", "shape", "stale", "users")

    def __init__(self, mem: Buffer, dtype: torch.dtype, shape: torch.Size) -> None:
        self.mem = mem
        self.dtype = dtype
        self.shape = shape
        self.nbytes = mem.data.numel()
        self.users = 0
        self.stale = False
        # set when installed, under the backend's lock: later entries have larger numbers
        # (the lease table ends leases on older entries of a key first)
        self.pin_order = 0

    @property
    def buf(self) -> torch.Tensor:
        """The value's bytes (flat uint8)."""
        return self.mem.data

    def view(self) -> torch.Tensor:
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return self.mem.data.view(self.dtype).view(self.shape)


class _Reservation:
    """Memory reserved for one value, filled by the caller (see ``try_reserve_threadsafe``)."""

    __slots__ = ("dtype", "generation", "mem", "open", "shape")

    def __init__(self, mem: Buffer, dtype: torch.dtype, shape: torch.Size, generation: int) -> None:
        self.mem = mem
        self.dtype = dtype
        self.shape = shape
        self.generation = generation
        self.open = True  # neither committed nor aborted yet


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _too_long(key: CacheEngineKey) -> bool:
    try:
        check_key_size(key)
    except KeyFormatError:
        return True
    return False


def _owns_storage(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t`` spans its whole storage (keeping it keeps nothing else alive)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes


class _Evictable(AbstractSet[CacheEngineKey]):
    """The keys a victim selector may name: stored and not in use (a live view)."""

    def __init__(self, entries: OrderedDict[CacheEngineKey, Any]) -> None:
        self._entries = entries

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.users == 0

    def __iter__(self) -> Iterator[CacheEngineKey]:
        return (k for k, e in self._entries.items() if e.users == 0)

    def __len__(self) -> int:
        return len(self._entries)


def release_pinned_cache() -> None:
    """Hand the page-locked blocks torch's host allocator caches back to the system. It
    keeps every freed block (rounded to a power of two) until asked, so page-locked
    memory a closed pinned tier gave up would otherwise stay locked for the process's
    life. Only blocks nothing uses are freed; a no-op where torch has no such call."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # (no accelerator in this build, say)
                continue
            return


class CPUBackend(BaseBackend):
    """Host-memory LRU tier (backend name ``cpu``)."""

    Options = CPUOptions
    capabilities = Capabilities(bounded=True, zero_copy=False)
    interface_version = "1.2"  # the lmcache_core.interface version it implements
    # Counters of stores made from other threads (try_batched_put_threadsafe), under _lock.
    _thread_puts = 0
    _thread_put_bytes = 0
    _thread_rejected_puts = 0

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(CPUOptions, options)
        super().__init__(opts, namespace=namespace, name=name or "cpu")
        self.opts = opts
        self.max_bytes = opts.max_bytes
        self._entries: OrderedDict[CacheEngineKey, _Entry] = OrderedDict()
        self._pool = BufferPool(self.max_bytes)
        self._used = 0  # cost of live entries (stale ones included until released)
        self._data_bytes = 0  # tensor bytes of those entries
        self._reserved = 0  # cost of buffers being filled by in-flight puts
        self._since_yield = 0
        self._reset_pending = False
        self._pin = False
        self._evictions = 0
        self._evicted_bytes = 0
        self._eviction_listener: EvictionListener | None = None
        self._victim_selector: VictimSelector | None = None
        self._evictable = _Evictable(self._entries)
        # Guards the index, reference counts and byte accounting against the loads that
        # other threads serve through try_batched_get_into_threadsafe. Reentrant: the
        # bookkeeping helpers nest.
        self._lock = threading.RLock()
        self._npins = 0
        # Bumped by close: a reservation taken before it commits nothing after it.
        self._generation = 0
        self._reservations = 0  # reservations taken and not yet committed or aborted
        self._committed = 0
        self._aborted = 0
        self._thread_hits = 0
        self._thread_misses = 0
        self._thread_bytes = 0

    # ------------------------------------------------------------------ life cycle
    async def _start(self) -> None:
        want = self.opts.pin_memory
        cuda = torch.cuda.is_available()
        if want == "true" and not cuda:
            raise ConfigError("pin_memory is true but CUDA is not available", "options.pin_memory")
        self._pin = cuda and want != "false"
        self._pool = BufferPool(self.max_bytes, pin=self._pin)

    async def _close(self) -> None:
        with self._lock:
            self._generation += 1
            self._reservations = 0
            self._entries.clear()
            self._npins = 0
            self._pool.clear()
            self._used = self._data_bytes = self._reserved = 0
        if self._pool.pin:
            release_pinned_cache()

    def set_victim_selector(self, selector: VictimSelector | None) -> None:
        """Ask ``selector`` for the next victim when room is needed (``None``: least
        recently used first). It is called with this backend's lock held and gets a set
        view of the evictable keys (never pinned or in-flight ones); whatever room its
        answer does not make is made in LRU order."""
        with self._lock:
            self._victim_selector = selector

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Call ``listener(key, tensor)`` before an entry is evicted for capacity.

        The tensor is only valid during the call (copy it to keep it), unless the listener
        returns ``True``: it then takes the tensor, and the backend never reuses that
        memory (zero-copy hand-over). Used by the hierarchy for write-back.
        """
        self._eviction_listener = listener

    # ------------------------------------------------------------------ memory
    # The bound: self._used (live entries, stale ones until released) + self._pool.bytes
    # (recycled buffers) + self._reserved (buffers being filled) <= max_bytes, each
    # buffer charged its Buffer.cost (see host_buffers.py).
    def _alloc_locked(self, nbytes: int, fresh: bool = True) -> Buffer | None:
        """A buffer for ``nbytes``, recycled when possible; ``None`` if no room (or memory).

        Entries are evicted only while even an empty pool would leave no room; each
        eviction's buffer joins the pool, and the best pooled buffer is then reused (one of
        the exact size, else a map resized), the rest dropped as far as the bound needs.
        ``fresh=False``: only a recycled buffer of the exact size (memory already faulted
        in), else ``None``.
        """
        pool = self._pool
        buf = pool.take(nbytes)
        if buf is not None:
            return buf  # its cost moves from the pool to the caller: the total is unchanged
        cost = pool.cost(nbytes)
        while self._used + self._reserved + cost > self.max_bytes:
            if not self._evict_one_locked():
                return None
            buf = pool.take(nbytes)
            if buf is not None:
                return buf
        if not fresh:
            return None
        if self._used + pool.bytes + self._reserved + cost > self.max_bytes:
            buf = pool.take_resized(nbytes)
        while pool.count and self._used + pool.bytes + self._reserved + cost > self.max_bytes:
            pool.drop_one()
        if buf is not None:
            return buf
        try:
            return pool.new(nbytes)
        except (OSError, RuntimeError, MemoryError) as exc:
            log.warning("cpu tier %r cannot allocate %d bytes: %s", self.name, nbytes, exc)
            return None

    def _recycle(self, buf: Buffer) -> None:
        with self._lock:
            if buf.capacity == 0:
                return
            if self._used + self._pool.bytes + self._reserved + buf.cost > self.max_bytes:
                return  # let it go: keeping it would exceed the bound
            self._pool.give(buf)

    def _free_entry(self, entry: _Entry) -> None:
        """Account for an entry nobody uses any more and recycle its buffer."""
        self._used -= entry.mem.cost
        self._data_bytes -= entry.nbytes
        self._recycle(entry.mem)

    def _release(self, entry: _Entry) -> None:
        """Entry no longer indexed: free its buffer once nobody reads it."""
        with self._lock:
            entry.stale = True
            if entry.users == 0:
                self._free_entry(entry)

    def _unuse(self, entry: _Entry) -> None:
        """Drop one reader or pin of ``entry``; free it if it was released meanwhile."""
        with self._lock:
            entry.users -= 1
            if entry.stale and entry.users == 0:
                self._free_entry(entry)

    def _evict_one_locked(self) -> bool:
        select = self._victim_selector
        if select is not None:
            try:
                chosen = select(self._evictable, 0)  # type: ignore[arg-type]
            except Exception:  # a policy must never break eviction
                log.exception("victim selector failed")
                chosen = ()
            for key in chosen:
                entry = self._entries.get(key)
                if entry is not None and entry.users == 0:
                    self._evict_locked(key, entry)
                    return True
        for key, entry in self._entries.items():
            if entry.users == 0:
                self._evict_locked(key, entry)
                return True
        return False

    def _evict_locked(self, key: CacheEngineKey, entry: _Entry) -> None:
        del self._entries[key]
        taken = False
        if self._eviction_listener is not None:
            try:
                taken = self._eviction_listener(key, entry.view()) is True
            except Exception:  # a listener must never break eviction
                log.exception("eviction listener failed for %s", key)
        self._evictions += 1
        self._evicted_bytes += entry.nbytes
        if taken:  # handed over: account for it, never recycle the buffer
            entry.stale = True
            self._used -= entry.mem.cost
            self._data_bytes -= entry.nbytes
        else:
            self._release(entry)

    def _reset_copy_budget(self) -> None:
        self._since_yield = 0
        self._reset_pending = False

    async def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type != "cpu" or src.device.type != "cpu":
            # a device buffer: off the loop, after the caller's queued work on it
            await asyncio.to_thread(device_copy, ready_event(dst, src), dst, src)
            return
        n = dst.numel() * dst.element_size()
        if n > self.opts.inline_copy_bytes:
            await asyncio.to_thread(copy_into, dst, src)
            return
        await self._copy_budget(n)
        copy_into(dst, src)

    async def _copy_budget(self, n: int) -> None:
        """Wait until ``n`` more bytes of inline copying fit this loop iteration's budget.

        At most ``yield_every_bytes`` are copied inline per event-loop iteration: a task
        over budget yields, and the counter resets at the start of the next iteration (a
        call_soon callback queued before the yielding tasks), so timers and other tasks
        run between copies even when many puts are gathered at once. The caller must
        copy right after this returns, without awaiting.
        """
        while self._since_yield and self._since_yield + n > self.opts.yield_every_bytes:
            await asyncio.sleep(0)
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._reset_copy_budget)
        self._since_yield += n

    # ------------------------------------------------------------------ operations
    async def _contains(self, key: CacheEngineKey) -> bool:
        return key in self._entries

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        entries = self._entries
        return [k in entries for k in keys]

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        entry = self._acquire(key)
        if entry is None:
            return None
        try:
            out = torch.empty(entry.shape, dtype=entry.dtype)
            if entry.nbytes:
                await self._copy(out, entry.buf)
        finally:
            self._unuse(entry)
        return out

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        entry = self._acquire(key, out)
        if entry is None:
            return False
        try:
            if entry.nbytes:
                await self._copy(out, entry.buf)
        finally:
            self._unuse(entry)
        return True

    def _acquire(self, key: CacheEngineKey, out: torch.Tensor | None = None) -> _Entry | None:
        """The entry stored under ``key`` with one more reader, or ``None``.

        Looked up and referenced under one acquisition of the lock: other threads store,
        remove and unpin too, and an entry released between a lookup and its reference
        would have its buffer recycled (and handed to another key) while it is read.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if out is not None and (out.dtype != entry.dtype or out.shape != entry.shape):
                raise BufferMismatchError(
                    f"output tensor is {out.dtype}{list(out.shape)}, stored chunk is "
                    f"{entry.dtype}{list(entry.shape)}"
                )
            self._entries.move_to_end(key)
            entry.users += 1
            return entry

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        if value.device.type != "cpu":  # off the loop, after the caller's work that makes it
            value = await asyncio.to_thread(host_copy, ready_event(value), value)
            donate = True
        nbytes = value.numel() * value.element_size()
        if self._pool.cost(nbytes) > self.max_bytes:
            return False
        if self._donatable(value, nbytes, donate):
            return self._install_donated(key, value)
        src = value.contiguous()
        old = self._entries.get(key)
        if (
            old is not None
            and old.users == 0
            and old.nbytes == nbytes
            and 0 < nbytes <= self.opts.inline_copy_bytes
        ):
            # Overwrite in place: the copy runs without an await once started, so no
            # reader can see it half done and a cancellation leaves the old value.
            await self._copy_budget(nbytes)
            with self._lock:  # no thread may start reading it meanwhile
                if old is self._entries.get(key) and old.users == 0:
                    copy_into(old.buf, src)
                    old.dtype, old.shape = value.dtype, value.shape
                    self._entries.move_to_end(key)
                    return True
        buf = self._reserve(nbytes)
        if buf is None:
            return False
        try:
            if nbytes:
                await self._copy(buf.data, src)
        except asyncio.CancelledError:
            # A worker thread may still be writing into buf: never recycle it.
            self._end_reservation(buf, recycle=False)
            raise
        except BaseException:
            self._end_reservation(buf, recycle=True)
            raise
        self._end_reservation(buf, install=(key, value))
        return True

    # The steps of a put that the event-loop path and the thread-safe path share.
    def _donatable(self, value: torch.Tensor, nbytes: int, donate: bool) -> bool:
        """Whether a donated ``value`` can be kept as it is instead of copied."""
        return (
            donate
            and value.is_contiguous()
            and (value.is_pinned() or not self._pin)
            and _owns_storage(value, nbytes)
        )

    def _install_donated(self, key: CacheEngineKey, value: torch.Tensor) -> bool:
        mem = self._pool.wrap(_flat_bytes(value))
        with self._lock:
            if not self._make_room_locked(mem.cost):
                return False
            self._install(key, _Entry(mem, value.dtype, value.shape))
        return True

    def _reserve(self, nbytes: int) -> Buffer | None:
        """A buffer for a copy in progress, counted as reserved until released."""
        with self._lock:
            buf = self._alloc_locked(nbytes)
            if buf is not None:
                self._reserved += buf.cost
        return buf

    def _end_reservation(
        self,
        buf: Buffer,
        *,
        recycle: bool = False,
        install: tuple[CacheEngineKey, torch.Tensor] | None = None,
    ) -> None:
        """End a reservation: install the copied value under its key, or recycle the
        buffer, or (a copy that may still be running) just drop the reservation."""
        with self._lock:
            self._reserved -= buf.cost
            if install is not None:
                key, value = install
                self._install(key, _Entry(buf, value.dtype, value.shape))
            elif recycle:
                self._recycle(buf)

    def _make_room_locked(self, cost: int) -> bool:
        while self._used + self._pool.bytes + self._reserved + cost > self.max_bytes:
            if self._pool.count:
                self._pool.drop_one()
            elif not self._evict_one_locked():
                return False
        return True

    def _install(self, key: CacheEngineKey, entry: _Entry) -> None:
        with self._lock:
            entry.pin_order = next(_INSTALLS)
            old = self._entries.pop(key, None)
            self._entries[key] = entry
            self._used += entry.mem.cost
            self._data_bytes += entry.nbytes
            if old is not None:
                self._release(old)

    async def _remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._release(entry)
            return True

    # ------------------------------------------------------------------ pins
    def pin(self, key: CacheEngineKey) -> object | None:
        """Keep the entry stored under ``key`` from eviction; return a handle for :meth:`unpin`.

        ``None`` when ``key`` is not stored. Pins nest. A pinned entry can still be removed
        or overwritten explicitly; its memory is kept until its last unpin. Safe from any
        thread.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.users += 1
            self._npins += 1
            return entry

    def unpin(self, handle: object) -> None:
        """Undo one :meth:`pin` (``handle`` is what it returned)."""
        if not isinstance(handle, _Entry):
            raise TypeError(f"not a pin handle of this backend: {handle!r}")
        with self._lock:
            self._npins -= 1
            self._unuse(handle)

    def pin_many(self, keys: Sequence[CacheEngineKey]) -> list[object | None]:
        """:meth:`pin` for each key, under one acquisition of the lock."""
        out: list[object | None] = []
        with self._lock:
            get = self._entries.get
            for k in keys:
                entry = get(k)
                if entry is not None:
                    entry.users += 1
                    self._npins += 1
                out.append(entry)
        return out

    def unpin_many(self, handles: Sequence[object]) -> None:
        """:meth:`unpin` for each handle, under one acquisition of the lock (all handles
        are checked first: a foreign one raises ``TypeError`` with nothing undone)."""
        for h in handles:
            if not isinstance(h, _Entry):
                raise TypeError(f"not a pin handle of this backend: {h!r}")
        with self._lock:
            for h in handles:
                self._npins -= 1
                self._unuse(h)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ thread-safe loads
    def try_batched_get_into_threadsafe(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool | None] | None:
        """Serve ``get_into`` for each pair from the calling thread, without the event loop.

        Per pair: ``True`` (loaded), ``False`` (not stored) or ``None`` (not decided here:
        a buffer of the wrong kind; the async ``batched_get_into`` will say why). ``None``
        overall when the backend is not started. The copy runs outside the lock, with the
        entry referenced so it is neither evicted nor recycled meanwhile.
        """
        if self._state != "started" or len(keys) != len(outs):
            return None
        results: list[bool | None] = []
        for key, out in zip(keys, outs, strict=True):
            if (
                not isinstance(key, CacheEngineKey)
                or not isinstance(out, torch.Tensor)
                or out.device.type != "cpu"
                or not out.is_contiguous()
            ):
                results.append(None)
                continue
            with self._lock:
                entry = self._entries.get(key)
                if entry is None:
                    self._thread_misses += 1
                    results.append(False)
                    continue
                if entry.dtype != out.dtype or entry.shape != out.shape:
                    results.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.users += 1
            ok = True
            try:
                if entry.nbytes:
                    copy_into(out, entry.buf)
            except Exception:
                ok = False
            finally:
                self._unuse(entry)
            if ok:
                with self._lock:
                    self._thread_hits += 1
                    self._thread_bytes += entry.nbytes
            results.append(True if ok else None)
        return results

    # ------------------------------------------------------------------ borrows
    def try_borrow_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[tuple[object, torch.Tensor] | None] | None:
        """Read-only views of the entries stored under ``keys``, each with a handle for
        :meth:`end_borrows` (``None`` per key not stored); ``None`` overall when the
        backend is not started. Safe from any thread.

        A borrow references the entry like a reader does: it is neither evicted nor
        recycled, and never overwritten in place (that needs no reader), until its borrow
        ends; a put or remove of the key meanwhile replaces only the index entry. The
        caller must not write into a view.
        """
        if self._state != "started":
            return None
        out: list[tuple[object, torch.Tensor] | None] = []
        with self._lock:
            get = self._entries.get
            for key in keys:
                entry = get(key) if isinstance(key, CacheEngineKey) else None
                if entry is None:
                    self._thread_misses += 1
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.users += 1
                self._thread_hits += 1
                self._thread_bytes += entry.nbytes
                out.append((entry, entry.view()))
        return out

    def end_borrows(self, handles: Sequence[object]) -> None:
        """End borrows taken by :meth:`try_borrow_threadsafe` (all handles are checked
        first: a foreign one raises ``TypeError`` with nothing ended)."""
        for h in handles:
            if not isinstance(h, _Entry):
                raise TypeError(f"not a borrow handle of this backend: {h!r}")
        with self._lock:
            for h in handles:
                self._unuse(h)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ reserved puts
    def try_reserve_threadsafe(
        self, dtype: torch.dtype, shape: Sequence[int], fresh: bool = True
    ) -> tuple[object, torch.Tensor] | None:
        """Memory for one value of ``dtype``/``shape``, for the caller to fill, with a
        handle for :meth:`commit_reserved` or :meth:`abort_reserved`; ``None`` when there
        is no room (everything in use), the value is empty or larger than the capacity, or
        the backend is not started. Safe from any thread.

        The memory is taken like a put's (recycled, evicting the least recently used
        entries for room) and counted against ``max_bytes`` until the reservation ends;
        nothing is visible under any key until the commit. ``fresh=False`` takes only a
        recycled buffer (memory already faulted in), never new memory.
        """
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if self._state != "started" or nbytes == 0 or self._pool.cost(nbytes) > self.max_bytes:
            return None
        with self._lock:
            buf = self._alloc_locked(nbytes, fresh=fresh)
            if buf is None:
                return None
            self._reserved += buf.cost
            self._reservations += 1
            res = _Reservation(buf, dtype, shape, self._generation)
        return res, buf.data.view(dtype).view(shape)

    def commit_reserved(
        self, handle: object, key: CacheEngineKey, borrow: bool = False
    ) -> tuple[bool, object | None]:
        """Publish a filled reservation under ``key`` (replacing any entry of it), as a put
        would. Returns ``(stored, borrow handle)``: with ``borrow=True`` the new entry is
        also borrowed, as by :meth:`try_borrow_threadsafe` (never evicted, recycled or
        overwritten in place until :meth:`end_borrows` of that handle), so that another
        reader (a write-through to a lower tier) may keep reading the tensor the
        reservation lent. ``(False, None)`` when the reservation ended already or the
        backend was closed since. Safe from any thread; an invalid key raises with the
        reservation aborted."""
        res = self._reservation(handle)
        try:
            check_key_size(key)
        except KeyFormatError:
            self.abort_reserved(res)
            raise
        with self._lock:
            if not res.open:
                return False, None
            res.open = False
            if res.generation != self._generation or self._state != "started":
                return False, None
            self._reserved -= res.mem.cost
            self._reservations -= 1
            entry = _Entry(res.mem, res.dtype, res.shape)
            self._install(key, entry)
            if borrow:
                entry.users += 1
            self._committed += 1
            self._thread_puts += 1
            self._thread_put_bytes += entry.nbytes
        return True, (entry if borrow else None)

    def abort_reserved(self, handle: object, reusable: bool = True) -> None:
        """End a reservation without storing anything (no-op once it ended).
        ``reusable=False``: something may still write into or read the memory (a copy
        that could not be stopped), so it is never recycled. Safe from any thread."""
        res = self._reservation(handle)
        with self._lock:
            if not res.open:
                return
            res.open = False
            if res.generation != self._generation:
                return
            self._reservations -= 1
            self._aborted += 1
            self._end_reservation(res.mem, recycle=reusable)

    @staticmethod
    def _reservation(handle: object) -> _Reservation:
        if not isinstance(handle, _Reservation):
            raise TypeError(f"not a reservation of this backend: {handle!r}")
        return handle

    # ------------------------------------------------------------------ thread-safe lookups
    def try_batched_contains_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[bool | None] | None:
        """``contains`` for each key from the calling thread, without the event loop.

        One acquisition of the index lock for the whole batch. ``None`` overall when the
        backend is not started or a key is not a :class:`CacheEngineKey` (the async
        ``batched_contains`` then raises the right error). Part of the thread-safe fast
        paths (:class:`~lmcache_core.interface.ThreadSafeContains`): the ``pin``/``unpin``
        family of this backend is safe from any thread too.
        """
        if self._state != "started":
            return None
        if keys and set(map(type, keys)) != _KEY_TYPES:  # a subclass goes the async way
            return None
        with self._lock:
            entries = self._entries
            return [k in entries for k in keys]

    # ------------------------------------------------------------------ thread-safe stores
    def try_batched_put_threadsafe(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor],
        donate: bool = False,
    ) -> list[bool | None] | None:
        """``put`` for each pair from the calling thread, without the event loop.

        Per pair: ``True`` (stored), ``False`` (refused: larger than the capacity, or no
        room because everything is in use) or ``None`` (not decided here: a value that is
        not a contiguous host tensor; the async ``batched_put`` handles it). ``None``
        overall when the backend is not started. The buffer is reserved under the index
        lock, filled outside it (a new buffer, so no reader can see a half-written
        value) and published under the lock. Pairs run in order and the first undecided
        pair leaves every later one undecided too, so whatever the async path stores
        comes after what was stored here: a later duplicate key wins, as with one call.
        """
        if self._state != "started" or len(keys) != len(values):
            return None
        results: list[bool | None] = []
        for key, value in zip(keys, values, strict=True):
            if (
                not isinstance(key, CacheEngineKey)
                or not isinstance(value, torch.Tensor)
                or not value.is_cpu
                or not value.is_contiguous()
                or _too_long(key)  # the async put raises the clear error
            ):
                results.extend([None] * (len(keys) - len(results)))
                break
            stored = self._put_from_thread(key, value, donate)
            with self._lock:
                if stored:
                    self._thread_puts += 1
                    self._thread_put_bytes += value.nbytes
                else:
                    self._thread_rejected_puts += 1
            results.append(stored)
        return results

    def _put_from_thread(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        nbytes = value.nbytes
        if self._pool.cost(nbytes) > self.max_bytes:
            return False
        if self._donatable(value, nbytes, donate):
            return self._install_donated(key, value)
        buf = self._reserve(nbytes)
        if buf is None:
            return False
        try:
            if nbytes:
                copy_into(buf.data, value)
        except BaseException:
            self._end_reservation(buf, recycle=True)
            raise
        self._end_reservation(buf, install=(key, value))
        return True

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        """Counters and usage, including loads served by other threads."""
        d = super().stats()
        with self._lock:
            d["hits"] += self._thread_hits
            d["misses"] += self._thread_misses
            d["bytes_read"] += self._thread_bytes
            d["puts"] += self._thread_puts
            d["bytes_written"] += self._thread_put_bytes
            d["rejected_puts"] += self._thread_rejected_puts
            d["threadsafe_hits"] = self._thread_hits
            d["pinned_entries"] = self._npins
            d["reservations"] = self._reservations
            d["reservations_committed"] = self._committed
            d["reservations_aborted"] = self._aborted
        return d

    def entry_cost(self, nbytes: int) -> int:
        """Bytes of ``max_bytes`` one entry holding an ``nbytes`` value takes.

        Its buffer (rounded to what the allocator really takes) plus a fixed per-entry
        overhead: ``n`` values of ``nbytes`` fit when ``max_bytes >= n * entry_cost(nbytes)``.
        """
        return self._pool.cost(nbytes)

    def _usage(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "used_bytes": self._used,
            "data_bytes": self._data_bytes,
            "recycled_bytes": self._pool.bytes,
            "max_bytes": self.max_bytes,
            "evictions": self._evictions,
            "evicted_bytes": self._evicted_bytes,
            "pinned": self._pin,
        }

    def keys(self) -> list[CacheEngineKey]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._entries)
