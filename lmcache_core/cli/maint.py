"""``lmcache-core verify`` and ``lmcache-core gc``: maintenance of persistent tiers.

Both work on any tier implementing :class:`~lmcache_core.maintenance.MaintainableBackend`
(the disk tier, object stores), given either directly (``--path DIR``: a tier directory,
opened by the backend of ``file://`` URLs; ``--url URL``) or through a configuration (``--config FILE``, every maintainable tier or the
one named by ``--tier``).

``verify``
    reads every object fully and checks size, header, identity/location and checksum;
    ``--delete`` removes the bad ones. Exit status 1 when bad objects remain.
``gc``
    first settles what crashed writers left (when the tier can: temporary files, index
    rows), then deletes, in this order: objects of a ``--namespace`` or ``--model``
    (purge), objects not accessed for ``--older-than``, and the least recently used
    objects until the tier holds at most ``--max-bytes``. ``--dry-run`` only reports.

A progress bar goes to stderr on long scans when stderr is a terminal (or with
``--progress``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError, LMCacheError
from ..interface import (
    EntryChecks,
    EntryInfo,
    MaintainableBackend,
    OpensForMaintenance,
    Reconcilable,
    implements,
    missing_members,
)
from ..keys import CacheEngineKey, Namespace
from ..sizes import format_bytes, parse_bytes
from ..tables import format_table
from .main import add_output_flags, print_json, wants_json

__all__ = ["ProgressBar", "gc_tier", "parse_duration", "register", "verify_tier"]

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_BATCH = 64


# ------------------------------------------------------------------ registration
def register(subparsers: Any) -> None:
    """Add the ``verify`` and ``gc`` commands."""
    v = subparsers.add_parser(
        "verify",
        help="read every object of persistent tiers and check it",
        description="Read every stored object fully and check its size, header, identity "
        "and checksum. Exit status 1 when bad objects remain.",
    )
    _add_target_args(v)
    v.add_argument("--delete", action="store_true", help="delete the bad objects found")
    v.set_defaults(func=run_verify)

    g = subparsers.add_parser(
        "gc",
        help="purge, expire and trim persistent tiers",
        description="Settle crashed writers' leftovers, then delete objects of a namespace "
        "or model, objects idle for --older-than, and least recently used objects beyond "
        "--max-bytes.",
    )
    _add_target_args(g)
    g.add_argument("--max-bytes", metavar="SIZE", help="trim each tier to this size (e.g. 50GiB)")
    g.add_argument(
        "--older-than", metavar="AGE", help="delete objects not accessed for AGE (30m, 12h, 7d)"
    )
    g.add_argument(
        "--namespace",
        metavar="NS",
        help="delete the objects of a namespace: its JSON, or a tier's ns-<hex> or ns2-<hex> directory",
    )
    g.add_argument("--model", metavar="NAME", help="delete the objects of a model")
    g.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    g.set_defaults(func=run_gc)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--path", metavar="DIR", help="a tier's directory (opened by the backend of file:// URLs)"
    )
    where.add_argument("--config", metavar="FILE", help="a configuration; its maintainable tiers")
    where.add_argument(
        "--url",
        metavar="URL",
        help="a tier by URL (s3://bucket/prefix): its scheme picks the backend; credentials "
        "from the default chain (for S3: AWS_ACCESS_KEY_ID, ~/.aws, an instance role)",
    )
    p.add_argument(
        "--option",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="with --url: a backend option (repeatable), e.g. endpoint_url=http://host:9000",
    )
    p.add_argument("--tier", metavar="NAME", help="with --config: only this tier")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    add_output_flags(p)


# ------------------------------------------------------------------ helpers
def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"45s"``, ``"30m"``, ``"12h"``, ``"7d"`` or ``"2w"``."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"cannot parse duration {text!r} (examples: 90, 45s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _UNITS[m.group(2)]


class ProgressBar:
    """A one-line progress bar, redrawn at most 10 times a second (``\\r`` on ``stream``)."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.total: int | None = None
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = max(total, done)
        now = time.monotonic()
        if self.enabled and now - self._last >= 0.1:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            text = f"{self.label} [{bar}] {self.done}/{self.total}"
        else:
            text = f"{self.label} {self.done}"
        self.stream.write("\r" + text)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


def _progress_enabled(args: argparse.Namespace) -> bool:
    flag = getattr(args, "progress", None)
    return bool(flag) if flag is not None else sys.stderr.isatty()


@dataclass
class _Target:
    name: str
    backend: Any
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _open_targets(args: argparse.Namespace) -> list[_Target]:
    """Unstarted backends for ``--path`` or ``--config`` (raises ConfigError)."""
    if args.path is not None:
        return [_Target(str(args.path), open_tier_dir(args.path))]
    from ..config import load_config

    if getattr(args, "url", None) is not None:
        options = dict(_option_pair(o) for o in args.option)
        cfg = load_config({"tiers": [{"name": "url", "backend": args.url, "options": options}]})
        return [_Target(args.url, cfg.tiers[0].create_backend())]
    cfg = load_config(Path(args.config))
    tiers = [t for t in cfg.tiers if args.tier is None or t.name == args.tier]
    if args.tier is not None and not tiers:
        raise ConfigError(f"no tier named {args.tier!r}; tiers: {[t.name for t in cfg.tiers]}")
    return [_Target(t.name, t.create_backend()) for t in tiers]


