"""A canary tree outside a tier: proof that nothing outside the tier is written, deleted or
opened. Every file and directory is recorded (inode, mode, size, bytes) before and compared
after; an inotify watch (through ctypes: no dependency) on every directory and file of the
tree records any open, read, write, attribute change, creation, deletion or move."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import select
import stat
import struct
from dataclasses import dataclass

IN_ACCESS = 0x001
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_CLOSE_NOWRITE = 0x010
IN_OPEN = 0x020
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
ALL_EVENTS = 0xFFF
_NAMES = {
    IN_ACCESS: "access",
    IN_MODIFY: "modify",
    IN_ATTRIB: "attrib",
    IN_CLOSE_WRITE: "close_write",
    IN_CLOSE_NOWRITE: "close_nowrite",
    IN_OPEN: "open",
    IN_MOVED_FROM: "moved_from",
    IN_MOVED_TO: "moved_to",
    IN_CREATE: "create",
    IN_DELETE: "delete",
    IN_DELETE_SELF: "delete_self",
    IN_MOVE_SELF: "move_self",
}
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]


class Inotify:
    """An inotify instance watching paths; :meth:`events` drains what happened."""

    def __init__(self) -> None:
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self.wds: dict[int, str] = {}

    def watch(self, path: str) -> None:
        # IN_DONT_FOLLOW (0x02000000): watch the entry itself
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), ALL_EVENTS | 0x02000000)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        self.wds[wd] = path

    def events(self) -> list[str]:
        """Events since the last call, as ``"<event> <path>[/<name>]"``."""
        out: list[str] = []
        while True:
            r, _, _ = select.select([self.fd], [], [], 0.05)
            if not r:
                return out
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    return out
                raise
            i = 0
            while i < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, i)
                name = data[i + _EVENT.size : i + _EVENT.size + length].rstrip(b"\0").decode()
                i += _EVENT.size + length
                if mask & IN_IGNORED:
                    continue
                kinds = [n for bit, n in _NAMES.items() if mask & bit]
                where = self.wds.get(wd, "?") + (f"/{name}" if name else "")
                out.append(f"{'+'.join(kinds)} {where}")

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class Entry:
    ino: int
    mode: int
    size: int
    digest: str  # of the bytes (files), of the sorted names (directories), of the target (links)


def snapshot(top: str) -> dict[str, Entry]:
    """Every entry under ``top`` (links not followed), by relative path."""
    out: dict[str, Entry] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in [*dirs, *files, "."] if dirpath == top else [*dirs, *files]:
            path = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(path)
            if os.path.islink(path):
                digest = hashlib.sha256(os.readlink(path).encode()).hexdigest()
            elif os.path.isdir(path):
                digest = hashlib.sha256("\0".join(sorted(os.listdir(path))).encode()).hexdigest()
            elif not stat.S_ISREG(st.st_mode):  # a FIFO: never opened
                digest = ""
            else:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, top)] = Entry(st.st_ino, st.st_mode, st.st_size, digest)
    return out


class Canary:
    """A tree of files outside the tier, recorded and watched.

    Use: build the tree, then :meth:`arm` (records it, starts the watch), run the attack,
    then :meth:`check` -> a list of differences and events (empty: untouched)."""

    def __init__(self, top: str) -> None:
        self.top = top
        self._before: dict[str, Entry] = {}
        self._watch: Inotify | None = None

    def arm(self) -> None:
        self._before = snapshot(self.top)
        watch = Inotify()
        for rel in self._before:
            path = os.path.normpath(os.path.join(self.top, rel))
            watch.watch(path)
        watch.events()  # nothing yet
        self._watch = watch

    def check(self) -> list[str]:
        """Differences and events since :meth:`arm` (drains the watch first, so this very
        comparison's reads are not counted)."""
        assert self._watch is not None
        events = self._watch.events()
        self._watch.close()
        self._watch = None
        after = snapshot(self.top)
        diffs = [f"event: {e}" for e in events]
        for rel in sorted(set(self._before) | set(after)):
            a, b = self._before.get(rel), after.get(rel)
            if a != b:
                diffs.append(f"changed: {rel}: {a} -> {b}")
        return diffs
