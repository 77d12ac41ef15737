"""Statistics files: owner-only, and free of the secrets of the configuration."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
from pathlib import Path

import torch

from lmcache_core import TieredHierarchy, load_config
from lmcache_core.hierarchy.stats import write_json_atomic
from lmcache_core.integrations.vllm.stats_file import write_stats
from lmcache_core.redaction import register_secrets
from lmcache_core.testing import make_key, run_async


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_stats_files_are_owner_only(tmp_path: Path) -> None:
    """Issue 10: stats files were world-readable (they name paths and hosts)."""
    target = tmp_path / "new-dir" / "1.json"
    write_json_atomic(target, {"a": 1})
    assert mode(target) == 0o600
    assert mode(target.parent) == 0o700  # a directory created for it
    assert json.loads(target.read_text()) == {"a": 1}
    # a symlink planted at the temporary name is replaced, never written through
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    planted.symlink_to(victim)
    write_json_atomic(target, {"a": 2})
    assert victim.read_text() == "keep" and json.loads(target.read_text()) == {"a": 2}
    assert list(target.parent.glob(".*.tmp")) == []
    write_stats(str(tmp_path / "conn"), "scheduler-1.json", {"b": 2})
    assert mode(tmp_path / "conn" / "scheduler-1.json") == 0o600


def test_secrets_never_reach_a_stats_file(tmp_path: Path) -> None:
    """Issue 10: a disk tier's path read from $env appeared in the hierarchy's stats file."""
    secret_dir = tmp_path / "hunter22-private-area"
    stats_dir = tmp_path / "stats"
    doc = {
        "stats_dir": str(stats_dir),
        "stats_interval_s": 0.05,
        "tiers": [
            {"name": "hot", "backend": "cpu"},
            {"name": "disk", "backend": "disk", "options": {"path": {"$env": "T_KV_DIR"}}},
        ],
    }
    cfg = load_config(doc, environ={"T_KV_DIR": str(secret_dir)})

    async def body() -> str:
        async with TieredHierarchy.from_config(cfg) as h:
            await h.put(make_key("s"), torch.zeros(1024, dtype=torch.uint8))
            await h.flush()
            for _ in range(200):
                files = list(stats_dir.glob("*.json"))
                if files and "disk" in files[0].read_text():
                    break
                await asyncio.sleep(0.02)
            assert files, "no stats file written"
            assert mode(files[0]) == 0o600
            return files[0].read_text()

    text = run_async(body())
    assert secret_dir.exists()  # the tier really used it
    assert "hunter22" not in text
    assert '"backend": "disk"' in text and "<redacted>" in text


def test_the_connector_helper_scrubs_too(tmp_path: Path) -> None:
    register_secrets(["s3://user:hunter23@bucket"])
    write_stats(str(tmp_path), "w.json", {"error": "cannot reach s3://user:hunter23@bucket/kv"})
    text = (tmp_path / "w.json").read_text()
    assert "hunter23" not in text and "<redacted>" in text


def test_what_counts_as_secret_text() -> None:
    from lmcache_core.redaction import redact_url, scrub_text, secret_forms

    for plain in ("8GiB", "512 MB", "1.5e3", "true", "off", "abc"):
        assert secret_forms(plain) == [], plain  # numbers, sizes, booleans, short texts
    assert secret_forms("1234abc") == ["1234abc"]
    forms = secret_forms("~/kv-data")  # a path also under the forms a backend would show
    assert forms[0] == "~/kv-data" and os.path.expanduser("~/kv-data") in forms
    assert scrub_text("open /srv/kv-9f failed", ["/srv/kv-9f"]) == "open <redacted> failed"
    assert redact_url("s3://u:pw@h:99999/b") == "s3://u:<redacted>@h:99999/b"  # no ValueError
    assert redact_url("s3://[::1/b") == "s3://[::1/b"
