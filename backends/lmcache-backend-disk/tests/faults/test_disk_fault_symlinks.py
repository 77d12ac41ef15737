"""Symbolic links planted at every level of a tier - root, ``.lmcache-disk``, ``owners``,
an owner file, the namespace, both shard levels, an object, a temporary file,
``namespace.json``, the index and its WAL/SHM files, ``index.lock`` - before a backend
starts and while one is open. Every operation then runs (reads, stores under eviction
pressure, removals, pins, reconcile, scan, verify, gc): no file outside the tier may be
written, deleted or opened (a canary tree compared byte for byte and by inode, watched by
inotify), no forged object reached through a link may be served, nothing may crash."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_world import FULL, LEGIT, OBJ, Tally, World, backend, key, phases, run, sample
from lmcache_backend_disk import sandbox

SEEDS = range(8) if FULL else range(1)


def _attacks(w: World) -> dict[str, Callable[[], None]]:
    rel0 = w.rel(0)
    ns, *shards, name = rel0.split("/")
    s1 = shards[0]
    leaf = "/".join([ns, *shards])  # the object's directory
    v = w.victim
    plain: dict[str, tuple[str, Path]] = {
        "meta": (".lmcache-disk", w.forged(".lmcache-disk")),
        "owners": (".lmcache-disk/owners", v),
        "owner-file": (".lmcache-disk/owners/0123456789abcdef", v / ".bashrc"),
        "namespace": (ns, w.forged(ns)),
        "shard1": (f"{ns}/{s1}", w.forged(f"{ns}/{s1}")),
        "leaf": (leaf, w.forged(leaf)),
        "object": (rel0, w.forged(rel0)),
        "object-fifo": (w.rel(1), v / "fifo"),
        "object-dir": (w.rel(2), v),
        "temp": (f"{leaf}/.{name}.0123456789abcdef.1.tmp", v / "notes.txt"),
        "namespace-json": (f"{ns}/namespace.json", v / "notes.txt"),
        "index": (".lmcache-disk/index.sqlite", v / "db.sqlite"),
        "index-wal": (".lmcache-disk/index.sqlite-wal", v / "notes.txt"),
        "index-shm": (".lmcache-disk/index.sqlite-shm", v / "notes.txt"),
        "index-lock": (".lmcache-disk/index.lock", v / "notes.txt"),
        "index-lock-fifo": (".lmcache-disk/index.lock", v / "fifo"),
    }
    out: dict[str, Callable[[], None]] = {
        k: (lambda rel=rel, target=target: w.replace_with_link(rel, target))
        for k, (rel, target) in plain.items()
    }
    out["root"] = lambda: w.replace_with_link("", w.forged_root)
    return out


ATTACKS = [
    "root", "meta", "owners", "owner-file", "namespace", "shard1", "leaf", "object",
    "object-fifo", "object-dir", "temp", "namespace-json", "index", "index-wal", "index-shm",
    "index-lock", "index-lock-fifo",
]  # fmt: skip


def _trial(template: World, tmp: Path, attack: str, hot: bool, seed: int) -> Tally:
    tally = Tally(trials=1)

    async def body() -> None:
        w = template.clone(tmp, random.Random(seed))
        b = None
        if hot:  # a backend that was running before the link appeared
            b = backend(w.root, max_bytes=(LEGIT + 4) * OBJ)
            await b.start()
        _attacks(w)[attack]()
        w.canary.arm()
        await w.battery(tally, b)
        await w.final_checks(tally, (LEGIT + 4) * OBJ)
        diffs = w.canary.check()
        if diffs:
            tally.outside_touched += 1
            tally.notes.extend(diffs[:10])

    try:
        run(body(), timeout=120)
    except Exception as exc:
        tally.crash(f"trial {attack}", exc)
    return tally


@pytest.mark.parametrize("nested", [False, True], ids=["layout2", "layout1"])
def test_symlinks_at_every_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nested: bool
) -> None:
    """Every level, planted before start or while a backend is open (both in the full
    campaign), resolved with ``openat2``; a sample again with the component-by-component
    walk used where ``openat2`` is missing. In both object layouts (layout 1: the
    namespace an older version wrote)."""
    template = World(tmp_path / "template", random.Random(0), nested)
    run(template.build())
    trials = phases([(a, seed, True) for seed in SEEDS for a in ATTACKS])
    trials += sample(phases([(a, seed, False) for seed in SEEDS for a in ATTACKS]), 6)
    total = Tally()
    for n, (attack, seed, fast, hot) in enumerate(trials):
        monkeypatch.setattr(sandbox, "USE_OPENAT2", fast)
        t = _trial(template, tmp_path / f"t{n}", attack, hot, seed)
        if t.failures():
            how = f"{'hot' if hot else 'cold'}, seed {seed}, {'openat2' if fast else 'walk'}"
            t.notes.insert(0, f"{attack} ({how})")
        total.add(t)
        shutil.rmtree(tmp_path / f"t{n}", ignore_errors=True)
    print(total.report("disk-symlinks"))
    assert total.trials == len(trials)
    assert total.failures() == 0, total.notes[:30]
    # the root link is refused at start (cold); a running backend whose root was replaced
    # reports that its index is unusable (its real root is gone), and nothing else does
    assert total.refused == sum(1 for a, _, _, hot in trials if a == "root" and not hot)
    assert all("/t" in n for n in total.notes if n.startswith("reported by")), total.notes


@pytest.mark.parametrize(
    ("nested", "level"),
    [(False, 0), (False, 1), (False, 2), (True, 0), (True, 1), (True, 2), (True, 3)],
    ids=[
        *("layout2-ns", "layout2-shard", "layout2-object"),
        *("layout1-ns", "layout1-shard1", "layout1-shard2", "layout1-object"),
    ],
)
def test_a_planted_link_is_removed_and_the_key_stored_again(
    tmp_path: Path, nested: bool, level: int
) -> None:
    """A link in place of the namespace (0), a shard directory (1; 2 in layout 1) or the
    object of a running tier: the forged object is not served, the link (not its target)
    is removed, and the key can be stored and read again."""

    async def body() -> None:
        w = World(tmp_path, random.Random(0), nested)
        await w.build()
        b = backend(w.root)
        await b.start()
        try:
            rel = "/".join(w.rel(0).split("/")[: level + 1])
            w.replace_with_link(rel, w.forged(rel))
            assert await b.get(key(0)) is None  # the forged object is not served
            assert not (w.root / rel).is_symlink(), "the link must be removed"
            assert w.forged(w.rel(0)).is_file(), "its target must stay"
            assert b.stats()["bad_objects"] == 1 and b.stats()["links_removed"] == 1
            assert await b.put(key(0), w.legit[0])  # the real directories are made again
            got = await b.get(key(0))
            assert got is not None and bool((got == w.legit[0]).all())
        finally:
            await b.close()

    run(body())
