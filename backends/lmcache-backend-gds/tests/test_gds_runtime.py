"""How the gds backend picks its I/O path, and how it says so (log, stats, CLI)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from lmcache_backend_gds import GdsBackend, runtime

from lmcache_core.errors import ConfigError
from lmcache_core.testing.contract import make_key, random_tensor, same_bits


def _kvikio_importable() -> bool:
    try:
        runtime.import_kvikio()
    except ImportError:
        return False
    return True


def _start_stop(b: GdsBackend) -> dict[str, object]:
    async def body() -> dict[str, object]:
        await b.start()
        try:
            key = make_key("rt")
            v = random_tensor((4096,), torch.float16)
            assert await b.put(key, v)
            assert same_bits(await b.get(key), v)
            return b.stats()
        finally:
            await b.close()

    return asyncio.run(body())


def test_without_a_usable_cuda_driver_the_posix_path_is_used_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime._logged.clear()
    caplog.set_level(logging.INFO, logger="lmcache_core.gds")
    for i in range(2):
        stats = _start_stop(GdsBackend({"path": str(tmp_path / f"t{i}")}))
        assert stats["io_path"] == "posix"
        reason = str(stats["io_path_reason"])
        if _kvikio_importable():
            assert "CuFile I/O failed" in reason, reason  # e.g. libcuda.so.1 missing
        else:
            assert "kvikio is not installed" in reason, reason
        assert stats["direct_io"] is True  # O_DIRECT on this filesystem
    lines = [r.getMessage() for r in caplog.records if "POSIX O_DIRECT fallback" in r.getMessage()]
    assert len(lines) == 1, lines  # once per process, not once per tier


def test_force_posix_is_honoured_and_reported(tmp_path: Path) -> None:
    stats = _start_stop(GdsBackend({"path": str(tmp_path / "t"), "force_posix": True}))
    assert stats["io_path"] == "posix" and stats["io_path_reason"] == "force_posix is set"


def _fake_kvikio(monkeypatch: pytest.MonkeyPatch, cufile: type, compat: str = "OFF") -> None:
    mod = types.ModuleType("kvikio")
    defaults = types.ModuleType("kvikio.defaults")
    defaults.get = lambda name: compat  # type: ignore[attr-defined]
    mod.__version__ = "0.0-fake"  # type: ignore[attr-defined]
    mod.CuFile = cufile  # type: ignore[attr-defined]
    mod.defaults = defaults  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)


def test_a_cufile_that_fails_like_without_libcuda_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extra unit layer (a fake module): kvikio imports, every CuFile call raises the
    error kvikio gives on a machine without a CUDA driver."""

    class FailingCuFile:
        def __init__(self, *args: object) -> None:
            raise RuntimeError("libcuda.so.1: cannot open shared object file: No such file")

    _fake_kvikio(monkeypatch, FailingCuFile)
    path = runtime.probe(str(tmp_path))
    assert path.mode == "posix"
    assert path.reason.startswith("kvikio 0.0-fake CuFile I/O failed: libcuda.so.1")
    assert os.listdir(tmp_path) == []  # the probe file is removed
    stats = _start_stop(GdsBackend({"path": str(tmp_path / "t")}))
    assert stats["io_path"] == "posix"


class _PosixCuFile:
    """A fake CuFile doing real POSIX I/O (an extra unit layer); with ``strict_fails``
    set, opening one fails as cuFile's handle registration does where GDS cannot take
    the file (kvikio's compatibility mode forced off)."""

    strict = False
    strict_fails = False

    def __init__(self, name: str, flags: str) -> None:
        if _PosixCuFile.strict and _PosixCuFile.strict_fails:
            raise RuntimeError("cuFile error at: cuFileHandleRegister (filesystem not supported)")
        self.fd = os.open(name, os.O_RDWR)

    def pwrite(self, buf: object, size: int, offset: int) -> types.SimpleNamespace:
        n = os.pwrite(self.fd, memoryview(buf).cast("B")[:size], offset)  # type: ignore[arg-type]
        return types.SimpleNamespace(get=lambda: n)

    def pread(self, buf: object, size: int, offset: int) -> types.SimpleNamespace:
        n = os.preadv(self.fd, [memoryview(buf).cast("B")[:size]], offset)  # type: ignore[arg-type]
        return types.SimpleNamespace(get=lambda: n)

    def close(self) -> None:
        os.close(self.fd)


def test_a_working_kvikio_in_compat_mode_is_reported_as_compat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extra unit layer (a fake CuFile doing real POSIX I/O): the probe's round trip
    succeeds, kvikio says compat mode, so the path is ``compat``."""
    _fake_kvikio(monkeypatch, _PosixCuFile, compat="ON")
    path = runtime.probe(str(tmp_path))
    assert path.mode == "compat", path
    assert "compatibility mode" in path.text()


class _StrictMode:
    """``kvikio.defaults.set("compat_mode", OFF)``'s context manager, faked."""

    def __enter__(self) -> None:
        _PosixCuFile.strict = True

    def __exit__(self, *exc: object) -> None:
        _PosixCuFile.strict = False


