"""Small random-weight Llama-style models made locally (tests and the demo).

Nothing is downloaded: the weights come from a seeded random initialisation and the
tokenizer is a word-level ``tokenizers`` model over a generated vocabulary, saved next to
the weights so ``vllm`` and ``transformers`` load the directory like any hub model.

The output head is scaled up so greedy decoding has clear winners: tests comparing a
cold run with a warm (cache-loaded) run are then not at the mercy of float rounding.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "ModelSpec", "make_local_model", "vocabulary", "words_to_text"]

#: Chat template written into ``tokenizer_config.json`` (chat completions need one). Each
#: message is ``<role word> : <content>``; the role words are in every vocabulary.
CHAT_TEMPLATE = (
    "{% set names = {'system': 'system', 'user': 'question', 'assistant': 'answer'} %}"
    "{% for m in messages %}{{ names.get(m['role'], m['role']) }} : {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}answer :{% endif %}"
)

_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "de",
    "fa",
    "gu",
    "ho",
    "ji",
    "ve",
    "zo",
    "be",
    "ci",
    "du",
    "ek",
    "il",
    "on",
    "ur",
    "ya",
    "we",
]
_WORDS = (
    "the of and to in is was for on that with as by at from it an be are this which or "
    "has had have not but were their its been one all they more can will two first new "
    "would about after other also into only time over such most some than when where "
    "city river model cache memory disk server request token layer answer question "
    "document report system north south east west water stone light paper market "
    "history science music garden winter summer island valley harbor bridge library"
).split()


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a local model (all defaults make a ~1 MB float32 test model)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    seed: int = 0
    head_scale: float = 12.0
    architecture: str = "llama"  # llama, qwen2 or mistral
    sliding_window: int | None = None  # mistral only


def vocabulary(size: int) -> list[str]:
    """The deterministic word list of a model with ``size`` tokens (specials first)."""
    words = list(_SPECIALS)
    seen = set(words)
    for w in _WORDS:
        if len(words) >= size:
            break
        if w not in seen:
            words.append(w)
            seen.add(w)
    i = 0
    while len(words) < size:
        a, b = divmod(i, len(_SYLLABLES))
        w = (
            _SYLLABLES[a % len(_SYLLABLES)]
            + _SYLLABLES[b]
            + ("" if a < len(_SYLLABLES) else str(a))
        )
        i += 1
        if w not in seen:
            words.append(w)
            seen.add(w)
    return words


def words_to_text(rng: random.Random, n_words: int, vocab_size: int) -> str:
    """``n_words`` random (non-special) words joined by spaces."""
    words = vocabulary(vocab_size)[len(_SPECIALS) :]
    return " ".join(rng.choice(words) for _ in range(n_words))


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tf: Any = importlib.import_module("transformers")

    vocab = {w: i for i, w in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))
    _write_chat_template(path)


def _write_chat_template(path: Path) -> None:
    """Put :data:`CHAT_TEMPLATE` into ``tokenizer_config.json`` (where every tokenizer
    loader reads it) and drop a separate ``chat_template.jinja``, which would win."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") == CHAT_TEMPLATE and not (path / "chat_template.jinja").exists():
        return
    cfg["chat_template"] = CHAT_TEMPLATE
    tmp = cfg_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    os.replace(tmp, cfg_path)
    (path / "chat_template.jinja").unlink(missing_ok=True)


def _build(spec: ModelSpec, path: Path) -> None:
    import torch

    tf: Any = importlib.import_module("transformers")

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(spec.seed)
    model: Any
    if spec.architecture == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif spec.architecture == "mistral":
        model = tf.MistralForCausalLM(
            tf.MistralConfig(**common, sliding_window=spec.sliding_window)
        )
    elif spec.architecture == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    else:
        raise ValueError(f"unknown architecture {spec.architecture!r} (llama, qwen2 or mistral)")
    with torch.no_grad():
        # Random init gives nearly flat logits; a larger head separates the top-1 token.
        model.lm_head.weight.mul_(spec.head_scale)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path, spec.vocab_size)
    (path / "lmcache_local_model.json").write_text(json.dumps(asdict(spec), sort_keys=True))


def make_local_model(path: str | os.PathLike[str], spec: ModelSpec | None = None) -> Path:
    """Create the model directory at ``path`` unless it already holds the same spec.

    The directory is built under a temporary name and renamed into place, so an
    interrupted build never leaves a half-written model behind.
    """
    spec = spec or ModelSpec()
    dest = Path(path)
    marker = dest / "lmcache_local_model.json"
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == asdict(spec):
                _write_chat_template(dest)  # directories made before it had one
                return dest
        except ValueError:
            pass
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _build(spec, tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
