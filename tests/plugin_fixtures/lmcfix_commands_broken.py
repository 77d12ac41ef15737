"""Two broken command hooks: one raises after adding a command, one takes a built-in name."""

from lmcache_core.plugins import hookimpl


class _Raises:
    @staticmethod
    @hookimpl
    def lmcache_register_commands(subparsers):
        subparsers.add_parser("fixture-half", help="left behind if the CLI did not roll back")
        raise RuntimeError("command hook exploded")


class _Clashes:
    @staticmethod
    @hookimpl
    def lmcache_register_commands(subparsers):
        subparsers.add_parser("verify", help="takes a built-in command's name")


RAISES = _Raises()
CLASHES = _Clashes()
