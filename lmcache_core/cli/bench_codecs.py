"""``lmcache-core bench codecs``: bytes, speed and error of every KV codec on real KV.

KV comes from a safetensors file of chunk tensors (``--kv``; :func:`save_kv_file` writes
one), or is captured from a vLLM run through the connector (``--from-engine``: the
connector stores the prompts' chunks in a raw disk tier, whose objects are then read
back). For each codec: the encoded bytes per chunk and the compression ratio; encode and
decode throughput (GB/s of raw KV) and their ratio to a plain single-threaded memory copy
of the same chunks measured in the same run (medians of interleaved rounds; the copy is
measured twice, and the spread of its two medians is the A/A noise beside every ratio);
and the max / mean absolute error of the decoded KV against the original.

With ``--model`` it also measures answer quality with decoded KV through vLLM
(:mod:`lmcache_core.cli.codec_quality`: held-out perplexity of positions computed on top
of a prefix loaded through each lossy codec, and greedy agreement, against an exact run).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..codecs import KVCodec, codec_label
from ..memory import as_bytes, copy_into

__all__ = [
    "DEFAULT_CODECS",
    "CodecRow",
    "capture_kv_from_engine",
    "format_table",
    "load_kv_file",
    "measure_codecs",
    "save_kv_file",
]

#: Chunk (and vLLM block) size of the quality runs.
QUALITY_CHUNK = 128

#: What ``bench codecs`` measures by default: (registered name, options).
DEFAULT_CODECS: list[tuple[str, dict[str, Any]]] = [
    ("lossless", {"compressor": "blosc2-lz4"}),
    ("lossless", {"compressor": "blosc2-zstd", "level": 1}),
    ("lossless", {"compressor": "zstd", "level": 1}),
    ("lossless", {"compressor": "lz4"}),
    ("int8", {}),
    ("int4", {}),
    ("fp8", {}),
    ("cachegen", {}),
    ("cachegen", {"entropy": "range"}),
    ("cachegen", {"bits": [8, 7, 6]}),
    ("cachegen", {"bits": [6, 5, 4]}),
]


@dataclass
class CodecRow:
    """One codec's measurements."""

    codec: str
    lossless: bool
    chunks: int
    raw_bytes_per_chunk: float
    bytes_per_chunk: float
    ratio: float
    encode_gbps: float
    decode_gbps: float
    encode_vs_copy: float
    decode_vs_copy: float
    copy_gbps: float
    copy_aa_spread: float
    max_abs_error: float
    mean_abs_error: float


# ---------------------------------------------------------------------------- KV sources
def save_kv_file(path: str | os.PathLike[str], chunks: Sequence[torch.Tensor]) -> None:
    """Write chunk tensors to a safetensors file (``chunk_00000``, ...)."""
    from safetensors.torch import save_file

    save_file({f"chunk_{i:05d}": c.contiguous() for i, c in enumerate(chunks)}, str(path))


def load_kv_file(path: str | os.PathLike[str]) -> list[torch.Tensor]:
    """The chunk tensors of a safetensors file, in name order."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    if not data:
        raise ValueError(f"{path}: no tensors")
    return [data[k] for k in sorted(data)]


def read_tier_chunks(root: str | os.PathLike[str], limit: int = 0) -> list[torch.Tensor]:
    """Every raw chunk stored under a disk tier's directory (objects verified on read)."""
    from .. import format as fmt
    from ..errors import FormatError

    out: list[torch.Tensor] = []
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = Path(dirpath, name)
            try:
                raw = path.read_bytes()
                header, tensor = fmt.decode(raw)
            except (OSError, FormatError):
                continue  # the tier's index and temporary files
            if header.codec == "raw":
                out.append(tensor)
            if limit and len(out) >= limit:
                return out
    return out


