"""Where things live under a disk tier's root directory.

::

    <root>/
      .lmcache-disk/              the tier's bookkeeping
        index.sqlite (+ -wal, -shm)   shared usage + LRU index
        index.lock                    serialises index creation and rebuilds
        owners/<owner id>             one flock'ed file per open backend (liveness)
      ns2-<16 hex>/               one directory per namespace (layout 2, the default)
        namespace.json              the namespace it holds (for inspect and gc)
        ab/<32 hex>                 one object per chunk: 256 shard directories by the
                                    name's first two digits
        ab/.<32 hex>.<owner>.<n>.tmp  a write in progress (renamed over the object)
      ns-<16 hex>/                a namespace written by versions before layout 2
        namespace.json
        ab/cd/<32 hex>              ``key.to_path()``: 65,536 leaf directories

The object name is the 32 hex digits of :meth:`CacheEngineKey.to_path` in both layouts.
Layout 2 exists because layout 1's 65,536 leaf directories outnumber the objects of most
tiers (a 100 GB tier of 4 MiB chunks holds ~25,000): almost every put made a directory
(a ``mkdir`` and a directory ``fsync`` on the write path) and most objects sat alone in
theirs. Layout 2 makes at most 256 directories per namespace, the first time a shard is
used.

The layout is chosen per namespace when a backend starts (:func:`pick_namespace_dir`): a
namespace that already has a layout-1 directory keeps it (its objects stay readable and
shared with older versions writing it); any other gets a layout-2 directory. Paths say
which layout they belong to (the directory prefix), so an index row, a file found by a
scan and ``verify``'s location check are validated from the path alone.

Relative paths stored in the index use ``/`` and never contain ``..``: object names come
from :meth:`CacheEngineKey.to_path` (hex digits only) and namespace directory names from a
digest, so nothing a key or namespace contains can point outside the root.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from lmcache_core.keys import CacheEngineKey, Namespace

from .sandbox import TierDir

__all__ = [
    "FLAT_PREFIX",
    "META_DIR",
    "NAMESPACE_FILE",
    "NESTED_PREFIX",
    "ObjectFile",
    "TempFile",
    "is_expected_location",
    "is_flat",
    "is_object_relpath",
    "iter_files",
    "key_location",
    "namespace_dir",
    "namespace_json",
    "object_relpath",
    "parse_temp_name",
    "pick_namespace_dir",
    "temp_relpath",
]

META_DIR = ".lmcache-disk"
OWNERS_DIR = "owners"
INDEX_FILE = "index.sqlite"
INDEX_LOCK = "index.lock"
NAMESPACE_FILE = "namespace.json"

#: Namespace directory prefixes: layout 1 (``ab/cd/<name>``) and layout 2 (``ab/<name>``).
NESTED_PREFIX = "ns-"
FLAT_PREFIX = "ns2-"

_NS_DIR = re.compile(r"ns2?-[0-9a-f]{16}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_OBJECT = re.compile(r"[0-9a-f]{32}")
_TEMP = re.compile(r"\.([0-9a-f]{32})\.([0-9a-f]{16})\.[0-9]+\.tmp")
OWNER_ID = re.compile(r"[0-9a-f]{16}")
# an object path of either layout, its shard directories matching the name's first digits
_REL = re.compile(
    r"ns-[0-9a-f]{16}/([0-9a-f]{2})/([0-9a-f]{2})/\1\2[0-9a-f]{28}"
    r"|ns2-[0-9a-f]{16}/([0-9a-f]{2})/\3[0-9a-f]{30}"
)


def namespace_json(namespace: Namespace | None) -> str:
    """The namespace text stored in objects (``""`` for no namespace)."""
    return namespace.to_json() if namespace is not None else ""


def namespace_dir(ns_json: str, flat: bool = True) -> str:
    """The directory name holding a namespace's objects: ``ns2-`` (layout 2, ``flat``) or
    ``ns-`` (layout 1) + 16 hex digits of a digest of the namespace."""
    digest = hashlib.blake2b(ns_json.encode("utf-8"), digest_size=8).hexdigest()
    return (FLAT_PREFIX if flat else NESTED_PREFIX) + digest


def pick_namespace_dir(tier: TierDir, ns_json: str) -> str:
    """The directory a backend starting now uses for a namespace: its layout-1 directory
    when one exists (written by an older version: its objects stay readable), else its
    layout-2 directory."""
    nested = namespace_dir(ns_json, flat=False)
    st = tier.lstat(nested)
    return nested if st is not None and stat.S_ISDIR(st.st_mode) else namespace_dir(ns_json)


def is_flat(ns_dir: str) -> bool:
    """Whether a namespace directory (or a path under one) is in layout 2."""
    return ns_dir.startswith(FLAT_PREFIX)


def key_location(ns_dir: str, key: CacheEngineKey) -> str:
    """Where ``key``'s object lives under the namespace directory ``ns_dir``:
    ``ab/<32 hex>`` (layout 2) or ``ab/cd/<32 hex>`` (layout 1)."""
    p = key.to_path()
    return p[:3] + p[6:] if is_flat(ns_dir) else p


def object_relpath(ns_dir: str, key: CacheEngineKey) -> str:
    """Relative path of ``key``'s object: ``ns2-…/ab/<32 hex>`` or ``ns-…/ab/cd/<32 hex>``
    (the layout of ``ns_dir``)."""
    return f"{ns_dir}/{key_location(ns_dir, key)}"


def is_object_relpath(rel: str) -> bool:
    """Whether ``rel`` has the exact shape of an object path of either layout (and so stays
    under the root)."""
    return _REL.fullmatch(rel) is not None


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


def expected_location(key_string: str, ns_json: str, flat: bool = True) -> str | None:
    """Where an object with this key string and namespace must live in the given layout
    (``None`` if the key string does not parse)."""
    try:
        key = CacheEngineKey.from_string(key_string)
    except ValueError:
        return None
    return object_relpath(namespace_dir(ns_json, flat), key)


def is_expected_location(rel: str, key_string: str, ns_json: str) -> bool:
    """Whether ``rel`` is where an object with this key string and namespace lives, in the
    layout ``rel`` belongs to."""
    return expected_location(key_string, ns_json, is_flat(rel)) == rel


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
    """``ns…/ab`` relative paths of the first shard level of one namespace."""
    names = [
        e.name
        for e in tier.scandir(ns_dir)
        if _SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    ]
    return [f"{ns_dir}/{n}" for n in sorted(names)]


def iter_files(tier: TierDir, top: str) -> Iterator[ObjectFile | TempFile]:
    """Objects and temporary files below ``top`` (a namespace or shard directory, relative).

    Names of any other shape, links and anything that is not a regular file are ignored
    (so are files at the other layout's depth); directories are entered without following
    links. Files vanishing during the walk are skipped.
    """
    depth_of_objects = 2 if is_flat(top) else 3
    stack = [top]
    while stack:
        rel_dir = stack.pop()
        for entry in tier.scandir(rel_dir):
            rel = f"{rel_dir}/{entry.name}"
            depth = rel.count("/")
            try:
                if depth < depth_of_objects and _SHARD.fullmatch(entry.name):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(rel)
                    continue
                if depth != depth_of_objects or not entry.is_file(follow_symlinks=False):
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
