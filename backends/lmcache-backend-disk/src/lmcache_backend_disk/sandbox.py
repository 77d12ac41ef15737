"""The tier directory as a sandbox: nothing below its root is reached through a symlink.

A tier directory may be shared with other users (``mode: "0660"``), so anything in it can
have been planted: a symbolic link in place of a namespace or shard directory, of an
object, of ``.lmcache-disk`` or of ``owners`` would otherwise make this process read,
write or delete files elsewhere with its own rights. :class:`TierDir` therefore holds a
descriptor of the root, opened once, and reaches every path below it *relative to that
descriptor* without following any symbolic link, in directories as in the last component:

* with ``openat2(2)`` and ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (Linux 5.6+): one
  system call per open, the same count as a plain ``open``, so the hot paths do not slow
  down;
* elsewhere (older kernels, seccomp filters that refuse ``openat2``) by walking the path
  one component at a time with ``O_NOFOLLOW | O_DIRECTORY`` relative to the previous
  directory's descriptor.

Checking a path and then using it ("verify before use") would leave a window in which a
component can be swapped for a link; resolving relative to descriptors leaves none. Links
found where the layout has directories or files are removed (the link itself, never its
target) and counted, so a planted link heals instead of blocking part of the tier.

:func:`open_root` opens the root (never through a symlink) and refuses a root that another
user controls; see ``docs/backends/disk.md`` ("The tier directory is a sandbox").
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import pwd
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lmcache_core.errors import ConfigError
from lmcache_core.libc import libc_function

__all__ = ["TierDir", "check_root", "open_root", "openat2_available"]

_O_PATH = getattr(os, "O_PATH", 0)
#: Errors of ``fsync`` on a directory from file systems that refuse it: not a failure.
DIR_FSYNC_REFUSED = frozenset({errno.EINVAL, errno.EROFS})
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (new syscall table)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _Openat2:
    """``openat2`` through ``syscall(2)`` (Python's ``os`` does not expose it)."""

    def __init__(self) -> None:
        self.ok = False
        self._hows: dict[tuple[int, int], object] = {}
        fn = libc_function("syscall")
        if fn is None:
            return
        fn.restype = ctypes.c_long
        fn.argtypes = [
            ctypes.c_long,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        self._fn = fn
        self._size = ctypes.sizeof(_OpenHow)
        try:
            fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            probe = self.call(fd, ".", _O_PATH | os.O_CLOEXEC, 0)
        except OSError:
            return
        finally:
            os.close(fd)
        os.close(probe)
        self.ok = True

    def call(self, dir_fd: int, rel: str, flags: int, mode: int) -> int:
        key = (flags, mode if flags & os.O_CREAT else 0)
        how = self._hows.get(key)
        if how is None:  # a handful of (flags, mode) pairs are used: built once each
            how = self._hows[key] = ctypes.byref(_OpenHow(key[0], key[1], _RESOLVE))
        fd = self._fn(_SYS_OPENAT2, dir_fd, rel.encode(), how, self._size)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), rel)
        return int(fd)


_openat2: _Openat2 | None = None
_openat2_lock = threading.Lock()
#: Tests set this to ``False`` to exercise the component-by-component walk.
USE_OPENAT2 = True


def openat2_available() -> bool:
    """Whether ``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` works here."""
    global _openat2
    if _openat2 is None:
        with _openat2_lock:
            if _openat2 is None:
                _openat2 = _Openat2()
    return _openat2.ok


def _split(rel: str) -> list[str]:
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a plain relative path inside a tier: {rel!r}")
    return parts