def capture_kv_from_engine(
    model: str, prompts: Sequence[Sequence[int]], workdir: str | os.PathLike[str]
) -> list[torch.Tensor]:
    """Run vLLM (CPU, float32) on ``prompts`` with the connector storing into a raw disk
    tier under ``workdir``; return the stored chunks (real KV, as the connector saves it).

    Runs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    root = Path(workdir) / "capture-tier"
    storage = {"tiers": [{"name": "disk", "backend": "disk", "options": {"path": str(root)}}]}
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=2048,
        kv_transfer_config={
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": storage},
        },
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
    _wait_stable(root)  # the stores run in the background
    llm.llm_engine.engine_core.shutdown()
    del llm
    chunks = read_tier_chunks(root)
    if not chunks:
        raise RuntimeError("the engine stored no chunks (prompts shorter than one chunk?)")
    return chunks


# ---------------------------------------------------------------------------- measuring
def _samples(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def measure_codecs(
    chunks: Sequence[torch.Tensor],
    codecs: Sequence[KVCodec],
    rounds: int = 7,
) -> list[CodecRow]:
    """Measure each codec on ``chunks`` (see the module docstring). Single-threaded torch,
    as on a tier's I/O threads."""
    chunks = [c.contiguous() for c in chunks]
    raw = sum(c.nbytes for c in chunks)
    outs = [torch.empty_like(c) for c in chunks]
    copies = [torch.empty(c.nbytes, dtype=torch.uint8) for c in chunks]

    def copy_all() -> None:
        for c, dst in zip(chunks, copies, strict=True):
            copy_into(dst, as_bytes(c))

    rows: list[CodecRow] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for codec in codecs:
            encoded = [bytes(codec.encode(c)) for c in chunks]

            def enc(codec: KVCodec = codec) -> None:
                for c in chunks:
                    codec.encode(c)

            def dec(codec: KVCodec = codec, encoded: list[bytes] = encoded) -> None:
                for b, o in zip(encoded, outs, strict=True):
                    codec.decode_into(b, o)

            if rounds > 0:
                fns: dict[str, Callable[[], object]] = {
                    "copy": copy_all,
                    "encode": enc,
                    "copy_aa": copy_all,
                    "decode": dec,
                }
                med = {k: statistics.median(v) for k, v in _samples(fns, rounds).items()}
            else:  # sizes and errors only (deterministic: no timing)
                dec()
                med = dict.fromkeys(("copy", "encode", "copy_aa", "decode"), math.nan)
            errs = [(o.double() - c.double()).abs() for o, c in zip(outs, chunks, strict=True)]
            max_err = max(float(e.max()) for e in errs if e.numel()) if raw else 0.0
            mean_err = sum(float(e.sum()) for e in errs) / max(1, sum(e.numel() for e in errs))
            nbytes = sum(len(b) for b in encoded)
            copy_t = statistics.median([med["copy"], med["copy_aa"]])
            rows.append(
                CodecRow(
                    codec=codec_label(codec.name, codec.options()),
                    lossless=codec.lossless,
                    chunks=len(chunks),
                    raw_bytes_per_chunk=raw / len(chunks),
                    bytes_per_chunk=nbytes / len(chunks),
                    ratio=raw / nbytes,
                    encode_gbps=raw / med["encode"] / 1e9,
                    decode_gbps=raw / med["decode"] / 1e9,
                    encode_vs_copy=copy_t / med["encode"],
                    decode_vs_copy=copy_t / med["decode"],
                    copy_gbps=raw / copy_t / 1e9,
                    copy_aa_spread=max(med["copy"], med["copy_aa"])
                    / min(med["copy"], med["copy_aa"])
                    if rounds > 0
                    else math.nan,
                    max_abs_error=max_err,
                    mean_abs_error=mean_err,
                )
            )
    finally:
        torch.set_num_threads(threads)
    return rows


