"""``lmcache-core config check|show|schema``.

``check FILE`` validates a configuration (backend names, URL schemes, every option), says
which namespace its tiers use and warns when a tier other processes can share uses the
``default`` one, and
opens nothing: no connection, no file besides FILE, and no ``backend_class`` module is
imported (its form is checked, its options are not) unless ``--import`` asks for it: importing
a module runs its code. Installed backends are loaded as usual (their plugins registered
them). Exit status 0 when valid, 1 when not (the error names the config path). ``show FILE`` prints the resolved configuration with
every default filled in and secrets redacted (YAML on a terminal, JSON when piped or with
``--json``). ``schema`` prints the reference tables of every key (Markdown);
``--write-docs FILE`` refreshes them where FILE embeds them between
``<!-- lmcache-core:config-schema -->`` and ``<!-- /lmcache-core:config-schema -->``.
``from-lmcache FILE`` prints the lmcache-core configuration equivalent to an LMCache
configuration file (YAML, ready for ``config_file``; the vLLM connector options it implies
in a comment at the top; ``--json`` for all of it as JSON); the LMCache settings it cannot
honour are named in one warning on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config import CacheConfig, NotImported, load_config, schema_markdown
from ..config.namespaces import configured_namespace, namespace_label, namespace_warnings
from ..errors import ConfigError
from .main import add_output_flags, print_json, rewrite_docs, wants_json

__all__ = ["SCHEMA_BEGIN", "SCHEMA_END", "register", "render_schema_block"]

SCHEMA_BEGIN = "<!-- lmcache-core:config-schema -->"
SCHEMA_END = "<!-- /lmcache-core:config-schema -->"


def register(subparsers: Any) -> None:
    """Add the ``config`` command and its actions."""
    p = subparsers.add_parser(
        "config",
        help="check or show a tier configuration",
        description="Validate, show or document lmcache-core configurations.",
    )
    actions = p.add_subparsers(title="actions", metavar="ACTION")

    c = actions.add_parser(
        "check",
        help="validate FILE (opens no connection)",
        description="Validate a configuration file. Exit 0 when valid, 1 when not.",
    )
    c.add_argument("file", metavar="FILE")
    _add_import_flag(c)
    add_output_flags(c)
    c.set_defaults(func=run_check)

    s = actions.add_parser(
        "show",
        help="print FILE resolved, secrets redacted",
        description="Print the resolved configuration (defaults filled in, secrets redacted).",
    )
    s.add_argument("file", metavar="FILE")
    _add_import_flag(s)
    add_output_flags(s)
    s.set_defaults(func=run_show)

    sc = actions.add_parser(
        "schema",
        help="print the configuration reference (Markdown)",
        description="Print the tables of every configuration key, generated from the schema.",
    )
    sc.add_argument(
        "--write-docs",
        nargs="+",
        metavar="FILE",
        help=f"refresh the tables embedded in FILE between {SCHEMA_BEGIN} and {SCHEMA_END}",
    )
    sc.set_defaults(func=run_schema)

    fl = actions.add_parser(
        "from-lmcache",
        help="print the lmcache-core equivalent of an LMCache config file",
        description="Translate an LMCache configuration file (LMCACHE_CONFIG_FILE) into an "
        "lmcache-core configuration (docs/vllm.md has the table of every key).",
    )
    fl.add_argument("file", metavar="FILE")
    fl.add_argument("--json", action="store_true", help="storage, connector options and notes")
    fl.set_defaults(func=run_from_lmcache)

    def usage(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)


def _add_import_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--import",
        dest="import_classes",
        action="store_true",
        help="import backend_class modules (runs their code) to validate their options too",
    )


def _load(args: argparse.Namespace) -> CacheConfig:
    return load_config(Path(args.file), import_backend_classes=args.import_classes)


def _not_imported(cfg: CacheConfig) -> list[str]:
    return [t.name for t in cfg.tiers if t.backend_cls is NotImported]


def _summary(cfg: CacheConfig) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "backend": t.backend,
            "write_policy": t.write_policy,
            "admit_after": t.admit_after,
        }
        for t in cfg.tiers
    ]


def _fail(args: argparse.Namespace, exc: ConfigError) -> int:
    if wants_json(args):
        print_json({"ok": False, "file": args.file, "path": exc.path, "error": exc.reason})
    else:
        print(f"{args.file}: invalid configuration: {exc}", file=sys.stderr)
    return 1


def run_check(args: argparse.Namespace) -> int:
    """Validate ``args.file``; 0 when valid, 1 when not."""
    try:
        cfg = _load(args)
    except ConfigError as exc:
        return _fail(args, exc)
    skipped = _not_imported(cfg)
    warnings = namespace_warnings(cfg)
    if wants_json(args):
        print_json(
            {
                "ok": True,
                "file": args.file,
                "namespace": namespace_label(configured_namespace(cfg)),
                "tiers": _summary(cfg),
                "not_imported": skipped,
                "warnings": warnings,
            }
        )
    else:
        chain = " -> ".join(
            f"{t.name} ({t.backend}, {t.write_policy}"
            + (f", admit_after={t.admit_after}" if t.admit_after > 1 else "")
            + ")"
            for t in cfg.tiers
        )
        print(f"{args.file}: OK, {len(cfg.tiers)} tier(s): {chain}")
        print(f"  namespace: {namespace_label(configured_namespace(cfg))}")
        for w in warnings:
            print(f"  warning: {w}")
        if skipped:
            print(
                f"  backend_class of {', '.join(skipped)} not imported, its options not "
                "checked (--import does, running the module's code)"
            )
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Print the resolved, redacted configuration of ``args.file``."""
    try:
        cfg = _load(args)
    except ConfigError as exc:
        return _fail(args, exc)
    doc = cfg.to_dict(redact=True)
    if wants_json(args):
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip())
    return 0


def render_schema_block(text: str) -> str:
    """``text`` with the block between the schema markers replaced by fresh tables."""
    begin = text.find(SCHEMA_BEGIN)
    end = text.find(SCHEMA_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {SCHEMA_BEGIN} ... {SCHEMA_END} block")
    return text[: begin + len(SCHEMA_BEGIN)] + "\n" + schema_markdown() + text[end:]


def run_schema(args: argparse.Namespace) -> int:
    """Print the schema tables, or refresh them in the given docs."""
    if not args.write_docs:
        print(schema_markdown(), end="")
        return 0
    return rewrite_docs(args.write_docs, render_schema_block, (ValueError,))


def run_from_lmcache(args: argparse.Namespace) -> int:
    """Print the lmcache-core equivalent of the LMCache configuration ``args.file``."""
    from ..config.lmcache_compat import from_lmcache, read_lmcache_file

    try:
        tr = from_lmcache(read_lmcache_file(args.file))
    except ConfigError as exc:
        print(f"{args.file}: cannot translate: {exc}", file=sys.stderr)
        return 1
    warning = tr.warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print_json(
            {
                "storage": tr.storage,
                "connector": tr.connector,
                "not_honoured": [{"key": k, "reason": why} for k, why in tr.not_honoured],
            }
        )
        return 0
    print(f"# lmcache-core configuration translated from the LMCache configuration {args.file}")
    if tr.connector:
        print(
            "# vLLM connector options it implies (kv_connector_extra_config): "
            + json.dumps(tr.connector, sort_keys=True)
        )
    print(yaml.safe_dump(tr.storage, sort_keys=False, default_flow_style=False).rstrip())
    return 0
