"""A plugin registering backend classes that get the declared interface wrong."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_iface_backends:FutureBackend", name="future")
    registry.add("lmcfix_iface_backends:HalfPinsBackend", name="halfpins")
    registry.add("lmcfix_iface_backends:ThreadSafeContainsBackend", name="tscontains")
