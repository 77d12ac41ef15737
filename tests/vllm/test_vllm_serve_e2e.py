"""vLLM's OpenAI-compatible server with the connector, started as ``make serve`` starts it.

Two server processes (``examples/serve.py``, i.e. ``python -m
vllm.entrypoints.openai.api_server``) on a free 127.0.0.1 port, driven by the ``openai``
client package: completions (token-id prompts), chat completions (the model maker's chat
template), a 3-turn conversation and two concurrent clients sharing a system prompt.
Server ``a`` starts with empty tiers; server ``b`` is a fresh process on the same disk
directory (its cpu tier empty), configured the way an LMCache user's server is (an LMCache
configuration file describing the same tiers, see ``docs/vllm.md``), and replays the same
requests: the connector loads the
prompts from disk (hits counted by vLLM's ``cached_tokens`` and by the worker's
per-tier counters) and every greedy output is identical. Each cold output's top-1/top-2
logprob margin is checked, so the comparison cannot flip on float rounding.

Each server's ``/metrics`` is scraped over HTTP after its workload: the connector's
series equal its own statistics and vLLM's ``prompt_tokens_cached_by_source`` counts
the hits under ``disk``.
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import vllm_cases as c
from conftest import Models, engine_env, requires_vllm
from engine_driver import disk_objects, wait_disk_stable

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "examples" / "serve.py"
MAX_TOKENS = 6
START_TIMEOUT_S = 300.0


def _words(seed: int, n: int) -> str:
    from lmcache_core.integrations.vllm.local_model import words_to_text

    return words_to_text(random.Random(seed), n, c.VOCAB)


# The workload: every prompt long enough for several 64-token chunks.
COMPLETION_PROMPTS = [c.toks(500, 256), c.toks(501, 200)]
SYSTEM = _words(510, 140)  # shared by the two concurrent clients and the conversation
TURNS = [_words(520 + i, 30) for i in range(3)]
CONCURRENT_QUESTIONS = [_words(530, 25), _words(531, 25)]


@dataclass
class Server:
    """One running server: its process, base URL and the connector's stats directory."""

    proc: subprocess.Popen[bytes]
    base_url: str
    stats_dir: Path
    log_path: Path
    outputs: dict[str, Any] = field(default_factory=dict)
    #: ``/metrics`` scraped after the workload: (sample name, labels, value)
    metrics: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    #: the worker's stats document read right after the scrape
    scraped_worker: dict[str, Any] = field(default_factory=dict)

    def scrape(self) -> None:
        """Scrape ``/metrics`` over HTTP (once the last step's statistics are in)."""
        from prometheus_client.parser import text_string_to_metric_families

        time.sleep(1.0)
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as r:
            text = r.read().decode()
        self.metrics = [
            (smp.name, dict(smp.labels), float(smp.value))
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
        ]
        self.scraped_worker = self.worker_stats()

    def series(self, name: str, **labels: str) -> float:
        """Sum of the scraped samples ``name`` whose labels include ``labels``."""
        return sum(
            v
            for n, lab, v in self.metrics
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        )

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", timeout=120, max_retries=0)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def worker_stats(self) -> dict[str, Any]:
        from lmcache_core.integrations.vllm.stats_file import read_stats

        (doc,) = [d for d in read_stats(str(self.stats_dir)) if d.get("role") == "worker"]
        return doc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _storage(workdir: Path) -> dict[str, Any]:
    return {
        "chunk_size": c.CHUNK,
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(workdir / "kv"), "max_bytes": "256MiB"},
                "write": {"policy": "through"},
            },
        ],
    }


def _lmcache_file(workdir: Path) -> Path:
    """An LMCache configuration describing :func:`_storage`'s tiers."""
    path = workdir / "lmcache.yaml"
    path.write_text(
        f"chunk_size: {c.CHUNK}\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 0.0625\n"  # GiB: 64 MiB
        f"local_disk: file://{workdir / 'kv'}\n"
        "max_local_disk_size: 0.25\n"
        "save_decode_cache: true\n"
    )
    from lmcache_core.config import load_config
    from lmcache_core.config.lmcache_compat import from_lmcache, read_lmcache_file

    translated = from_lmcache(read_lmcache_file(path))
    assert translated.not_honoured == []
    assert load_config(translated.storage).to_dict() == load_config(_storage(workdir)).to_dict()
    return path


