"""Check the trained measuring model in vLLM: it loads, generates, and scores its held-out
prompts (prompt logprobs) with the perplexity measured at training time.

Run by ``python -m lmcache_core.integrations.vllm.trained_model --check-vllm`` (one engine
start; take the heavy-jobs lock on a shared machine).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_with_vllm", "prompt_logprob_perplexity"]


def prompt_logprob_perplexity(outputs: Sequence[Any], prompts: Sequence[Sequence[int]]) -> float:
    """Perplexity of every prompt token but the first from vLLM ``RequestOutput`` objects
    generated with ``SamplingParams(prompt_logprobs=0)``."""
    nll, n = 0.0, 0
    for out, ids in zip(outputs, prompts, strict=True):
        scored = out.prompt_logprobs
        if scored is None or len(scored) != len(ids):
            raise ValueError("the request did not return one prompt logprob per prompt token")
        for tok, entry in zip(ids[1:], scored[1:], strict=True):
            nll -= entry[tok].logprob
            n += 1
    return math.exp(nll / n)


def check_with_vllm(path: Path, expected: float, tolerance: float = 0.03) -> float:
    """Start one vLLM engine on the model at ``path``; return its held-out perplexity.

    Raises ``AssertionError`` when it differs from ``expected`` (the training-time figure)
    by more than ``tolerance`` (relative), or when greedy generation produces nothing.
    """
    from .trained_model import load_prompts

    for k, v in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = load_prompts(path)
    t0 = time.monotonic()
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024, seed=0)
    started = time.monotonic() - t0
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        use_tqdm=False,
    )
    ppl = prompt_logprob_perplexity(scored, prompts)
    gen = llm.generate(
        [TokensPrompt(prompt_token_ids=p[:64]) for p in prompts[:3]],
        SamplingParams(max_tokens=32, temperature=0.0),
        use_tqdm=False,
    )
    tok = llm.get_tokenizer()
    for p, out in zip(prompts[:3], gen, strict=True):
        text = out.outputs[0].text
        print(f"--- prompt tail {tok.decode(p[48:64])!r}\n    greedy      {text!r}")
        assert len(out.outputs[0].token_ids) > 0, "vLLM generated nothing"
    rel = abs(ppl - expected) / expected
    print(
        f"vLLM ({started:.0f} s to start): held-out perplexity {ppl:.3f} from prompt logprobs "
        f"over {len(prompts)} prompts; training-time {expected:.3f}; difference {rel:.2%}"
    )
    assert rel <= tolerance, f"vLLM perplexity {ppl:.3f} vs {expected:.3f}: {rel:.2%} apart"
    return ppl
