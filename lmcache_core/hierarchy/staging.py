"""Private copies of chunks on their way to background stores.

A store returns before the lower tiers are written, and the caller may reuse its tensor
at once, so the hierarchy keeps its own copy until every background store of it is done.
The copies come from a :class:`StagingPool` that recycles buffers by size (fresh memory
costs page faults: several times slower than copying into reused memory), and are shared
between the tiers writing the same chunk through a reference-counted :class:`StagedChunk`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

import torch

from ..blob import lower_thread_priority
from ..memory import copy_into, mapped_empty, populated_empty

__all__ = ["CopyBudget", "StagedChunk", "StagingPool"]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


class StagingPool:
    """Recycles flat uint8 buffers by size, keeping at most ``max_free_bytes`` idle.

    A buffer donated to a memory tier never comes back, so every promotion and
    write-through of a new chunk into a memory tier takes fresh memory, and on this kind
    of machine the page faults of fresh memory cost ~10x the copy itself (see
    :func:`~lmcache_core.memory.populated_empty`). So after each take of a buffer of
    ``spare_min_nbytes`` or more, a background thread tops the size's free list up to
    ``spare_bytes`` with buffers already faulted in: a load that promotes a few chunks
    copies into memory that is already there.

    With ``background`` (a function that runs a callable on some thread later, in order:
    the hierarchy passes :meth:`CopyBudget.submit`) the top-up runs there, one buffer per
    call, each queued behind the copies submitted meanwhile, so copies and faults together
    never take more than that one thread's core from the event loop. Without it the pool
    starts its own thread, ``spare_nice`` steps nicer than the process (default 0: a
    niced thread that takes the GIL stalls the loop when other processes load every core,
    see :func:`~lmcache_core.blob.lower_thread_priority`). A buffer taken when no spare is left is a page-aligned mapping that is
    not faulted in on the taking thread (the event loop): the copy thread takes its
    faults. ``spare_bytes=0`` turns the background top-up off.
    """

    def __init__(
        self,
        max_free_bytes: int = 256 << 20,
        *,
        spare_bytes: int = 32 << 20,
        spare_min_nbytes: int = 1 << 20,
        spare_nice: int = 0,
        background: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.max_free_bytes = max_free_bytes
        self.spare_bytes = min(spare_bytes, max_free_bytes)
        self.spare_min_nbytes = spare_min_nbytes
        self.spare_nice = spare_nice
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self.allocated = 0
        self.reused = 0
        #: buffers the background thread faulted in ahead of use
        self.prefaulted = 0
        self._cond = threading.Condition()
        self._wanted: set[int] = set()
        self._thread: threading.Thread | None = None
        self._background = background
        self._step_queued = False
        self._closed = False

    def take(self, nbytes: int) -> torch.Tensor:
        large = nbytes >= self.spare_min_nbytes
        with self._cond:
            bucket = self._free.get(nbytes)
            if bucket:
                self._free_bytes -= nbytes
                self.reused += 1
                buf = bucket.pop()
            else:
                self.allocated += 1
                buf = None
        if large:
            self._want(nbytes)  # (a spare taken or missing: the top-up refills the size)
        if buf is not None:
            return buf
        if not large:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Page-aligned but not faulted in here: the caller (the event loop) hands the
        # copy to a thread, which takes the page faults; only spares are faulted in ahead.
        return mapped_empty(nbytes)

    def prepare(self, nbytes: int) -> None:
        """Have the background thread fault in spare buffers of ``nbytes`` now, ahead of
        the first take of that size (``nbytes`` under ``spare_min_nbytes``: nothing)."""
        if nbytes >= self.spare_min_nbytes:
            self._want(nbytes)

    def take_like(self, like: torch.Tensor) -> torch.Tensor:
        """A recycled buffer viewed with ``like``'s dtype and shape."""
        nbytes = like.numel() * like.element_size()
        buf = self.take(nbytes)
        if nbytes == 0:
            return torch.empty(like.shape, dtype=like.dtype)
        return buf.view(like.dtype).view(like.shape)

    def give(self, t: torch.Tensor) -> None:
        """Return a buffer (any view of one taken from this pool)."""
        flat = flat_bytes(t) if t.numel() else t
        n = flat.numel() * flat.element_size()
        with self._cond:
            if n == 0 or self._free_bytes + n > self.max_free_bytes:
                return
            self._free.setdefault(n, []).append(flat)
            self._free_bytes += n

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        """Stop the background top-up (buffers already free stay usable)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    # ------------------------------------------------------------------ top-up
    def _want(self, nbytes: int) -> None:
        if self.spare_bytes < nbytes:
            return
        with self._cond:
            if self._closed or not self._short(nbytes):
                return
            self._wanted.add(nbytes)
            if self._background is not None:
                if self._step_queued:
                    return
                self._step_queued = True
            else:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._top_up, name="lmcache-prefault", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()
                return
        self._queue_step()

    def _short(self, nbytes: int) -> bool:
        """Whether the size's free list is under ``spare_bytes`` (caller holds the lock)."""
        have = len(self._free.get(nbytes, ())) * nbytes
        return (
            have + nbytes <= self.spare_bytes and self._free_bytes + nbytes <= self.max_free_bytes
        )

    def _next_wanted(self) -> int | None:
        """A size still short of spares (caller holds the lock), dropping those that are
        not; ``None`` when none is."""
        while self._wanted:
            nbytes = next(iter(self._wanted))
            if self._short(nbytes):
                return nbytes
            self._wanted.discard(nbytes)
        return None

    def _fill_one(self, nbytes: int) -> bool:
        """Fault in one spare of ``nbytes`` (caller does not hold the lock); False once
        the pool is closed."""
        buf = populated_empty(nbytes)  # (outside the lock: it takes milliseconds)
        with self._cond:
            if self._closed:
                return False
            if self._short(nbytes):
                self._free.setdefault(nbytes, []).append(buf)
                self._free_bytes += nbytes
                self.prefaulted += 1
        return True

    def _top_up(self) -> None:
        """The pool's own thread (no ``background`` given)."""
        lower_thread_priority(self.spare_nice)
        while True:
            with self._cond:
                nbytes = None
                while not self._closed and (nbytes := self._next_wanted()) is None:
                    self._cond.wait()
                if self._closed or nbytes is None:
                    return
            if not self._fill_one(nbytes):
                return

    def _queue_step(self) -> None:
        assert self._background is not None
        try:
            self._background(self._step)
        except RuntimeError:  # the thread is shutting down: no more spares
            with self._cond:
                self._step_queued = False

    def _step(self) -> None:
        """One spare on the ``background`` thread, then the next step queued behind the
        work submitted meanwhile (copies wait for at most one buffer's faults)."""
        with self._cond:
            nbytes = None if self._closed else self._next_wanted()
            if nbytes is None:
                self._step_queued = False
                return
        more = False
        try:
            more = self._fill_one(nbytes)
        finally:
            if not more:
                with self._cond:
                    self._step_queued = False
        if more:
            self._queue_step()