def _driver_reports_gds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The faked kvikio's cuFile driver says GDS is available."""
    drv = types.ModuleType("kvikio.cufile_driver")
    drv.get = lambda name: True  # type: ignore[attr-defined]
    sys.modules["kvikio"].cufile_driver = drv  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", drv)


@pytest.mark.parametrize("strict_fails", [False, True])
def test_gds_is_claimed_only_where_cufile_takes_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict_fails: bool
) -> None:
    """The driver reporting GDS available is not enough: kvikio's default ``AUTO`` mode
    falls back to compatibility mode per file, silently. The probe repeats its round
    trip with compatibility mode forced off; only if that works is the path ``gds``."""
    _fake_kvikio(monkeypatch, _PosixCuFile, compat="OFF")
    kv = sys.modules["kvikio"]
    kv.CompatMode = types.SimpleNamespace(OFF="OFF")  # type: ignore[attr-defined]
    kv.defaults.set = lambda name, value: _StrictMode()  # type: ignore[attr-defined]
    _driver_reports_gds(monkeypatch)
    monkeypatch.setattr(_PosixCuFile, "strict_fails", strict_fails)
    path = runtime.probe(str(tmp_path))
    if strict_fails:
        assert path.mode == "compat", path
        assert "GDS is available but not for this directory: cuFile error" in path.reason
    else:
        assert path.mode == "gds", path
    assert not _PosixCuFile.strict  # the setting was put back
    assert os.listdir(tmp_path) == []


def test_without_kvikio_the_posix_path_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(``make venv`` installs kvikio, so its absence is simulated here.)"""

    def missing() -> None:
        raise ImportError("No module named 'kvikio'")

    monkeypatch.setattr(runtime, "import_kvikio", missing)
    path = runtime.probe(str(tmp_path))
    assert path.mode == "posix", path
    assert "kvikio is not installed (No module named 'kvikio')" in path.reason, path
    assert "pip install './backends/lmcache-backend-gds[kvikio]'" in path.reason, path
    stats = _start_stop(GdsBackend({"path": str(tmp_path / "t")}))
    assert stats["io_path"] == "posix" and "kvikio is not installed" in str(stats["io_path_reason"])


@pytest.mark.skipif(not _kvikio_importable(), reason="kvikio is not installed (optional extra)")
def test_real_kvikio_without_a_gpu_falls_back(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the fallback is not what happens here")
    path = runtime.probe(str(tmp_path))
    assert path.mode == "posix" and "CuFile I/O failed" in path.reason, path


def test_lmcache_core_backends_names_the_io_path() -> None:
    cli = "import sys; from lmcache_core.cli.main import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run(
        [sys.executable, "-c", cli, "backends", "gds", "--table"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "runtime: POSIX O_DIRECT fallback with aligned host buffers:" in res.stdout
    if _kvikio_importable() and not torch.cuda.is_available():
        assert "CuFile I/O failed" in res.stdout  # kvikio imports, cuFile cannot work
    for option in ("path", "paths", "max_bytes", "io_threads", "task_size", "force_posix"):
        assert f"\n  {option} " in res.stdout or f"  {option}  " in res.stdout, option


@pytest.mark.parametrize(
    ("opts", "where"),
    [
        ({}, "options.path"),
        ({"path": "/tmp/a", "paths": ["/tmp/b"]}, "options.paths"),
        ({"paths": ["/tmp/a", "/tmp/a/"]}, "options.paths[1]"),
        ({"paths": ["/tmp/a", "/tmp/a/b"]}, "options.paths"),
        ({"paths": ["/tmp/a", ""]}, "options.paths[1]"),
        ({"path": "/tmp/a", "task_size": 100}, "options.task_size"),
    ],
)
def test_bad_options_are_refused_with_their_path(opts: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GdsBackend(opts)
    assert exc.value.path == where, exc.value


def test_a_kvikio_whose_set_is_no_context_manager_gets_its_setting_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older kvikio's ``defaults.set`` changes the setting for good and returns
    nothing: the strict probe is skipped and the previous setting is put back."""
    _fake_kvikio(monkeypatch, _PosixCuFile, compat="AUTO-fake")
    kv = sys.modules["kvikio"]
    kv.CompatMode = types.SimpleNamespace(OFF="OFF")  # type: ignore[attr-defined]
    calls: list[tuple[str, object]] = []
    kv.defaults.set = lambda name, value: calls.append((name, value))  # type: ignore[attr-defined]
    kv.defaults.is_compat_mode_preferred = lambda: False  # type: ignore[attr-defined]
    _driver_reports_gds(monkeypatch)
    path = runtime.probe(str(tmp_path))
    assert path.mode == "gds", path  # (the strict check could not be made)
    assert calls == [("compat_mode", "OFF"), ("compat_mode", "AUTO-fake")]
