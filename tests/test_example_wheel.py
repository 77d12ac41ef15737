"""The tutorial's example backend, installed the way a user installs it.

``examples/lmcache-backend-sqlite`` is built as a wheel and ``pip install --no-deps``-ed
into a throwaway venv that sees this project's environment through a ``.pth`` file
(``site.addsitedir`` of ``.venv``'s site-packages, so its editable installs work too; a
``--system-site-packages`` venv would see the base interpreter's packages instead). In
that venv: ``lmcache-core plugins`` lists it, ``backends`` shows its options, a tier
configured with it works through the hierarchy (and its data is there for the next
process), and its contract tests pass against the installed package.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lmcache-backend-sqlite"
DIST = "lmcache-backend-sqlite"


def sh(
    *cmd: str | Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
):
    res = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert res.returncode == 0, (
        f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return res


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A throwaway venv holding only the example's wheel, seeing ``.venv``'s packages."""
    tmp = tmp_path_factory.mktemp("example-wheel")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_CORE_", "PYTHON"))}
    env["PIP_NO_INPUT"] = "1"
    pip = [sys.executable, "-m", "pip"]
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    source = tmp / "source"
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    sh(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
       "-w", tmp / "dist", source, env=env)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("lmcache_backend_sqlite-*.whl")
    venv = tmp / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv, env=env)
    python = venv / "bin" / "python"
    purelib = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    ours = Path(purelib.stdout.strip())
    (ours / "_lmcache_project_env.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n"
    )
    sh(*pip, "--python", python, "install", "--no-deps", "--no-index", "-q", wheel, env=env)
    env["LMCACHE_CORE_STRICT_PLUGINS"] = "1"  # a broken plugin fails the run here
    return python, env


def cli(user_venv: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    python, env = user_venv
    return sh(python, "-m", "lmcache_core.cli", *args, env=env)


def test_the_installed_wheel_is_what_runs(user_venv):
    python, env = user_venv
    res = sh(python, "-c", "import lmcache_backend_sqlite as m, lmcache_core as c; "
             "print(m.__file__); print(c.__file__)", env=env)  # fmt: skip
    mine, core = res.stdout.split()
    assert mine.startswith(str(python.parents[1])), mine  # from the wheel, not from src/
    assert core.startswith(str(ROOT)), core  # the project's editable lmcache-core


def test_plugins_lists_it(user_venv):
    doc = json.loads(cli(user_venv, "plugins", "--json", "--strict").stdout)
    (row,) = [p for p in doc["plugins"] if p["name"] == DIST]
    assert (row["status"], row["version"], row["distribution"]) == ("ok", "0.1.0", DIST)
    assert row["hooks"] == ["lmcache_register_backends"] and row["backends"] == ["sqlite"]
    assert row["problems"] == []


def test_backends_shows_its_options(user_venv):
    doc = json.loads(cli(user_venv, "backends", "sqlite", "--json").stdout)
    (b,) = doc["backends"]
    assert (b["provider"], b["status"]) == (DIST, "ok")
    assert b["capabilities"]["persistent"] and b["capabilities"]["shared"]
    options = {o["name"]: o for o in b["options"]}
    assert set(options) == {"path", "timeout_s", "synchronous", "max_concurrency"}
    assert options["path"]["required"] and options["synchronous"]["choices"] == [
        "off",
        "normal",
        "full",
    ]


HIERARCHY_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, torch
    from lmcache_core import CacheEngineKey, TieredHierarchy, load_config

    db, mode = sys.argv[1], sys.argv[2]
    tiers = [{"name": "hot", "backend": "cpu", "options": {"max_bytes": "64MiB"}}]
    tiers.append({"name": "db", "backend": "sqlite", "options": {"path": db}})
    cfg = load_config({"chunk_size": 256, "tiers": tiers if mode == "put" else tiers[1:]})
    keys = [CacheEngineKey("m", 1, 0, 1000 + i, "float16") for i in range(3)]
    values = [torch.full((4096,), float(i), dtype=torch.float16) for i in range(3)]

    async def main():
        async with TieredHierarchy.from_config(cfg) as h:
            if mode == "put":
                for k, v in zip(keys, values):
                    assert await h.put(k, v)
                await h.flush()
                assert h.stats()["tiers"][1]["name"] == "db"
            found = await h.lookup_prefix(keys)
            assert found.num_hit == 3, found
            for k, v in zip(keys, values):
                assert torch.equal(await h.get(k), v)
            print(mode, "ok", found.counts())

    asyncio.run(main())
    """
)


def test_a_tier_configured_with_it_works_through_the_hierarchy(user_venv, tmp_path):
    python, env = user_venv
    script = tmp_path / "tiers.py"
    script.write_text(HIERARCHY_SCRIPT)
    db = tmp_path / "kv.db"
    assert "put ok" in sh(python, script, db, "put", env=env).stdout
    assert db.stat().st_size > 3 * 8192  # the chunks went down to the sqlite tier
    # a fresh process with only the sqlite tier finds what the first one stored
    assert "get ok" in sh(python, script, db, "get", env=env).stdout


def test_its_contract_tests_pass_against_the_installed_package(user_venv):
    python, env = user_venv
    res = sh(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", EXAMPLE / "tests",
             env=env, cwd=EXAMPLE, timeout=400)  # fmt: skip
    assert " passed" in res.stdout and "failed" not in res.stdout
