"""Which I/O path the ``gds`` backend can use in this process: cuFile through kvikio, or
its own POSIX ``O_DIRECT`` path.

:func:`probe` imports kvikio (optional) and makes one real ``CuFile`` write and read of a
4 KiB block in a directory of the tier: on a machine without a usable CUDA driver
``import kvikio`` works but that call fails (``libcuda.so.1: cannot open shared object
file``), and the backend then uses the POSIX path. The outcome is logged once per process
(per distinct outcome) and shown by ``lmcache-core backends`` and in ``stats()``.
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["IoPath", "describe", "import_kvikio", "log_once", "probe"]

log = logging.getLogger("lmcache_core.gds")

#: kvikio did the probe through cuFile with GPUDirect Storage (nvidia-fs) active.
GDS = "gds"
#: kvikio works, but in compatibility mode (its POSIX reads/writes, or cuFile's own
#: compatibility mode): device data bounces through host memory inside kvikio.
COMPAT = "compat"
#: kvikio unusable or not wanted: the backend's own POSIX O_DIRECT path.
POSIX = "posix"

_logged: set[tuple[str, str]] = set()
_log_lock = threading.Lock()


@dataclass(frozen=True)
class IoPath:
    """The I/O path chosen: ``mode`` (``gds``, ``compat`` or ``posix``) and why."""

    mode: str
    reason: str
    kvikio_version: str | None = None
    cuda_tensors: bool = False  # torch sees a CUDA device (device tensors can be used)

    @property
    def uses_kvikio(self) -> bool:
        return self.mode in (GDS, COMPAT)

    def text(self) -> str:
        """One line for logs and ``lmcache-core backends``."""
        if self.mode == GDS:
            return f"GPUDirect Storage through kvikio {self.kvikio_version} (cuFile): {self.reason}"
        if self.mode == COMPAT:
            return f"kvikio {self.kvikio_version} in compatibility mode (no GDS): {self.reason}"
        return f"POSIX O_DIRECT fallback with aligned host buffers: {self.reason}"


def import_kvikio() -> Any:
    """The ``kvikio`` module with its ``defaults`` and ``cufile_driver`` submodules loaded,
    or raise ImportError (anything its import raises, too: a missing ``libcufile.so``
    raises its own error class)."""
    try:
        import kvikio  # type: ignore[import-not-found, unused-ignore]

        importlib.import_module("kvikio.defaults")
    except ImportError:
        raise
    except Exception as exc:  # a broken install raises all sorts of things
        raise ImportError(f"import kvikio failed: {type(exc).__name__}: {exc}") from exc
    try:
        importlib.import_module("kvikio.cufile_driver")
    except Exception:
        pass  # only needed to ask whether GDS is available
    return kvikio


def _cuda_tensors() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _setting(kvikio: Any, name: str) -> Any:
    """A kvikio runtime setting, whatever the kvikio version (``None`` if unknown)."""
    defaults = getattr(kvikio, "defaults", None)
    try:
        return defaults.get(name)  # type: ignore[union-attr]
    except Exception:
        pass
    fn = getattr(defaults, name, None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None


def _gds_available(kvikio: Any) -> bool | None:
    """Whether the cuFile driver reports GPUDirect Storage (nvidia-fs) as available
    (``None`` when this kvikio cannot say)."""
    drv: Any = getattr(kvikio, "cufile_driver", None)
    if drv is None:
        return None
    try:
        return bool(drv.get("is_gds_available"))  # kvikio >= 25.x
    except Exception:
        pass
    try:
        return bool(drv.DriverProperties().is_gds_available)  # older kvikio
    except Exception:
        return None


def configure(kvikio: Any, io_threads: int, task_size: int) -> None:
    """Set kvikio's thread pool size and task size (process-wide settings)."""
    defaults = kvikio.defaults
    try:
        defaults.set({"num_threads": io_threads, "task_size": task_size})
        return
    except Exception:
        pass
    for fn, value in (("num_threads_reset", io_threads), ("task_size_reset", task_size)):
        reset = getattr(defaults, fn, None)
        if callable(reset):
            reset(value)


#: Bytes of the device round trip (above kvikio's ``gds_threshold``, 16 KiB by default,
#: under which even device buffers skip cuFile).
DEVICE_PROBE_BYTES = 1 << 20


def _cufile_round_trip(kvikio: Any, directory: str, device: bool = False) -> None:
    """Write and read back 4 KiB of host memory through ``kvikio.CuFile`` in
    ``directory``, and with ``device`` also 1 MiB of CUDA memory at file offset 4096, where
    object data lives (kvikio sends host buffers down its POSIX path: only a device buffer
    tries cuFile itself). Raises on any failure or difference."""
    import numpy as np

    fd, name = tempfile.mkstemp(prefix=".gds-probe-", dir=directory)
    os.close(fd)
    try:
        data = np.arange(4096, dtype=np.uint8)
        f = kvikio.CuFile(name, "r+")
        try:
            wrote = f.pwrite(data, data.nbytes, 0).get()
            back = np.zeros_like(data)
            got = f.pread(back, back.nbytes, 0).get()
        finally:
            f.close()
        if wrote != data.nbytes or got != data.nbytes or not np.array_equal(back, data):
            raise OSError(f"CuFile round trip returned {wrote}/{got} bytes or other data")
        if device:
            _device_round_trip(kvikio, name)
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass


