"""The shared C library handle (lmcache_core.libc)."""

from __future__ import annotations

import ctypes
import errno
import sys

import pytest

from lmcache_core import memory
from lmcache_core.integrations.vllm import stats_file
from lmcache_core.libc import libc, libc_function

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux C library")


def test_one_handle_for_the_process() -> None:
    assert libc() is not None and libc() is libc()


def test_each_caller_gets_its_own_function_object() -> None:
    a, b = libc_function("madvise"), libc_function("madvise")
    assert a is not None and b is not None and a is not b
    a.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert b.argtypes is None  # one caller's signature never changes another's
    # memory.py's madvise keeps its own signature whatever other callers set
    assert memory._madvise is not None
    assert memory._madvise.argtypes == [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def test_a_missing_symbol_is_none() -> None:
    assert libc_function("lmcache_no_such_function") is None


def test_errno_is_kept_after_a_call() -> None:
    fn = libc_function("renameat2")
    if fn is None:
        pytest.skip("no renameat2 in this C library")
    ctypes.set_errno(0)
    assert fn(-100, b"/nonexistent/lmcache-a", -100, b"/nonexistent/lmcache-b", 0) == -1
    assert ctypes.get_errno() == errno.ENOENT
    assert stats_file._renameat2 is not None  # the stats files use the same library
