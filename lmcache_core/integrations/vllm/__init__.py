"""vLLM integration: the ``LMCacheCoreConnector`` KV connector (see ``docs/vllm.md``).

Importing this package imports nothing from vLLM; the connector lives in
:mod:`lmcache_core.integrations.vllm.connector` and the entry point registering its name
in :mod:`lmcache_core.integrations.vllm.plugin`.
"""
