"""docs/vllm.md stays true: its options table, its configurations and its example file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from lmcache_core.integrations.vllm.settings import options_markdown, parse_settings
from lmcache_core.integrations.vllm.storage import load_storage_config

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "vllm.md").read_text()


def test_options_table_matches_the_code() -> None:
    block = DOC.split("<!-- connector-options:start -->\n")[1].split(
        "<!-- connector-options:end -->"
    )[0]
    assert block == options_markdown()


def test_documented_kv_transfer_configs_are_valid() -> None:
    configs = [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", DOC)]
    assert configs
    for cfg in configs:
        assert cfg["kv_connector"] == "LMCacheCoreConnector"
        assert cfg["kv_load_failure_policy"] == "recompute"
        extra = dict(cfg["kv_connector_extra_config"])
        extra["config_file"] = str(ROOT / extra["config_file"])
        settings = parse_settings(extra)
        assert load_storage_config(settings.storage).chunk_size == 256


def test_example_storage_file_is_the_documented_one() -> None:
    text = (ROOT / "examples" / "vllm-storage.yaml").read_text()
    documented = DOC.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(documented) == yaml.safe_load(text)
    cfg = load_storage_config(yaml.safe_load(text))
    assert [t.backend for t in cfg.tiers] == ["cpu", "disk"]
