"""Recovery of a disk tier: settle what dead writers left, rebuild a lost index."""

from __future__ import annotations

import logging
import os
import time

from . import layout
from .owners import claim_dead_owner, list_owner_ids
from .state import DiskState, unlink_quiet

__all__ = ["DiskRecovery"]

log = logging.getLogger("lmcache_core.disk")


class DiskRecovery(DiskState):
    """Dead-owner clean-up and index rebuild (a mixin)."""

    def _reap_sync(self) -> int:
        """Settle the leftovers of dead owners: remove their temporary files, adopt objects
        they renamed but did not record, drop their reservations. Returns owners reaped."""
        owners = set(list_owner_ids(self.root))
        with self.index.snapshot() as tx:
            owners.update(tx.pending_owners())
            owners.update(tx.pin_owners())
        owners.discard(self.owner)
        reaped = 0
        for owner in sorted(owners):
            dead = claim_dead_owner(self.root, owner)
            if dead is None:
                continue
            try:
                with self.index.transaction() as tx:
                    for pending_id, rel, tmp, _size in tx.pending_of(owner):
                        if layout.is_temp_relpath_of(rel, tmp):
                            if unlink_quiet(self._abs(tmp)):
                                self.counters.removed_temps += 1
                            try:
                                st = os.lstat(self._abs(rel))
                            except FileNotFoundError:
                                pass
                            else:
                                if tx.entry_size(rel) != st.st_size:
                                    tx.upsert_entry(rel, st.st_size, time.time())
                        tx.delete_pending(pending_id)
                    tx.delete_pins_of(owner)
                    self._totals = tx.totals()
            finally:
                dead.done()
            reaped += 1
        self.counters.reaped_owners += reaped
        return reaped

    def _rebuild_sync(self) -> None:
        """Rebuild the index from the files (a new, lost or damaged index)."""
        t0 = time.monotonic()
        n = 0
        stale_before = time.time() - self.opts.stale_temp_seconds
        with self.index.transaction() as tx:
            live_tmps = tx.pending_tmp_names()
            tx.clear_entries()
            for ns in layout.namespace_dirs(self.root):
                for f in layout.iter_files(self.root, ns):
                    if isinstance(f, layout.ObjectFile):
                        tx.upsert_entry(f.rel, f.size, f.mtime)
                        n += 1
                    elif (
                        f.rel not in live_tmps
                        and self._temp_is_stale(f, stale_before)
                        and (unlink_quiet(self._abs(f.rel)))
                    ):
                        self.counters.removed_temps += 1
            tx.set_meta("complete", "1")
        if n:
            log.info(
                "disk tier %s: index rebuilt from %d objects in %.1f s",
                self.root,
                n,
                time.monotonic() - t0,
            )

    def _temp_is_stale(self, f: layout.TempFile, stale_before: float) -> bool:
        if f.owner == self.owner:
            return False
        if f.mtime < stale_before:
            return True
        dead = claim_dead_owner(self.root, f.owner)
        if dead is None:
            return False
        dead.done()
        return True
