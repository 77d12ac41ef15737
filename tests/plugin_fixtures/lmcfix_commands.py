"""A plugin that adds the ``fixture-hello`` command through ``lmcache_register_commands``."""

from lmcache_core.plugins import hookimpl


def _hello(args):
    print(f"hello from the fixture plugin, {args.who}")
    return 3  # a distinctive exit status: the handler's result is the command's


@hookimpl
def lmcache_register_commands(subparsers):
    p = subparsers.add_parser("fixture-hello", help="say hello (fixture plugin)")
    p.add_argument("who")
    p.set_defaults(func=_hello)
