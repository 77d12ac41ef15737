"""A tiny backend class for plugin tests: only what the registry and the CLI look at."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.config.options import option


@dataclass(frozen=True)
class FixtureOptions:
    """Options of the fixture backend."""

    region: str = option(kind="str", doc="A required option.")
    max_bytes: int = option("1MiB", doc="Capacity in bytes.", kind="bytes", minimum=1)
    label: str = option("fixture", doc="A free-form label.")


class FixtureBackend(BaseBackend):
    """The ``fixture`` backend (never started by the tests)."""

    Options = FixtureOptions
    capabilities = Capabilities(persistent=True)


class NoOptionsBackend:
    """A class that forgot to declare Options."""
