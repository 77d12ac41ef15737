"""One directory of a ``gds`` tier: the disk tier (layout, shared index, sandbox, atomic
publication, verified reads, ``O_DIRECT`` object I/O) plus the device paths.

:class:`GdsStripe` subclasses :class:`lmcache_backend_disk.DiskBackend` and changes only
where a value lives:

* a CPU tensor takes the disk tier's own path: ``O_DIRECT`` from and into page-aligned
  memory (values and buffers made with ``aligned_empty`` are used in place, others go
  through reused aligned staging buffers) - the POSIX path of the ``gds`` backend;
* a CUDA tensor goes through kvikio's ``CuFile`` when the I/O path is ``gds`` or
  ``compat`` (:mod:`.device_io`), else it is staged through host memory and takes the
  POSIX path (``force_posix``, or kvikio unusable).

Everything else (reservation, eviction, rename-and-record, removal of bad objects,
pins, maintenance) is the disk tier's, unchanged: the files are the same files.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from lmcache_backend_disk import DiskBackend, aligned_empty

from lmcache_core.cuda_sync import wait_ready
from lmcache_core.keys import CacheEngineKey, Namespace

from .device_io import DeviceObjectIO
from .runtime import IoPath

if TYPE_CHECKING:
    from lmcache_backend_disk.store import _Write

__all__ = ["GdsStripe"]

log = logging.getLogger("lmcache_core.gds")


class GdsStripe(DiskBackend):
    """A disk-layout directory whose device tensors move through kvikio when it works."""

    def __init__(
        self,
        options: Any = None,
        *,
        namespace: Namespace | None = None,
        name: str | None = None,
        task_size: int = 4 << 20,
    ) -> None:
        super().__init__(options, namespace=namespace, name=name)
        self.task_size = task_size
        self.io_path: IoPath | None = None
        self._device_io: DeviceObjectIO | None = None

    def use_io_path(self, path: IoPath, kvikio: Any) -> None:
        """Set the I/O path (after :meth:`start`): with kvikio, device tensors use cuFile."""
        self.io_path = path
        if path.uses_kvikio and kvikio is not None:
            io = self.io
            self._device_io = DeviceObjectIO(
                io.tier,
                io.file_mode,
                io.dir_mode,
                direct=io.direct,
                durable=io.durable,
                pool=io.pool,
                mem_align=io.mem_align,
                reads_in_flight=io.reads_in_flight,
                stage_small_pages=io.stage_small_pages,
                stage_page_aligned=io.stage_page_aligned,
                kvikio=kvikio,
                task_size=self.task_size,
            )

    # ------------------------------------------------------------------ writes
    def _write_sync(self, w: _Write) -> None:
        dev = self._device_io
        if dev is None or w.value.device.type != "cuda":
            super()._write_sync(w)  # the disk tier's path (device values staged to host)
            return
        try:
            wait_ready(w.ready, w.value.device)  # the caller's queued work that makes it
            _, new_dirs = dev.write_temp_device(w.tmp, w.template, w.value)
            w.new_dirs = tuple(new_dirs)
            w.written = True
        except Exception as exc:  # kvikio raises RuntimeError for I/O errors too
            self.counters.store_failures += 1
            self._stats.errors += 1
            log.warning("gds tier %s: writing %s through cuFile failed: %s", self.root, w.rel, exc)

    # ------------------------------------------------------------------ reads
    def _get_into_sync(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        if out.device.type != "cuda":
            return super()._get_into_sync(key, out)
        dev = self._device_io
        if dev is None:
            # no kvikio: read into host memory with O_DIRECT, then copy to the device
            host = aligned_empty(out.shape, out.dtype)
            if not super()._get_into_sync(key, host):
                return False
            out.copy_(host)
            return True
        rel = self._rel(key)
        try:
            res = dev.read_into_device(rel, key.to_string(), self._ns_json, out)
        except OSError as exc:
            self._read_error(rel, exc)
            return False
        except RuntimeError as exc:  # kvikio's I/O errors
            self._read_error(rel, OSError(str(exc)))
            return False
        return self._settle_read(rel, res)