class TierDir:
    """Descriptor-relative, symlink-free access below one root directory (thread-safe).

    Every ``rel`` is a ``/``-separated path relative to the root made of plain names (no
    ``..``, no absolute paths); :class:`ValueError` otherwise. A symbolic link on the way
    raises ``OSError(ELOOP)``.
    """

    def __init__(self, root_fd: int, path: str) -> None:
        self.fd = root_fd
        self.path = path
        self.links_removed = 0
        self._fast = USE_OPENAT2 and openat2_available()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ opening
    def open(self, rel: str, flags: int, mode: int = 0o600) -> int:
        """``open(root/rel, flags | O_NOFOLLOW | O_CLOEXEC, mode)`` without following any link."""
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if self._fast:
            assert _openat2 is not None
            if ".." in rel or rel.startswith("/"):
                _split(rel)  # raises
            try:
                return _openat2.call(self.fd, rel, flags, mode)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # EAGAIN: a racing rename; walk instead
                    raise
        return self._walk_open(rel, flags, mode)

    def _walk_open(self, rel: str, flags: int, mode: int) -> int:
        parts = _split(rel)
        fd = self.fd
        try:
            for name in parts[:-1]:
                try:
                    nxt = os.open(name, (_O_PATH or os.O_RDONLY) | _DIR_FLAGS, dir_fd=fd)
                except NotADirectoryError:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):  # as openat2 reports it
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel) from None
                    raise
                if fd != self.fd:
                    os.close(fd)
                fd = nxt
            return os.open(parts[-1], flags, mode, dir_fd=fd)
        finally:
            if fd != self.fd:
                os.close(fd)

    def open_dir(self, rel: str) -> int:
        """A readable descriptor of the directory ``rel`` (``""`` is the root itself)."""
        if not rel:
            return os.dup(self.fd)
        return self.open(rel, os.O_RDONLY | os.O_DIRECTORY)

    @contextmanager
    def dir(self, rel: str) -> Iterator[int]:
        """:meth:`open_dir` as a context manager (closed at the end)."""
        fd = self.open_dir(rel)
        try:
            yield fd
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ names
    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel`` (the entry itself, a link is not followed); ``None`` if absent
        (or if a directory on the way is missing, not a directory or a link)."""
        head, _, name = rel.rpartition("/")
        try:
            with self.dir(head) as dfd:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise

    def exists(self, rel: str) -> bool:
        """Whether something that is not a link is at ``rel``, reached without any link
        (the cheap check behind ``contains``: two system calls with ``openat2``; what it
        finds is verified when read)."""
        if self._fast:
            assert _openat2 is not None
            try:
                fd = _openat2.call(self.fd, rel, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0)
            except OSError:
                return False
            os.close(fd)
            return True  # (RESOLVE_BENEATH: nothing outside the root is reachable)
        return self.is_file(rel)

    def is_file(self, rel: str) -> bool:
        """Whether ``rel`` is a regular file reached without any link."""
        try:
            fd = self.open(rel, _O_PATH or os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def unlink(self, rel: str) -> bool:
        """Remove the entry ``rel`` (a link is removed, never its target); ``False`` when
        it was not there."""
        head, _, name = rel.rpartition("/")
        try:
            with self.dir(head) as dfd:
                os.unlink(name, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return False  # a link on the way: the entry is not reachable, so not there
            raise
        return True

    def rename(self, dir_rel: str, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` inside the directory ``dir_rel`` (replaces ``dst``)."""
        with self.dir(dir_rel) as dfd:
            os.rename(src, dst, src_dir_fd=dfd, dst_dir_fd=dfd)

    def scandir(self, rel: str) -> Iterator[os.DirEntry[str]]:
        """The entries of directory ``rel`` (stat them with ``follow_symlinks=False``).
        Nothing when it is missing, not a directory or a link."""
        try:
            fd = self.open_dir(rel)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return
            raise
        try:
            with os.scandir(fd) as it:
                yield from it
        finally:
            os.close(fd)

    def listdir(self, rel: str) -> list[str]:
        return [e.name for e in self.scandir(rel)]

    # ------------------------------------------------------------------ creating
    def make_dirs(self, rel: str, mode: int, umask: int | None = None) -> list[str]:
        """``mkdir -p root/rel`` with ``mode`` (umask notwithstanding), never through a
        link: a link or a non-directory found where a directory belongs is removed (the
        link itself) and replaced. Returns the relative parents (``""``: the root) whose
        entries changed and need an fsync to be durable."""
        head, _, leaf = rel.rpartition("/")
        if head and self._fast:
            _split(rel)  # a plain relative path (raises otherwise)
            # The usual case of a put: only the last directory is missing. Reach its
            # parent in one call (no link on the way) and create it there; anything
            # else (the parent missing too, something already at the name) takes the
            # component-by-component walk below, which heals what it finds.
            made = self._make_last_dir(head, leaf, mode, umask)
            if made:
                return [head]
        parents: list[str] = []
        fd = self.fd
        done: list[str] = []
        try:
            for name in _split(rel):
                parent_rel = "/".join(done)
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    nxt = self._mkdir_open(fd, name, mode, umask)
                    parents.append(parent_rel)
                except (NotADirectoryError, OSError) as exc:
                    if not isinstance(exc, NotADirectoryError) and exc.errno != errno.ELOOP:
                        raise
                    self._remove_squatter(fd, name)
                    nxt = self._mkdir_open(fd, name, mode, umask)
                    parents.append(parent_rel)
                if fd != self.fd:
                    os.close(fd)
                fd = nxt
                done.append(name)
        finally:
            if fd != self.fd:
                os.close(fd)
        return parents

    def _make_last_dir(self, head: str, name: str, mode: int, umask: int | None) -> bool:
        """Create the directory ``name`` in the existing directory ``head``; ``False``
        (nothing done) when ``head`` cannot be opened or ``name`` already exists."""
        try:
            dfd = self.open(head, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        try:
            try:
                os.mkdir(name, mode, dir_fd=dfd)
            except (FileExistsError, FileNotFoundError):  # the walk settles these
                return False
            if umask is None or mode & umask:  # the umask took bits away: put them back
                fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            return True
        finally:
            os.close(dfd)

    def _mkdir_open(self, dir_fd: int, name: str, mode: int, umask: int | None) -> int:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
            created = True
        except FileExistsError:
            created = False
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        if created and (umask is None or mode & umask):
            try:
                os.fchmod(fd, mode)  # the umask took bits away
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _remove_squatter(self, dir_fd: int, name: str) -> None:
        """Remove what sits where a directory belongs: a link (the link only) or a file."""
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            return  # raced with a creator: a directory now
        os.unlink(name, dir_fd=dir_fd)
        self.links_removed += 1

    def remove_links(self, rel: str) -> int:
        """Remove every symbolic link on the way to ``rel`` (the links themselves); how many."""
        fd = self.fd
        removed = 0
        try:
            for name in _split(rel):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    break
                if stat.S_ISLNK(st.st_mode):
                    try:
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    break
                if not stat.S_ISDIR(st.st_mode):
                    break
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                if fd != self.fd:
                    os.close(fd)
                fd = nxt
        finally:
            if fd != self.fd:
                os.close(fd)
        self.links_removed += removed
        return removed

    def write_file(self, rel: str, data: bytes, mode: int, umask: int | None = None) -> None:
        """Write ``data`` to ``rel`` atomically (a new temporary file renamed over it)."""
        head, _, name = rel.rpartition("/")
        tmp = f".{name}.{os.getpid()}.{threading.get_native_id()}.tmp"
        with self.dir(head) as dfd:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                os.unlink(tmp, dir_fd=dfd)  # left by a crash of this very thread id
            except FileNotFoundError:
                pass
            fd = os.open(tmp, flags, mode, dir_fd=dfd)
            try:
                if umask is None or mode & umask:
                    os.fchmod(fd, mode)
                os.write(fd, data)
            except BaseException:
                os.close(fd)
                os.unlink(tmp, dir_fd=dfd)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)

    def read_file(self, rel: str, limit: int) -> bytes:
        """At most ``limit`` bytes of the regular file ``rel`` (``OSError`` if it is not one)."""
        fd = self.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", rel)
            return os.pread(fd, limit, 0)
        finally:
            os.close(fd)

    def fsync_dir(self, rel: str) -> None:
        """fsync the directory ``rel`` (makes creations and renames in it durable)."""
        with self.dir(rel) as dfd:
            try:
                os.fsync(dfd)
            except OSError as exc:
                if exc.errno not in DIR_FSYNC_REFUSED:
                    raise