def open_tier_dir(path: str) -> Any:
    """An unstarted backend on the tier stored in local directory ``path``: the backend of
    ``file://`` URLs opens it (:class:`~lmcache_core.interface.OpensForMaintenance`), so
    what a tier directory looks like is that backend's knowledge. Raises ConfigError."""
    from ..plugins import get_registry

    spec = get_registry().for_scheme("file")
    cls = spec.load()
    if not implements(cls, OpensForMaintenance):
        raise ConfigError(
            f"backend {spec.name!r} (file:// URLs) cannot open an existing tier directory "
            f"({', '.join(missing_members(cls, OpensForMaintenance))} missing)"
        )
    return cls.open_for_maintenance(str(path))


def _option_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--option takes NAME=VALUE, got {text!r}")
    return name.strip(), value


async def _each_target(
    targets: list[_Target],
    work: Callable[[_Target], Awaitable[dict[str, Any]]],
) -> list[dict[str, Any]]:
    rows = []
    for t in targets:
        row: dict[str, Any] = {"tier": t.name}
        backend: Any = t.backend  # a StorageBackend too: started and closed here
        if not implements(t.backend, MaintainableBackend):
            row["skipped"] = "not a maintainable (persistent) tier"
            rows.append(row)
            continue
        try:
            await backend.start()
        except Exception as exc:
            row["error"] = f"cannot open: {_describe(exc)}"
            rows.append(row)
            continue
        try:
            row.update(await work(t))
        except Exception as exc:  # reported in the table / JSON, never a traceback
            row["error"] = _describe(exc)
        finally:
            try:
                await backend.close()
            except Exception as exc:
                row.setdefault("error", f"closing failed: {_describe(exc)}")
        rows.append(row)
    return rows


def _describe(exc: BaseException) -> str:
    """An error for the report: the message of our own errors, the type of any other."""
    return str(exc) if isinstance(exc, LMCacheError) else f"{type(exc).__name__}: {exc}"


async def _batches(
    backend: MaintainableBackend, read_headers: bool, bar: ProgressBar | None
) -> AsyncIterator[list[EntryInfo]]:
    """The scan in lists of up to ``_BATCH`` entries."""

    def on_progress(done: int, total: int | None) -> None:
        if bar is not None and total is not None:
            bar.update(bar.done, total)

    batch: list[EntryInfo] = []
    async for e in backend.scan(read_headers=read_headers, progress=on_progress):
        batch.append(e)
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


# ------------------------------------------------------------------ verify
async def verify_tier(
    backend: MaintainableBackend, *, delete: bool = False, bar: ProgressBar | None = None
) -> dict[str, Any]:
    """Verify every object of a started tier; report counts and the bad objects."""

    async def reason(e: EntryInfo) -> str | None:
        if implements(backend, EntryChecks):
            return await backend.check_entry(e)
        return None if await backend.verify_entry(e) else "verification failed"

    checked = nbytes = deleted = 0
    bad: list[dict[str, Any]] = []
    async for batch in _batches(backend, False, bar):
        reasons = await asyncio.gather(*(reason(e) for e in batch))
        for e, why in zip(batch, reasons, strict=True):
            checked += 1
            nbytes += e.size
            if why is not None and why != "missing":
                item = {"location": e.location, "size": e.size, "reason": why}
                if delete and await backend.delete_entry(e):
                    item["deleted"] = True
                    deleted += 1
                bad.append(item)
        if bar is not None:
            bar.update(checked)
    return {"checked": checked, "bytes": nbytes, "bad": len(bad), "deleted": deleted,
            "bad_objects": bad}  # fmt: skip


def run_verify(args: argparse.Namespace) -> int:
    try:
        targets = _open_targets(args)
    except (ConfigError, LMCacheError) as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2

    async def work(t: _Target) -> dict[str, Any]:
        bar = ProgressBar(f"verify {t.name}", _progress_enabled(args))
        try:
            return await verify_tier(t.backend, delete=args.delete, bar=bar)
        finally:
            bar.close()

    rows = asyncio.run(_each_target(targets, work))
    if wants_json(args):
        print_json({"verify": rows})
    else:
        table = [[r["tier"], r.get("checked"), format_bytes(r["bytes"]) if "bytes" in r else None, r.get("bad"),
                  r.get("deleted"), r.get("error") or r.get("skipped") or ""] for r in rows]  # fmt: skip
        print(format_table(table, ["tier", "checked", "bytes", "bad", "deleted", "note"]))
        for r in rows:
            for b in r.get("bad_objects", []):
                gone = " (deleted)" if b.get("deleted") else ""
                print(f"  {r['tier']}: {b['location']}: {b['reason']}{gone}")
    failed = any("error" in r or r.get("bad", 0) > r.get("deleted", 0) for r in rows)
    return 1 if failed else 0