def _start(name: str, model: Path, workdir: Path, *, lmcache: bool = False) -> Server:
    if lmcache:
        storage_args = ["--lmcache-config", str(_lmcache_file(workdir))]
    else:
        config = workdir / "storage.json"
        config.write_text(json.dumps(_storage(workdir)))
        storage_args = ["--config", str(config)]
    stats = workdir / f"stats-{name}"
    port = _free_port()
    log_path = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        str(SERVE),
        "--model-dir",
        str(model),
        "--port",
        str(port),
        "--workdir",
        str(workdir),
        *storage_args,
        "--block-size",
        str(c.BLOCK),
        "--max-model-len",
        "1024",
        "--extra-config",
        json.dumps({"stats_dir": str(stats)}),
        "--",
        "--enable-prompt-tokens-details",
        "--max-num-batched-tokens",
        "256",
    ]
    env = engine_env(multiprocessing=True)
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # vLLM's periodic stats line, every second
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    server = Server(proc, f"http://127.0.0.1:{port}", stats, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server {name} exited (rc={proc.returncode}):\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    pytest.fail(f"server {name} not ready after {START_TIMEOUT_S} s:\n{server.log_tail()}")


def _completion(client: Any, prompt: list[int]) -> dict[str, Any]:
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2
    )
    choice = r.choices[0]
    margins = [
        sorted(top.values(), reverse=True)[0] - sorted(top.values(), reverse=True)[1]
        for top in choice.logprobs.top_logprobs
    ]
    return {
        "text": choice.text,
        "margins": margins,
        "prompt_tokens": r.usage.prompt_tokens,
        "cached": (r.usage.prompt_tokens_details.cached_tokens or 0)
        if r.usage.prompt_tokens_details
        else 0,
    }


