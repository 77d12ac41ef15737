"""Object files to and from device memory through kvikio's ``CuFile`` (cuFile / GDS).

The object format, the sandbox and the locking are the disk tier's
(:class:`lmcache_backend_disk.objects.ObjectIO`, subclassed here): a file is created or
opened relative to the tier's root without following links and shared-locked for reading
exactly as there; kvikio then gets that very file through ``/proc/self/fd/<fd>`` (a
reopen of the open inode, no path lookup that a planted link could redirect).

The header (the first 4096 bytes: JSON, key, namespace, checksum) is host data and goes
through ``os.pwrite``/``os.pread``; the data region moves between the file and device
memory through ``CuFile.pwrite``/``pread`` at file offset 4096. The checksum
(xxh3-128 of the data region) is computed on a host copy of the device data (written
bytes on the way out, read bytes on the way in): reads are verified in host memory, so
each object also crosses PCIe once to the host until a device-side digest exists.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lmcache_backend_disk.objects import HeaderTemplate, ObjectIO, ReadResult
from xxhash import xxh3_128_hexdigest

from lmcache_core import format as fmt
from lmcache_core.errors import FormatError

__all__ = ["DeviceObjectIO"]


def _host_digest(t: torch.Tensor) -> str:
    """xxh3-128 hex digest of a device tensor's bytes (copied to host memory)."""
    if not t.numel():
        return xxh3_128_hexdigest(b"")
    host = t.detach().reshape(-1).view(torch.uint8).cpu()
    return xxh3_128_hexdigest(fmt.tensor_bytes(host))


def _proc_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


class DeviceObjectIO(ObjectIO):
    """:class:`ObjectIO` plus writes from and reads into CUDA tensors through kvikio."""

    def __init__(self, *args: Any, kvikio: Any, task_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvikio = kvikio
        self.task_size = task_size

    def write_temp_device(
        self, tmp_rel: str, template: HeaderTemplate, value: torch.Tensor
    ) -> tuple[int, list[str]]:
        """Write the object of the CUDA tensor ``value`` to the new file ``tmp_rel``: the
        header with ``os.pwrite``, the data with ``CuFile.pwrite`` (removed on error)."""
        value = value.contiguous()
        n = value.numel() * value.element_size()
        header = template.with_digits(_host_digest(value))

        def fill(fd: int) -> int:
            self._write_device(fd, header, value, n)
            return len(header) + n

        return self.write_new_file(tmp_rel, fill)

    def _write_device(self, fd: int, header: bytes, value: torch.Tensor, n: int) -> None:
        hlen = len(header)
        # The header block is 4096 bytes (the format pads it), so it is one aligned write;
        # from a page-aligned staging block when the file is open with O_DIRECT.
        buf = self.pool.take(hlen)
        try:
            buf.view[:hlen] = header
            if os.pwrite(fd, buf.view[:hlen], 0) != hlen:
                raise OSError("short header write")
        finally:
            self.pool.give(buf)
        if n:
            f = self.kvikio.CuFile(_proc_path(fd), "r+")
            try:
                wrote = self._transfer(f.pwrite, value.detach().reshape(-1).view(torch.uint8), hlen)
            finally:
                f.close()
            if wrote != n:
                raise OSError(f"short device write: {wrote} of {n} bytes")

    def _transfer(self, op: Any, data: torch.Tensor, offset: int) -> int:
        """``op`` (a CuFile's ``pread`` or ``pwrite``) of the flat uint8 ``data`` at file
        offset ``offset``, in pieces of ``task_size`` bytes, each one kvikio task (its
        own future), all submitted at once and all waited for, even after one failed: the
        file is closed only when none is still running (a failed kvikio future returns
        while its other tasks may still run, and a close under them would leave them with
        a closed, possibly reused, descriptor). Returns the bytes moved; raises the first
        failure."""
        n, step = data.numel(), self.task_size
        futures = []
        first: BaseException | None = None
        for start in range(0, n, step):
            k = min(step, n - start)
            try:
                futures.append(op(data[start : start + k], k, offset + start, k))
            except Exception as exc:  # not submitted: nothing of it runs
                first = exc
                break
        done = 0
        for fut in futures:
            try:
                done += int(fut.get())
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first
        return done

    def read_into_device(self, rel: str, key: str, ns_json: str, out: torch.Tensor) -> ReadResult:
        """Read the object at ``rel`` into the CUDA tensor ``out`` and verify it (header in
        host memory, data with ``CuFile.pread``, checksum on a host copy)."""

        def body(fd: int, size: int) -> tuple[torch.Tensor, fmt.ObjectHeader | None]:
            template = HeaderTemplate(key, ns_json, out.dtype, tuple(out.shape))
            hlen = len(template)
            n = out.numel() * out.element_size()
            raw = self._read_head(fd, size)
            digits = template.digits_of(raw) if size == hlen + n else None
            if digits is None:
                header = self._check_header(raw, size, key, ns_json)
                fmt.check_out(header, out)
                raise FormatError("object header differs from the expected one")
            if n:
                f = self.kvikio.CuFile(_proc_path(fd), "r")
                try:
                    got = self._transfer(f.pread, out.detach().reshape(-1).view(torch.uint8), hlen)
                finally:
                    f.close()
                if got != n:
                    raise FormatError(f"short read: {got} of {n} bytes (truncated?)")
            if _host_digest(out) != digits:
                raise FormatError("checksum mismatch: object data is corrupted")
            return out, None

        return self._read_verified(rel, body)