# ---------------------------------------------------------------------- the root
def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def check_root(st: os.stat_result, path: str, file_mode: int) -> None:
    """Refuse (``ConfigError`` on ``options.path``, naming the fix) a root that another
    user controls: writable by every user, or owned by another user unless ``file_mode``
    grants group read/write and the root's group is one of this process's groups."""
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory", "options.path")
    perms = stat.S_IMODE(st.st_mode)
    if perms & 0o002:
        raise ConfigError(
            f"refusing tier root {path}: it is writable by every user (mode {perms:04o}), so "
            "anyone could plant links or forged objects in it. Use a directory only you (or "
            f"your group) can write, e.g. `mkdir -m 700 {path}-$USER` and point `path` at it, "
            f"or, if you own it, `chmod o-w {path}`",
            "options.path",
        )
    euid = os.geteuid()
    if st.st_uid == euid:
        return
    groups = {os.getegid(), *os.getgroups()}
    owner = _user(st.st_uid)
    if file_mode & 0o060 != 0o060:
        raise ConfigError(
            f"refusing tier root {path}: it belongs to {owner}, not to {_user(euid)}, and "
            "whoever owns it controls what this tier reads and deletes. Use a directory of "
            f"your own (e.g. `mkdir -m 700 {path}-$USER`), or share this one within a group: "
            f"its owner runs `chgrp GROUP {path} && chmod 2770 {path}` and every process sets "
            'mode: "0660"',
            "options.path",
        )
    if st.st_gid not in groups:
        raise ConfigError(
            f"refusing tier root {path}: it belongs to {owner} and its group "
            f"{_group(st.st_gid)} is not one of this process's groups "
            f"({', '.join(_group(g) for g in sorted(groups))}). Add this user to that group, or "
            f"have the owner `chgrp` the directory to a group you share",
            "options.path",
        )


