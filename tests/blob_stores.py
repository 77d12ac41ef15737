"""Two small byte stores on :class:`lmcache_core.blob.BlobBackend`, used by its tests.

``DictBlobBackend``: objects in a dict shared by every backend made with the same dict,
its operations written ``async`` (they run on the event loop). ``DirBlobBackend``: one
file per object under a directory, written with plain ``def`` methods (they run on the
base's threads), atomic through a temporary file and a rename.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lmcache_core.backend import Capabilities
from lmcache_core.blob import BlobBackend, ObjectStat
from lmcache_core.config.options import build_options, option
from lmcache_core.keys import Namespace


@dataclass(frozen=True)
class DictOptions:
    """Options of the dict store."""

    max_concurrency: int = option(4, minimum=1, doc="operations in flight")
    lookup_cache_s: float = option(10.0, doc="positive existence answers kept")
    negative_cache_s: float = option(1.0, doc="negative existence answers kept")


class DictBlobBackend(BlobBackend):
    """Objects in a shared dict (async byte operations)."""

    Options = DictOptions
    capabilities = Capabilities(persistent=True, shared=True)

    def __init__(
        self,
        objects: dict[str, tuple[Any, float]],
        options: Any = None,
        *,
        namespace: Namespace | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(build_options(DictOptions, options), namespace=namespace, name=name)
        self.objects = objects
        self.requests = 0

    async def read_object(self, name: str) -> Any:
        self.requests += 1
        item = self.objects.get(name)
        return None if item is None else item[0]

    async def read_range(self, name: str, start: int, length: int) -> Any:
        self.requests += 1
        item = self.objects.get(name)
        return None if item is None else item[0][start : start + length]

    async def write_object(self, name: str, data: memoryview) -> None:
        self.requests += 1
        self.objects[name] = (data, time.time())  # the base never reuses data: keep it

    async def delete_object(self, name: str) -> bool:
        self.requests += 1
        return self.objects.pop(name, None) is not None

    async def stat_object(self, name: str) -> ObjectStat | None:
        self.requests += 1
        item = self.objects.get(name)
        return None if item is None else ObjectStat(name, len(item[0]), item[1])

    async def list_objects(self, prefix: str) -> AsyncIterator[ObjectStat]:
        for name, (data, mtime) in list(self.objects.items()):
            if name.startswith(prefix):
                yield ObjectStat(name, len(data), mtime)


@dataclass(frozen=True)
class DirOptions:
    """Options of the directory store."""

    path: str = option(kind="path", doc="root directory")
    max_concurrency: int = option(8, minimum=1, doc="operations in flight")


class DirBlobBackend(BlobBackend):
    """One file per object under a directory (sync byte operations)."""

    Options = DirOptions
    capabilities = Capabilities(persistent=True, shared=True)

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(DirOptions, options)
        super().__init__(opts, namespace=namespace, name=name)
        self.root = opts.path

    def describe_store(self) -> str:
        return f"file://{self.root}"

    def open_store(self) -> None:
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"directory {self.root} does not exist")

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read_object(self, name: str) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(start)
                return f.read(length)
        except FileNotFoundError:
            return None

    def write_object(self, name: str, data: memoryview) -> None:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def delete_object(self, name: str) -> bool:
        try:
            os.unlink(self._path(name))
            return True
        except FileNotFoundError:
            return False

    def stat_object(self, name: str) -> ObjectStat | None:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            return None
        return ObjectStat(name, st.st_size, st.st_mtime)

    def list_objects(self, prefix: str) -> list[ObjectStat]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if rel.startswith(prefix):
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue
                    out.append(ObjectStat(rel, st.st_size, st.st_mtime))
        return out
