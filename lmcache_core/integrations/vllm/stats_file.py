"""Atomic JSON statistics files (one per connector process) for tools and the demo.

The connector rewrites its file inside engine steps (the worker after every step whose
document differs from the last one written, the scheduler as requests finish), so a
write must cost next to nothing. Replacing an existing file by ``rename`` does
not on ext4: renaming over a file makes the kernel start writing the new file's data out
first (``auto_da_alloc``), 2-6 ms per rename measured here, for a document of 3 KB.
Exchanging the two names instead (``renameat2(RENAME_EXCHANGE)``) and unlinking the old
document costs ~0.06 ms and is just as atomic for readers: the name always holds one
complete document. Where the exchange is not available (other systems, some filesystems)
or there is no previous document yet, a plain ``os.replace`` is used. The documents are
advisory and never fsynced: after a machine crash one may be empty (readers skip it).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import tempfile
from typing import Any

from ...libc import libc_function
from ...redaction import scrub

__all__ = ["encode_stats", "read_stats", "write_stats", "write_stats_text"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Any:
    fn = libc_function("renameat2")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2: Any = _load_renameat2() if sys.platform.startswith("linux") else None


def _swap_into_place(tmp: str, final: str) -> None:
    """Make ``final`` name the complete file ``tmp`` (atomically for readers)."""
    global _renameat2
    fn = _renameat2
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE) == 0:
            os.unlink(tmp)  # now the previous document
            return
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            _renameat2 = None  # not supported here: never try again
    os.replace(tmp, final)  # no previous document (ENOENT), or no exchange


def encode_stats(data: dict[str, Any]) -> str:
    """The document :func:`write_stats` writes for ``data`` (configuration secrets scrubbed;
    the same data always gives the same text, so callers can skip unchanged documents)."""
    return json.dumps(scrub(data), sort_keys=True, default=str)


def write_stats(directory: str, name: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``directory/name`` atomically; errors are ignored (stats are advisory)."""
    write_stats_text(directory, name, encode_stats(data))


def write_stats_text(directory: str, name: str, text: str) -> bool:
    """Write a document made by :func:`encode_stats` to ``directory/name`` atomically;
    ``False`` if that failed (errors are otherwise ignored)."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stats.")
        try:
            with os.fdopen(fd, "w") as f:  # mkstemp: owner-only
                f.write(text)
            _swap_into_place(tmp, os.path.join(directory, name))
            return True
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError:
        return False


def read_stats(directory: str) -> list[dict[str, Any]]:
    """Every statistics document in ``directory`` (unreadable files are skipped)."""
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            doc.setdefault("file", name)
            out.append(doc)
    return out
