"""Blocking object-file I/O: write a temporary object, read and verify a published one.

Runs in the backend's I/O threads (``os.pread*``/``os.pwrite*`` and numpy copies release
the GIL). Every read checks, in order: the file size against the header, the header
against its canonical encoding (so even a flipped padding byte is caught), the key and
namespace against the ones asked for, and the checksum of the data region against the
header. Any mismatch raises :class:`~lmcache_core.errors.FormatError`; the caller turns it
into a miss and removes the file.

Readers take a shared ``flock`` on the file they opened; an evictor takes an exclusive one
without waiting and skips files it cannot lock, so an entry being read is never evicted.
A reader that opened a file just before it was evicted or replaced still reads a complete
inode (unlinking keeps it alive), verified by its checksum: never a torn read.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import NoReturn

import numpy as np
import torch
from xxhash import xxh3_128, xxh3_128_hexdigest

from lmcache_core import format as fmt
from lmcache_core.errors import FormatError
from lmcache_core.libc import libc_function
from lmcache_core.turns import ReadTurns

from .aligned import ALIGN, BufferPool, aligned_empty, huge_backed, round_up
from .layout import current_umask, is_expected_location
from .sandbox import TierDir

__all__ = ["ObjectIO", "ReadOutcome", "ReadResult"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: ``O_DIRECT`` reads of large objects go in requests of this many bytes, each checksummed
#: (and, into an unaligned buffer, copied) as soon as it lands, while the cache still
#: holds it: the checksum and the copy overlap the object's next request instead of
#: running over the whole object from memory after its last byte arrived.
READ_PIECE = 4 << 20
#: ``O_DIRECT`` writes of larger objects go in pieces of this size (a multiple of ALIGN),
#: each checksummed (and copied, from an unaligned source) just before it is written.
WRITE_PIECE = 4 << 20
#: Threads allowed to copy and checksum objects at once (one per core this process may
#: run on). A batch's writes all start together: sharing the cores fairly between them
#: would finish every object's CPU work at about the same time and only then issue the
#: first write, leaving the device idle for the whole CPU phase; in lanes, the first
#: objects reach the device after one object's work and the rest overlap their writes.
CPU_LANES = threading.BoundedSemaphore(max(1, len(os.sched_getaffinity(0))))
_DUMMY_CHECKSUM = "xxh3_128:" + "0" * 32
_CHECKSUM_FIELD = b'"checksum":"xxh3_128:'
_KEY_FIELD = b'"key":"'
_U64 = struct.Struct("<Q")
_STANDARD_META = frozenset({"format", "format_version", "key", "namespace", "checksum", "codec"})


class ReadOutcome(enum.Enum):
    HIT = "hit"
    MISSING = "missing"  # no file
    BUSY = "busy"  # being evicted right now
    BAD = "bad"  # truncated, corrupted or foreign: to be removed
    LINK = "link"  # a symbolic link on the way (planted): to be removed, never followed


@dataclass
class ReadResult:
    """What a read found. ``inode`` identifies the file read (for a safe removal)."""

    outcome: ReadOutcome
    tensor: torch.Tensor | None = None
    reason: str = ""
    inode: tuple[int, int] | None = None
    size: int = 0
    header: fmt.ObjectHeader | None = None


def _u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat numpy uint8 array (zero copy)."""
    return (
        np.frombuffer(fmt.tensor_bytes(t), dtype=np.uint8) if t.numel() else np.empty(0, np.uint8)
    )


class _Skeleton:
    """A header's JSON body around the key's value (see :class:`HeaderTemplate`)."""

    __slots__ = ("after", "before", "digits_in_after", "fixed_len")

    def __init__(self, ns_json: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str):
        raw = fmt.encode_header("", ns_json, dtype, shape, _DUMMY_CHECKSUM, codec)
        body = raw[8:].rstrip(b" ")
        # the metadata fields before "key" are constants without this text, so the first
        # match is the key field; its empty value is the '""' right after it
        at = body.index(_KEY_FIELD) + len(_KEY_FIELD) - 1
        self.before = body[:at]
        self.after = body[at + 2 :]
        # '"checksum":"' cannot occur inside a JSON string value (its quotes would be
        # escaped), so the first match in what follows the key is the field itself
        self.digits_in_after = self.after.index(_CHECKSUM_FIELD) + len(_CHECKSUM_FIELD)
        self.fixed_len = len(self.before) + len(self.after)