def _device_round_trip(kvikio: Any, name: str) -> None:
    import torch

    n = DEVICE_PROBE_BYTES
    data = (torch.arange(n, device="cuda") % 251).to(torch.uint8)
    back = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    f = kvikio.CuFile(name, "r+")
    try:
        wrote = f.pwrite(data, n, 4096).get()
        got = f.pread(back, n, 4096).get()
    finally:
        f.close()
    torch.cuda.synchronize()
    if wrote != n or got != n or not torch.equal(back, data):
        raise OSError(f"CuFile device round trip returned {wrote}/{got} bytes or other data")


def _round_trip_in(kvikio: Any, directory: str | None, device: bool) -> None:
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="lmcache-gds-probe-") as tmp:
            _cufile_round_trip(kvikio, tmp, device)
    else:
        _cufile_round_trip(kvikio, directory, device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _strict_gds_error(kvikio: Any, directory: str | None, device: bool) -> str | None:
    """Why a round trip with kvikio's compatibility mode forced off fails here (``None``:
    it worked, or this kvikio cannot be asked). Under the default ``AUTO`` kvikio falls
    back to compatibility mode per file, silently, when cuFile cannot take it (an
    ``O_DIRECT`` open or the handle registration failing): the driver saying GDS is
    available does not mean this directory gets it."""
    previous = _setting(kvikio, "compat_mode")
    try:
        ctx = kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
    except Exception:
        return None
    if not hasattr(ctx, "__enter__"):  # an older kvikio set it for good: put it back
        try:
            kvikio.defaults.set("compat_mode", previous)
        except Exception:
            pass
        return None
    try:
        with ctx:
            _round_trip_in(kvikio, directory, device)
    except Exception as exc:
        return _first_line(exc)
    return None


def probe(directory: str | None, *, force_posix: bool = False) -> IoPath:
    """Decide the I/O path (does I/O: a 4 KiB ``CuFile`` round trip in ``directory``, or in
    a temporary directory when ``None``)."""
    cuda = _cuda_tensors()
    if force_posix:
        return IoPath(POSIX, "force_posix is set", None, cuda)
    try:
        kvikio = import_kvikio()
    except ImportError as exc:
        return IoPath(
            POSIX,
            f"kvikio is not installed ({exc}); pip install './backends/lmcache-backend-gds[kvikio]' (in an lmcache-core checkout)",
            None,
            cuda,
        )
    version = str(getattr(kvikio, "__version__", "?"))
    try:
        _round_trip_in(kvikio, directory, cuda)
    except Exception as exc:
        return IoPath(
            POSIX, f"kvikio {version} CuFile I/O failed: {_first_line(exc)}", version, cuda
        )
    compat = _compat_preferred(kvikio)
    gds = _gds_available(kvikio)
    if compat is False and gds:
        refused = _strict_gds_error(kvikio, directory, cuda)
        if refused is None:
            return IoPath(GDS, "the cuFile driver reports GDS available", version, cuda)
        return IoPath(
            COMPAT, f"GDS is available but not for this directory: {refused}", version, cuda
        )
    setting = _setting(kvikio, "compat_mode")
    why = (
        f"kvikio compat_mode={getattr(setting, 'name', setting)}"
        if compat
        else "the cuFile driver reports no GDS (nvidia-fs not loaded?)"
        if gds is False
        else "GDS availability unknown"
    )
    return IoPath(COMPAT, why, version, cuda)


def _compat_preferred(kvikio: Any) -> bool | None:
    """Whether kvikio runs (or will run) in compatibility mode."""
    fn = getattr(getattr(kvikio, "defaults", None), "is_compat_mode_preferred", None)
    if callable(fn):
        try:
            return bool(fn())
        except Exception:
            pass
    value = _setting(kvikio, "compat_mode")
    if value is None:
        return None
    text = str(getattr(value, "name", value)).upper()
    return text not in ("OFF", "0", "FALSE", "COMPATMODE.OFF")


def log_once(path: IoPath, where: str) -> None:
    """Log the chosen path, once per process for each distinct outcome."""
    key = (path.mode, path.reason)
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    level = logging.INFO if path.mode == GDS else logging.WARNING
    log.log(level, "gds tier %s: using %s", where, path.text())


def describe() -> str:
    """What a ``gds`` tier would use in this process (``lmcache-core backends``)."""
    return probe(None).text()