class StagedChunk:
    """A chunk value owned by the hierarchy, shared by background stores.

    The buffer goes back to its pool when the last reference is released, unless a store
    took it (``donate=True``): the last store of a chunk donates it to its backend, which
    may then keep the memory instead of copying it (the ``cpu`` backend does).

    With ``on_release`` the value is memory someone else owns and lends (an entry of the
    top tier, borrowed while lower tiers write it through): ``on_release()`` runs once
    after the last reference is released (it ends the borrow), and the value is never
    donated. A release with ``reusable=False`` (a thread may still read the value) skips
    it: the lender then never reuses that memory.
    """

    __slots__ = ("_on_release", "_pool", "_refs", "value")

    def __init__(
        self,
        value: torch.Tensor,
        pool: StagingPool | None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.value = value
        self._pool = pool
        self._on_release = on_release
        self._refs = 1

    def retain(self) -> StagedChunk:
        self._refs += 1
        return self

    def exclusive(self) -> bool:
        """Whether only one holder is left and the value is the hierarchy's own (that
        holder may donate it)."""
        return self._refs == 1 and self._on_release is None

    def donated(self) -> None:
        """The value was donated to a backend: never reuse its memory."""
        self._pool = None

    def release(self, reusable: bool = True) -> None:
        """Drop one reference. ``reusable=False`` (a store was cancelled mid-copy, a thread
        may still read the buffer) keeps the buffer out of the pool (and a lent value
        with its lender, never handed back)."""
        self._refs -= 1
        if not reusable:
            self._pool = None
            self._on_release = None
        if self._refs == 0:
            if self._pool is not None:
                self._pool.give(self.value)
                self._pool = None
            done, self._on_release = self._on_release, None
            if done is not None:
                done()


class CopyBudget:
    """Copies without starving the event loop.

    Copies of at most ``yield_every_bytes`` per loop iteration run inline (a thread hop
    costs more than a small copy); a task over budget yields first. Copies larger than
    ``thread_bytes`` run in one dedicated thread (the memcpy releases the GIL): one thread,
    not a pool, so that staging copies never take more than one core from the event loop
    (with a pool of threads, 16 concurrent 4 MiB stores on this 2-core machine pushed the
    loop's p99 wake-up lag from ~10 ms to ~30 ms; with one thread it stayed at ~10 ms).
    The hierarchy's staging pool faults in its spare buffers on the same thread
    (:meth:`submit`), for the same reason.
    """

    def __init__(self, yield_every_bytes: int = 1 << 20, thread_bytes: int = 1 << 20) -> None:
        self.yield_every_bytes = yield_every_bytes
        self.thread_bytes = thread_bytes
        self._used = 0
        self._reset_pending = False
        self._closed = False
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the copy thread (after the copies already submitted)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:  # (submit may come from any thread)
            if self._closed:  # (checked under the lock: no thread started after close)
                raise RuntimeError("copy thread closed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lmcache-staging"
                )
            return self._executor

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the copy thread after what was submitted before it (the staging
        pool's top-up: :class:`StagingPool` ``background``). Raises ``RuntimeError`` once
        closed. Any thread may call it."""
        self._thread().submit(fn)

    def _reset(self) -> None:
        self._used = 0
        self._reset_pending = False

    async def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = dst.numel() * dst.element_size()
        if n > self.thread_bytes:
            try:
                thread = self._thread()
            except RuntimeError:  # closed: a copy still asked for runs here
                copy_into(dst, src)
                return
            await asyncio.get_running_loop().run_in_executor(thread, copy_into, dst, src)
            return
        while self._used and self._used + n > self.yield_every_bytes:
            await asyncio.sleep(0)
        if not self._reset_pending:
            self._reset_pending = True
            asyncio.get_running_loop().call_soon(self._reset)
        self._used += n
        copy_into(dst, src)
