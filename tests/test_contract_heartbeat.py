"""The contract heartbeat's discount for a loaded machine (lmcache_core.testing.contract)."""

from __future__ import annotations

import time

import pytest

from lmcache_core.testing.contract import _OTHER_WAIT_CAP_S, _CpuWaits

MS = 1_000_000  # ns


def test_only_waits_for_cpus_other_processes_took_are_excused() -> None:
    w = _CpuWaits()
    w._cpus = 2
    me, other = w._me, "other"
    before = {me: (0, 0), other: (0, 0)}
    # the loop waited 30 ms for a CPU while the process's other threads ran nothing
    assert w.excused(before, {me: (0, 30 * MS), other: (0, 0)}) == pytest.approx(0.030)
    # ... while they ran 60 ms (both CPUs for 30 ms): the backend's doing, not excused
    assert w.excused(before, {me: (0, 30 * MS), other: (60 * MS, 0)}) == 0
    # ... while they ran 20 ms: at most 20 ms of it was theirs
    assert w.excused(before, {me: (0, 30 * MS), other: (20 * MS, 0)}) == pytest.approx(0.020)
    # the loop's own CPU time (busy, blocked) is never excused
    assert w.excused(before, {me: (500 * MS, 0), other: (0, 0)}) == 0
    # another thread (a GIL holder) kept waiting: at most the cap
    assert w.excused(before, {me: (0, 0), other: (0, 200 * MS)}) == pytest.approx(_OTHER_WAIT_CAP_S)


def test_snapshots_read_this_process_threads() -> None:
    w = _CpuWaits()
    try:
        s0 = w.snapshot()
        if not s0:
            pytest.skip("no /proc/self/task/*/schedstat here")
        assert w._me in s0
        t_end = time.thread_time() + 0.02
        while time.thread_time() < t_end:
            pass
        s1 = w.snapshot()
        assert s1[w._me][0] - s0[w._me][0] >= 15 * MS  # the loop thread's CPU time
    finally:
        w.close()
