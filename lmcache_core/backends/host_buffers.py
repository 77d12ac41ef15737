"""Host buffers of the ``cpu`` backend: what each costs, and a pool that recycles them.

The backend's bound (``max_bytes``) must hold for the memory the process really uses, so
every buffer is charged what it occupies, not only its tensor bytes:

* :data:`ENTRY_OVERHEAD` per entry (the Python and torch objects of an entry, its key and
  index slot: ~0.7-0.9 KiB measured here), so 0-byte values are bounded too;
* buffers of at least ``map_min`` bytes are anonymous private memory maps of whole
  pages, owned by the pool: freeing one returns its pages to the system at once (the C
  heap keeps freed memory and fragments under mixed sizes: RSS reached ~1.8x the bound
  in a mixed-size storm). A freed map is recycled for a value of another size by
  ``mremap`` (shrinking releases pages, growing faults in only the difference), so a
  mixed-size workload does not pay fresh page faults for every value;
* smaller buffers come from torch's allocator, charged in 64-byte units;
* pinned buffers (CUDA) are charged the power of two torch's caching host allocator
  rounds them to.

``map_min`` grows with the bound (at most ``MAX_MAPS`` maps per backend) so a large
cache of small values never runs into the kernel's limit on memory maps.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

__all__ = ["ENTRY_OVERHEAD", "MAP_MIN", "MAX_MAPS", "Buffer", "BufferPool"]

#: Bytes charged per entry on top of its buffer.
ENTRY_OVERHEAD = 1024
#: Smallest buffer held as a memory map (when the bound allows at most MAX_MAPS of them).
MAP_MIN = 64 << 10
#: At most ``max_bytes // map_min`` maps: this many.
MAX_MAPS = 16384
_PAGE = mmap.PAGESIZE
_ALIGN = 64
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_EMPTY = torch.empty(0, dtype=torch.uint8)


def _round(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Buffer:
    """One buffer: ``data`` (flat uint8, exactly the value's bytes) over ``capacity`` bytes.

    ``mapping`` is the memory map behind ``data`` (``None`` for torch-allocated memory).
    ``cost`` is what the bound is charged while the buffer is held (capacity plus
    :data:`ENTRY_OVERHEAD`).
    """

    __slots__ = ("capacity", "cost", "data", "mapping")

    def __init__(self, data: torch.Tensor, capacity: int, mapping: mmap.mmap | None) -> None:
        self.data = data
        self.capacity = capacity
        self.cost = capacity + ENTRY_OVERHEAD
        self.mapping = mapping


class BufferPool:
    """Allocates :class:`Buffer` objects and keeps freed ones for reuse.

    The pool does no bound checks itself: the backend decides when a freed buffer may be
    kept (:meth:`give`) and when pooled ones must go (:meth:`drop_one`). ``bytes`` is the
    cost of the pooled buffers. Not thread-safe: the backend's lock guards it.
    """

    def __init__(self, max_bytes: int, pin: bool = False) -> None:
        self.pin = pin
        self.map_min = max(MAP_MIN, _round(-(-max_bytes // MAX_MAPS), _PAGE))
        self._maps: dict[int, list[mmap.mmap]] = {}  # capacity -> freed maps
        self._heap: dict[int, list[torch.Tensor]] = {}  # capacity -> freed tensors
        self.bytes = 0
        self.count = 0

    # ------------------------------------------------------------------ sizes
    def mapped(self, nbytes: int) -> bool:
        """Whether a buffer for ``nbytes`` is a memory map."""
        return not self.pin and nbytes >= self.map_min

    def capacity(self, nbytes: int) -> int:
        """Bytes a buffer for an ``nbytes`` value occupies."""
        if self.pin:
            return 1 << (nbytes - 1).bit_length() if nbytes else 0
        if nbytes >= self.map_min:
            return -(-nbytes // _PAGE) * _PAGE
        return -(-nbytes // _ALIGN) * _ALIGN

    def cost(self, nbytes: int) -> int:
        """What an entry holding an ``nbytes`` value is charged."""
        return self.capacity(nbytes) + ENTRY_OVERHEAD

    # ------------------------------------------------------------------ buffers
    def wrap(self, data: torch.Tensor) -> Buffer:
        """A buffer over a caller's flat uint8 tensor that owns its whole storage (donated)."""
        n = data.numel()
        return Buffer(data, n, None) if n else Buffer(_EMPTY, 0, None)

    def new(self, nbytes: int) -> Buffer:
        """A fresh buffer for ``nbytes`` (raises ``OSError``/``RuntimeError`` when out of memory)."""
        cap = self.capacity(nbytes)
        if nbytes == 0:
            return Buffer(_EMPTY, 0, None)
        if self.mapped(nbytes):
            mm = mmap.mmap(-1, cap, flags=_MAP_FLAGS)
            return Buffer(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), cap, mm)
        data = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin)
        return Buffer(data[:nbytes] if cap != nbytes else data, cap, None)

    def take(self, nbytes: int) -> Buffer | None:
        """A pooled buffer of exactly the capacity ``nbytes`` needs, or ``None``."""
        if not self.count:
            return None
        cap = self.capacity(nbytes)
        if cap == 0:
            return None
        if self.mapped(nbytes):
            maps = self._maps.get(cap)
            if not maps:
                return None
            mm = maps.pop()
            if not maps:
                del self._maps[cap]
            self._forget(cap)
            return Buffer(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), cap, mm)
        heap = self._heap.get(cap)
        if not heap:
            return None
        full = heap.pop()
        if not heap:
            del self._heap[cap]
        self._forget(cap)
        return Buffer(full[:nbytes] if cap != nbytes else full, cap, None)

    def take_resized(self, nbytes: int) -> Buffer | None:
        """A pooled map resized (``mremap``) to fit ``nbytes``; ``None`` if there is none.

        The smallest map at least as large is taken (shrinking only releases pages), else
        the largest (growing maps new pages, which fault in when written: the fewer the
        better). Only for values that are held as maps.
        """
        if not self._maps or not self.mapped(nbytes):
            return None
        cap = self.capacity(nbytes)
        larger = [c for c in self._maps if c >= cap]
        size = min(larger) if larger else max(self._maps)
        maps = self._maps[size]
        mm = maps.pop()
        if not maps:
            del self._maps[size]
        self._forget(size)
        try:
            mm.resize(cap)
        except (BufferError, OSError, ValueError, SystemError):
            return None  # still viewed elsewhere (or no mremap here): let it go
        return Buffer(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), cap, mm)

    def give(self, buf: Buffer) -> None:
        """Keep ``buf`` for reuse (the caller checked that the bound allows it)."""
        if buf.capacity == 0:
            return
        if buf.mapping is not None:
            mm = buf.mapping
            buf.data = _EMPTY  # drop the view: the map can be resized later
            buf.mapping = None
            self._maps.setdefault(buf.capacity, []).append(mm)
        else:
            data = buf.data
            if data.numel() != buf.capacity:  # the full allocation, not the value's view
                data = torch.empty(0, dtype=torch.uint8).set_(data.untyped_storage())
            self._heap.setdefault(buf.capacity, []).append(data)
        self.bytes += buf.cost
        self.count += 1

    def drop_one(self) -> None:
        """Free one pooled buffer (the oldest capacity first); no-op when empty."""
        for pool in (self._heap, self._maps):
            if pool:
                cap = next(iter(pool))
                bucket: list[Any] = pool[cap]
                bucket.pop()
                if not bucket:
                    del pool[cap]
                self._forget(cap)
                return

    def clear(self) -> None:
        """Free every pooled buffer."""
        self._maps.clear()
        self._heap.clear()
        self.bytes = self.count = 0

    def _forget(self, cap: int) -> None:
        self.bytes -= cap + ENTRY_OVERHEAD
        self.count -= 1
