"""The ``lmcache-core`` command: a thin dispatcher over subcommand modules.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its
subcommands with ``parser.set_defaults(func=handler)``; ``handler(args) -> int`` returns
the exit status. A module that is not there is skipped silently; one that fails to import
is skipped with a note on stderr, so a broken subcommand never takes the others down.
Plugins add theirs the same way through the ``lmcache_register_commands(subparsers)``
hook (:func:`add_plugin_commands`); a hook that raises is reported and its commands are
left out.

Shared output helpers (:func:`add_output_flags`, :func:`wants_json`, :func:`print_json`,
:func:`lmcache_core.tables.format_table`) keep every subcommand's output alike: a table
on a terminal, JSON when stdout is not a terminal or with ``--json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COMMAND_MODULES",
    "add_output_flags",
    "add_plugin_commands",
    "build_parser",
    "main",
    "print_json",
    "wants_json",
]

COMMAND_MODULES = [
    "lmcache_core.cli.plugins",
    "lmcache_core.cli.config",
    "lmcache_core.cli.inspect",
    "lmcache_core.cli.maint",
    "lmcache_core.cli.simulate",
    "lmcache_core.cli.bench",
]


def _import_command_module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None  # not written (or not shipped): skip silently
        print(f"lmcache-core: commands of {name} unavailable: {exc}", file=sys.stderr)
    except Exception as exc:
        print(
            f"lmcache-core: commands of {name} unavailable: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
    return None


def _version() -> str:
    from ..plugins.compat import core_version

    return core_version()


def _speedups() -> str:
    """Whether the optional compiled helper (``lmcache_core._speedups``) was built."""
    try:
        from .. import _speedups  # noqa: F401  (a tiny C module: no numpy, no torch)
    except ImportError:
        return "compiled speedups: off (not built at install: pure-Python fallbacks)"
    return "compiled speedups: on"


def add_plugin_commands(subparsers: Any, pm: Any | None = None) -> list[str]:
    """Call every plugin's ``lmcache_register_commands(subparsers)`` hook, each on its own.

    ``pm`` is the plugin manager (default: the process-wide registry's). A hook that
    raises, or adds a command name already taken, is reported on stderr and whatever it
    added is removed again. Returns the names of the plugins whose hook failed.
    """
    if pm is None:
        from ..plugins import get_registry

        try:
            pm = get_registry().plugin_manager
        except Exception as exc:  # strict plugin loading: the built-in commands still work
            print(f"lmcache-core: plugin commands unavailable: {_describe(exc)}", file=sys.stderr)
            return []
        if pm is None:
            return []
    failed: list[str] = []
    for impl in pm.hook.lmcache_register_commands.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        before_names = dict(subparsers.choices)
        before_help = list(subparsers._choices_actions)
        try:
            impl.function(subparsers=subparsers)
        except (Exception, SystemExit) as exc:  # a plugin must not take the CLI down
            subparsers.choices.clear()
            subparsers.choices.update(before_names)
            subparsers._choices_actions[:] = before_help
            print(
                f"lmcache-core: commands of plugin {name} unavailable: {_describe(exc)}",
                file=sys.stderr,
            )
            failed.append(name)
    return failed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def build_parser(
    modules: Sequence[str] = COMMAND_MODULES, *, plugin_manager: Any | None = None
) -> argparse.ArgumentParser:
    """The argument parser with the subcommands of every importable module in ``modules``
    and of every plugin's ``lmcache_register_commands`` hook (``plugin_manager``: the
    manager whose plugins are asked; default: the process-wide registry's)."""
    parser = argparse.ArgumentParser(
        prog="lmcache-core",
        description="Tiered KV-cache storage for LLM serving: plugins, backends, tiers, data.",
    )
    parser.add_argument(
        "--version", action="version", version=f"lmcache-core {_version()} ({_speedups()})"
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in modules:
        module = _import_command_module(name)
        if module is None:
            continue
        register: Callable[[Any], None] | None = getattr(module, "register", None)
        if register is None:
            print(f"lmcache-core: {name} has no register(subparsers)", file=sys.stderr)
            continue
        register(subparsers)
    add_plugin_commands(subparsers, plugin_manager)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmcache-core`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lmcache-core plugins | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


# --------------------------------------------------------------------------- output helpers
def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--json`` / ``--table``: force one output form (default: table on a terminal)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", help="print JSON"
    )
    group.add_argument(
        "--table", dest="output", action="store_const", const="table", help="print a table"
    )
    parser.set_defaults(output=None)


def wants_json(args: argparse.Namespace) -> bool:
    """JSON when asked for, or when stdout is not a terminal and no table was asked for."""
    output = getattr(args, "output", None)
    if output is not None:
        return bool(output == "json")
    return not sys.stdout.isatty()


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON (non-JSON values as their ``str``)."""
    print(json.dumps(data, indent=2, default=str))


def rewrite_docs(
    files: Sequence[str],
    render: Callable[[str], str],
    errors: tuple[type[Exception], ...] = (),
) -> int:
    """Replace each file's text with ``render(text)``; print what happened to each file.

    A file that cannot be read or rendered (``OSError`` or one of ``errors``) is reported
    on stderr and makes the result 1; the others are still processed.
    """
    caught: tuple[type[Exception], ...] = (OSError, *errors)
    status = 0
    for name in files:
        path = Path(name)
        try:
            old = path.read_text(encoding="utf-8")
            new = render(old)
        except caught as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            status = 1
            continue
        if new != old:
            path.write_text(new, encoding="utf-8")
            print(f"{name}: updated")
        else:
            print(f"{name}: up to date")
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
