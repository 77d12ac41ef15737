"""The measuring model's training code on a tiny scale (no real training: ``make model``
does that): tokenizer, a few steps, the bar, the cache, save/load round-trip, and the
perplexity arithmetic on cases worked out by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lmcache_core.integrations.vllm import trained_model as tm

TINY = tm.TrainSpec(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    seq_len=32,
    batch_size=2,
    steps=5,
    warmup=2,
    heldout_every=3,
    prompt_tokens=32,
    num_prompts=4,
)


@pytest.fixture(scope="module")
def sources() -> list[tuple[str, str]]:
    # a dozen small standard-library files: some held out by the name hash (1 in 3)
    allf = tm.stdlib_sources()
    small = sorted((s for s in allf if 2_000 < len(s[1]) < 8_000), key=lambda s: s[0])[:12]
    names = [n for n, _ in small]
    assert any(tm._is_heldout(n, TINY.heldout_every) for n in names)
    assert not all(tm._is_heldout(n, TINY.heldout_every) for n in names)
    return small


def test_unigram_perplexity_by_hand() -> None:
    # add-one counts [3, 2] of 5: p(0)=0.6, p(1)=0.4
    assert tm.unigram_perplexity([0, 0, 1], [0, 1], 2) == pytest.approx(1 / math.sqrt(0.24))
    # no training data: uniform over the vocabulary
    assert tm.unigram_perplexity([], [3, 1, 4], 7) == pytest.approx(7)


def test_model_perplexity_uniform_and_fixed() -> None:
    import torch

    torch.manual_seed(0)
    model = tm._llama(TINY)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every next token equally likely
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert tm.model_perplexity(model, prompts) == pytest.approx(TINY.vocab_size, rel=1e-5)

    class Fixed:
        """Logits log(3) for token 0 and 0 for tokens 1, 2 everywhere: p(0) = 3/5."""

        def eval(self) -> None:
            pass

        def __call__(self, ids: torch.Tensor) -> object:
            logits = torch.zeros(1, ids.shape[1], 3)
            logits[..., 0] = math.log(3)
            return type("Out", (), {"logits": logits})()

    # targets 0, 1 (the first token is context only): exp(-(ln 0.6 + ln 0.2) / 2)
    assert tm.model_perplexity(Fixed(), [[2, 0, 1]]) == pytest.approx(1 / math.sqrt(0.12))


def test_train_save_load_and_cache(tmp_path: Path, sources: list[tuple[str, str]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logs: list[str] = []
    dest = tmp_path / "models" / "measure-llama"
    # 5 steps cannot reach a third of the unigram perplexity: loud failure, nothing left
    with pytest.raises(RuntimeError, match="not installing"):
        tm.make_trained_model(dest, TINY, sources, log=logs.append)
    assert not dest.exists() and list(dest.parent.iterdir()) == []

    path, meta = tm.make_trained_model(dest, TINY, sources, log=logs.append, max_ratio=None)
    r = meta["results"]
    assert r["vocab_size"] == TINY.vocab_size and r["parameters"] > 0
    assert math.isfinite(r["heldout_perplexity"]) and r["heldout_perplexity"] > 1
    assert json.loads((path / tm.METADATA).read_text()) == meta

    # round trip: the saved weights and prompts give the training-time perplexity
    prompts = tm.load_prompts(path)
    assert len(prompts) == TINY.num_prompts
    assert all(len(p) == TINY.prompt_tokens for p in prompts)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert tm.model_perplexity(model, prompts) == pytest.approx(r["heldout_perplexity"], rel=1e-5)

    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == TINY.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    texts = json.loads((path / tm.PROMPTS).read_text())["prompts"]
    assert tok.decode(prompts[0]) == texts[0]["text"]
    assert tm._is_heldout(texts[0]["source"], TINY.heldout_every)
    chat = tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], tokenize=False)
    assert chat.startswith("question : def f(x):")

    # the held-out split rebuilt at any window length: the shipped prompts at theirs
    assert tm.heldout_windows(path, TINY.prompt_tokens, TINY.num_prompts, sources) == prompts
    longer = tm.heldout_windows(path, 2 * TINY.prompt_tokens, 2, sources)
    assert len(longer) == 2 and all(len(p) == 2 * TINY.prompt_tokens for p in longer)
    with pytest.raises(ValueError, match="windows of"):
        tm.heldout_windows(path, TINY.prompt_tokens, 10_000, sources)
    with pytest.raises(ValueError, match="other standard-library sources"):
        tm.heldout_windows(path, TINY.prompt_tokens, 1, sources[:-1])

    # cached: the same spec and corpus return at once; a new spec retrains
    logs.clear()
    again, meta2 = tm.make_trained_model(dest, TINY, sources, log=logs.append, max_ratio=None)
    assert again == path and meta2 == meta and logs == [f"{dest}: up to date"]
    other = replace(TINY, steps=4)
    _, meta3 = tm.make_trained_model(dest, other, sources, log=logs.append, max_ratio=None)
    assert meta3["spec"]["steps"] == 4
    # a changed corpus retrains too
    changed = [*sources[:-1], (sources[-1][0], sources[-1][1] + "\n# changed\n")]
    logs.clear()
    _, meta4 = tm.make_trained_model(dest, other, changed, log=logs.append, max_ratio=None)
    assert meta4["corpus"]["digest"] != meta3["corpus"]["digest"]
    assert f"{dest}: up to date" not in logs

    # a retrain that misses the bar keeps the previous model in place
    with pytest.raises(RuntimeError, match="not installing"):
        tm.make_trained_model(dest, replace(other, steps=3), changed, log=logs.append)
    assert json.loads((dest / tm.METADATA).read_text()) == meta4
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]

    # located by the codec benchmark through the models folder
    assert tm.find_trained_model(tmp_path / "models") == path
    assert tm.find_trained_model(tmp_path / "elsewhere") is None


def test_deterministic(tmp_path: Path, sources: list[tuple[str, str]]) -> None:
    a, ma = tm.make_trained_model(tmp_path / "a", TINY, sources, log=lambda _: None, max_ratio=None)
    b, mb = tm.make_trained_model(tmp_path / "b", TINY, sources, log=lambda _: None, max_ratio=None)
    assert ma["results"]["heldout_perplexity"] == mb["results"]["heldout_perplexity"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_prompt_logprob_perplexity_by_hand() -> None:
    from types import SimpleNamespace as NS

    from lmcache_core.integrations.vllm.trained_model_check import prompt_logprob_perplexity

    def out(*logprobs: dict[int, float] | None) -> NS:
        return NS(
            prompt_logprobs=[
                None if d is None else {t: NS(logprob=v) for t, v in d.items()} for d in logprobs
            ]
        )

    # the actual tokens' logprobs count, not the top-ranked ones vLLM also returns
    outs = [
        out(None, {7: math.log(0.5), 8: math.log(0.9)}),
        out(None, {4: math.log(0.25)}, {5: math.log(0.5)}),
    ]
    ppl = prompt_logprob_perplexity(outs, [[1, 7], [1, 4, 5]])
    assert ppl == pytest.approx((0.5 * 0.25 * 0.5) ** (-1 / 3))
    with pytest.raises(ValueError, match="one prompt logprob per prompt token"):
        prompt_logprob_perplexity([out(None)], [[1, 7]])
