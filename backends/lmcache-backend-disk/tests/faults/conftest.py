"""Fault campaign of the disk tier: a bounded sample with a fixed seed by default, the full
campaign with ``LMCACHE_FAULTS_FULL=1`` (``make faults``). ``LMCACHE_FAULTS_LOG=FILE``
appends one JSON line per campaign (trial counts and results) to FILE."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.dirname(HERE)):  # disk_world, disk_canary; disk_testutil
    if p not in sys.path:
        sys.path.insert(0, p)
