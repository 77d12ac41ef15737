"""Opening the tiered storage for the connector's processes.

Each **worker** process opens the full hierarchy from the configuration (its CPU tier is
process-local memory; disk/S3 tiers are shared). The **scheduler** process cannot read a
worker's memory, so it opens a *lookup view*: the same configuration restricted to the
tiers other processes can see (``capabilities.shared``: disk, S3, ...), used only for
``lookup_prefix``. Together with what the workers report having stored, that tells the
scheduler what every rank can load.

Both are driven from vLLM's synchronous threads through one :class:`~lmcache_core.SyncBackend`
each (an IO event-loop thread per process).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...config import CacheConfig, load_config
from ...hierarchy import TieredHierarchy
from ...keys import CacheEngineKey, Namespace
from ...sync import SyncBackend

__all__ = ["Lookup", "Storage", "load_storage_config"]

log = logging.getLogger("vllm.lmcache_core.storage")


def load_storage_config(raw: dict[str, Any], source: str = "") -> CacheConfig:
    """Validate the storage configuration (raises ``ConfigError`` naming the bad field)."""
    cfg = load_config(raw)
    if source and not cfg.source:
        cfg = dataclasses.replace(cfg, source=source)
    return cfg


@dataclass(frozen=True)
class Lookup:
    """Leading keys available, and the name of the tier holding each."""

    num_hit: int
    tiers: tuple[str, ...]


class Storage:
    """A started hierarchy plus the blocking calls the connector needs."""

    def __init__(
        self,
        config: CacheConfig,
        namespace: Namespace,
        *,
        shared_only: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        if shared_only:
            tiers = [
                t
                for t in config.tiers
                if getattr(t.backend_cls, "capabilities", None)
                and t.backend_cls.capabilities.shared
            ]
            config = dataclasses.replace(
                config,
                tiers=tuple(dataclasses.replace(t, index=i) for i, t in enumerate(tiers)),
                stats_dir=None,
            )
        self.config = config
        self.tier_names = tuple(t.name for t in config.tiers)
        self.hierarchy = TieredHierarchy(config, namespace=namespace, name="vllm-connector")
        backend: Any = self.hierarchy
        self.sync = SyncBackend(backend, timeout=timeout_s)
        self.sync.start()
        _close_before_thread_pools_stop(self)

    @classmethod
    def lookup_view(
        cls, config: CacheConfig, namespace: Namespace, timeout_s: float | None = None
    ) -> Storage | None:
        """The shared tiers of ``config`` for scheduler-side lookups, or ``None`` if none."""
        if not any(
            getattr(t.backend_cls, "capabilities", None) and t.backend_cls.capabilities.shared
            for t in config.tiers
        ):
            return None
        return cls(config, namespace, shared_only=True, timeout_s=timeout_s)

    def lookup(self, keys: Sequence[CacheEngineKey], lease_s: float | None = None) -> Lookup:
        """How many leading ``keys`` some tier holds (pinned for ``lease_s`` when given)."""
        if not keys:
            return Lookup(0, ())
        res = self.sync.io.run(
            self.hierarchy.lookup_prefix(keys, lease_s=lease_s), self.sync.timeout
        )
        return Lookup(res.num_hit, tuple(res.tier_of(i) for i in range(res.num_hit)))

    def release(self, keys: Sequence[CacheEngineKey]) -> None:
        """End the leases :meth:`lookup` took on ``keys``."""
        if keys:
            self.sync.io.run(self.hierarchy.release(keys), self.sync.timeout)

    def get_into(self, keys: Sequence[CacheEngineKey], outs: Sequence[Any]) -> list[bool]:
        """Load each key into its buffer; ``False`` for a miss (never raises for a miss)."""
        return self.sync.batched_get_into(keys, outs)

    def put(self, keys: Sequence[CacheEngineKey], values: Sequence[Any]) -> list[bool]:
        """Store the chunks (copied: the caller may reuse the buffers afterwards)."""
        return self.sync.batched_put(keys, values)

    def stats(self) -> dict[str, Any]:
        return self.hierarchy.stats()

    def close(self) -> None:
        """Finish queued stores (up to the configured drain timeout) and close. Idempotent."""
        try:
            self.sync.close()
        except Exception as exc:  # closing must never break vLLM's shutdown
            log.warning("LMCacheCoreConnector: closing the storage failed: %s", exc)


def _close_before_thread_pools_stop(storage: Storage) -> None:
    """Close ``storage`` at interpreter exit *before* ``concurrent.futures`` stops its
    threads: queued write-through stores (to disk, S3) need them to finish. vLLM closes
    the connector itself on a normal engine shutdown; this covers an in-process engine
    left to the interpreter's exit."""
    ref = weakref.ref(storage)

    def close() -> None:
        s = ref()
        if s is not None:
            s.close()

    register = getattr(threading, "_register_atexit", None)
    try:
        # Called in reverse order of registration: after concurrent.futures' own hook
        # was registered (at its import), ours runs first.
        register(close)  # type: ignore[misc]
    except Exception:  # pragma: no cover - other Python implementations
        atexit.register(close)
