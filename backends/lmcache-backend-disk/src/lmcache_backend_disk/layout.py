"""Where things live under a disk tier's root directory.

::

    <root>/
      .lmcache-disk/              the tier's bookkeeping
        index.sqlite (+ -wal, -shm)   shared usage + LRU index
        index.lock                    serialises index creation and rebuilds
        owners/<owner id>             one flock'ed file per open backend (liveness)
      ns-<16 hex>/                one directory per namespace
        namespace.json              the namespace it holds (for inspect and gc)
        ab/cd/<32 hex>              one object per chunk: key.to_path() under the namespace
        ab/cd/.<32 hex>.<owner>.<n>.tmp   a write in progress (renamed over the object)

Relative paths stored in the index use ``/`` and never contain ``..``: object names come
from :meth:`CacheEngineKey.to_path` (hex digits only) and namespace directory names from a
digest, so nothing a key or namespace contains can point outside the root.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from lmcache_core.keys import CacheEngineKey, Namespace

from .sandbox import TierDir

__all__ = [
    "META_DIR",
    "NAMESPACE_FILE",
    "ObjectFile",
    "TempFile",
    "iter_files",
    "namespace_dir",
    "namespace_json",
    "object_relpath",
    "parse_temp_name",
    "temp_relpath",
]

META_DIR = ".lmcache-disk"
OWNERS_DIR = "owners"
INDEX_FILE = "index.sqlite"
INDEX_LOCK = "index.lock"
NAMESPACE_FILE = "namespace.json"

_NS_DIR = re.compile(r"ns-[0-9a-f]{16}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_OBJECT = re.compile(r"[0-9a-f]{32}")
_TEMP = re.compile(r"\.([0-9a-f]{32})\.([0-9a-f]{16})\.[0-9]+\.tmp")
OWNER_ID = re.compile(r"[0-9a-f]{16}")
_REL = re.compile(r"ns-[0-9a-f]{16}/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}")


def namespace_json(namespace: Namespace | None) -> str:
    """The namespace text stored in objects (``""`` for no namespace)."""
    return namespace.to_json() if namespace is not None else ""


def namespace_dir(ns_json: str) -> str:
    """The directory name holding a namespace's objects: ``ns-`` + 16 hex digits."""
    return "ns-" + hashlib.blake2b(ns_json.encode("utf-8"), digest_size=8).hexdigest()


def object_relpath(ns_dir: str, key: CacheEngineKey) -> str:
    """Relative path of ``key``'s object: ``ns-…/ab/cd/<32 hex>``."""
    return f"{ns_dir}/{key.to_path()}"


def is_object_relpath(rel: str) -> bool:
    """Whether ``rel`` has the exact shape of an object path (and so stays under the root)."""
    return _REL.fullmatch(rel) is not None and rel.split("/")[-1].startswith(
        rel.split("/")[1] + rel.split("/")[2]
    )


def temp_relpath(rel: str, owner: str, seq: int) -> str:
    """The temporary name of a writer's ``seq``-th write, for ``rel`` (same directory,
    hidden, unique even for concurrent writes of one key)."""
    head, _, name = rel.rpartition("/")
    return f"{head}/.{name}.{owner}.{seq}.tmp"


def is_temp_relpath_of(rel: str, tmp: str) -> bool:
    """Whether ``tmp`` is a well-formed temporary name for the object ``rel``."""
    head, _, name = tmp.rpartition("/")
    parsed = parse_temp_name(name)
    return (
        is_object_relpath(rel)
        and parsed is not None
        and head == rel.rpartition("/")[0]
        and parsed[0] == rel.rpartition("/")[2]
    )


def parse_temp_name(name: str) -> tuple[str, str] | None:
    """``(object name, owner id)`` of a temporary file name, or ``None``."""
    m = _TEMP.fullmatch(name)
    return (m.group(1), m.group(2)) if m else None


def expected_location(key_string: str, ns_json: str) -> str | None:
    """Where an object with this key string and namespace must live (``None`` if the key
    string does not parse)."""
    try:
        key = CacheEngineKey.from_string(key_string)
    except ValueError:
        return None
    return object_relpath(namespace_dir(ns_json), key)


@dataclass(frozen=True)
class ObjectFile:
    """An object file found by :func:`iter_files`."""

    rel: str
    size: int
    mtime: float


@dataclass(frozen=True)
class TempFile:
    """A temporary file found by :func:`iter_files`."""

    rel: str
    owner: str
    mtime: float


def namespace_dirs(tier: TierDir) -> list[str]:
    """Names of the namespace directories under the root."""
    return sorted(
        e.name
        for e in tier.scandir("")
        if _NS_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def shard_dirs(tier: TierDir, ns_dir: str) -> list[str]:
    """``ns-…/ab`` relative paths of the first shard level of one namespace."""
    names = [
        e.name
        for e in tier.scandir(ns_dir)
        if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    ]
    return [f"{ns_dir}/{n}" for n in sorted(names)]


def iter_files(tier: TierDir, top: str) -> Iterator[ObjectFile | TempFile]:
    """Objects and temporary files below ``top`` (a namespace or shard directory, relative).

    Names of any other shape, links and anything that is not a regular file are ignored;
    directories are entered without following links. Files vanishing during the walk are
    skipped.
    """
    stack = [top]
    while stack:
        rel_dir = stack.pop()
        for entry in tier.scandir(rel_dir):
            rel = f"{rel_dir}/{entry.name}"
            depth = rel.count("/")
            try:
                if depth <= 2 and _SHARD.fullmatch(entry.name):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(rel)
                    continue
                if depth != 3 or not entry.is_file(follow_symlinks=False):
                    continue
                if _OBJECT.fullmatch(entry.name):
                    st = entry.stat(follow_symlinks=False)
                    if is_object_relpath(rel):
                        yield ObjectFile(rel, st.st_size, st.st_mtime)
                    continue
                parsed = parse_temp_name(entry.name)
                if parsed is not None:
                    st = entry.stat(follow_symlinks=False)
                    yield TempFile(rel, parsed[1], st.st_mtime)
            except FileNotFoundError:
                continue


def current_umask() -> int:
    """The process umask, read without changing it (``/proc``; else set-and-restore)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old
