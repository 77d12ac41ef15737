"""A minimal in-memory reference backend (a dict of copies).

It is the smallest correct implementation of the protocol: the contract suite runs
against it to show that the suite itself is sound, and it is a template for new backends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from ..backend import BaseBackend, Capabilities
from ..config.options import build_options
from ..keys import CacheEngineKey, Namespace


@dataclass(frozen=True)
class ReferenceOptions:
    """The reference backend has no options."""


class ReferenceBackend(BaseBackend):
    """Unbounded dict of private copies. Not for production use."""

    Options = ReferenceOptions
    capabilities = Capabilities()

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        super().__init__(
            build_options(ReferenceOptions, options), namespace=namespace, name=name or "reference"
        )
        self._data: dict[CacheEngineKey, torch.Tensor] = {}

    async def _contains(self, key: CacheEngineKey) -> bool:
        return key in self._data

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        value = self._data.get(key)
        return None if value is None else await _copy(value)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        self._data[key] = value.contiguous() if donate else await _copy(value)
        return True

    async def _remove(self, key: CacheEngineKey) -> bool:
        return self._data.pop(key, None) is not None

    def _usage(self) -> dict[str, Any]:
        return {
            "entries": len(self._data),
            "used_bytes": sum(v.numel() * v.element_size() for v in self._data.values()),
        }


async def _copy(value: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy; big copies run in a thread so the loop is never blocked."""
    if value.numel() * value.element_size() >= 1 << 20:
        return await asyncio.to_thread(lambda: value.contiguous().clone())
    return value.contiguous().clone()