# ------------------------------------------------------------------ gc
@dataclass(frozen=True)
class GcRules:
    """What ``gc`` deletes (see the module docstring)."""

    max_bytes: int | None = None
    older_than_s: float | None = None
    namespace: str | None = None
    model: str | None = None
    dry_run: bool = False

    @property
    def needs_headers(self) -> bool:
        return (self.namespace is not None and not _is_ns_dir(self.namespace)) or (
            self.model is not None
        )


def _is_ns_dir(text: str) -> bool:
    """Whether ``text`` names a namespace directory (``ns-…``, or ``ns2-…`` for the disk
    tier's layout 2) rather than a namespace's JSON."""
    return text.startswith(("ns-", "ns2-"))


def _normalise_namespace(text: str) -> str:
    if _is_ns_dir(text):
        return text
    try:
        return Namespace.from_json(text).to_json()
    except ValueError:
        return text


def _purged(e: EntryInfo, rules: GcRules) -> bool:
    if rules.namespace is not None:
        if _is_ns_dir(rules.namespace):
            if e.location.split("/", 1)[0] == rules.namespace:
                return True
        elif e.namespace == rules.namespace:
            return True
    if rules.model is not None:
        if e.namespace:
            try:
                if json.loads(e.namespace).get("model_name") == rules.model:
                    return True
            except (ValueError, AttributeError):
                pass
        if e.key:
            try:
                if CacheEngineKey.from_string(e.key).model_name == rules.model:
                    return True
            except ValueError:
                pass
    return False


async def gc_tier(
    backend: MaintainableBackend, rules: GcRules, *, bar: ProgressBar | None = None
) -> dict[str, Any]:
    """Apply ``rules`` to a started tier; report what was (or would be) deleted."""
    report: dict[str, Any] = {"dry_run": rules.dry_run}
    if implements(backend, Reconcilable) and not rules.dry_run:
        report["reconciled"] = await backend.reconcile()
    now = time.time()
    keep: list[EntryInfo] = []
    doomed: dict[str, list[EntryInfo]] = {"purged": [], "expired": [], "trimmed": []}
    scanned = 0
    async for batch in _batches(backend, rules.needs_headers, bar):
        for e in batch:
            scanned += 1
            if _purged(e, rules):
                doomed["purged"].append(e)
            elif rules.older_than_s is not None and e.last_access < now - rules.older_than_s:
                doomed["expired"].append(e)
            else:
                keep.append(e)
        if bar is not None:
            bar.update(scanned)
    total = sum(e.size for e in keep)
    if rules.max_bytes is not None and total > rules.max_bytes:
        keep.sort(key=lambda e: (e.last_access, e.location))
        n = 0
        while total > rules.max_bytes and n < len(keep):
            total -= keep[n].size
            n += 1
        doomed["trimmed"], keep = keep[:n], keep[n:]
    report["scanned"] = scanned
    for why, entries in doomed.items():
        freed = 0
        count = 0
        for e in entries:
            if rules.dry_run or await backend.delete_entry(e):
                count += 1
                freed += e.size
        report[why] = {"entries": count, "bytes": freed}
    report["remaining"] = {"entries": len(keep), "bytes": sum(e.size for e in keep)}
    return report


def run_gc(args: argparse.Namespace) -> int:
    try:
        rules = GcRules(
            max_bytes=None if args.max_bytes is None else parse_bytes(args.max_bytes),
            older_than_s=None if args.older_than is None else parse_duration(args.older_than),
            namespace=None if args.namespace is None else _normalise_namespace(args.namespace),
            model=args.model,
            dry_run=args.dry_run,
        )
        targets = _open_targets(args)
    except (ValueError, LMCacheError) as exc:
        print(f"gc: {exc}", file=sys.stderr)
        return 2

    async def work(t: _Target) -> dict[str, Any]:
        bar = ProgressBar(f"gc {t.name}", _progress_enabled(args))
        try:
            return await gc_tier(t.backend, rules, bar=bar)
        finally:
            bar.close()

    rows = asyncio.run(_each_target(targets, work))
    if wants_json(args):
        print_json({"gc": rows})
    else:
        table = []
        for r in rows:
            cells = [r["tier"], r.get("scanned")]
            for why in ("purged", "expired", "trimmed", "remaining"):
                d = r.get(why)
                cells.append(None if d is None else f"{d['entries']} ({format_bytes(d['bytes'])})")
            cells.append(r.get("error") or r.get("skipped") or ("dry run" if rules.dry_run else ""))
            table.append(cells)
        header = ["tier", "scanned", "purged", "expired", "trimmed", "remaining", "note"]
        print(format_table(table, header))
    return 1 if any("error" in r for r in rows) else 0
