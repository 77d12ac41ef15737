"""The measuring model: a small Llama trained locally, so KV values mean something.

The random-weight demo model (:mod:`.local_model`) measures speed; lossy KV codecs also
need quality (perplexity, greedy agreement), which only a trained model gives. This module
trains one on text every machine has offline — the Python standard library's own sources
(``Lib/*.py`` of the base interpreter: code, comments and docstrings) — with a byte-level
BPE tokenizer trained by ``tokenizers`` and plain torch (AdamW, fixed seed, 2 threads).

Files are split by a hash of their name: about one in ten is held out. The held-out split
gives a fixed prompt set (``heldout_prompts.json``, token ids and text) used both for the
perplexity reported here and by the codec benchmark. Training refuses to install a model
whose held-out perplexity is above a third of a unigram model fitted on the training split.

``make model`` builds it into ``.models/measure-llama`` (a no-op when up to date); the codec
benchmark finds it with :func:`find_trained_model` and reads the prompts with
:func:`load_prompts`. ``make test`` never trains it (tests use the random demo model).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .local_model import llama_shape

__all__ = [
    "METADATA",
    "PROMPTS",
    "TrainSpec",
    "find_trained_model",
    "heldout_windows",
    "load_prompts",
    "main",
    "make_trained_model",
    "model_perplexity",
    "stdlib_sources",
    "unigram_perplexity",
]

#: Bumped when training changes in a way the spec does not show (cached models retrain).
TRAINING_VERSION = 1
#: The file in a trained model's directory holding its spec, corpus digest and results.
METADATA = "lmcache_trained_model.json"
#: The held-out prompt set written next to the model.
PROMPTS = "heldout_prompts.json"
#: Where ``make model`` puts it, relative to the repository root.
DEFAULT_DIR = Path(".models") / "measure-llama"
#: The trained model must reach at most this fraction of the unigram perplexity.
MAX_RATIO = 1 / 3

_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclass(frozen=True)
class TrainSpec:
    """Everything that decides the trained model (the cache key, with the corpus digest)."""

    vocab_size: int = 2048
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6  # head size 32, as the demo model's
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 600
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    heldout_every: int = 10  # a file is held out when hash(name) % heldout_every == 0
    prompt_tokens: int = 256
    num_prompts: int = 64


def stdlib_sources(lib: str | os.PathLike[str] | None = None) -> list[tuple[str, str]]:
    """``(file name, text)`` of the base interpreter's ``Lib/*.py``, sorted by name."""
    root = Path(lib) if lib is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files in {root} (the standard library sources)")
    return [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def _is_heldout(name: str, every: int) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % every == 0


def _digest(sources: Sequence[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in sources:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with the demo model's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return tok


def save_tokenizer(tok: Any, path: Path) -> None:
    """Save as a ``PreTrainedTokenizerFast`` with the demo model's chat template."""
    from .local_model import _write_chat_template

    tf: Any = importlib.import_module("transformers")
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))
    _write_chat_template(path)


def unigram_perplexity(train_ids: Sequence[int], targets: Sequence[int], vocab_size: int) -> float:
    """Perplexity on ``targets`` of token frequencies in ``train_ids`` (add-one smoothed)."""
    counts = [1] * vocab_size
    for t in train_ids:
        counts[t] += 1
    total = sum(counts)
    nll = -sum(math.log(counts[t] / total) for t in targets)
    return math.exp(nll / len(targets))


def model_perplexity(model: Any, prompts: Sequence[Sequence[int]]) -> float:
    """Perplexity of every prompt token but the first, each prompt scored on its own
    (as vLLM's prompt logprobs score it)."""
    import torch

    nll, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            n += len(p) - 1
    return math.exp(nll / n)


def _llama(spec: TrainSpec) -> Any:
    tf: Any = importlib.import_module("transformers")
    cfg = tf.LlamaConfig(**llama_shape(spec))
    return tf.LlamaForCausalLM(cfg)


def _heldout_prompts(
    tok: Any, heldout: Sequence[tuple[str, str]], spec: TrainSpec
) -> list[dict[str, Any]]:
    """``num_prompts`` windows of ``prompt_tokens`` tokens, each inside one held-out file,
    spread evenly over all such windows."""
    windows: list[tuple[str, list[int]]] = []
    for name, text in heldout:
        ids = tok.encode(text).ids
        for s in range(0, len(ids) - spec.prompt_tokens + 1, spec.prompt_tokens):
            windows.append((name, ids[s : s + spec.prompt_tokens]))
    if len(windows) < spec.num_prompts:
        raise ValueError(f"held-out split has {len(windows)} windows, {spec.num_prompts} needed")
    step = len(windows) / spec.num_prompts
    picked = [windows[int(i * step)] for i in range(spec.num_prompts)]
    return [
        {"source": name, "token_ids": ids, "text": tok.decode(ids, skip_special_tokens=False)}
        for name, ids in picked
    ]


def _train(
    spec: TrainSpec,
    sources: Sequence[tuple[str, str]],
    out: Path,
    log: Callable[[str], None],
    max_ratio: float | None,
) -> dict[str, Any]:
    """Train tokenizer and model into ``out``; return the measured results."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    torch.manual_seed(spec.seed)
    t_start = time.monotonic()
    train = [s for s in sources if not _is_heldout(s[0], spec.heldout_every)]
    heldout = [s for s in sources if _is_heldout(s[0], spec.heldout_every)]
    tok = train_tokenizer((text for _, text in train), spec.vocab_size)
    if tok.get_vocab_size() != spec.vocab_size:
        raise ValueError(f"tokenizer reached {tok.get_vocab_size()} tokens, not {spec.vocab_size}")
    stream: list[int] = []
    for _, text in train:
        stream.extend(tok.encode(text).ids)
        stream.append(2)  # </s> between files
    data = torch.tensor(stream, dtype=torch.long)
    prompts = _heldout_prompts(tok, heldout, spec)
    log(
        f"corpus: {len(train)} training files ({len(stream)} tokens), {len(heldout)} held out; "
        f"tokenizer {time.monotonic() - t_start:.1f} s"
    )

    model = _llama(spec)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < spec.warmup:
            return spec.lr * (step + 1) / spec.warmup
        frac = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(spec.seed)
    t_train = time.monotonic()
    model.train()
    for step in range(spec.steps):
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + spec.seq_len + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1]).logits
        loss: Any = F.cross_entropy(logits.reshape(-1, spec.vocab_size), batch[:, 1:].reshape(-1))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == spec.steps - 1:
            log(f"step {step:5d}  loss {loss.item():.3f}  {time.monotonic() - t_train:6.1f} s")
    train_seconds = time.monotonic() - t_train
    cpu = resource.getrusage(resource.RUSAGE_SELF)

    prompt_ids = [p["token_ids"] for p in prompts]
    ppl = model_perplexity(model, prompt_ids)
    uni = unigram_perplexity(stream, [t for p in prompt_ids for t in p[1:]], spec.vocab_size)
    results = {
        "heldout_perplexity": ppl,
        "unigram_perplexity": uni,
        "ratio": ppl / uni,
        "train_seconds": train_seconds,
        "total_seconds": time.monotonic() - t_start,
        "parameters": params,
        "vocab_size": spec.vocab_size,
        "train_tokens": len(stream),
        "tokens_seen": spec.steps * spec.batch_size * spec.seq_len,
        "heldout_targets": sum(len(p) - 1 for p in prompt_ids),
        "torch_threads": torch.get_num_threads(),
        "cpu_seconds": cpu.ru_utime + cpu.ru_stime,  # whole process, tokenizer included
    }
    log(
        f"held-out perplexity {ppl:.2f} vs unigram {uni:.2f} (ratio {ppl / uni:.3f}); "
        f"{params / 1e6:.2f} M parameters, vocab {spec.vocab_size}, "
        f"training {train_seconds:.0f} s wall, process CPU {cpu.ru_utime + cpu.ru_stime:.0f} s"
    )
    if max_ratio is not None and ppl > max_ratio * uni:
        raise RuntimeError(
            f"trained model's held-out perplexity {ppl:.2f} is above {max_ratio:.3f} x the "
            f"unigram perplexity {uni:.2f}: not installing it"
        )
    model.config.dtype = "float32"
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tok, out)
    (out / PROMPTS).write_text(
        json.dumps({"prompt_tokens": spec.prompt_tokens, "prompts": prompts}, indent=1)
    )
    return results


def _expected_key(spec: TrainSpec, sources: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {
        "version": TRAINING_VERSION,
        "spec": asdict(spec),
        "corpus": {"digest": _digest(sources), "files": len(sources)},
    }


def _read_metadata(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def make_trained_model(
    path: str | os.PathLike[str],
    spec: TrainSpec | None = None,
    sources: Sequence[tuple[str, str]] | None = None,
    log: Callable[[str], None] = print,
    max_ratio: float | None = MAX_RATIO,
) -> tuple[Path, dict[str, Any]]:
    """Train the model into ``path`` unless it already holds this spec and corpus.

    Returns the directory and its metadata (spec, corpus digest, measured results). Built
    under a temporary name and renamed into place: an interrupted or failed training
    leaves no partial model (a stale one stays until its successor is ready). Raises
    ``RuntimeError`` when the model's held-out perplexity is above ``max_ratio`` times
    the unigram's (``None``: no bar, for tests).
    """
    spec = spec or TrainSpec()
    sources = stdlib_sources() if sources is None else sources
    dest = Path(path)
    key = _expected_key(spec, sources)
    meta = _read_metadata(dest)
    if meta is not None and all(meta.get(k) == v for k, v in key.items()):
        log(f"{dest}: up to date")
        return dest, meta
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        results = _train(spec, sources, tmp, log, max_ratio)
        meta = {**key, "results": results}
        (tmp / METADATA).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if dest.exists():  # the stale model goes only once its successor is ready
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest, meta


def _repo_models_dir() -> Path:
    return Path(__file__).resolve().parents[3] / ".models"


def find_trained_model(models_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The trained model's directory, or ``None`` when ``make model`` has not built it.

    Looks in ``models_dir`` (default: ``$LMCACHE_CORE_MODELS_DIR``, else the checkout's
    ``.models``). Does not check that it is up to date (that reads the corpus; ``make
    model`` does it).
    """
    root = Path(models_dir or os.environ.get("LMCACHE_CORE_MODELS_DIR") or _repo_models_dir())
    path = root / DEFAULT_DIR.name
    meta = _read_metadata(path)
    if meta is None or "results" not in meta or not (path / PROMPTS).exists():
        return None
    return path


def load_prompts(model_dir: str | os.PathLike[str]) -> list[list[int]]:
    """The held-out prompts (token ids) shipped with a trained model."""
    data = json.loads((Path(model_dir) / PROMPTS).read_text())
    return [list(p["token_ids"]) for p in data["prompts"]]


def heldout_windows(
    model_dir: str | os.PathLike[str],
    tokens: int,
    count: int,
    sources: Sequence[tuple[str, str]] | None = None,
) -> list[list[int]]:
    """``count`` windows of ``tokens`` token ids from the trained model's held-out split,
    each inside one held-out file, spread evenly over all such windows (as the shipped
    prompts are, at any length: the codec benchmark needs prompts longer than the part
    it loads from a tier).

    Tokenized with the model's own tokenizer; the held-out files are the standard
    library's, split as at training. Raises ``ValueError`` when the sources are not the
    ones the model was trained on (another Python: the split would differ) or when the
    held-out split has fewer windows than ``count``.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir)
    meta = _read_metadata(path)
    if meta is None or "spec" not in meta:
        raise ValueError(f"{path}: not a trained measuring model (no {METADATA})")
    every = int(meta["spec"].get("heldout_every", TrainSpec.heldout_every))
    sources = stdlib_sources() if sources is None else sources
    digest = meta.get("corpus", {}).get("digest")
    if digest is not None and digest != _digest(sources):
        raise ValueError(
            f"{path} was trained on other standard-library sources than this Python's "
            "(its held-out split cannot be rebuilt here): run make model"
        )
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    windows: list[list[int]] = []
    for name, text in sources:
        if not _is_heldout(name, every):
            continue
        ids = tok.encode(text).ids
        windows.extend(ids[s : s + tokens] for s in range(0, len(ids) - tokens + 1, tokens))
    if len(windows) < count:
        raise ValueError(
            f"the held-out split has {len(windows)} windows of {tokens} tokens, {count} asked"
        )
    step = len(windows) / count
    return [windows[int(i * step)] for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    """``make model``: train (or find up to date) the measuring model and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", default=str(_repo_models_dir() / DEFAULT_DIR.name))
    ap.add_argument(
        "--check-vllm",
        action="store_true",
        help="then load it in vLLM: generate, and compare prompt-logprob perplexity",
    )
    args = ap.parse_args(argv)
    path, meta = make_trained_model(args.out)
    r = meta["results"]
    print(
        f"{path}: held-out perplexity {r['heldout_perplexity']:.2f}, unigram "
        f"{r['unigram_perplexity']:.2f} (ratio {r['ratio']:.3f} <= {MAX_RATIO:.3f}); "
        f"{r['parameters']} parameters, vocab {r['vocab_size']}, "
        f"trained in {r['train_seconds']:.0f} s"
    )
    if r["heldout_perplexity"] > MAX_RATIO * r["unigram_perplexity"]:
        raise SystemExit("the trained model misses the perplexity bar")
    if args.check_vllm:
        from .trained_model_check import check_with_vllm

        check_with_vllm(path, r["heldout_perplexity"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
