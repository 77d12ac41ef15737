"""``lmcache-core bench``: measurements that need only this package and its plugins.

``bench codecs`` measures every KV codec (bytes, encode/decode speed against a memory
copy measured in the same run, error): see ``docs/codecs.md``. The measuring code lives
in :mod:`lmcache_core.cli.bench_codecs` and is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def _codecs(args: argparse.Namespace) -> int:
    from .bench_codecs import run

    return run(args)


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands."""
    p = subparsers.add_parser("bench", help="measure codecs (docs/codecs.md)")
    sub = p.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    c = sub.add_parser(
        "codecs",
        help="bytes, encode/decode GB/s (x a memory copy) and error of every KV codec",
        description="Bytes, encode/decode GB/s against a same-run memory copy, and the "
        "error of every KV codec, on KV captured from vLLM (--from-engine) or read from a file.",
    )
    from .bench_args import add_codec_arguments

    add_codec_arguments(c)
    c.set_defaults(func=_codecs)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
