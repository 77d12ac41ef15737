"""Zygote of the gds crash test: ``python gds_kill_worker.py SPEC_JSON ROUNDS SEED``.

Imports torch and the backend once, then ROUNDS times forks a writer (the contract
worker's ``forever`` loop: 4 MiB values under four keys, each alternating between two
known values), lets it run a random 0.1-0.6 s and SIGKILLs it. Prints a JSON report:
the kills and the temporary files the killed writers left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

import torch

from lmcache_core.testing.worker import killed_writer_candidates, open_from_spec, shared_key


async def _write_forever(spec: dict[str, Any], values: list[Any]) -> None:
    backend = open_from_spec(spec)
    await backend.start()
    rnd = 0
    while True:
        for j in range(4):
            await backend.put(shared_key(j, "killed"), values[j][rnd % 2])
        rnd += 1


def _temps(roots: list[str]) -> int:
    return sum(
        f.endswith(".tmp")
        for r in roots
        for d, _, files in os.walk(r)
        if ".lmcache-disk" not in d
        for f in files
    )


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    rounds, rng = int(argv[1]), random.Random(int(argv[2]))
    opts = spec["options"]
    roots = list(opts.get("paths") or [opts["path"]])
    # Computed here, before any fork: a forked child must not start torch's thread pool.
    torch.set_num_threads(1)
    values = [killed_writer_candidates(j) for j in range(4)]
    kills = left = 0
    for _ in range(rounds):
        pid = os.fork()
        if pid == 0:
            try:
                asyncio.run(_write_forever(spec, values))
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.1, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
        left += _temps(roots)
    print(json.dumps({"kills": kills, "left_temps": left}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