def _fsync_path(path: str) -> None:
    """fsync the directory ``path`` if this process may open it (else leave it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in DIR_FSYNC_REFUSED:
            raise
    finally:
        os.close(fd)


def open_root(path: str, dir_mode: int, file_mode: int, *, durable: bool) -> TierDir:
    """Open (creating it, and missing parents, with ``dir_mode``) the tier root ``path``.

    The root itself is never followed through a symbolic link, and is checked with
    :func:`check_root` on the opened descriptor (so what is checked is what is used).
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name:  # "/"
        fd = os.open(path, _DIR_FLAGS)
        st = os.fstat(fd)
        try:
            check_root(st, path, file_mode)
        except BaseException:
            os.close(fd)
            raise
        return TierDir(fd, path)
    if not os.path.isdir(parent):
        os.makedirs(parent, dir_mode, exist_ok=True)
    pfd = os.open(parent, (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        created = False
        try:
            os.mkdir(name, dir_mode, dir_fd=pfd)
            created = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=pfd)
                raise ConfigError(
                    f"refusing tier root {path}: it is a symbolic link (to {target}). A tier "
                    "root must be a real directory, so that nobody can redirect it: if you "
                    "made this link, set `path` to the directory it points to",
                    "options.path",
                ) from None
            raise ConfigError(f"{path} is not a directory", "options.path") from None
        try:
            st = os.fstat(fd)
            if created:
                if stat.S_IMODE(st.st_mode) != dir_mode:
                    os.fchmod(fd, dir_mode)  # the umask took bits away
                    st = os.fstat(fd)
                if durable:
                    _fsync_path(parent)
            check_root(st, path, file_mode)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(pfd)
    return TierDir(fd, path)
