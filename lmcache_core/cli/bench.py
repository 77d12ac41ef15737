"""``lmcache-core bench``: measurements that need only this package and its plugins.

``bench codecs`` measures every KV codec (bytes, encode/decode speed against a memory
copy measured in the same run, error): see ``docs/codecs.md``. The measuring code lives
in :mod:`lmcache_core.cli.bench_codecs` and is imported only when the command runs.
``bench rag`` runs RAG prompts on vLLM with and without the connector and compares the
placement policies at cpu tier sizes below the working set with the simulator's
prediction (:mod:`lmcache_core.cli.bench_rag`, ``docs/placement.md``).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def _codecs(args: argparse.Namespace) -> int:
    from .bench_codecs import run

    return run(args)


def _rag(args: argparse.Namespace) -> int:
    from .bench_rag import run

    return run(args)


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands."""
    p = subparsers.add_parser(
        "bench", help="measure codecs (docs/codecs.md), the RAG experiment (docs/placement.md)"
    )
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
    r = sub.add_parser(
        "rag",
        help="RAG prompts on vLLM with and without the connector; placement policies at "
        "cpu tier sizes below the working set, beside the simulator's prediction",
        description="RAG prompts on vLLM (CPU) with and without the connector, then per "
        "cpu tier size below the working set and placement policy: prefill tokens saved "
        "(the engine's own count) beside the simulator's prediction (docs/placement.md).",
    )
    from .bench_rag import add_rag_arguments

    add_rag_arguments(r)
    r.set_defaults(func=_rag)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