def format_table(rows: Sequence[CodecRow]) -> str:
    """A Markdown table of ``rows``."""
    head = (
        "| codec | bytes/chunk | ratio | encode GB/s (x copy) | decode GB/s (x copy) | "
        "copy A/A | max abs err | mean abs err |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        if math.isnan(r.encode_gbps):
            lines.append(
                f"| `{r.codec}` | {r.bytes_per_chunk:,.0f} | {r.ratio:.2f}x | - | - | - | "
                f"{r.max_abs_error:.3g} | {r.mean_abs_error:.3g} |"
            )
            continue
        lines.append(
            f"| `{r.codec}` | {r.bytes_per_chunk:,.0f} | {r.ratio:.2f}x | "
            f"{r.encode_gbps:.2f} ({r.encode_vs_copy:.3f}x) | {r.decode_gbps:.2f} "
            f"({r.decode_vs_copy:.3f}x) | {r.copy_aa_spread:.2f}x | {r.max_abs_error:.3g} | "
            f"{r.mean_abs_error:.3g} |"
        )
    return "\n".join(lines)


def rows_json(rows: Sequence[CodecRow]) -> str:
    """``rows`` as JSON."""
    return json.dumps([asdict(r) for r in rows], indent=1)


# ---------------------------------------------------------------------------- helpers
def _wait_stable(root: Path, settle_s: float = 1.0, timeout_s: float = 60.0) -> int:
    """Wait until the number of files under ``root`` stops changing; return it."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(len(f) for _, _, f in os.walk(root)) if root.exists() else 0
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.1)
    return last


# ---------------------------------------------------------------------------- command
def _parse_codec(text: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:{json options}``."""
    name, sep, rest = text.partition(":")
    if not sep:
        return name, {}
    opts = json.loads(rest)
    if not isinstance(opts, dict):
        raise ValueError(f"codec options must be a JSON object: {text!r}")
    return name, opts


def default_model() -> tuple[str, bool]:
    """``(path, trained)``: the trained measuring model when it is built (``make model``),
    else a random-weight demo model made in a temporary folder."""
    try:
        from ..integrations.vllm import trained_model

        found = trained_model.find_trained_model()
        if found is not None:
            return str(found), True
    except (ImportError, AttributeError):
        pass
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        cand = root / ".models" / "measure-llama"
        if (cand / "config.json").is_file():
            return str(cand), True
    import tempfile

    from ..integrations.vllm.local_model import make_local_model

    return str(make_local_model(Path(tempfile.mkdtemp()) / "demo")), False


def _prompts_for(model: str, n: int, tokens: int) -> list[list[int]]:
    """The model's held-out prompts when it has them, else seeded random ones."""
    held = Path(model) / "heldout_prompts.json"
    if held.is_file():
        doc = json.loads(held.read_text())
        prompts = [list(p["token_ids"]) for p in doc.get("prompts", [])]
        if prompts:
            return prompts[:n]
    cfg = json.loads((Path(model) / "config.json").read_text())
    import random

    rng = random.Random(0)
    return [[rng.randrange(4, int(cfg["vocab_size"])) for _ in range(tokens)] for _ in range(n)]


def run(args: Any) -> int:
    """Run ``lmcache-core bench codecs``; returns the exit status."""
    import sys
    import tempfile

    from ..plugins.codec_registry import get_codec_registry

    if args.from_engine:
        model, trained = (args.model, True) if args.model else default_model()
        if not trained:
            print(
                "warning: the trained measuring model is not built (make model): measuring on a "
                "random-weight demo model; sizes and speeds hold, quality figures are meaningless",
                file=sys.stderr,
            )
        with tempfile.TemporaryDirectory() as tmp:
            chunks = capture_kv_from_engine(
                model, _prompts_for(model, args.prompts, args.tokens), tmp
            )
        source = f"{len(chunks)} chunks captured from vLLM ({model})"
        if args.save_kv:
            save_kv_file(args.save_kv, chunks)
    else:
        chunks = load_kv_file(args.kv)
        source = f"{len(chunks)} chunks from {args.kv}"
    reg = get_codec_registry()
    specs = [_parse_codec(t) for t in args.codec] if args.codec else DEFAULT_CODECS
    codecs = [reg.create(name, opts) for name, opts in specs]
    rows = measure_codecs(chunks, codecs, rounds=0 if args.sizes_only else args.rounds)
    want_quality = bool(args.from_engine and args.model)
    if not args.json:
        first = chunks[0]
        print(f"# {source}: {first.dtype}, shape {list(first.shape)}, {first.nbytes:,} bytes each")
        if args.sizes_only:
            print("# sizes and errors only (--sizes-only): no timing")
        else:
            copy = statistics.median(r.copy_gbps for r in rows)
            print(
                f"# a plain memory copy of the same chunks ran at {copy:.2f} GB/s "
                f"(medians of {args.rounds} interleaved rounds; copy A/A beside each row)"
            )
        print(format_table(rows), flush=True)  # before the (long) quality runs
    quality: list[dict[str, Any]] = []
    if want_quality:
        from .codec_quality import format_quality, measure_quality, quality_prompts

        lossy = [
            (c.name, c.options()) for c in codecs if not c.lossless
        ]  # the codec's own options: the labels match the table's rows
        prefix = args.quality_prefix_chunks * QUALITY_CHUNK
        with tempfile.TemporaryDirectory() as tmp:
            quality, _ = measure_quality(
                args.model,
                quality_prompts(
                    args.model, args.quality_prompts, prefix + args.quality_suffix_tokens
                ),
                lossy,
                tmp,
                prefix_tokens=prefix,
                chunk=QUALITY_CHUNK,
                gen_tokens=args.gen_tokens,
            )
    if args.json:
        print(json.dumps({"codecs": [asdict(r) for r in rows], "quality": quality}, indent=1))
        return 0
    if quality:
        print(
            f"\n# quality with decoded KV: {quality[0]['prompts']} held-out prompts of "
            f"{quality[0]['prompt_tokens']:.0f} tokens; the first {prefix} ({args.quality_prefix_chunks} "
            f"chunks of {QUALITY_CHUNK}) loaded from a disk tier through the codec, the rest "
            f"computed on top; perplexity over the {quality[0]['scored_positions']} computed "
            "positions every run scored (change vs exact: 95% bootstrap interval over prompts); "
            "greedy agreement = share of generated tokens before the first difference from exact"
        )
        errors = {r.codec: (r.max_abs_error, r.mean_abs_error) for r in rows}
        print(format_quality(quality, args.gen_tokens, errors))
    return 0
