"""Owner files: which open backends are alive, across processes and PID namespaces.

Each open backend holds an exclusive ``flock`` on its own file
``<root>/.lmcache-disk/owners/<owner id>`` for its whole life. The kernel drops the lock
when the process dies, however it dies, so anyone can tell a dead writer from a live one
by trying to take the lock: success means the owner is gone and its leftovers (temporary
files, reservations in the index) may be cleaned up. Unlike PIDs this works between
containers that share the directory (same kernel, different PID namespaces) and cannot be
fooled by PID reuse.

An owner file is created under a temporary name, locked, and only then renamed into
place, so nobody ever sees an unlocked owner file of a live backend.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time

from .layout import META_DIR, OWNERS_DIR

__all__ = ["OwnerLock", "claim_dead_owner", "list_owner_ids", "new_owner_id"]


def new_owner_id() -> str:
    """16 random hex digits."""
    return secrets.token_hex(8)


def owners_dir(root: str) -> str:
    return os.path.join(root, META_DIR, OWNERS_DIR)


class OwnerLock:
    """The flock'ed owner file of one open backend."""

    def __init__(self, root: str, owner: str, mode: int) -> None:
        self.path = os.path.join(owners_dir(root), owner)
        tmp = os.path.join(owners_dir(root), f".{owner}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the owner file and drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


class DeadOwner:
    """The lock of a dead owner, held while its leftovers are cleaned up."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    def done(self) -> None:
        """Remove the owner file and release it."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_dead_owner(root: str, owner: str) -> DeadOwner | None:
    """Lock the owner file of ``owner`` if its backend is dead; ``None`` while it lives.

    An owner without a file (removed by an earlier cleanup, or never created) is dead.
    """
    path = os.path.join(owners_dir(root), owner)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return DeadOwner(path, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return DeadOwner(path, fd)


def list_owner_ids(root: str) -> list[str]:
    """Owner ids with a file under ``owners/`` (alive or not); stale ``.new`` files of
    creators that died before locking are removed."""
    out = []
    try:
        names = os.listdir(owners_dir(root))
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith("."):
            _remove_if_unlocked(os.path.join(owners_dir(root), name))
        elif len(name) == 16:
            out.append(name)
    return out


def _remove_if_unlocked(path: str, min_age: float = 60.0) -> None:
    try:
        if time.time() - os.stat(path).st_mtime < min_age:
            return  # a creator may be between creating and locking it
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
