"""vLLM general plugin: registers the ``LMCacheCoreConnector`` name.

vLLM calls :func:`register` in every one of its processes (entry-point group
``vllm.general_plugins``), so it only records the connector's module path with vLLM's
factory: nothing of lmcache-core is imported and no lmcache plugin is loaded until a
configuration actually selects the connector.
"""

from __future__ import annotations

CONNECTOR_NAME = "LMCacheCoreConnector"
CONNECTOR_MODULE = "lmcache_core.integrations.vllm.connector"

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]


def register() -> None:
    """Register the connector name with vLLM's ``KVConnectorFactory`` (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector API: nothing to register
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered concurrently, or by another copy of this plugin
        pass
