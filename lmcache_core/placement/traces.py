"""Request traces: the JSON-lines formats the simulator reads, and the four generators.

One request per line. lmcache-core's own form::

    {"arrival": 12.5, "groups": [3, 17, 17001], "output_length": 128}
    {"arrival": 12.9, "tokens": [101, 2023, ...], "output_length": 64}

``groups`` are prefix-group ids, one per chunk of ``chunk_tokens`` tokens (two requests
share a prefix as far as their lists agree); ``tokens`` are token ids, cut into chunks of
``chunk_tokens``. An optional ``input_length`` trims the last group's tokens.

The Mooncake trace's published form (kvcache-ai/Mooncake, FAST'25 release) is read too::

    {"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}

with ``timestamp`` in milliseconds and one ``hash_ids`` entry per block of
``block_tokens`` (512 in the published traces) tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "FAMILIES",
    "Request",
    "TraceError",
    "generate",
    "mix_trace",
    "multi_turn_trace",
    "rag_trace",
    "read_trace",
    "system_prompt_trace",
    "write_trace",
    "zipf_sampler",
]


class TraceError(ValueError):
    """A trace line that cannot be read; says which line and why."""


@dataclass
class Request:
    """One request: arrival (s), its chunks' group ids, tokens per chunk, output length."""

    arrival: float
    groups: list[int]
    chunk_tokens: list[int]
    output_length: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.chunk_tokens)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "arrival": round(self.arrival, 6),
            "groups": self.groups,
            "output_length": self.output_length,
        }
        out["input_length"] = self.prompt_tokens
        return out


def _int_list(obj: dict[str, Any], name: str, where: str) -> list[int]:
    value = obj[name]
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TraceError(f"{where}: {name!r} must be a list of integers")
    return value


def _parse(obj: Any, where: str, chunk_tokens: int, block_tokens: int) -> Request:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    out_len = obj.get("output_length", 0)
    if not isinstance(out_len, int) or out_len < 0:
        raise TraceError(f"{where}: 'output_length' must be a non-negative integer")
    if "hash_ids" in obj:  # Mooncake
        ts = obj.get("timestamp", 0)
        if not isinstance(ts, (int, float)):
            raise TraceError(f"{where}: 'timestamp' must be a number (milliseconds)")
        groups = _int_list(obj, "hash_ids", where)
        arrival, size = float(ts) / 1000.0, block_tokens
    elif "groups" in obj or "tokens" in obj:
        arr = obj.get("arrival", 0.0)
        if not isinstance(arr, (int, float)):
            raise TraceError(f"{where}: 'arrival' must be a number (seconds)")
        arrival, size = float(arr), chunk_tokens
        if "groups" in obj:
            groups = _int_list(obj, "groups", where)
        else:
            tokens = _int_list(obj, "tokens", where)
            # A chunk of token ids is its own group: identified by its content.
            groups = [hash(tuple(tokens[i : i + size])) for i in range(0, len(tokens), size)]
            lengths = [min(size, len(tokens) - i) for i in range(0, len(tokens), size)]
            return Request(arrival, groups, lengths, out_len)
    else:
        raise TraceError(f"{where}: needs 'groups', 'tokens' or 'hash_ids'")
    lengths = [size] * len(groups)
    in_len = obj.get("input_length")
    if isinstance(in_len, int) and groups and 0 < in_len < size * len(groups):
        full = in_len // size
        groups, lengths = groups[: full + (1 if in_len % size else 0)], lengths[:full]
        if in_len % size:
            lengths.append(in_len % size)
    return Request(arrival, groups, lengths, out_len)


def read_trace(
    source: str | Path | TextIO, chunk_tokens: int = 256, block_tokens: int = 512
) -> list[Request]:
    """Every request of a JSON-lines trace (blank lines skipped), sorted by arrival."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as f:
            return read_trace(f, chunk_tokens, block_tokens)
    name = getattr(source, "name", "<trace>")
    out = []
    for n, line in enumerate(source, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{name}:{n}: not JSON: {exc.msg}") from None
        out.append(_parse(obj, f"{name}:{n}", chunk_tokens, block_tokens))
    out.sort(key=lambda r: r.arrival)
    return out


def write_trace(requests: Iterable[Request], dest: TextIO) -> None:
    """Write requests in lmcache-core's own JSON-lines form."""
    for r in requests:
        dest.write(json.dumps(r.to_json()) + "\n")


# ---------------------------------------------------------------------------- generators
def zipf_sampler(n: int, alpha: float, rng: random.Random) -> Iterator[int]:
    """Endless ranks in ``[0, n)`` with P(rank k) proportional to ``1/(k+1)**alpha``."""
    weights = [1.0 / (k + 1) ** alpha for k in range(n)]
    ranks = list(range(n))
    while True:
        yield from rng.choices(ranks, weights, k=1024)


class _Ids:
    """Fresh group ids: one namespace per generator so families never collide."""

    def __init__(self, base: int) -> None:
        self.next = base

    def take(self, n: int = 1) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _arrivals(rng: random.Random, rate: float) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def system_prompt_trace(
    n_requests: int = 4000,
    seed: int = 0,
    n_prompts: int = 20,
    alpha: float = 1.0,
    chunk_tokens: int = 256,
) -> list[Request]:
    """Shared system prompts (``n_prompts``, 2-16 chunks each) chosen Zipf(``alpha``),
    each followed by a unique 1-2 chunk user message."""
    rng = random.Random(seed)
    ids = _Ids(1 << 40)
    prompts = [ids.take(rng.randint(2, 16)) for _ in range(n_prompts)]
    pick = zipf_sampler(n_prompts, alpha, rng)
    return _zipf_requests(
        rng,
        n_requests,
        pick,
        _arrivals(rng, rate=4.0),
        lambda p: prompts[p] + ids.take(rng.randint(1, 2)),
        chunk_tokens,
        ("system", "prompt"),
    )


