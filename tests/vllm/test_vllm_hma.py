"""The connector's side of vLLM's hybrid KV-cache manager (HMA) contract, and the keys
of replicated KV (MLA at tensor parallel > 1). Engines: ``test_vllm_models_e2e.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm]


def test_configuring_the_connector_keeps_hma_on() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers the short name (the package's entry point)
    for extra in ({}, {"kv_connector_module_path": "lmcache_core.integrations.vllm.connector"}):
        ktc = KVTransferConfig(kv_connector="LMCacheCoreConnector", kv_role="kv_both", **extra)
        assert KVConnectorFactory.supports_hma_config(ktc)


class _Sched:
    def __init__(self) -> None:
        self.finished: list[tuple[str, Any]] = []

    def request_finished(self, request: Any, block_ids: Any) -> bool:
        self.finished.append((request.request_id, block_ids))
        return True


def _connector(group_ids: tuple[int, ...], disabled: str | None = None) -> Any:
    """The connector's scheduler-side dispatch around a recording stand-in."""
    from lmcache_core.integrations.vllm.connector import LMCacheCoreConnector

    conn: Any = object.__new__(LMCacheCoreConnector)
    conn._scheduler = _Sched()
    conn._worker = None
    conn._ctx = SimpleNamespace(
        layout=SimpleNamespace(group_id=group_ids[0], group_ids=group_ids)
        if not disabled
        else None,
        disabled=disabled,
    )
    return conn


def test_request_finished_all_groups_hands_every_group_to_the_scheduler() -> None:
    conn = _connector(group_ids=(1, 0))
    req = SimpleNamespace(request_id="r")
    delay, params = conn.request_finished_all_groups(req, ([0, 0, 5], [7, 8, 9]))
    assert (delay, params) == (True, None)
    assert conn._scheduler.finished == [("r", ([0, 0, 5], [7, 8, 9]))]
    assert conn.get_loaded_kv_cache_group_ids(req) == (1, 0)  # both groups are restored
    conn.request_finished(req, [3, 4])  # HMA off: one group
    assert conn._scheduler.finished[-1] == ("r", ([3, 4],))


def test_no_group_is_restored_for_a_model_without_hits() -> None:
    conn = _connector(group_ids=(0,), disabled="two KV-cache groups")
    assert conn.get_loaded_kv_cache_group_ids(SimpleNamespace(request_id="r")) == ()


def test_replica_ranks_share_keys_and_only_the_first_writes_shared_tiers(tmp_path: Any) -> None:
    from lmcache_core.integrations.vllm.context import ConnectorContext
    from lmcache_core.integrations.vllm.storage import load_storage_config, replica_storage_config

    storage = load_storage_config(
        {
            "chunk_size": 64,
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "1MiB"}},
                {"name": "disk", "backend": "disk", "options": {"path": str(tmp_path)}},
            ],
        }
    )
    ctx = ConnectorContext(
        settings=SimpleNamespace(), storage_config=storage, world_size=4, failure_policy="x"
    )
    ctx.kv_tp_replicas = 2
    assert ctx.key_world_size == 2
    assert [ctx.shard_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [ctx.is_writer(r) for r in range(4)] == [True, False, True, False]
    cfg, saves_off = replica_storage_config(storage)
    assert not saves_off
    assert [t.write_policy for t in cfg.tiers] == ["through", "none"]
    only_disk = load_storage_config(
        {"chunk_size": 64, "tiers": [{"name": "disk", "backend": "disk", "options": {"path": "x"}}]}
    )
    assert replica_storage_config(only_disk)[1]  # a shared first tier: the replica stores nothing
