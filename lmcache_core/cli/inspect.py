"""``lmcache-core inspect``: what live engines do, or what a configuration's tiers hold.

* ``inspect --stats-dir DIR`` (or ``inspect DIR``) reads the ``<pid>.json`` files that
  running hierarchies write every ``stats_interval_s`` when ``stats_dir`` is set, and
  prints per engine and tier: hits, misses, bytes, latency percentiles, queue depth,
  dropped stores, errors and health. Files of processes that no longer exist are marked
  ``dead`` (an engine that crashed; a clean close removes its file).
* ``inspect --config FILE`` (or ``inspect FILE``) opens each tier of the configuration and
  reports what is stored: tiers implementing
  :class:`~lmcache_core.maintenance.MaintainableBackend` are scanned (entries, bytes,
  oldest and newest access; ``--headers`` also reads each object's header to count
  namespaces); other tiers report their own statistics (an in-memory tier opened here is
  empty: its contents live in the engine's process).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError
from ..hierarchy.stats import read_stats_dir
from ..interface import MaintainableBackend, implements
from ..sizes import format_bytes
from ..tables import format_table
from .main import add_output_flags, print_json, wants_json

__all__ = ["inspect_config", "register"]


def register(subparsers: Any) -> None:
    """Add the ``inspect`` command."""
    p = subparsers.add_parser(
        "inspect",
        help="statistics of live engines (stats_dir) or contents of a config's tiers",
        description="Show live statistics written to a stats_dir, or scan the tiers of a config.",
    )
    p.add_argument("path", nargs="?", metavar="PATH", help="a stats_dir or a config file")
    p.add_argument("--stats-dir", metavar="DIR", help="directory of <pid>.json stats files")
    p.add_argument("--config", metavar="FILE", help="configuration whose tiers to scan")
    p.add_argument(
        "--headers", action="store_true", help="read object headers while scanning (slower)"
    )
    add_output_flags(p)
    p.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    stats_dir, config = args.stats_dir, args.config
    if args.path is not None:
        if Path(args.path).is_dir():
            stats_dir = stats_dir or args.path
        else:
            config = config or args.path
    if stats_dir is None and config is None:
        print("inspect: give a stats_dir or a config file", file=sys.stderr)
        return 2
    status = 0
    if stats_dir is not None:
        status |= _inspect_stats(args, stats_dir)
    if config is not None:
        status |= _inspect_config(args, config)
    return status


# ------------------------------------------------------------------ live statistics
def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}"


def _inspect_stats(args: argparse.Namespace, directory: str) -> int:
    if not Path(directory).is_dir():
        print(f"inspect: {directory} is not a directory", file=sys.stderr)
        return 1
    docs = read_stats_dir(directory)
    if wants_json(args):
        print_json({"stats_dir": directory, "engines": docs})
        return 0
    if not docs:
        print(f"{directory}: no stats files (no engine with this stats_dir is running)")
        return 0
    for doc in docs:
        if "error" in doc:
            print(f"{doc['file']}: unreadable: {doc['error']}\n")
            continue
        alive = {True: "alive", False: "dead", None: "other host"}[doc.get("alive")]
        stats = doc.get("stats", {})
        print(
            f"pid {doc.get('pid')} on {doc.get('host')} ({alive}), {stats.get('name', '?')}: "
            f"updated {doc.get('age_s')} s ago; hits {stats.get('hits')}, "
            f"misses {stats.get('misses')}, lookups {stats.get('lookups')}, "
            f"pending stores {stats.get('pending_stores')}, leases {stats.get('leases')}"
        )
        rows = []
        for t in stats.get("tiers", []):
            lat = t.get("load_latency", {})
            total = (t.get("hits") or 0) + (t.get("misses") or 0)
            rows.append(
                [
                    t.get("name"),
                    t.get("backend"),
                    t.get("write_policy"),
                    t.get("health", {}).get("state"),
                    t.get("hits"),
                    t.get("misses"),
                    f"{100.0 * t['hits'] / total:.0f}%" if total else "-",
                    format_bytes(t.get("bytes_out", 0)),
                    format_bytes(t.get("bytes_in", 0)),
                    _ms(lat.get("p50_ms")),
                    _ms(lat.get("p99_ms")),
                    t.get("queue_depth"),
                    t.get("dropped_stores"),
                    t.get("errors"),
                ]
            )
        header = ["tier", "backend", "write", "health", "hits", "misses", "hit%", "out", "in",
                  "load p50 ms", "p99 ms", "queue", "dropped", "errors"]  # fmt: skip
        print(format_table(rows, header))
        print()
    return 0


# ------------------------------------------------------------------ stored contents
async def inspect_config(config: Any, read_headers: bool = False) -> list[dict[str, Any]]:
    """Open each tier of ``config`` and report what it stores (one dict per tier)."""
    cfg = load_config(config)
    out: list[dict[str, Any]] = []
    for tc in cfg.tiers:
        backend = tc.create_backend()
        row: dict[str, Any] = {"name": tc.name, "backend": tc.backend}
        try:
            await backend.start()
        except Exception as exc:
            row["error"] = f"cannot open: {type(exc).__name__}: {exc}"
            out.append(row)
            continue
        try:
            if implements(backend, MaintainableBackend):
                row.update(await _scan(backend, read_headers))
            else:
                stats = backend.stats()
                row["scannable"] = False
                row["entries"] = stats.get("entries")
                row["bytes"] = stats.get("used_bytes")
                row["note"] = "not scannable; an in-memory tier's contents live in its engine"
        except Exception as exc:
            row["error"] = f"scan failed: {type(exc).__name__}: {exc}"
        finally:
            await backend.close()
        out.append(row)
    return out


async def _scan(backend: MaintainableBackend, read_headers: bool) -> dict[str, Any]:
    entries = 0
    nbytes = 0
    oldest: float | None = None
    newest: float | None = None
    namespaces: dict[str, int] = {}
    async for e in backend.scan(read_headers=read_headers):
        entries += 1
        nbytes += e.size
        oldest = e.last_access if oldest is None else min(oldest, e.last_access)
        newest = e.last_access if newest is None else max(newest, e.last_access)
        if read_headers and e.namespace is not None:
            namespaces[e.namespace] = namespaces.get(e.namespace, 0) + 1
    row: dict[str, Any] = {"scannable": True, "entries": entries, "bytes": nbytes,
                           "oldest_access": oldest, "newest_access": newest}  # fmt: skip
    if read_headers:
        row["namespaces"] = namespaces
    return row


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _inspect_config(args: argparse.Namespace, config: str) -> int:
    try:
        rows = asyncio.run(inspect_config(Path(config), read_headers=args.headers))
    except ConfigError as exc:
        print(f"{config}: invalid configuration: {exc}", file=sys.stderr)
        return 1
    if wants_json(args):
        print_json({"config": config, "tiers": rows})
    else:
        table = [
            [
                r["name"],
                r["backend"],
                r.get("error") or ("scanned" if r.get("scannable") else r.get("note", "")),
                r.get("entries"),
                None if r.get("bytes") is None else format_bytes(r["bytes"]),
                _when(r.get("oldest_access")),
                _when(r.get("newest_access")),
            ]
            for r in rows
        ]
        header = ["tier", "backend", "how", "entries", "bytes", "oldest access", "newest access"]
        print(format_table(table, header))
    return 1 if any("error" in r for r in rows) else 0
