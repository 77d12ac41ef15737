"""Chunk hashes of a vLLM request: tokens plus everything else that changes its KV.

Per chunk, the token database hashes the tokens and these extra keys:

* chunk 0: the LoRA adapter and ``cache_salt``; the hash chain carries them into every
  later chunk. An adapter is its name and the revision of its files (the ``sha256:``
  digest of its weights and ``adapter_config.json``, or its hub snapshot's commit, see
  :func:`~.identity.adapter_revision`), never vLLM's per-server integer id: two servers
  that loaded the same adapters in another order share its chunks;
* every chunk: the multimodal items overlapping it (hash, offset in the chunk, length)
  and, for prompts given as embeddings, a SHA-256 of the chunk's embeddings.

A request the connector cannot key safely (a multimodal item without a hash, a LoRA
adapter whose files are not found locally, a prompt mixing tokens and embeddings) gets no
hashes: it is neither looked up nor saved, and :attr:`RequestKeyer.unkeyable` counts it.

With ``use_vllm_block_hashes`` the chain is built from vLLM's own block hashes (which
already include those extra keys), but only when they are reproducible across
processes: a cryptographic ``prefix_caching_hash_algo`` or ``PYTHONHASHSEED`` set. vLLM
keys a LoRA adapter by its name and path only, so the adapter's revision is added to the
first chunk there too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...token_db import ChunkedTokenDatabase
from .identity import UnknownRevision, adapter_revision

__all__ = ["CRYPTO_VLLM_HASHES", "RequestKeyer", "RequestKeys", "vllm_hash_reproducible"]

log = logging.getLogger("vllm.lmcache_core.keys")

#: vLLM prefix-caching hash algorithms that are reproducible without PYTHONHASHSEED.
CRYPTO_VLLM_HASHES = frozenset({"sha256", "sha256_cbor"})
#: An adapter whose files were not found is looked for again after this long (a hub
#: adapter appears in the local cache once vLLM's worker has downloaded it).
ADAPTER_RETRY_S = 10.0


@dataclass(frozen=True)
class RequestKeys:
    """Chunk hashes of a request's prompt (one per full chunk), or why there are none."""

    hashes: tuple[int, ...]
    reason: str | None = None


def vllm_hash_reproducible(algo: str) -> tuple[bool, str]:
    """Whether vLLM's block hashes with ``algo`` are the same in every process, and why."""
    if algo in CRYPTO_VLLM_HASHES:
        return True, f"prefix_caching_hash_algo={algo} is cryptographic with a fixed seed"
    if os.environ.get("PYTHONHASHSEED") is not None:
        return True, "PYTHONHASHSEED is set"
    return False, (
        f"vLLM's block hashes ({algo}) use a random per-process seed unless PYTHONHASHSEED "
        "is set or prefix_caching_hash_algo is sha256/sha256_cbor"
    )


