"""The arguments of ``lmcache-core bench codecs`` (imports nothing heavy)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_codec_arguments"]


def add_codec_arguments(ap: Any) -> None:
    """The arguments of ``lmcache-core bench codecs``."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--kv", metavar="FILE", help="a safetensors file of KV chunks")
    src.add_argument(
        "--from-engine",
        action="store_true",
        help="capture KV from a vLLM run through the connector (the model: --model)",
    )
    ap.add_argument(
        "--model",
        metavar="PATH",
        help="model folder for --from-engine (default: the trained model of `make model` when "
        "built, else a random-weight demo model, whose quality figures are meaningless); given, "
        "it also measures perplexity and greedy agreement with decoded KV (one engine per codec)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="prompts to capture (default 16)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per random prompt")
    ap.add_argument(
        "--save-kv", metavar="FILE", help="also write the captured KV here (--kv reads it)"
    )
    ap.add_argument(
        "--codec",
        action="append",
        metavar="NAME[:JSON]",
        help='a codec to measure, e.g. int8 or cachegen:{"bits":[6]} (repeatable; default: all '
        "first-party codecs at their settings of docs/codecs.md)",
    )
    ap.add_argument(
        "--quality-prompts",
        type=int,
        default=64,
        help="held-out prompts for perplexity and greedy agreement with decoded KV (with "
        "--model; default 64)",
    )
    ap.add_argument(
        "--quality-prefix-chunks",
        type=int,
        default=2,
        help="chunks of 128 tokens of each quality prompt loaded from the coded tier (default 2)",
    )
    ap.add_argument(
        "--quality-suffix-tokens",
        type=int,
        default=256,
        help="prompt tokens computed on top of the loaded chunks and scored (default 256)",
    )
    ap.add_argument(
        "--gen-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)"
    )
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    ap.add_argument(
        "--sizes-only",
        action="store_true",
        help="bytes and errors only, no timing (deterministic: needs no quiet machine)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
