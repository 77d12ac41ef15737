"""The connector's figures in vLLM's own statistics: :class:`ConnectorStats`.

vLLM asks every worker (``get_kv_connector_stats``, after each step) and the scheduler
for what happened since the last call, merges the answers with :meth:`ConnectorStats.
aggregate` (over the tensor-parallel ranks of one step, then with the scheduler's, then
over the steps of a logging interval), sends ``to_dict()`` to the front-end process and
there rebuilds the object through ``build_kv_connector_stats`` for the periodic log line
(:meth:`ConnectorStats.reduce`) and hands the dictionary to the Prometheus series
(:mod:`.prom_metrics`).

So every figure in :attr:`ConnectorStats.data` is a **delta that adds up**: aggregation
is a plain sum (lists of observations are concatenated), whatever the order. What keeps
the totals right across ranks is who reports what:

* token counts (``hit_tokens``) come from rank 0 only: every rank loads the same chunks
  (its own shard of them), so a chunk's tokens are counted once, not once per rank;
* byte counts and transfer observations come from every rank (each moves its own bytes):
  summed over ranks;
* request-level counts (failed and stale loads, dropped saves, unkeyable requests) come
  from the scheduler, which merges the ranks' reports first;
* tier health is a state, not a delta: per tier and rank, the last report wins.

The payload holds only strings, ints, floats, lists and dicts (it travels through vLLM's
msgpack channel to the front-end process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["MAX_OBSERVATIONS", "ConnectorStats", "StatsDelta", "merge_stats"]

#: At most this many load/save observations are kept per payload (a logging interval's
#: worth of steps is merged into one); counters stay exact beyond it.
MAX_OBSERVATIONS = 4096

#: Keys holding ``{tier: int}`` maps (summed per tier).
_PER_TIER = ("hit_tokens", "load_bytes")
#: Keys holding plain ints (summed).
_COUNTS = (
    "save_bytes",
    "saved_chunks",
    "failed_loads",
    "stale_loads",
    "dropped_saves",
    "unkeyable_requests",
)
#: Keys holding lists of observations (concatenated, capped).
_OBSERVATIONS = ("load_obs", "save_obs")


def merge_stats(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add the payload ``other`` to ``into`` and return ``into``. Only ``into``'s top
    level is modified: nested maps and lists are replaced by new ones, never changed in
    place (vLLM hands the same payload to several loggers)."""
    for key, value in other.items():
        if key in _PER_TIER:
            acc = dict(into.get(key, {}))
            for tier, n in value.items():
                acc[tier] = acc.get(tier, 0) + n
            into[key] = acc
        elif key in _OBSERVATIONS:
            acc_list = list(into.get(key, []))
            room = MAX_OBSERVATIONS - len(acc_list)
            if room > 0:
                acc_list.extend(value[:room])
            into[key] = acc_list
            dropped = len(value) - max(0, room)
            if dropped > 0:
                into["observations_dropped"] = into.get("observations_dropped", 0) + dropped
        elif key == "tier_health":
            acc_h = {t: dict(r) for t, r in into.get(key, {}).items()}
            for tier, ranks in value.items():
                acc_h.setdefault(tier, {}).update(ranks)
            into[key] = acc_h
        elif isinstance(value, int | float):
            into[key] = into.get(key, 0) + value
    return into


@dataclass
class ConnectorStats(KVConnectorStats):
    """Deltas of the connector's figures since the last report (see the module docstring
    for the payload and its merging rules)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data = merge_stats(dict(self.data), other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line's worth of figures for vLLM's periodic ``KV Transfer metrics`` log."""
        d = self.data
        out: dict[str, int | float] = {}
        for tier, n in sorted(d.get("hit_tokens", {}).items()):
            out[f"hit_tokens_{tier}"] = n
        loads = d.get("load_obs", [])
        out["load_bytes"] = sum(d.get("load_bytes", {}).values())
        if loads:
            seconds = sum(float(o[2]) for o in loads)
            nbytes = sum(int(o[1]) for o in loads)
            out["loads"] = len(loads)
            out["load_MBps"] = round(nbytes / seconds / 1e6, 1) if seconds > 0 else 0.0
        out["save_bytes"] = d.get("save_bytes", 0)
        saves = d.get("save_obs", [])
        if saves:
            seconds = sum(float(o[1]) for o in saves)
            out["save_avg_ms"] = round(seconds / len(saves) * 1e3, 3)
        for key in ("failed_loads", "stale_loads", "dropped_saves", "unkeyable_requests"):
            if d.get(key):
                out[key] = d[key]
        for tier, ranks in sorted(d.get("tier_health", {}).items()):
            out[f"tier_healthy_{tier}"] = int(all(ranks.values()))
        return out


class StatsDelta:
    """Turns cumulative counters into the deltas :class:`ConnectorStats` carries."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def flat(self, key: str, total: int) -> int:
        """The growth of counter ``key`` since the last call (``total`` is cumulative)."""
        prev = int(self._last.get(key, 0))
        self._last[key] = total
        return total - prev

    def per_tier(self, key: str, totals: dict[str, int]) -> dict[str, int]:
        """The per-tier growth of ``totals`` since the last call (zero growths left out)."""
        prev: dict[str, int] = self._last.get(key, {})
        out = {t: n - prev.get(t, 0) for t, n in totals.items() if n != prev.get(t, 0)}
        self._last[key] = dict(totals)
        return out
