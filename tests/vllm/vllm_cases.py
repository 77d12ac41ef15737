"""Prompts and settings shared by the vLLM end-to-end tests and their model fixture."""

from __future__ import annotations

import random

VOCAB = 512
CHUNK = 64
BLOCK = 32
MAX_TOKENS = 6
MARGIN = 1e-2  # minimum top-1 vs top-2 logprob gap along every greedy test continuation


def toks(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


LONG = toks(1, 256)  # exactly 4 chunks: a warm run loads 255 tokens (the last is recomputed)
MID = toks(2, 200)  # 3 chunks + 8 tokens: a warm run loads 192
SHORT = toks(3, 40)  # shorter than a chunk: never a hit
ONE = toks(4, 64)  # exactly one chunk: a warm run loads 63
SALTED = toks(5, 150)  # 2 chunks, run with different cache salts
PREFIX = toks(6, 128)
BATCH = [PREFIX + toks(100 + i, 50) for i in range(3)]  # share 2 chunks
ABORT = toks(7, 320)
CORRUPT = toks(8, 192)
LOCAL_EXT = toks(9, 256)
LOCAL_EXT_HEAD = LOCAL_EXT[:128] + toks(10, 60)
CPU_REUSE = toks(11, 192)
EVICT = toks(12, 192)
FILLERS = [toks(20 + i, 192) for i in range(4)]
FILLERS2 = [toks(24 + i, 192) for i in range(4)]
# failure isolation, multi-turn and preemption (test_vllm_isolation_e2e.py)
ISO_A = toks(30, 256)  # a 4-chunk shared prefix
ISO_X = toks(31, 130)
ISO_Y = toks(32, 130)
ISO_Z = toks(35, 20)
TURN1 = toks(33, 170)
TURN2_NEW = toks(34, 20)
PREEMPT = [toks(40 + i, 400) for i in range(4)]
# stale index (test_vllm_stale_e2e.py): 10 prompts of 2 chunks
STALE = [toks(60 + i, 138) for i in range(10)]
# slow tier (test_vllm_slow_e2e.py)
SLOW = [toks(80 + i, 266) for i in range(5)]
DECODER = toks(90, 40)
# LoRA adapters across processes (test_vllm_e2e.py: e1, e2); margins checked per adapter
LORA_P = toks(70, 192)  # exactly 3 chunks: a warm run loads 191
LORA_Q = toks(71, 130)  # 2 chunks + 2 tokens

#: Every prompt whose greedy continuation the tests compare (the fixture checks margins).
COMPARED = [
    LONG,
    MID,
    SHORT,
    ONE,
    SALTED,
    *BATCH,
    ABORT,
    CORRUPT,
    LOCAL_EXT,
    LOCAL_EXT_HEAD,
    CPU_REUSE,
    EVICT,
    ISO_A + ISO_X,
    ISO_A + ISO_Y,
    *SLOW,
]


def expected_hit(n_tokens: int, stored_chunks: int | None = None) -> int:
    """Tokens a warm run loads when ``stored_chunks`` (default: all full) chunks are stored."""
    full = n_tokens // CHUNK if stored_chunks is None else stored_chunks
    hit = full * CHUNK
    return n_tokens - 1 if hit >= n_tokens else hit
