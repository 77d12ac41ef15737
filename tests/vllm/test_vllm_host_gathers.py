"""Save gathers on CPU run on the copier's gather thread (``BlockCopier.host_async``), with
the real ``cpu`` and ``disk`` backends and real files; no engine.

The engine thread issues a step's gathers and goes on; the gather thread copies; the next
step starts (``begin_step``) only once they are done, as the compute stream waits for the
side stream's gathers on CUDA. Checked: the chunks land bit for bit in both tiers; a
gather still running holds ``begin_step``, its request's end (``gathered_for``) and
``close``; a failed gather stores nothing and leaves no reservation open; layouts whose
blocks are not one run per layer keep the synchronous copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from copy_checks import BLOCKS, caches, fill
from test_vllm_save_reserved import _disk_holds, _expected, _items, _save, _storage, _wait

from lmcache_core.integrations.vllm import layout
from lmcache_core.integrations.vllm.layout import BlockCopier, HostEvent
from lmcache_core.integrations.vllm.saves import SaveQueue
from lmcache_core.integrations.vllm.staging import ChunkBuffers

pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Any]:
    views = caches("cpu", "LBHNC")
    fill(views, 5)
    copier = BlockCopier(views, BLOCKS)
    copier.host_async = True
    chunk_bytes = copier.block_nbytes * 2
    storage = _storage(tmp_path, 4, chunk_bytes)
    q = SaveQueue(storage, ChunkBuffers(copier.chunk_shape(2), torch.float32, 8), copier)
    yield storage, copier, q
    copier.close()
    storage.close()


class _Gate:
    """Holds the gather thread's copies until :meth:`open` (wraps the real ``memmove``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.opened = threading.Event()
        self.started = threading.Event()
        self.fail = fail
        real = layout._memmove

        def held(dst: int, src: int, n: int) -> Any:
            self.started.set()
            assert self.opened.wait(20), "the gate was never opened"
            if self.fail:
                raise OSError("copy failed")
            return real(dst, src, n)

        monkeypatch.setattr(layout, "_memmove", held)

    def open(self) -> None:
        self.opened.set()


def _returns_within(fn: Any, seconds: float) -> tuple[bool, threading.Thread]:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), t


def test_saves_gathered_on_the_thread_land_bit_exact_in_both_tiers(setup: Any) -> None:
    storage, copier, q = setup
    items = _items(0, 10)
    for i in range(0, 10, 2):  # filling, then recycling reservations: both buffer kinds
        _save(storage, q, items[i : i + 2])
    assert q.stored == 10 and q.reserved > 0
    assert q.gathered == 10
    for it in items:
        want = _expected(copier, it.block_ids)
        assert _disk_holds(storage, it.key, want), f"disk holds wrong bytes for {it.chunk_hash}"
    last = items[-1]
    out = torch.empty(copier.chunk_shape(2))
    assert storage.get_into_memory([last.key], [out]) == [True]
    assert torch.equal(out, _expected(copier, last.block_ids))


def test_the_next_step_and_the_requests_end_wait_for_a_running_gather(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, copier, q = setup
    gate = _Gate(monkeypatch)
    (item,) = _items(0, 1)
    want = _expected(copier, item.block_ids)
    assert q.submit([item]) == []  # returns with the copy held
    assert gate.started.wait(10)
    assert not q.gathered_for(item.req_id)  # its blocks may not be reused yet
    done, waiter = _returns_within(copier.begin_step, 0.3)
    assert not done, "begin_step returned while a gather still read the blocks"
    assert q.pending == 1 and q.stored == 0  # the store waits for the gather too
    gate.open()
    waiter.join(10)
    assert not waiter.is_alive()
    assert q.gathered_for(item.req_id)
    _wait(lambda: q.pending == 0)
    assert q.stored == 1
    storage.submit(storage.hierarchy.flush()).result(timeout=20)
    assert _disk_holds(storage, item.key, want)


def test_wait_gathers_and_close_wait_for_running_gathers(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, copier, q = setup
    gate = _Gate(monkeypatch)
    assert q.submit(_items(0, 1)) == []
    assert gate.started.wait(10)
    done, waiter = _returns_within(q.wait_gathers, 0.3)
    assert not done
    closed, closer = _returns_within(copier.close, 0.3)
    assert not closed, "close returned while a gather still read the cache"
    gate.open()
    waiter.join(10)
    closer.join(10)
    assert not waiter.is_alive() and not closer.is_alive()
    _wait(lambda: q.pending == 0)


def test_a_failed_gather_on_the_thread_stores_nothing(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, copier, q = setup
    cpu = storage.hierarchy.tiers[0].backend
    _save(storage, q, _items(0, 4))  # the tier is full: the next save reserves
    gate = _Gate(monkeypatch, fail=True)
    (bad,) = _items(100, 1)
    assert q.submit([bad]) == []
    assert q.reserved == 1
    gate.open()
    _wait(lambda: q.pending == 0)
    copier.begin_step()  # a failed gather fails its store, not the next step
    assert q.stored == 4 and q.refused == 1
    assert q.take_refused() == [(bad.req_id, 0)]
    storage.submit(storage.hierarchy.flush()).result(timeout=20)
    s = cpu.stats()
    assert s["reservations"] == 0 and s["reservations_aborted"] == 1
    assert bad.key not in list(cpu.keys())
    assert not _disk_holds(storage, bad.key, _expected(copier, bad.block_ids))
    monkeypatch.undo()
    (good,) = _items(200, 1)
    _save(storage, q, [good])
    assert _disk_holds(storage, good.key, _expected(copier, good.block_ids))


def test_a_gather_returns_an_event_only_where_one_memmove_per_layer_run_works() -> None:
    views = caches("cpu", "LBHNC")
    fill(views, 3)
    copier = BlockCopier(views, BLOCKS)
    out = torch.empty(copier.chunk_shape(2))
    assert copier.gather_to_host([3, 1], out) is None  # host_async off: copied at once
    copier.host_async = True
    try:
        ev = copier.gather_to_host([3, 1], out)
        assert isinstance(ev, HostEvent)
        ev.synchronize()
        assert torch.equal(out, _expected(copier, [3, 1]))
        # A destination of another dtype or not contiguous per layer: the synchronous copy.
        odd = torch.empty(copier.chunk_shape(4))[:, ::2]
        assert copier.gather_to_host([5, 6], odd) is None
        assert torch.equal(odd, _expected(copier, [5, 6]))
        with pytest.raises(IndexError):
            copier.gather_to_host([BLOCKS], out)
        with pytest.raises(ValueError, match="do not fit"):
            copier.gather_to_host([1, 2, 3], out)
    finally:
        copier.close()
    # Every layer's blocks interleaved (a cross-layer layout): no run per layer to memmove.
    cross = BlockCopier(caches("cpu", "BLHNC"), BLOCKS)
    cross.host_async = True
    assert cross.gather_to_host([3, 1], torch.empty(cross.chunk_shape(2))) is None


def test_host_events_report_their_end_and_failure() -> None:
    ev = HostEvent()
    assert not ev.query()
    t = threading.Timer(0.05, ev.set)
    t.start()
    t0 = time.monotonic()
    ev.synchronize()
    assert ev.query() and time.monotonic() - t0 >= 0.03
    bad = HostEvent()
    bad.set(OSError("boom"))
    bad.wait()  # (no error from wait)
    with pytest.raises(RuntimeError, match="boom"):
        bad.synchronize()