def _zipf_requests(
    rng: random.Random,
    n_requests: int,
    pick: Iterator[int],
    at: Iterator[float],
    groups_of: Callable[[int], list[int]],
    chunk_tokens: int,
    label: tuple[str, str],
) -> list[Request]:
    """``n_requests`` requests, each for the item ``pick`` draws: its chunk groups from
    ``groups_of``, the next arrival, a 32-256 token answer, meta ``{family: ..., key: i}``
    (``label`` = (family, key)). The draws happen in that order, for reproducible traces."""
    family, meta_key = label
    out = []
    for _ in range(n_requests):
        i = next(pick)
        groups = groups_of(i)
        out.append(
            Request(
                next(at),
                groups,
                [chunk_tokens] * len(groups),
                rng.randint(32, 256),
                {"family": family, meta_key: i},
            )
        )
    return out


def rag_trace(
    n_requests: int = 6000,
    seed: int = 0,
    n_docs: int = 1000,
    alpha: float = 0.8,
    chunk_tokens: int = 256,
) -> list[Request]:
    """RAG: one shared 2-chunk instruction, one of ``n_docs`` documents (2-8 chunks)
    chosen Zipf(``alpha``), then a unique 1-chunk question."""
    rng = random.Random(seed)
    ids = _Ids(2 << 40)
    instruction = ids.take(2)
    docs = [ids.take(rng.randint(2, 8)) for _ in range(n_docs)]
    pick = zipf_sampler(n_docs, alpha, rng)
    return _zipf_requests(
        rng,
        n_requests,
        pick,
        _arrivals(rng, rate=8.0),
        lambda d: instruction + docs[d] + ids.take(1),
        chunk_tokens,
        ("rag", "doc"),
    )


def multi_turn_trace(
    seed: int = 0,
    n_sessions: int = 200,
    turns: int = 5,
    chunk_tokens: int = 256,
) -> list[Request]:
    """Multi-turn chats: ``n_sessions`` sessions of ``turns`` turns; each session starts
    with one of 4 shared 2-chunk system prompts and each turn re-sends the conversation
    so far plus the previous answer (1 chunk) and a new user message (1-3 chunks).
    Sessions start over 10 minutes; turns follow 5-60 s apart, so sessions interleave."""
    rng = random.Random(seed)
    ids = _Ids(3 << 40)
    systems = [ids.take(2) for _ in range(4)]
    out = []
    for s in range(n_sessions):
        t = rng.uniform(0.0, 600.0)
        history = list(systems[rng.randrange(4)])
        for turn in range(turns):
            if turn > 0:
                history += ids.take(1)  # the previous answer
                t += rng.uniform(5.0, 60.0)
            history += ids.take(rng.randint(1, 3))
            out.append(
                Request(
                    t,
                    list(history),
                    [chunk_tokens] * len(history),
                    chunk_tokens,
                    {"family": "multi-turn", "session": s, "turn": turn},
                )
            )
    out.sort(key=lambda r: r.arrival)
    return out


def mix_trace(
    n_requests: int = 6000,
    seed: int = 0,
    scan_fraction: float = 0.2,
    chunk_tokens: int = 256,
) -> list[Request]:
    """A mix: system-prompt and RAG (alpha = 1.0) requests in equal parts, with
    ``scan_fraction`` of all requests one-off scans (16 unique chunks each)."""
    rng = random.Random(seed)
    n_scan = round(n_requests * scan_fraction)
    n_rest = n_requests - n_scan
    sys_part = system_prompt_trace(n_rest // 2, seed + 1, chunk_tokens=chunk_tokens)
    rag_part = rag_trace(n_rest - n_rest // 2, seed + 2, alpha=1.0, chunk_tokens=chunk_tokens)
    reused = sys_part + rag_part
    rng.shuffle(reused)
    ids = _Ids(4 << 40)
    scans = [
        Request(0.0, ids.take(16), [chunk_tokens] * 16, 64, {"family": "scan"})
        for _ in range(n_scan)
    ]
    order = reused + scans
    rng.shuffle(order)
    at = _arrivals(rng, rate=8.0)
    for r in order:
        r.arrival = next(at)
    return order


#: Family name -> generator with the issue's fixed parameters (``seed`` varies).
FAMILIES: dict[str, Any] = {
    "system": lambda seed=0: system_prompt_trace(seed=seed, alpha=1.0),
    "rag-a0.8": lambda seed=0: rag_trace(seed=seed, alpha=0.8),
    "rag-a1.2": lambda seed=0: rag_trace(seed=seed, alpha=1.2),
    "multi-turn": lambda seed=0: multi_turn_trace(seed=seed),
    "mix": lambda seed=0: mix_trace(seed=seed),
}


def generate(family: str, seed: int = 0) -> list[Request]:
    """The trace of one family (a key of :data:`FAMILIES`)."""
    try:
        gen = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown trace family {family!r}; known: {', '.join(FAMILIES)}") from None
    return list(gen(seed))
