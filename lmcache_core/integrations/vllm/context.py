"""Everything both connector roles derive from vLLM's configuration, computed identically
in every process: settings, storage configuration, KV layout, model identity, namespace
and the token database that turns prompts into chunk hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from ...config import CacheConfig
from ...config.namespaces import resolve_namespace
from ...errors import ConfigError
from ...keys import Namespace
from ...token_db import ChunkedTokenDatabase
from .identity import ModelIdentity, UnknownRevision, model_identity
from .keying import vllm_hash_reproducible
from .layout import LayoutInfo, UnrestorableGroups, UnsupportedModel, describe_layout
from .settings import ConnectorSettings, parse_settings
from .storage import load_storage_config

__all__ = ["ConnectorContext", "build_context"]

log = logging.getLogger("vllm.lmcache_core.connector")


@dataclass
class ConnectorContext:
    """Shared state of one connector instance (either role)."""

    settings: ConnectorSettings
    storage_config: CacheConfig
    world_size: int
    failure_policy: str
    layout: LayoutInfo | None = None
    identity: ModelIdentity | None = None
    namespace: Namespace | None = None
    db: ChunkedTokenDatabase | None = None
    block_size: int = 0
    hash_block_size: int = 0
    use_vllm_hashes: bool = False
    disabled: str | None = None
    #: ``disabled`` is an expected condition (a model whose KV-cache groups the connector
    #: cannot all restore): logged once at INFO, not as an error.
    disabled_expected: bool = False
    #: Consecutive tensor-parallel ranks holding identical KV (MLA): they share one copy
    #: of each chunk, written by the first rank of each replica group.
    kv_tp_replicas: int = 1

    @property
    def key_world_size(self) -> int:
        """Number of distinct KV shards, the ``world_size`` in keys."""
        return self.world_size // self.kv_tp_replicas

    def shard_of(self, rank: int) -> int:
        """The KV shard (``worker_id`` in keys) tensor-parallel ``rank`` holds."""
        return rank // self.kv_tp_replicas

    def is_writer(self, rank: int) -> bool:
        """Whether ``rank`` writes its replica group's chunks to shared tiers."""
        return rank % self.kv_tp_replicas == 0

    @property
    def chunk_size(self) -> int:
        return self.storage_config.chunk_size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


def _served_name(model_config: Any) -> str | None:
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name) if name else None


def _overrides_digest(model_config: Any) -> str:
    overrides = getattr(model_config, "hf_overrides", None)
    if not overrides or callable(overrides):
        return "none" if not overrides else "callable"
    text = json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_context(vllm_config: Any, kv_cache_config: Any) -> ConnectorContext:
    """Validate the configuration; an unsupported model yields a disabled context.

    Configuration mistakes (bad settings, a chunk size that is not a multiple of the
    block size) raise :class:`ConfigError`: vLLM refuses to start and says why.
    """
    kvt = vllm_config.kv_transfer_config
    settings = parse_settings(getattr(kvt, "kv_connector_extra_config", None))
    storage_config = load_storage_config(settings.storage, settings.source)
    parallel = vllm_config.parallel_config
    ctx = ConnectorContext(
        settings=settings,
        storage_config=storage_config,
        world_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        failure_policy=str(getattr(kvt, "kv_load_failure_policy", "fail")),
    )
    try:
        ctx.layout = describe_layout(vllm_config, kv_cache_config)
    except UnsupportedModel as exc:
        ctx.disabled = str(exc)
        ctx.disabled_expected = isinstance(exc, UnrestorableGroups)
        return ctx
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
    if replicas > 1 and ctx.world_size % replicas == 0:
        ctx.kv_tp_replicas = replicas
    ctx.block_size = ctx.layout.block_size
    if ctx.chunk_size % ctx.block_size:
        raise ConfigError(
            f"chunk_size {ctx.chunk_size} must be a multiple of vLLM's block size {ctx.block_size}",
            f"{settings.source}.chunk_size",
        )
    model_config = vllm_config.model_config
    opts = settings.options
    try:
        ctx.identity = model_identity(
            str(model_config.model),
            served_name=_served_name(model_config),
            revision=getattr(model_config, "revision", None),
            name_override=opts.model_name,
            revision_override=opts.model_revision,
        )
    except UnknownRevision as exc:
        ctx.disabled = str(exc)
        return ctx

    extra: dict[str, str] = {"hf_overrides": _overrides_digest(model_config)}
    quantization = getattr(model_config, "quantization", None)
    if quantization:  # online (--quantization) or the checkpoint's: other weights, other KV
        extra["quantization"] = str(quantization)
    quant_config = getattr(model_config, "quantization_config", None)
    if isinstance(quant_config, dict) and quant_config:  # given by hand: its digest
        text = json.dumps(quant_config, sort_keys=True, default=str)
        extra["quantization_config"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    if ctx.kv_tp_replicas > 1:
        extra["kv_tp_replicas"] = str(ctx.kv_tp_replicas)
    ctx.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or ctx.block_size)
    cache_config = vllm_config.cache_config
    if opts.use_vllm_block_hashes:
        algo = str(getattr(cache_config, "prefix_caching_hash_algo", "sha256"))
        ok, why = vllm_hash_reproducible(algo)
        if not getattr(cache_config, "enable_prefix_caching", False):
            ok, why = False, "vLLM's prefix caching is off, so it computes no block hashes"
        elif ctx.chunk_size % ctx.hash_block_size:
            ok, why = (
                False,
                f"chunk_size is not a multiple of vLLM's hash block size {ctx.hash_block_size}",
            )
        if ok:
            ctx.use_vllm_hashes = True
            extra["vllm_block_hash"] = algo
            extra["vllm_hash_block_size"] = str(ctx.hash_block_size)
        else:
            log.warning("LMCacheCoreConnector hashes prompts itself: %s", why)

    salt = storage_config.hash_salt
    derived = Namespace(
        model_name=ctx.identity.name,
        model_revision=ctx.identity.revision,
        kv_layout=ctx.layout.kv_layout,
        kv_dtype=ctx.layout.kv_dtype,
        block_size=ctx.block_size,
        chunk_size=ctx.chunk_size,
        hash_algorithm=storage_config.hash_algorithm,
        hash_salt_id=ChunkedTokenDatabase.salt_id(salt) if salt else "",
        extra=tuple(extra.items()),
    )
    try:  # a configured name is added; a configured model/revision/layout must agree
        ctx.namespace = resolve_namespace(
            storage_config,
            derived,
            "the vLLM connector (the served model, its revision and KV layout; set the "
            "connector's model_name/model_revision options to change them)",
        )
    except ConfigError as exc:
        raise ConfigError(
            exc.reason, f"{settings.source}.{exc.path}" if settings.source else exc.path
        ) from None
    ctx.db = ChunkedTokenDatabase(
        namespace=ctx.namespace,
        world_size=ctx.key_world_size,
        worker_id=0,
        dtype=ctx.layout.kv_dtype,
        hash_salt=salt,
    )
    return ctx
