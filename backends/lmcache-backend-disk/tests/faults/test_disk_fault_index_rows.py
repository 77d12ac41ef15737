"""Crafted rows in the shared index - owner ids that are paths (``../../x``, absolute),
object and temporary paths that point outside, negative, huge and mistyped sizes,
tampered totals, a planted trigger, never-expiring pins, a foreign schema version - written
before a backend starts and while one runs. The index is input: nothing outside the tier
may be touched, the bound must hold, nothing may crash, and a reconciled index must agree
with the files."""

from __future__ import annotations

import random
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_world import FULL, LEGIT, OBJ, Tally, World, backend, phases, run
from lmcache_backend_disk import store as store_mod

SEEDS = range(6) if FULL else range(1)
DEAD = "0123456789abcdef"  # a well-formed owner id nobody holds


def _sql(w: World, *statements: tuple[str, tuple[object, ...]]) -> None:
    con = sqlite3.connect(w.root / ".lmcache-disk" / "index.sqlite", timeout=30)
    try:
        for stmt, args in statements:
            con.execute(stmt, args)
        con.commit()
    finally:
        con.close()


def _attacks(w: World) -> dict[str, Callable[[], None]]:
    v = w.victim
    rel0 = w.rel(0)
    tmp0 = f"{rel0.rpartition('/')[0]}/.{rel0.rpartition('/')[2]}.{DEAD}.1.tmp"
    pend = "INSERT INTO pending(owner, path, tmp, size, started) VALUES (?, ?, ?, ?, 0)"
    ent = "INSERT INTO entries(path, size, atime) VALUES (?, ?, 0)"
    return {
        "owner-dotdot": lambda: _sql(w, (pend, ("../../canary/victim", rel0, tmp0, 10))),
        "owner-dotdot-dotfile": lambda: _sql(
            w, (pend, ("../../canary/victim/.bashrc", rel0, tmp0, 10))
        ),
        "owner-absolute": lambda: _sql(w, (pend, (str(v / "notes.txt"), rel0, tmp0, 10))),
        "pending-paths": lambda: _sql(
            w,
            (pend, (DEAD, "../../canary/victim/notes.txt", str(v / ".bashrc"), 10)),
            (pend, (DEAD, str(v / "notes.txt"), "../../canary/victim/.bashrc", 10)),
        ),
        "pending-huge": lambda: _sql(w, (pend, (DEAD, rel0, tmp0, 10**18))),
        "entry-dotdot": lambda: _sql(w, (ent, ("../../canary/victim/notes.txt", 100))),
        "entry-absolute": lambda: _sql(w, (ent, (str(v / "notes.txt"), 100))),
        "entry-negative": lambda: _sql(
            w, ("UPDATE entries SET size = ? WHERE path = ?", (-(10**12), rel0))
        ),
        "entry-types": lambda: _sql(
            w,
            ("UPDATE entries SET size = 'abc' WHERE path = ?", (rel0,)),
            (ent, (b"\x00\xff", 5)),
            ("UPDATE entries SET atime = 'x' WHERE path = ?", (w.rel(1),)),
        ),
        "totals-negative": lambda: _sql(w, ("UPDATE totals SET used = ?", (-(10**15),))),
        "totals-zero": lambda: _sql(w, ("UPDATE totals SET used = 0, entries = 0", ())),
        "totals-huge": lambda: _sql(w, ("UPDATE totals SET used = ?", (10**15,))),
        "totals-text": lambda: _sql(w, ("UPDATE totals SET used = 'x'", ())),
        "trigger": lambda: _sql(
            w,
            (
                "CREATE TRIGGER evil AFTER INSERT ON entries BEGIN UPDATE totals SET used = 0; END",
                (),
            ),
        ),
        "trigger-dropped": lambda: _sql(w, ("DROP TRIGGER entries_ins", ())),
        "pins-forever": lambda: _sql(
            w,
            (
                "INSERT INTO pins(path, owner, expires) SELECT path, ?, 1e18 FROM entries",
                ("f" * 16,),
            ),
            ("INSERT INTO pins(path, owner, expires) VALUES (?, '../x', 1e18)", (rel0,)),
        ),
        "meta-garbage": lambda: _sql(
            w, ("INSERT OR REPLACE INTO meta(k, v) VALUES ('max_bytes', '../../x')", ())
        ),
        "schema-version": lambda: _sql(
            w, ("INSERT OR REPLACE INTO meta(k, v) VALUES ('schema', '99')", ())
        ),
    }


ATTACKS = [  # the names above, in order
    "owner-dotdot", "owner-dotdot-dotfile", "owner-absolute", "pending-paths", "pending-huge",
    "entry-dotdot", "entry-absolute", "entry-negative", "entry-types", "totals-negative",
    "totals-zero", "totals-huge", "totals-text", "trigger", "trigger-dropped", "pins-forever",
    "meta-garbage", "schema-version",
]  # fmt: skip


def _trial(template: World, tmp: Path, attack: str, hot: bool, seed: int) -> Tally:
    tally = Tally(trials=1)
    bound = (LEGIT + 4) * OBJ

    async def body() -> None:
        w = template.clone(tmp, random.Random(seed))
        b = None
        if hot:
            b = backend(w.root, max_bytes=bound)
            await b.start()
        _attacks(w)[attack]()
        w.canary.arm()
        await w.battery(tally, b, pressure=16)
        await w.final_checks(tally, bound)
        diffs = w.canary.check()
        if diffs:
            tally.outside_touched += 1
            tally.notes.extend(diffs[:10])

    try:
        run(body(), timeout=120)
    except Exception as exc:
        tally.crash(f"trial {attack}", exc)
    return tally


def test_crafted_index_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a running backend audits the shared totals every AUDIT_INTERVAL_S (60 s); here at
    # every store, so that tampering while it runs is met within the trial
    monkeypatch.setattr(store_mod, "AUDIT_INTERVAL_S", 0.0, raising=False)
    template = World(tmp_path / "template", random.Random(0))
    run(template.build())
    total = Tally()
    trials = phases([(a, seed) for seed in SEEDS for a in ATTACKS])
    for n, (attack, seed, hot) in enumerate(trials):
        t = _trial(template, tmp_path / f"t{n}", attack, hot, seed)
        if t.failures():
            t.notes.insert(0, f"{attack} ({'hot' if hot else 'cold'}, seed {seed})")
        total.add(t)
        shutil.rmtree(tmp_path / f"t{n}", ignore_errors=True)
    print(total.report("disk-index-rows"))
    assert total.trials == len(trials)
    assert total.failures() == 0, total.notes[:30]
    assert total.refused == 0
