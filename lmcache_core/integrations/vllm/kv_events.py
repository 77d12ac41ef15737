"""KV events for KV-aware routers: what the workers' memory tier holds, in vLLM's terms.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` events (``--kv-events-config``) for
its own KV cache; the connector adds its own through ``take_events``, with ``medium``
set to the name of the tier (e.g. ``"cpu"``), so a router can tell a block in vLLM's
cache from one the connector can load. Each stored chunk becomes one ``BlockStored``
carrying vLLM's own block hash of every vLLM block of the chunk, the hash of the block
before it (``parent_block_hash``) and the chunk's token ids; a chunk the memory tier no
longer holds on any rank (evicted, or cleared by ``reset_cache``) becomes one
``BlockRemoved``.

Events are built only when vLLM's block hashes are the same in every process (a
cryptographic ``prefix_caching_hash_algo``, vLLM's default, or ``PYTHONHASHSEED`` set):
otherwise the connector says once that its events are off.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from .keying import vllm_hash_reproducible

__all__ = ["ChunkBlocks", "KVEvents"]

log = logging.getLogger("vllm.lmcache_core.connector")


@dataclass(frozen=True)
class ChunkBlocks:
    """vLLM's view of one chunk: its blocks' hashes, the hash before them, its tokens."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    lora_name: str | None
    lora_id: int | None


class KVEvents:
    """Remembers the vLLM blocks of chunks planned for saving and turns the workers'
    store/evict reports into vLLM KV events."""

    def __init__(
        self,
        *,
        enabled: bool,
        medium: str,
        block_size: int,
        blocks_per_chunk: int,
        hash_block_size: int,
        hash_algo: str,
        group_idx: int = 0,
        max_chunks: int = 1 << 16,
    ) -> None:
        self.medium = medium
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.scale = max(1, block_size // max(1, hash_block_size))
        self.group_idx = group_idx
        self.max_chunks = max_chunks
        self.enabled = enabled
        self.off_reason: str | None = None
        if enabled:
            ok, why = vllm_hash_reproducible(hash_algo)
            if not ok:
                self.enabled = False
                self.off_reason = why
                log.warning(
                    "LMCacheCoreConnector: KV events off (the connector publishes none): %s",
                    why,
                )
        self._planned: OrderedDict[int, ChunkBlocks] = OrderedDict()  # saved, not yet stored
        self._held: OrderedDict[int, ChunkBlocks] = OrderedDict()  # stored (events sent)
        self._queue: list[KVCacheEvent] = []

    def chunk_blocks(self, request: Any, chunk_index: int) -> ChunkBlocks | None:
        """vLLM's blocks of chunk ``chunk_index`` of ``request`` (``None`` if unknown)."""
        hashes = list(getattr(request, "block_hashes", None) or [])
        bpc, scale = self.blocks_per_chunk, self.scale
        first = chunk_index * bpc
        need = (first + bpc) * scale
        if len(hashes) < need:
            return None
        blocks = [
            maybe_convert_block_hash(hashes[(b + 1) * scale - 1]) for b in range(first, first + bpc)
        ]
        parent = maybe_convert_block_hash(hashes[first * scale - 1]) if first > 0 else None
        tokens = list(
            request.all_token_ids[first * self.block_size : (first + bpc) * self.block_size]
        )
        lora = getattr(request, "lora_request", None)
        return ChunkBlocks(
            blocks,
            parent,
            tokens,
            getattr(lora, "lora_name", None) if lora is not None else None,
            getattr(lora, "adapter_id", None) if lora is not None else None,
        )

    def planned(self, chunk_hash: int, request: Any, chunk_index: int) -> None:
        """A save of this chunk was planned: remember its blocks until it is stored."""
        if not self.enabled or chunk_hash in self._held:
            return
        blocks = self.chunk_blocks(request, chunk_index)
        if blocks is None:
            return
        self._planned[chunk_hash] = blocks
        self._planned.move_to_end(chunk_hash)
        while len(self._planned) > self.max_chunks:
            self._planned.popitem(last=False)

    def stored(self, chunk_hash: int) -> None:
        """The memory tier of some rank now holds the chunk (it held it on none before)."""
        blocks = self._planned.pop(chunk_hash, None)
        if not self.enabled or blocks is None:
            return
        self._held[chunk_hash] = blocks
        while len(self._held) > self.max_chunks:
            self._held.popitem(last=False)  # forgotten: no BlockRemoved for it later
        self._queue.append(
            BlockStored(
                block_hashes=list(blocks.block_hashes),
                parent_block_hash=blocks.parent_block_hash,
                token_ids=list(blocks.token_ids),
                block_size=self.block_size,
                lora_id=blocks.lora_id,
                medium=self.medium,
                lora_name=blocks.lora_name,
                group_idx=self.group_idx,
            )
        )

    def removed(self, chunk_hash: int) -> None:
        """No rank's memory tier holds the chunk any more."""
        blocks = self._held.pop(chunk_hash, None)
        if not self.enabled or blocks is None:
            return
        self._queue.append(
            BlockRemoved(
                block_hashes=list(blocks.block_hashes), medium=self.medium, group_idx=self.group_idx
            )
        )

    def removed_all(self) -> None:
        """Every chunk is gone (``reset_cache``)."""
        for h in list(self._held):
            self.removed(h)
        self._planned.clear()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call."""
        out, self._queue = self._queue, []
        return out
