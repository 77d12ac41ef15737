"""Options of the ``gds`` backend (validated by :func:`lmcache_core.config.options.build_options`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lmcache_backend_disk.options import parse_mode

from lmcache_core.config.options import option
from lmcache_core.errors import ConfigError

__all__ = ["GdsOptions", "stripe_roots"]


@dataclass(frozen=True)
class GdsOptions:
    """Options of the ``gds`` backend."""

    path: str | None = option(
        None,
        kind="path",
        doc="Directory of the tier on an NVMe filesystem (created if missing); the disk "
        "tier's layout, so a `disk` backend on the same path reads and writes the same "
        "files. Give this or `paths`.",
    )
    paths: list[Any] = option(  # noqa: RUF009 (a fresh list per instance)
        [],
        kind="list",
        doc="Several directories (one per NVMe mount), striped by key: each key always "
        "lives under the same one. Each directory gets max_bytes / len(paths) and is a "
        "complete disk-layout tier of its own (striped tiers are gds-only).",
    )
    max_bytes: int = option(
        "16GiB",
        kind="bytes",
        minimum=1,
        doc="Bound on the bytes of all objects of the tier (split evenly between `paths`), "
        "whichever process wrote them; least recently used entries are evicted.",
    )
    io_threads: int = option(
        32,
        minimum=1,
        maximum=256,
        doc="I/O threads per directory: file operations in flight (the POSIX path), and "
        "kvikio's thread pool (num_threads) when cuFile is used.",
    )
    io_nice: int = option(
        0,
        minimum=0,
        maximum=19,
        doc="Niceness added to the POSIX I/O threads, as for the disk backend (default 0: the "
        "process's priority; a niced thread holding the GIL stalls the event loop when other "
        "processes load every core).",
    )
    task_size: int = option(
        "4MiB",
        kind="bytes",
        minimum=4096,
        doc="kvikio task size: a device transfer larger than this is split into tasks of "
        "this size run in parallel on kvikio's threads. The POSIX path issues one request "
        "per object (a batch keeps io_threads writes in flight, and its reads two at a time "
        "per directory, as the disk tier's reads_in_flight).",
    )
    force_posix: bool = option(
        False,
        doc="Never use kvikio/cuFile, even when it works: the POSIX O_DIRECT path with "
        "aligned host buffers (device tensors are staged through host memory).",
    )
    mode: str = option(
        "0600",
        doc="Permission bits of object files (octal), as for the disk backend.",
    )
    fsync: bool = option(
        True,
        doc="fdatasync each object and fsync its directory before a put returns (survives "
        "power loss); publication is atomic against process crashes either way.",
    )
    pin_seconds: float = option(
        300.0,
        minimum=0.001,
        maximum=86400.0,
        doc="Lifetime of a pin taken by pin()/pin_many() (lookup leases), as for the disk backend.",
    )

    def __post_init__(self) -> None:
        parse_mode(self.mode)
        stripe_roots(self)


def stripe_roots(opts: GdsOptions) -> list[str]:
    """The absolute directories of the tier: ``[path]`` or ``paths`` (exactly one given,
    no directory twice)."""
    if opts.path is not None and opts.paths:
        raise ConfigError("give either `path` or `paths`, not both", "options.paths")
    if opts.path is not None:
        return [os.path.abspath(opts.path)]
    if not opts.paths:
        raise ConfigError(
            "the tier needs a directory: set `path` (or `paths` to stripe over several)",
            "options.path",
        )
    roots = []
    for i, p in enumerate(opts.paths):
        if not isinstance(p, (str, os.PathLike)) or not os.fspath(p):
            raise ConfigError(f"expected a non-empty path string, got {p!r}", f"options.paths[{i}]")
        root = os.path.abspath(os.path.expanduser(os.fspath(p)))
        if root in roots:
            raise ConfigError(f"{root} is listed twice", f"options.paths[{i}]")
        roots.append(root)
    for i, a in enumerate(roots):
        for b in roots[i + 1 :]:
            if a.startswith(b + os.sep) or b.startswith(a + os.sep):
                raise ConfigError(
                    f"{a} and {b} are nested: stripes must be separate directories",
                    "options.paths",
                )
    return roots
