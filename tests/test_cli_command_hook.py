"""The ``lmcache_register_commands`` hook: a plugin's subcommands in the real console script.

Plugins are real ``*.dist-info`` folders on ``PYTHONPATH`` (see ``test_cli_plugins``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

import lmcfix_commands
import lmcfix_commands_broken
from fakedist import write_dist_info
from test_cli_plugins import run

from lmcache_core.cli.main import add_plugin_commands
from lmcache_core.plugins.loader import new_plugin_manager


def test_plugin_command_is_listed_in_help_and_runs(tmp_path: Path) -> None:
    write_dist_info(tmp_path, "lmcfix-commands", "lmcfix_commands")
    helped = run("--help", path=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "fixture-hello" in helped.stdout
    assert "say hello (fixture plugin)" in helped.stdout
    ran = run("fixture-hello", "world", path=tmp_path)
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout.strip() == "hello from the fixture plugin, world"
    # the built-in commands are all still there
    assert "verify" in helped.stdout and "backends" in helped.stdout


def test_plugins_lists_the_command_hook(tmp_path: Path) -> None:
    write_dist_info(tmp_path, "lmcfix-commands", "lmcfix_commands")
    out = run("plugins", "--json", path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"lmcache_register_commands"' in out.stdout


def _parser_with(
    *plugins: object,
) -> tuple[argparse._SubParsersAction[argparse.ArgumentParser], list[str]]:
    pm = new_plugin_manager()
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"fixture-{i}")
    parser = argparse.ArgumentParser(prog="t")
    sub = parser.add_subparsers()
    sub.add_parser("verify")
    failed = add_plugin_commands(sub, pm)
    return sub, failed


def test_a_raising_hook_is_reported_and_rolled_back(capsys: pytest.CaptureFixture[str]) -> None:
    sub, failed = _parser_with(lmcfix_commands_broken.RAISES, lmcfix_commands)
    err = capsys.readouterr().err
    assert failed == ["fixture-0"]
    assert "commands of plugin fixture-0 unavailable: RuntimeError: command hook exploded" in err
    assert set(sub.choices) == {"verify", "fixture-hello"}  # fixture-half was removed
    assert [a.dest for a in sub._choices_actions] == ["fixture-hello"]


def test_a_clashing_name_is_reported_and_keeps_the_builtin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sub, failed = _parser_with(lmcfix_commands_broken.CLASHES)
    err = capsys.readouterr().err
    assert failed == ["fixture-0"]
    assert "conflicting subparser: verify" in err
    assert set(sub.choices) == {"verify"}


def test_broken_command_hook_does_not_crash_the_cli(tmp_path: Path) -> None:
    write_dist_info(tmp_path, "lmcfix-commands-broken", "lmcfix_commands_broken:RAISES")
    write_dist_info(tmp_path, "lmcfix-commands", "lmcfix_commands")
    helped = run("--help", path=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert (
        "lmcache-core: commands of plugin lmcfix-commands-broken unavailable: "
        "RuntimeError: command hook exploded"
    ) in helped.stderr
    assert "fixture-hello" in helped.stdout and "fixture-half" not in helped.stdout
    ran = run("fixture-hello", "again", path=tmp_path)
    assert ran.returncode == 3 and "again" in ran.stdout