_SKELETONS: dict[tuple[str, torch.dtype, tuple[int, ...], str], _Skeleton] = {}
_SKELETONS_MAX = 1024


def _skeleton(ns_json: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str) -> _Skeleton:
    """The cached skeleton of headers with these fields (a handful per deployment: one per
    chunk shape and namespace; the cache is emptied if it ever holds too many)."""
    k = (ns_json, dtype, shape, codec)
    sk = _SKELETONS.get(k)
    if sk is None:
        sk = _Skeleton(ns_json, dtype, shape, codec)
        if len(_SKELETONS) >= _SKELETONS_MAX:
            _SKELETONS.clear()
        _SKELETONS[k] = sk
    return sk


class HeaderTemplate:
    """The exact header of an object with these fields, checksum digits left open.

    Writers fill in the digits, readers compare a file's header with it byte for byte (all
    but the digits), which checks canonical form, format, key, namespace, dtype and shape
    at once. Built from a cached skeleton per (namespace, dtype, shape, codec): the JSON
    before and after the key's value, encoded once by
    :func:`~lmcache_core.format.encode_header`, with the key spliced in as the JSON
    encoder would write it - the same bytes, without a JSON encoding per object.
    """

    __slots__ = ("bytes", "digits_at")

    def __init__(
        self,
        key: str,
        ns_json: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        codec: str = "raw",
    ) -> None:
        sk = _skeleton(ns_json, dtype, shape, codec)
        key_json = encode_basestring(key).encode("utf-8")  # what json.dumps writes
        body_len = sk.fixed_len + len(key_json)
        n = -(-(8 + body_len) // fmt.DATA_ALIGN) * fmt.DATA_ALIGN - 8
        self.bytes = b"".join((_U64.pack(n), sk.before, key_json, sk.after, b" " * (n - body_len)))
        self.digits_at = 8 + len(sk.before) + len(key_json) + sk.digits_in_after

    def __len__(self) -> int:
        return len(self.bytes)

    def with_digits(self, digits: str) -> bytes:
        """The header carrying checksum ``xxh3_128:<digits>``."""
        at = self.digits_at
        return self.bytes[:at] + digits.encode("ascii") + self.bytes[at + 32 :]

    def digits_of(self, raw: bytes | memoryview) -> str | None:
        """The checksum digits of ``raw`` if it is this header (any digits), else ``None``."""
        at = self.digits_at
        if len(raw) != len(self.bytes) or raw[:at] != self.bytes[:at]:
            return None
        if raw[at + 32 :] != self.bytes[at + 32 :]:
            return None
        return bytes(raw[at : at + 32]).decode("latin-1")


def check_canonical(raw: memoryview | bytes, header: fmt.ObjectHeader) -> None:
    """Raise :class:`FormatError` unless the header bytes are exactly what the writer emits.

    JSON parsing alone would accept a padding space flipped into a tab or newline.
    """
    if header.codec != "raw" and (header.dtype != torch.uint8 or len(header.shape) != 1):
        # a coded chunk (lmcache_core.codecs) is a 1-D uint8 envelope, decoded by its tier
        raise FormatError(f"codec {header.codec!r} on a {header.dtype} tensor: not a coded chunk")
    extra = {k: v for k, v in header.metadata.items() if k not in _STANDARD_META}
    expected = fmt.encode_header(
        header.key,
        header.namespace,
        header.dtype,
        header.shape,
        header.checksum,
        header.codec,
        extra or None,
    )
    if bytes(raw[: header.data_offset]) != expected:
        raise FormatError("object header is not in canonical form (corrupted)")


class ObjectIO:
    """Reads and writes object files under one root (thread-safe, blocking).

    Paths are relative to the root and reached through ``tier`` (:class:`TierDir`): no
    symbolic link is ever followed, in directories or in the last component."""

    def __init__(
        self,
        tier: TierDir,
        file_mode: int,
        dir_mode: int,
        *,
        direct: bool,
        durable: bool,
        pool: BufferPool,
        mem_align: int = ALIGN,
        reads_in_flight: int = 0,
        stage_small_pages: int = 0,
        stage_page_aligned: bool = True,
    ) -> None:
        self.tier = tier
        #: Memory alignment an ``O_DIRECT`` transfer needs here (see
        #: :func:`~.aligned.probe_direct_mem_align`): a caller's tensor aligned to it is
        #: written from and read into directly, without a staging copy...
        self.mem_align = mem_align
        #: ... unless it is larger than this many bytes (0: never) and lies in 4 KiB
        #: pages (not known to be huge-backed): on a device that splits such transfers
        #: into more requests, the staging buffer's huge pages and a copy cost less (the
        #: ``small_pages`` option; the device's bytes per request from small pages).
        self.stage_small_pages = stage_small_pages
        #: Whether that includes tensors starting on a page boundary. Those are almost
        #: always a mapping of their own (``mmap``, ``aligned_empty``, the connector's and
        #: the hierarchy's buffers, pinned memory) whose pages were faulted in together and
        #: lie in long physical runs: direct transfers from them were measured faster
        #: (``make demo``'s disk loads). Memory starting inside a page is almost always a
        #: ``malloc`` heap's, whose pages were handed out and reused piecemeal.
        self.stage_page_aligned = stage_page_aligned
        #: Aligned caller tensors staged for that reason (counted, for stats and tests).
        self.small_page_stagings = 0
        self._count_lock = threading.Lock()
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.direct = direct
        self.durable = durable
        self.pool = pool
        self.umask = current_umask()
        #: ``O_DIRECT`` read requests allowed on the device at once (0: no limit). With
        #: a whole batch in flight the device serves every read at once and they all land
        #: near the end, so their checksums and copies run after the device went idle; a
        #: few at a time, each read's CPU work overlaps the next ones
        #: (``benchmarks/bench_disk.py``; docs/performance.md, "Reads a few at a time").
        self.reads_in_flight = reads_in_flight
        #: The turns pass between reader threads without the GIL where lmcache_core's
        #: compiled module was built (:class:`lmcache_core.turns.ReadTurns`).
        self._read_turns: ReadTurns | None = (
            ReadTurns(reads_in_flight) if reads_in_flight > 0 else None
        )

    # ------------------------------------------------------------------ writing
    def _direct(self, arr: np.ndarray) -> bool:
        """Whether an ``O_DIRECT`` transfer may use ``arr``'s memory itself: aligned for
        the device and, where small pages are staged, not known to lie in 4 KiB pages."""
        addr = arr.ctypes.data
        if addr % self.mem_align:
            return False
        limit = self.stage_small_pages
        if not limit or arr.nbytes <= limit:
            return True
        if addr % ALIGN == 0 and not self.stage_page_aligned:
            return True
        if huge_backed(addr, arr.nbytes) is not False:
            return True
        with self._count_lock:
            self.small_page_stagings += 1
        return False

    def write_temp_unsynced(
        self, tmp_rel: str, template: HeaderTemplate, value: torch.Tensor
    ) -> tuple[int, list[str], int]:
        """Write the complete object of ``value`` (whose header ``template`` describes) to
        the new file ``tmp_rel``, left open and not yet flushed: returns its size, the
        (relative) directories whose new entries (created on the way) still need an fsync
        and its descriptor, which the caller must flush and close (:meth:`finish_temp`, or
        the disk tier's wave after its renames). The file is removed on any error. A
        batch writes all its objects first and then flushes them, so one journal commit
        covers the whole batch instead of one commit (and device cache flush) per object
        racing the other objects' writes."""
        fd, size, new_dirs = self._fill_new_file(
            tmp_rel, lambda fd: self._write(fd, template, value)
        )
        return size, new_dirs, fd

    def finish_temp(self, tmp_rel: str, fd: int) -> None:
        """Flush (when durable) and close ``fd``, the open file ``tmp_rel`` from
        :meth:`write_temp_unsynced`; on any error the file is removed and the error
        raised."""
        try:
            if self.durable:
                os.fdatasync(fd)
        except BaseException:
            self._discard(tmp_rel, fd)
            raise
        os.close(fd)

    def write_new_file(self, tmp_rel: str, fill: Callable[[int], int]) -> tuple[int, list[str]]:
        """Create the new file ``tmp_rel`` (sandboxed, like every create), let ``fill``
        write it through its descriptor and return the size written, flush it when
        durable; the file is removed on any error. Returns the size and the directories
        still needing an fsync (see :meth:`write_temp_unsynced`). The seam other I/O
        paths (the gds backend's device writes) use."""
        fd, size, new_dirs = self._fill_new_file(tmp_rel, fill)
        self.finish_temp(tmp_rel, fd)
        return size, new_dirs

    def _fill_new_file(
        self, tmp_rel: str, fill: Callable[[int], int]
    ) -> tuple[int, int, list[str]]:
        """Create ``tmp_rel`` and run ``fill`` on it; the open descriptor, the size and the
        new directories (the file is removed on any error)."""
        fd, new_dirs = self._create(tmp_rel)
        try:
            size = fill(fd)
        except BaseException:
            self._discard(tmp_rel, fd)
            raise
        return fd, size, new_dirs

    def _discard(self, tmp_rel: str, fd: int) -> None:
        os.close(fd)
        try:
            self.tier.unlink(tmp_rel)
        except OSError:
            pass

    def _create(self, rel: str) -> tuple[int, list[str]]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct:
            flags |= _O_DIRECT
        new_dirs: list[str] = []
        try:
            fd = self.tier.open(rel, flags, self.file_mode)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise
            # a directory is missing, or something was planted where one belongs: make
            # the directories (links and files in their place are removed) and retry once
            new_dirs = self.tier.make_dirs(rel.rpartition("/")[0], self.dir_mode, self.umask)
            fd = self.tier.open(rel, flags, self.file_mode)
        if self.file_mode & self.umask:  # the umask took bits away: put them back
            try:
                os.fchmod(fd, self.file_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd, new_dirs

    def _write(self, fd: int, template: HeaderTemplate, value: torch.Tensor) -> int:
        src = _u8(value)
        n = src.nbytes
        if not self.direct:
            with CPU_LANES:
                digits = xxh3_128_hexdigest(src.data)
            header = template.with_digits(digits)
            _pwrite_all(fd, [memoryview(header), src.data], 0)
            return len(header) + n
        hlen = len(template)
        size = hlen + n
        padded = round_up(size)
        _preallocate(fd, padded)
        aligned = n >= ALIGN and self._direct(src)
        if n > WRITE_PIECE:
            return self._write_direct_pieces(fd, template, src, aligned)
        if aligned:
            return self._write_direct_aligned(fd, template, src)
        buf = self.pool.take(padded)
        try:
            stage = np.frombuffer(buf.view, dtype=np.uint8)
            with CPU_LANES:
                np.copyto(stage[hlen:size], src)
                digits = xxh3_128_hexdigest(buf.view[hlen:size])
            buf.view[:hlen] = template.with_digits(digits)
            stage[size:padded] = 0
            _pwrite_all(fd, [buf.view[:padded]], 0)
            if padded != size:
                os.ftruncate(fd, size)
        finally:
            self.pool.give(buf)
        return size

    def _write_direct_pieces(
        self, fd: int, template: HeaderTemplate, src: np.ndarray, aligned: bool
    ) -> int:
        """``O_DIRECT`` write of an object of more than one :data:`WRITE_PIECE`: each
        piece is checksummed (and, from an unaligned source, copied into one staging
        piece) and written before the next, the header with the whole checksum last. The
        device starts on the object after one piece's CPU work, not after the whole
        object's (docs/performance.md, "A read queue with its own threads, and writes in
        pieces")."""
        hlen, n = len(template), src.nbytes
        hasher = xxh3_128()
        buf = self.pool.take(max(hlen, ALIGN if aligned else WRITE_PIECE))
        stage = np.frombuffer(buf.view, dtype=np.uint8)
        try:
            off = 0
            while off < n:
                piece = min(WRITE_PIECE, n - off)
                if aligned:
                    body = piece - piece % ALIGN
                    tail = piece - body
                    with CPU_LANES:
                        hasher.update(src.data[off : off + piece])
                    views = [src.data[off : off + body]] if body else []
                    if tail:
                        stage[:tail] = src[off + body : off + piece]
                        stage[tail:ALIGN] = 0
                        views.append(buf.view[:ALIGN])
                else:
                    span = round_up(piece)
                    with CPU_LANES:
                        np.copyto(stage[:piece], src[off : off + piece])
                        hasher.update(buf.view[:piece])
                    stage[piece:span] = 0
                    views = [buf.view[:span]]
                _pwrite_all(fd, views, hlen + off)
                off += piece
            buf.view[:hlen] = template.with_digits(hasher.hexdigest())
            _pwrite_all(fd, [buf.view[:hlen]], 0)
        finally:
            self.pool.give(buf)
        if n % ALIGN:
            os.ftruncate(fd, hlen + n)
        return hlen + n

    def _write_direct_aligned(self, fd: int, template: HeaderTemplate, src: np.ndarray) -> int:
        """``O_DIRECT`` write straight from an aligned source (no staging copy): the header
        and a partial last block go through a small bounce buffer."""
        hlen, n = len(template), src.nbytes
        body = n - n % ALIGN
        tail = n - body
        with CPU_LANES:
            digits = xxh3_128_hexdigest(src.data)
        bounce = self.pool.take(hlen + (ALIGN if tail else 0))
        try:
            bounce.view[:hlen] = template.with_digits(digits)
            views = [bounce.view[:hlen], src.data[:body]]
            if tail:
                end = np.frombuffer(bounce.view, dtype=np.uint8)[hlen : hlen + ALIGN]
                end[:tail] = src[body:]
                end[tail:] = 0
                views.append(bounce.view[hlen : hlen + ALIGN])
            _pwrite_all(fd, views, 0)
            if tail:
                os.ftruncate(fd, hlen + n)
        finally:
            self.pool.give(bounce)
        return hlen + n

    # ------------------------------------------------------------------ reading
    def _open(self, rel: str) -> tuple[int | None, ReadResult | None]:
        flags = os.O_RDONLY | os.O_NONBLOCK  # a FIFO planted here must not block the open
        if self.direct:
            flags |= _O_DIRECT
        try:
            fd = self.tier.open(rel, flags)
        except (FileNotFoundError, NotADirectoryError):
            return None, ReadResult(ReadOutcome.MISSING)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None, ReadResult(ReadOutcome.LINK, reason="a symbolic link")
            st = self.tier.lstat(rel)  # e.g. O_DIRECT refused: is it even a file?
            if st is not None and not stat.S_ISREG(st.st_mode):
                inode = (st.st_dev, st.st_ino)
                return None, ReadResult(ReadOutcome.BAD, reason="not a regular file", inode=inode)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, ReadResult(ReadOutcome.BUSY)
        except BaseException:
            os.close(fd)
            raise
        return fd, None

    def read_into(self, rel: str, key: str, ns_json: str, out: torch.Tensor) -> ReadResult:
        """Read the object at ``rel`` into ``out`` and verify it.

        Raises :class:`~lmcache_core.errors.BufferMismatchError` when the stored object is
        valid but ``out`` cannot receive it.
        """

        def body(fd: int, size: int) -> tuple[torch.Tensor, fmt.ObjectHeader | None]:
            self._read_into(fd, size, key, ns_json, out)
            return out, None

        return self._read_verified(rel, body)

    def _read_verified(
        self,
        rel: str,
        body: Callable[[int, int], tuple[torch.Tensor, fmt.ObjectHeader | None]],
    ) -> ReadResult:
        """Open ``rel`` shared-locked and run ``body(fd, size)``, which reads and verifies
        the object: a ``FormatError`` from it is a BAD result, its tensor a HIT."""
        fd, early = self._open(rel)
        if fd is None:
            assert early is not None
            return early
        try:
            st = os.fstat(fd)
            inode = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode):
                return ReadResult(ReadOutcome.BAD, reason="not a regular file", inode=inode)
            try:
                out, header = body(fd, st.st_size)
            except FormatError as exc:
                return ReadResult(ReadOutcome.BAD, reason=str(exc), inode=inode, size=st.st_size)
            return ReadResult(
                ReadOutcome.HIT, tensor=out, inode=inode, size=st.st_size, header=header
            )
        finally:
            os.close(fd)

    def _read_into(self, fd: int, size: int, key: str, ns_json: str, out: torch.Tensor) -> None:
        template = HeaderTemplate(key, ns_json, out.dtype, tuple(out.shape))
        hlen = len(template)
        n = out.numel() * out.element_size()
        if size != hlen + n:
            # Either another shape/dtype of this key (the caller's buffer is wrong) or junk.
            self._explain_mismatch(self._read_head(fd, size), size, key, ns_json, out)
        dst = _u8(out)
        if self.direct:
            raw, digest = self._read_direct_hashed(fd, hlen, size, dst)
        else:
            raw = self._read_body(fd, hlen, size, dst, with_head=True)
            digest = None
        digits = template.digits_of(raw)
        if digits is None:
            self._explain_mismatch(raw, size, key, ns_json, out)
        if (digest if digest is not None else xxh3_128_hexdigest(dst.data)) != digits:
            raise FormatError("checksum mismatch: object data is corrupted")

    def _read_direct_hashed(
        self, fd: int, hlen: int, size: int, dst: np.ndarray
    ) -> tuple[bytes, str]:
        """``O_DIRECT`` read of the header (``hlen`` bytes, block-aligned) and the data into
        ``dst``, in requests of :data:`READ_PIECE`, each hashed as it lands (into an
        aligned ``dst`` directly, else through one staging piece). Returns the header bytes
        and the data's xxh3-128 hex digest."""
        n = size - hlen
        hasher = xxh3_128()
        aligned = self._direct(dst)
        span = round_up(hlen + min(n, READ_PIECE)) if not aligned else hlen + ALIGN
        buf = self.pool.take(span)
        stage = np.frombuffer(buf.view, dtype=np.uint8)
        head = b""
        try:
            off = 0
            while True:
                piece = min(READ_PIECE, n - off)
                head_len = hlen if off == 0 else 0
                start = 0 if off == 0 else hlen + off
                if aligned:
                    body = piece - piece % ALIGN
                    tail = piece - body
                    views = [buf.view[:head_len]] if head_len else []
                    if body:
                        views.append(dst.data[off : off + body])
                    if tail:
                        views.append(buf.view[head_len : head_len + ALIGN])
                else:
                    body, tail = 0, 0
                    views = [buf.view[: round_up(head_len + piece)]]
                got = self._data_read(fd, views, start)
                if got != head_len + piece:
                    raise FormatError(f"short read: {start + got} of {size} bytes (truncated?)")
                if aligned:
                    if tail:
                        dst[off + body : off + piece] = stage[head_len : head_len + tail]
                else:
                    np.copyto(dst[off : off + piece], stage[head_len : head_len + piece])
                if head_len:
                    head = bytes(buf.view[:hlen])
                if piece:
                    hasher.update(dst.data[off : off + piece])
                off += piece
                if off >= n:
                    return head, hasher.hexdigest()
        finally:
            self.pool.give(buf)

    def _data_read(self, fd: int, views: list[memoryview], offset: int) -> int:
        """One ``O_DIRECT`` read of object data into ``views`` (``0`` for none), on one of
        the device's ``reads_in_flight`` turns. Header reads (a block or two) take none."""
        if not views:
            return 0
        if self._read_turns is None:
            return os.preadv(fd, views, offset)
        return self._read_turns.preadv(fd, views, offset)

    def _explain_mismatch(
        self, raw: bytes, size: int, key: str, ns_json: str, out: torch.Tensor
    ) -> NoReturn:
        """The header is not the one expected: raise why (a FormatError for a bad or
        foreign object, a BufferMismatchError for a sound object of another shape)."""
        header = self._check_header(raw, size, key, ns_json)
        fmt.check_out(header, out)
        raise FormatError("object header differs from the expected one")

    def read_new(self, rel: str, key: str | None, ns_json: str | None) -> ReadResult:
        """Read the object at ``rel`` into a new tensor and verify it. ``key``/``ns_json``
        ``None`` skip the identity check (maintenance reads check the location instead)."""

        def body(fd: int, size: int) -> tuple[torch.Tensor, fmt.ObjectHeader | None]:
            raw = self._read_head(fd, size)
            header = self._check_header(raw, size, key, ns_json)
            out = (
                aligned_empty(header.shape, header.dtype)
                if self.direct
                else torch.empty(header.shape, dtype=header.dtype)
            )
            dst = _u8(out)
            self._read_body(fd, header.data_offset, size, dst, with_head=False)
            fmt.verify_data(header, dst)
            return out, header

        return self._read_verified(rel, body)

    def verify(self, rel: str) -> str | None:
        """Fully check the object at ``rel`` (size, header, checksum, and that it lives
        where its key and namespace put it); ``None`` when it is sound, else the reason."""
        res = self.read_new(rel, None, None)
        if res.outcome is ReadOutcome.MISSING:
            return "missing"
        if res.outcome is ReadOutcome.LINK:
            return "a symbolic link (never followed)"
        if res.outcome is ReadOutcome.BUSY:
            return None  # being evicted: not a defect
        if res.outcome is ReadOutcome.BAD:
            return res.reason
        assert res.header is not None
        if not is_expected_location(rel, res.header.key, res.header.namespace):
            return "object is stored under another key's or namespace's path"
        return None

    def read_header(self, rel: str) -> fmt.ObjectHeader | None:
        """The checked header of the object at ``rel`` (data not read), or ``None``."""
        fd, _ = self._open(rel)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            size = st.st_size
            return self._check_header(self._read_head(fd, size), size, None, None)
        except FormatError:
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ read helpers
    def _read_head(self, fd: int, size: int) -> bytes:
        """The header bytes (length prefix + JSON) of the object in ``fd``."""
        first = self._pread(fd, 0, min(size, ALIGN))
        hlen = fmt.read_header_length(first)
        if hlen > size:
            raise FormatError(f"object is truncated inside its header ({size} < {hlen} bytes)")
        if hlen <= len(first):
            return first[:hlen]
        return self._pread(fd, 0, hlen)

    def _pread(self, fd: int, offset: int, length: int) -> bytes:
        """``length`` bytes at an aligned ``offset`` (through a staging block when direct)."""
        if not self.direct:
            data = os.pread(fd, length, offset)
        else:
            buf = self.pool.take(round_up(length))
            try:
                got = os.preadv(fd, [buf.view[: round_up(length)]], offset)
                data = bytes(buf.view[: min(got, length)])
            finally:
                self.pool.give(buf)
        if len(data) != length:
            raise FormatError(f"short read: {len(data)} of {length} bytes (truncated?)")
        return data

    def _read_body(
        self, fd: int, hlen: int, size: int, dst: np.ndarray, *, with_head: bool
    ) -> bytes:
        """Read the data region (``hlen`` .. ``size``) into ``dst``; with ``with_head`` read
        the header in the same request and return it."""
        n = size - hlen
        if not self.direct:
            head = bytearray(hlen if with_head else 0)
            views = [memoryview(head)] if with_head else []
            views.append(dst.data)
            _pread_exact(fd, views, 0 if with_head else hlen, n + len(head))
            return bytes(head)
        if self._direct(dst):
            return self._read_direct_aligned(fd, hlen, size, dst, with_head)
        start = 0 if with_head else hlen
        buf = self.pool.take(round_up(size - start))
        try:
            got = self._data_read(fd, [buf.view[: round_up(size - start)]], start)
            if got != size - start:
                raise FormatError(f"short read: {got} of {size - start} bytes (truncated?)")
            stage = np.frombuffer(buf.view, dtype=np.uint8)
            np.copyto(dst, stage[hlen - start : size - start])
            return bytes(buf.view[:hlen]) if with_head else b""
        finally:
            self.pool.give(buf)

    def _read_direct_aligned(
        self, fd: int, hlen: int, size: int, dst: np.ndarray, with_head: bool
    ) -> bytes:
        """``O_DIRECT`` read straight into an aligned destination (tail via a bounce block)."""
        n = size - hlen
        body = n - n % ALIGN
        tail = n - body
        head_len = hlen if with_head else 0
        bounce = self.pool.take(head_len + (ALIGN if tail else 0) or ALIGN)
        try:
            views = [bounce.view[:head_len]] if with_head else []
            if body:
                views.append(dst.data[:body])
            if tail:
                views.append(bounce.view[head_len : head_len + ALIGN])
            start = 0 if with_head else hlen
            got = self._data_read(fd, views, start)
            if got != size - start:
                raise FormatError(f"short read: {got} of {size - start} bytes (truncated?)")
            if tail:
                stage = np.frombuffer(bounce.view, dtype=np.uint8)
                dst[body:] = stage[head_len : head_len + tail]
            return bytes(bounce.view[:head_len])
        finally:
            self.pool.give(bounce)

    def _check_header(
        self, raw: memoryview | bytes, size: int, key: str | None, ns_json: str | None
    ) -> fmt.ObjectHeader:
        header = fmt.decode_header(raw, total_size=size)
        check_canonical(raw, header)
        fmt.check_identity(header, key, ns_json)
        return header


def _pread_exact(fd: int, views: list[memoryview], offset: int, total: int) -> None:
    """Buffered ``preadv`` of exactly ``total`` bytes into ``views`` (short read: truncated)."""
    done = 0
    views = [v for v in views if len(v)]
    while views:
        got = os.preadv(fd, views, offset + done)
        if got == 0:
            raise FormatError(f"short read: {done} of {total} bytes (truncated?)")
        done += got
        views = _advance(views, got)


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    fn = libc_function("fallocate")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_fallocate = _load_fallocate()


def _preallocate(fd: int, nbytes: int) -> None:
    """Allocate the file's blocks before an ``O_DIRECT`` write (``fallocate``, never
    glibc's ``posix_fallocate`` emulation, which writes zeros): a write that extends a
    file makes ext4 journal the extension around every request; into allocated blocks
    it does not. Where the filesystem cannot (``EOPNOTSUPP``), the write extends the
    file as before; other errors (``ENOSPC``) raise like the write would."""
    if _fallocate is None or _fallocate(fd, 0, 0, nbytes) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return
    raise OSError(err, os.strerror(err))


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` everything in ``views`` at ``offset``."""
    done = 0
    views = [v for v in views if len(v)]
    while views:
        got = os.pwritev(fd, views, offset + done)
        if got <= 0:  # pragma: no cover - the kernel raises ENOSPC rather than return 0
            raise OSError("pwritev wrote nothing")
        done += got
        views = _advance(views, got)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:] if n else v)
        n = 0
    return [v for v in out if len(v)]
