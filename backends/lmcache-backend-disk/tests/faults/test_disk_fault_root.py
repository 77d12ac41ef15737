"""Tier roots another user controls: world-writable (with or without the sticky bit, ours
or another user's), owned by another user (without group sharing, with a group this
process is not in), a symbolic link, a world-writable ``.lmcache-disk`` of another user.
Each is refused at start with a ``ConfigError`` naming the fix, and nothing in it is
created or changed; a root shared through a group this process is in is accepted with
``mode: "0660"``. The tests run as root here, so "another user" is made with ``os.chown``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from disk_canary import snapshot
from disk_world import FULL, Tally, backend, key, legit_value, run

from lmcache_core.errors import ConfigError
from lmcache_core.testing import same_bits

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")

OTHER_UID = 4242
OTHER_GID = 4243
REPEATS = 5 if FULL else 1


def _dir(path: Path, mode: int, uid: int = 0, gid: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, mode)


# name -> (prepare(root), backend mode option, words the error must contain)
CASES: dict[str, tuple[Callable[[Path], None], str, tuple[str, ...]]] = {
    "world-writable": (lambda r: _dir(r, 0o777), "0600", ("every user", "chmod o-w")),
    "sticky-world-writable": (lambda r: _dir(r, 0o1777), "0600", ("every user",)),
    "foreign": (lambda r: _dir(r, 0o755, OTHER_UID, OTHER_GID), "0600", ("belongs to", "mkdir")),
    "foreign-group-mode": (
        lambda r: _dir(r, 0o2770, OTHER_UID, OTHER_GID),
        "0660",
        ("not one of this process's groups",),
    ),
    "foreign-no-group-mode": (
        lambda r: _dir(r, 0o2770, OTHER_UID, 0),
        "0600",
        ("belongs to", 'mode: "0660"'),
    ),
    "foreign-world-writable": (
        lambda r: _dir(r, 0o777, OTHER_UID, OTHER_GID),
        "0660",
        ("every user",),
    ),
    "symlink-to-own-dir": (
        lambda r: (_dir(r.parent / "real", 0o700), r.symlink_to(r.parent / "real")),  # type: ignore[func-returns-value]
        "0600",
        ("symbolic link", "real"),
    ),
    "foreign-world-writable-meta": (
        lambda r: (_dir(r, 0o700), _dir(r / ".lmcache-disk", 0o777, OTHER_UID, OTHER_GID)),  # type: ignore[func-returns-value]
        "0600",
        ("writable by every user", "chmod o-w"),
    ),
    "not-a-directory": (lambda r: r.write_text("x"), "0600", ("not a directory",)),
}


def _refusal_trial(base: Path, name: str) -> Tally:
    prepare, mode, words = CASES[name]
    tally = Tally(trials=1)
    base.mkdir()
    root = base / "tier"
    prepare(root)
    before = snapshot(str(base))

    async def body() -> None:
        b = backend(root, mode=mode)
        try:
            await b.start()
        except ConfigError as exc:
            tally.refused += 1
            missing = [w for w in words if w not in str(exc)]
            if missing or exc.path != "options.path":
                tally.inconsistent += 1
                tally.notes.append(f"{name}: message lacks {missing}: {exc}")
            return
        tally.notes.append(f"{name}: accepted")
        await b.close()

    try:
        run(body())
    except Exception as exc:
        tally.crash(name, exc)
    if snapshot(str(base)) != before:
        tally.outside_touched += 1
        tally.notes.append(f"{name}: something changed in the refused root")
    return tally


def test_roots_another_user_controls_are_refused(tmp_path: Path) -> None:
    total = Tally()
    for rep in range(REPEATS):
        for name in CASES:
            total.add(_refusal_trial(tmp_path / f"{name}-{rep}", name))
    print(total.report("disk-root-ownership"))
    assert total.trials == total.refused == REPEATS * len(CASES), total.notes
    assert total.failures() == 0, total.notes


def test_a_root_shared_through_our_group_is_accepted(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    _dir(root, 0o2770, OTHER_UID, os.getegid())

    async def body() -> None:
        private = backend(root)  # mode 0600: another user's root is refused
        with pytest.raises(ConfigError, match="belongs to"):
            await private.start()
        b = backend(root, mode="0660")
        await b.start()
        try:
            assert await b.put(key(0), legit_value(0))
            assert same_bits(await b.get(key(0)), legit_value(0))
        finally:
            await b.close()

    run(body())