def _chat(client: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = r.choices[0]
    margins = [
        t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in choice.logprobs.content
    ]
    return {
        "text": choice.message.content,
        "margins": margins,
        "prompt_tokens": r.usage.prompt_tokens,
        "cached": (r.usage.prompt_tokens_details.cached_tokens or 0)
        if r.usage.prompt_tokens_details
        else 0,
    }


def _workload(server: Server) -> dict[str, Any]:
    """The same requests, in the same order, against one server."""
    client = server.client()
    out: dict[str, Any] = {}
    for i, prompt in enumerate(COMPLETION_PROMPTS):
        out[f"completion{i}"] = _completion(client, prompt)
    messages = [{"role": "system", "content": SYSTEM}]
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        reply = _chat(client, messages)
        out[f"turn{i}"] = reply
        messages.append({"role": "assistant", "content": reply["text"]})

    def ask(question: str) -> dict[str, Any]:
        other = server.client()  # two clients, each its own connection pool
        return _chat(
            other, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        )

    with ThreadPoolExecutor(2) as pool:
        for i, r in enumerate(pool.map(ask, CONCURRENT_QUESTIONS)):
            out[f"concurrent{i}"] = r
    return out


@pytest.fixture(scope="module")
def serve_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_serve")


@pytest.fixture(scope="module")
def serve_a(vllm_models: Models, serve_workdir: Path) -> Server:
    """The first server: empty tiers; runs the workload, then stops (disk writes done)."""
    server = _start("a", vllm_models.main, serve_workdir)
    try:
        server.outputs = _workload(server)
        server.scrape()
        wait_disk_stable(str(serve_workdir / "kv"), at_least=1)
    finally:
        server.stop()
    return server


@pytest.fixture(scope="module")
def serve_b(vllm_models: Models, serve_workdir: Path, serve_a: Server) -> Server:
    """A fresh server process on the same disk directory, configured by an LMCache file;
    the same requests."""
    server = _start("b", vllm_models.main, serve_workdir, lmcache=True)
    try:
        server.outputs = _workload(server)
        server.scrape()
    finally:
        server.stop()
    return server


# ------------------------------------------------------------------------------- tests
def test_first_server_answers_every_kind_of_request(serve_a: Server) -> None:
    out = serve_a.outputs
    assert set(out) == {"completion0", "completion1", "turn0", "turn1", "turn2"} | {
        "concurrent0",
        "concurrent1",
    }
    for name, r in out.items():
        assert r["text"], name
        assert len(r["margins"]) == MAX_TOKENS, name
        # greedy outputs compared below: a clear top-1 everywhere
        assert min(r["margins"]) > c.MARGIN, (name, r["margins"])
    # the conversation grows: each turn's prompt holds the previous turns
    assert (
        out["turn0"]["prompt_tokens"]
        < out["turn1"]["prompt_tokens"]
        < out["turn2"]["prompt_tokens"]
    )
    # the chunks went to the disk tier
    assert disk_objects(str(serve_a.stats_dir.parent / "kv"))


def test_first_server_shares_the_system_prompt_between_clients(serve_a: Server) -> None:
    """Within one server, later requests reuse the system prompt's chunks (the turns
    before them stored them): vLLM reports them as cached."""
    out = serve_a.outputs
    shared = len(SYSTEM.split()) // c.CHUNK * c.CHUNK
    for name in ("turn1", "turn2", "concurrent0", "concurrent1"):
        assert out[name]["cached"] >= shared, (name, out[name])


def test_restarted_server_gives_identical_outputs(serve_a: Server, serve_b: Server) -> None:
    assert serve_b.proc.pid != serve_a.proc.pid
    for name, r in serve_a.outputs.items():
        assert serve_b.outputs[name]["text"] == r["text"], name
        assert serve_b.outputs[name]["prompt_tokens"] == r["prompt_tokens"], name


def test_restarted_server_loads_prompts_from_disk(serve_a: Server, serve_b: Server) -> None:
    out = serve_b.outputs
    # the first requests of the new process: nothing in vLLM's own prefix cache yet, so
    # every cached token came through the connector, from the disk tier
    for i, prompt in enumerate(COMPLETION_PROMPTS):
        assert out[f"completion{i}"]["cached"] == c.expected_hit(len(prompt)), i
        assert serve_a.outputs[f"completion{i}"]["cached"] == 0, i
    first_turn = out["turn0"]
    assert first_turn["cached"] == c.expected_hit(first_turn["prompt_tokens"])
    stats = serve_b.worker_stats()
    assert stats["loaded_tokens_by_tier"].get("disk", 0) >= sum(
        c.expected_hit(len(p)) // c.CHUNK * c.CHUNK for p in COMPLETION_PROMPTS
    ), stats["loaded_tokens_by_tier"]
    assert stats["failed_chunks"] == 0
    log = serve_b.log_path.read_text(errors="replace")
    assert "LMCache settings not honoured" not in log


def test_metrics_endpoint_shows_the_connector_series(serve_a: Server, serve_b: Server) -> None:
    """``/metrics`` over HTTP: the connector's series equal its own statistics (tokens
    per tier, bytes loaded), and vLLM's hit-source counter puts the hits the second
    process loaded from disk under ``disk``."""
    from lmcache_core.integrations.vllm.prom_metrics import SERIES

    names = {n for n, _, _ in serve_b.metrics}
    suffix = {"counter": "_total", "histogram": "_count", "gauge": ""}
    for s in SERIES:  # label-less series are exposed from the start, the others once used
        if not s.labels:
            assert s.name + suffix[s.kind] in names, s.name
    w = serve_b.scraped_worker
    loaded = w["loaded_tokens_by_tier"]
    assert loaded.get("disk", 0) > 0
    for tier, n in loaded.items():
        assert serve_b.series("vllm:lmcache_core_hit_tokens_total", tier=tier) == n, tier
    assert serve_b.series("vllm:lmcache_core_hit_tokens_total") == sum(loaded.values())
    assert serve_b.series("vllm:lmcache_core_load_bytes_total") == w["loaded_bytes"]
    assert serve_b.series("vllm:lmcache_core_load_seconds_count", tier="disk") >= 1
    assert serve_b.series("vllm:lmcache_core_tier_healthy", tier="disk") == 1
    disk = serve_b.series("vllm:prompt_tokens_cached_by_source_total", source="disk")
    external = serve_b.series("vllm:external_prefix_cache_hits_total")
    assert disk > 0
    # every connector hit has a tier type: none left unspecified
    assert (
        serve_b.series("vllm:prompt_tokens_cached_by_source_total", source="external_unspecified")
        == 0
    )
    assert (
        disk + serve_b.series("vllm:prompt_tokens_cached_by_source_total", source="host")
        == external
    )
    # vLLM's periodic log line carries the connector's figures (build_kv_connector_stats)
    log = serve_b.log_path.read_text(errors="replace")
    lines = re.findall(r"KV Transfer metrics: (.*)", log)
    assert any("hit_tokens_disk=" in line and "load_bytes=" in line for line in lines), lines
    # the first server stored chunks (its saves are on its series)
    assert serve_a.series("vllm:lmcache_core_save_bytes_total") > 0
    assert serve_a.series("vllm:lmcache_core_save_seconds_count") >= 1


def test_make_serve_command_defaults(
    vllm_models: Models, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make serve``'s command: the server module, 127.0.0.1, the embedded cpu + disk
    storage under the work directory, the connector by its registered name."""
    sys.path.insert(0, str(SERVE.parent))
    import serve

    assert (
        serve.main(
            ["--model-dir", str(vllm_models.main), "--workdir", str(tmp_path), "--print-command"]
        )
        == 0
    )
    cmd = capsys.readouterr().out.split()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    ktc = json.loads(" ".join(cmd[cmd.index("--kv-transfer-config") + 1 :]))
    assert ktc["kv_connector"] == "LMCacheCoreConnector"
    tiers = ktc["kv_connector_extra_config"]["config"]["tiers"]
    assert [t["backend"] for t in tiers] == ["cpu", "disk"]
    assert tiers[1]["options"]["path"] == str(tmp_path.resolve() / "kv")
    # the model maker's chat template is in tokenizer_config.json (chat completions need it)
    tok = json.loads((vllm_models.main / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok["chat_template"]
