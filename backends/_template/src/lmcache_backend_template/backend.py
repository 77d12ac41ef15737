"""The ``template`` backend: one file per KV chunk object under a directory.

A starting point: replace the byte operations with your store's. The byte-store base
(:class:`lmcache_core.blob.BlobBackend`) provides the object format, verification (a
corrupt object is a miss and is deleted), threads, batching and maintenance.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from lmcache_core.backend import Capabilities
from lmcache_core.blob import BlobBackend, ObjectStat
from lmcache_core.config.options import build_options, option
from lmcache_core.keys import Namespace


@dataclass(frozen=True)
class TemplateOptions:
    """Options of the ``template`` backend (the docs' table is generated from these)."""

    path: str = option(kind="path", doc="Directory of the objects (must exist).")
    max_concurrency: int = option(8, minimum=1, doc="Operations in flight (I/O threads).")


class TemplateBackend(BlobBackend):
    """KV chunks as files under a directory (TEMPLATE: say what yours stores)."""

    Options = TemplateOptions
    # Capabilities decide which contract tests apply (tests/test_template_contract.py).
    capabilities = Capabilities(persistent=True, shared=True)
    interface_version = "1.0"  # the lmcache_core.interface version it implements

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(TemplateOptions, options)  # validates; no I/O here
        super().__init__(opts, namespace=namespace, name=name or "template")
        self.root = opts.path

    def describe_store(self) -> str:
        return f"file://{self.root}"

    def open_store(self) -> None:  # the only set-up I/O, called once by start()
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

    def write_object(self, name: str, data: memoryview) -> None:
        # atomic: a temporary file renamed over the object (never a partial object)
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
                rel = os.path.relpath(os.path.join(dirpath, f), self.root).replace(os.sep, "/")
                if rel.startswith(prefix) and not f.startswith(".tmp-"):  # skip unfinished writes
                    st = self.stat_object(rel)
                    if st is not None:
                        out.append(st)
        return out
