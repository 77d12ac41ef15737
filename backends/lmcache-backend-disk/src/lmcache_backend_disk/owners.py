"""Owner files: which open backends are alive, across processes and PID namespaces.

Each open backend holds an exclusive ``flock`` on its own file
``<root>/.lmcache-disk/owners/<owner id>`` for its whole life. The kernel drops the lock
when the process dies, however it dies, so anyone can tell a dead writer from a live one
by trying to take the lock: success means the owner is gone and its leftovers (temporary
files, reservations and pins in the index) may be cleaned up. Unlike PIDs this works
between containers that share the directory (same kernel, different PID namespaces) and
cannot be fooled by PID reuse.

An owner file is created under a temporary name, locked, and only then renamed into
place, so nobody ever sees an unlocked owner file of a live backend.

Owner ids are 16 lowercase hex digits; an id read from the shared index or from a file
name is checked against that shape before it names anything (:func:`is_owner_id`), and
every file here is reached through the tier's :class:`~.sandbox.TierDir` (no link is
followed).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time

from .layout import META_DIR, OWNER_ID, OWNERS_DIR
from .sandbox import TierDir

__all__ = ["OwnerLock", "claim_dead_owner", "is_owner_id", "list_owner_ids", "new_owner_id"]

OWNERS = f"{META_DIR}/{OWNERS_DIR}"


def new_owner_id() -> str:
    """16 random hex digits."""
    return secrets.token_hex(8)


def is_owner_id(value: object) -> bool:
    """Whether ``value`` has the shape of an owner id (16 lowercase hex digits)."""
    return isinstance(value, str) and OWNER_ID.fullmatch(value) is not None


class OwnerLock:
    """The flock'ed owner file of one open backend."""

    def __init__(self, tier: TierDir, owner: str, mode: int) -> None:
        if not is_owner_id(owner):
            raise ValueError(f"not an owner id: {owner!r}")
        self.tier = tier
        self.rel = f"{OWNERS}/{owner}"
        tmp = f".{owner}.new"
        with tier.dir(OWNERS) as dfd:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(tmp, flags, mode, dir_fd=dfd)
            try:
                os.fchmod(fd, mode)  # whatever the umask: group sharing needs the mode
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(fd, f"{os.getpid()}\n".encode())
                os.rename(tmp, owner, src_dir_fd=dfd, dst_dir_fd=dfd)
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        self._fd: int | None = fd
        self.ident = (st.st_dev, st.st_ino)

    def in_place(self) -> bool:
        """Whether the owner file in the directory is still this one (not deleted or
        replaced): others judge this backend alive by it."""
        st = self.tier.lstat(self.rel)
        return st is not None and (st.st_dev, st.st_ino) == self.ident

    def drop(self) -> None:
        """Close the lock without removing anything (the file is no longer ours)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Remove the owner file and drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            self.tier.unlink(self.rel)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


class DeadOwner:
    """The lock of a dead owner, held while its leftovers are cleaned up."""

    def __init__(self, tier: TierDir, rel: str, fd: int | None) -> None:
        self.tier = tier
        self.rel = rel
        self._fd = fd

    def done(self) -> None:
        """Remove the owner file and release it."""
        try:
            self.tier.unlink(self.rel)
        except OSError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_dead_owner(tier: TierDir, owner: str) -> DeadOwner | None:
    """Lock the owner file of ``owner`` if its backend is dead; ``None`` while it lives.

    An owner without a file (removed by an earlier cleanup, or never created) is dead.
    ``owner`` must be an owner id (:class:`ValueError` otherwise: never a path).
    """
    if not is_owner_id(owner):
        raise ValueError(f"not an owner id: {owner!r}")
    rel = f"{OWNERS}/{owner}"
    try:
        fd = tier.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return DeadOwner(tier, rel, None)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        tier.unlink(rel)  # a link planted in place of an owner file: not a live owner
        return DeadOwner(tier, rel, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return DeadOwner(tier, rel, fd)


def list_owner_ids(tier: TierDir) -> list[str]:
    """Owner ids with a file under ``owners/`` (alive or not); stale ``.new`` files of
    creators that died before locking are removed. Other names are ignored."""
    out = []
    for entry in tier.scandir(OWNERS):
        name = entry.name
        if name.startswith(".") and name.endswith(".new") and is_owner_id(name[1:-4]):
            _remove_if_unlocked(tier, f"{OWNERS}/{name}")
        elif is_owner_id(name):
            out.append(name)
    return out


def _remove_if_unlocked(tier: TierDir, rel: str, min_age: float = 60.0) -> None:
    try:
        st = tier.lstat(rel)
        if st is None or time.time() - st.st_mtime < min_age:
            return  # a creator may be between creating and locking it
        fd = tier.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tier.unlink(rel)
    except OSError:
        pass
    finally:
        os.close(fd)
