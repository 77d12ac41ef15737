"""``lmcache-core plugins`` and ``lmcache-core backends``.

``plugins`` lists every discovered plugin (the built-in one included) with its version,
status (``ok``/``failed``/``incompatible``/``disabled``/``misconfigured``) and error, the
hooks it implements, the backends and URL schemes it registered and the backends it
replaced (``override=True``). A broken plugin is a row in that report, never a crash;
``--strict`` (or ``LMCACHE_CORE_STRICT_PLUGINS=1``) also imports and checks every
registered backend class, and makes the command exit 1 when a plugin or a class failed.

``backends`` lists every registered backend with its provider (and whose backend it
replaced), schemes, capabilities and options (type, default, description), all generated
from the backend's ``Options``; ``--markdown`` prints the option tables the docs embed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from ..errors import UnknownBackendError
from ..interface import INTERFACE_VERSION, RuntimeNote, implements, supported_interface_range
from ..plugins.backend_options import (
    describe_backend_options,
    options_markdown,
    render_options_blocks,
)
from ..plugins.checks import backend_class_check, spec_problems
from ..plugins.compat import core_version
from ..plugins.hookspecs import HOOKSPEC_VERSION
from ..plugins.loader import load_plugins
from ..plugins.registry import KNOWN_BACKENDS, BackendRegistry, BackendSpec, install_hint
from ..plugins.report import ERROR_STATUSES
from ..plugins.settings import PluginSettings
from ..tables import format_table
from .main import add_output_flags, print_json, rewrite_docs, wants_json

__all__ = ["backends_report", "plugins_report", "register"]


def register(subparsers: Any) -> None:
    """Add the ``plugins`` and ``backends`` subcommands."""
    p = subparsers.add_parser(
        "plugins",
        help="list plugins: version, status, hooks, backends",
        description="List discovered lmcache-core plugins and what each registered.",
    )
    add_output_flags(p)
    p.add_argument(
        "--strict",
        action="store_true",
        help="also import and check every backend class; exit 1 when a plugin or a class "
        "failed (default from LMCACHE_CORE_STRICT_PLUGINS)",
    )
    p.set_defaults(func=run_plugins)

    b = subparsers.add_parser(
        "backends",
        help="list backends with their options",
        description="List registered storage backends with their URL schemes and options.",
    )
    b.add_argument("names", nargs="*", metavar="NAME", help="only these backends")
    add_output_flags(b)
    b.add_argument(
        "--markdown",
        dest="output",
        action="store_const",
        const="markdown",
        help="print the option tables as Markdown (what the docs embed)",
    )
    b.add_argument(
        "--write-docs",
        nargs="+",
        metavar="FILE",
        help="regenerate the option tables embedded in these Markdown files "
        "(between <!-- lmcache-core:options NAME --> and <!-- /lmcache-core:options -->)",
    )
    b.set_defaults(func=run_backends)


# --------------------------------------------------------------------------- data
def _load_registry() -> tuple[BackendRegistry, bool]:
    """A registry loaded without strict mode (so broken plugins are reported, not raised)."""
    settings = PluginSettings.from_env()
    reg = BackendRegistry()
    load_plugins(reg, settings=dataclasses.replace(settings, strict=False))
    return reg, settings.strict


def plugins_report(reg: BackendRegistry, *, check_classes: bool = False) -> dict[str, Any]:
    """The ``plugins --json`` document for a loaded registry.

    ``check_classes`` imports every registered backend class and lists what is wrong
    with it under its plugin's ``problems`` (a plugin with problems counts as failed).
    """
    plugins = []
    for info in reg.plugins:
        mine = [s for s in reg.specs() if s.provider == info.name]
        entry = info.as_dict()
        entry["backends"] = [s.name for s in mine]
        entry["schemes"] = sorted(sch for s in mine for sch in s.schemes)
        entry["overrides"] = [
            {"backend": s.name, "replaces": s.replaces} for s in mine if s.replaces
        ]
        entry["problems"] = (
            [p for s in mine for p in spec_problems(s)]
            if check_classes and info.status == "ok"
            else []
        )
        plugins.append(entry)
    return {
        "core_version": core_version(),
        "hookspec_version": HOOKSPEC_VERSION,
        "interface_version": INTERFACE_VERSION,
        "supported_interface": supported_interface_range(),
        "plugins": plugins,
    }


def _backend_entry(reg: BackendRegistry, spec: BackendSpec) -> dict[str, Any]:
    version = next((p.version for p in reg.plugins if p.name == spec.provider), None)
    entry: dict[str, Any] = {
        "name": spec.name,
        "provider": spec.provider,
        "version": version,
        "target": spec.target_text,
        "replaces": spec.replaces,
        "schemes": list(spec.schemes),
        "install_hint": spec.install_hint,
        "status": "ok",
        "error": None,
        "capabilities": None,
        "interface": None,
        "options": [],
        "runtime": None,
    }
    try:
        cls = spec.load()
        checked = backend_class_check(cls)
        if checked.capabilities is not None:
            entry["capabilities"] = dataclasses.asdict(checked.capabilities)
        entry["interface"] = {
            "version": checked.interface_version,
            "optional": checked.optional,
            "warnings": checked.warnings,
        }
        if checked.problems:
            raise TypeError("; ".join(checked.problems))
        entry["options"] = describe_backend_options(cls)
        entry["runtime"] = _runtime_note(cls)
    except Exception as exc:  # a broken backend is a row of the report, not a crash
        entry["status"] = "failed"
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


def _runtime_note(cls: Any) -> str | None:
    """What the backend would use in this process, when its class says (an optional
    ``runtime_note()`` classmethod: the ``gds`` backend names its I/O path)."""
    if not implements(cls, RuntimeNote):
        return None
    try:
        return str(cls.runtime_note())
    except Exception as exc:  # a probe that fails is a line of the report
        return f"unknown ({type(exc).__name__}: {exc})"


def backends_report(reg: BackendRegistry, names: list[str] | None = None) -> dict[str, Any]:
    """The ``backends --json`` document (raises UnknownBackendError for an unknown name)."""
    specs = [reg.get(n) for n in names] if names else reg.specs()
    missing = [
        {"name": n, "distribution": dist, "install": install_hint(dist)}
        for n, dist in sorted(KNOWN_BACKENDS.items())
        if n not in reg and not names
    ]
    return {
        "backends": [_backend_entry(reg, s) for s in specs],
        "not_installed": missing,
    }


# --------------------------------------------------------------------------- commands
def run_plugins(args: argparse.Namespace) -> int:
    """``lmcache-core plugins``."""
    reg, strict_env = _load_registry()
    strict = bool(args.strict or strict_env)
    report = plugins_report(reg, check_classes=strict)
    if wants_json(args):
        print_json(report)
    else:
        rows = [
            [
                p["name"],
                p["version"],
                p["status"],
                ", ".join(p["hooks"]) or None,
                ", ".join(p["backends"]) or None,
                ", ".join(p["schemes"]) or None,
            ]
            for p in report["plugins"]
        ]
        header = ["PLUGIN", "VERSION", "STATUS", "HOOKS", "BACKENDS", "SCHEMES"]
        print(format_table(rows, header))
        print(
            f"\nlmcache-core {report['core_version']}, hook interface {HOOKSPEC_VERSION}, "
            f"backend interface {INTERFACE_VERSION} (loads {supported_interface_range()})"
        )
        for p in report["plugins"]:
            if p["error"]:
                print(f"{p['name']}: {p['status']}: {p['error']}")
            for o in p["overrides"]:
                print(
                    f"{p['name']}: replaces backend {o['backend']!r} of {o['replaces']} "
                    "(override=True)"
                )
            for problem in p["problems"]:
                print(f"{p['name']}: failed: {problem}")
    failed = [p for p in report["plugins"] if p["status"] in ERROR_STATUSES or p["problems"]]
    return 1 if failed and strict else 0


def _print_backends_table(report: dict[str, Any]) -> None:
    rows = [
        [
            b["name"],
            b["provider"] + (f" (replaces {b['replaces']})" if b["replaces"] else ""),
            b["version"],
            ", ".join(b["schemes"]) or None,
            b["status"],
        ]
        for b in report["backends"]
    ]
    print(format_table(rows, ["BACKEND", "PROVIDER", "VERSION", "SCHEMES", "STATUS"]))
    for b in report["backends"]:
        print(f"\n{b['name']} ({b['target']})")
        if b["error"]:
            print(f"  failed: {b['error']}")
            continue
        if b["capabilities"]:
            caps = [k for k, v in b["capabilities"].items() if v]
            print(f"  capabilities: {', '.join(caps) or 'none'}")
        iface = b["interface"]
        if iface:
            print(f"  interface: {iface['version'] or 'undeclared'}")
            print(f"  optional protocols: {', '.join(iface['optional']) or 'none'}")
            for w in iface["warnings"]:
                print(f"  warning: {w}")
        if b.get("runtime"):
            print(f"  runtime: {b['runtime']}")
        opt_rows = [
            [o["name"], o["type"], o["default_text"] or None, o["doc"]] for o in b["options"]
        ]
        if opt_rows:
            table = format_table(opt_rows, ["OPTION", "TYPE", "DEFAULT", "DESCRIPTION"])
            print("\n".join("  " + line for line in table.splitlines()))
    if report["not_installed"]:
        print("\nNot installed:")
        for m in report["not_installed"]:
            print(f"  {m['name']}: {m['install']}")


def write_docs(reg: BackendRegistry, files: list[str]) -> int:
    """Regenerate the embedded option tables of ``files``; 1 if a backend is unknown."""
    return rewrite_docs(
        files, lambda text: render_options_blocks(text, reg.get), (UnknownBackendError,)
    )


def run_backends(args: argparse.Namespace) -> int:
    """``lmcache-core backends``."""
    reg, _ = _load_registry()
    if args.write_docs:
        return write_docs(reg, args.write_docs)
    try:
        report = backends_report(reg, list(args.names))
    except UnknownBackendError as exc:
        print(f"lmcache-core: {exc}", file=sys.stderr)
        return 1
    if args.output == "markdown":
        for b in report["backends"]:
            print(f"### `{b['name']}` options\n")
            try:
                print(options_markdown(reg.get(b["name"])))
            except Exception as exc:
                print(f"(cannot load: {type(exc).__name__}: {exc})\n")
        return 0
    if wants_json(args):
        print_json(report)
    else:
        _print_backends_table(report)
    return 1 if any(b["status"] != "ok" for b in report["backends"]) and args.names else 0