class RequestKeyer:
    """Computes :class:`RequestKeys` for vLLM ``Request`` objects."""

    def __init__(
        self,
        db: ChunkedTokenDatabase,
        block_size: int,
        *,
        vllm_block_hashes: bool = False,
    ) -> None:
        self.db = db
        self.chunk_size = db.chunk_size
        self.block_size = block_size
        self.vllm_block_hashes = vllm_block_hashes
        self.unkeyable: Counter[str] = Counter()
        #: (lora_path, vLLM's integer id) -> (revision or None, when it was looked up).
        #: vLLM loads an adapter's files once per integer id, so a new id for the same
        #: path (its files replaced and registered again) is identified afresh.
        self._lora_revisions: dict[tuple[str, int], tuple[str | None, float]] = {}

    # ------------------------------------------------------------------ extra keys
    def _lora_key(self, lora: Any) -> tuple[Any, ...] | str:
        """``("lora", name, revision)``, or why the adapter cannot be identified."""
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        name = str(getattr(lora, "lora_name", ""))
        if not path:
            return f"LoRA adapter {name!r} has no path to identify its weights"
        path = str(path)
        slot = (path, int(getattr(lora, "lora_int_id", 0) or 0))
        known = self._lora_revisions.get(slot)
        now = time.monotonic()
        if known is None or (known[0] is None and now - known[1] >= ADAPTER_RETRY_S):
            try:
                known = (adapter_revision(path), now)
            except (UnknownRevision, OSError) as exc:
                if slot not in self._lora_revisions:
                    log.warning("cannot identify LoRA adapter %r: %s", name, exc)
                known = (None, now)
            self._lora_revisions[slot] = known
        revision = known[0]
        if revision is None:
            return f"LoRA adapter {name!r} has no weight files found locally"
        return ("lora", name, revision)

    @staticmethod
    def _mm_items(request: Any) -> list[tuple[str, int, int]] | str:
        items = []
        for feat in getattr(request, "mm_features", None) or []:
            ident = getattr(feat, "identifier", None)
            pos = getattr(feat, "mm_position", None)
            if not ident or pos is None:
                return "a multimodal item has no content hash"
            items.append((str(ident), int(pos.offset), int(pos.length)))
        items.sort(key=lambda it: it[1])
        return items

    def _extra_keys(self, request: Any, n_chunks: int) -> list[Any] | str | None:
        first: list[Any] = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            key = self._lora_key(lora)
            if isinstance(key, str):
                return key
            first.append(key)
        salt = getattr(request, "cache_salt", None)
        if salt:
            first.append(("salt", str(salt)))
        mm = self._mm_items(request)
        if isinstance(mm, str):
            return mm
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None and getattr(request, "prompt_is_token_ids", None) is not None:
            return "prompts mixing token ids and embeddings are not keyed"
        if not first and not mm and embeds is None:
            return None
        cs = self.chunk_size
        out: list[Any] = []
        for i in range(n_chunks):
            start, end = i * cs, (i + 1) * cs
            keys: list[Any] = list(first) if i == 0 else []
            for ident, off, length in mm:
                if off < end and off + length > start:
                    keys.append(("mm", ident, off - start, length))
            if embeds is not None:
                part = embeds[start:end].detach().cpu().contiguous()
                h = hashlib.sha256(str(part.dtype).encode() + str(tuple(part.shape)).encode())
                h.update(part.view(-1).view(dtype=_byte_dtype()).numpy().tobytes())
                keys.append(("embeds", h.digest()))
            out.append(keys or None)
        return out

    # ------------------------------------------------------------------ hashes
    def keys(self, request: Any, num_tokens: int | None = None) -> RequestKeys:
        """The chunk hashes of the first ``num_tokens`` tokens of ``request`` (default: its
        prompt), full chunks only. Tokens past the prompt are the generated ones known
        so far (a chunk completed while decoding continues the prompt's chain)."""
        n_prompt = int(request.num_prompt_tokens)
        if num_tokens is None:
            num_tokens = n_prompt
        num_tokens = min(num_tokens, int(request.num_tokens))
        n_chunks = num_tokens // self.chunk_size
        if n_chunks == 0:
            return RequestKeys(())
        if self.vllm_block_hashes:
            return self._from_block_hashes(request, n_chunks)
        extra = self._extra_keys(request, n_chunks)
        if isinstance(extra, str):
            return self._refuse(extra)
        cut = n_chunks * self.chunk_size
        tokens: Sequence[int]
        if request.prompt_token_ids is not None and cut <= n_prompt:
            tokens = request.prompt_token_ids[:cut]
        elif request.prompt_token_ids is not None:
            tokens = list(request.all_token_ids[:cut])
        else:  # prompt given as embeddings (keyed by their digest): zeros stand for them
            tokens = [0] * n_prompt + list(request.output_token_ids)
            tokens = tokens[:cut]
        hashes = tuple(k.chunk_hash for k in self.db.keys(tokens, extra_keys=extra))
        return RequestKeys(hashes)

    def _from_block_hashes(self, request: Any, n_chunks: int) -> RequestKeys:
        per = self.chunk_size // self.block_size
        blocks = list(getattr(request, "block_hashes", None) or [])[: n_chunks * per]
        if len(blocks) < n_chunks * per:
            return self._refuse("vLLM has not computed this request's block hashes")
        extra: list[Any] | None = None
        lora = getattr(request, "lora_request", None)
        if lora is not None:  # vLLM's hashes hold the adapter's name and path, not its files
            key = self._lora_key(lora)
            if isinstance(key, str):
                return self._refuse(key)
            extra = [[key]] + [None] * (n_chunks - 1)
        raw = [bytes(b) for b in blocks]
        keys = self.db.keys_from_block_hashes(raw, self.block_size, extra_keys=extra)
        return RequestKeys(tuple(k.chunk_hash for k in keys))

    def _refuse(self, reason: str) -> RequestKeys:
        if not self.unkeyable[reason]:
            log.warning("LMCacheCoreConnector: requests not cached: %s", reason)
        self.unkeyable[reason] += 1
        return RequestKeys((), reason)


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
