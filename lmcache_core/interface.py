"""The backend interface, declared once: required methods, optional capabilities, version.

Every tier implements :class:`StorageBackend` (the required async methods). Anything more
a backend can do is one of the named optional protocols below; the hierarchy, the
:class:`~lmcache_core.sync.SyncBackend` facade, the CLI and the vLLM connector use a
capability only after :func:`implements` says the backend has it, and registration,
``lmcache-core backends`` and ``plugins --strict`` check a class with
:func:`check_backend_class`, which names what is missing.

A backend class declares the interface version it was written for::

    class MyBackend(BaseBackend):
        interface_version = "1.1"

Its major version must equal :data:`INTERFACE_VERSION`'s and its minor version must not
be newer (:func:`interface_version_problem` names the supported range).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, TypeVar, runtime_checkable

from .keys import CacheEngineKey

if TYPE_CHECKING:
    import torch

    from .hierarchy.tiered import PrefixLookup

__all__ = [
    "INTERFACE_VERSION",
    "MIN_INTERFACE_VERSION",
    "OPTIONAL_PROTOCOLS",
    "REQUIRED_METHODS",
    "BatchedPinning",
    "Capabilities",
    "ClassCheck",
    "EntryCharges",
    "EntryChecks",
    "EntryInfo",
    "EvictionEvents",
    "EvictionListener",
    "MaintainableBackend",
    "OpensForMaintenance",
    "Pinning",
    "PrefixContains",
    "PrefixLookups",
    "ProgressCallback",
    "Reconcilable",
    "ReservedPuts",
    "RuntimeNote",
    "StorageBackend",
    "ThreadSafeBorrows",
    "ThreadSafeContains",
    "ThreadSafeLoads",
    "ThreadSafeLookups",
    "ThreadSafePuts",
    "VictimSelection",
    "VictimSelector",
    "check_backend_class",
    "implements",
    "interface_version_problem",
    "missing_members",
    "pins_do_io",
    "supported_interface_range",
]

#: The backend interface this lmcache-core provides (``major.minor``). A new optional
#: protocol raises the minor version; a change to a required method raises the major.
INTERFACE_VERSION = "1.2"
#: The oldest interface version a backend may declare and still load.
MIN_INTERFACE_VERSION = "1.0"

P = TypeVar("P")


# ---------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class Capabilities:
    """What a backend is; drives which contract tests apply and how tiers are used.

    ``persistent``: data survives ``close()`` and reopening. ``shared``: other processes
    opening the same location see the same data. ``bounded``: a capacity bound
    (``max_bytes``) is enforced. ``zero_copy``: ``get_into`` fills the caller's buffer
    without an intermediate copy.
    """

    persistent: bool = False
    shared: bool = False
    bounded: bool = False
    zero_copy: bool = False


@dataclass(frozen=True)
class EntryInfo:
    """One stored object as a scan sees it (the header is read only when asked)."""

    location: str  # backend-specific (a relative path, an object key)
    size: int  # bytes on the medium
    last_access: float  # unix time of the last read or write, as well as the tier knows
    key: str | None = None  # CacheEngineKey string, when read from the header
    namespace: str | None = None  # namespace JSON, when read from the header


#: ``progress(done, total_or_None)`` called now and then during long scans.
ProgressCallback = Callable[[int, int | None], None]

#: ``listener(key, tensor) -> bool | None``, called before an entry is evicted for
#: capacity; returning ``True`` takes the tensor's memory (zero-copy hand-over).
EvictionListener = Callable[[CacheEngineKey, "torch.Tensor"], "bool | None"]

#: ``selector(candidates, nbytes) -> victims``: ``candidates`` are evictable keys, least
#: recently used first (never pinned or in-flight ones); ``nbytes`` is the room needed.
#: The backend evicts the returned keys in order (ignoring any not among the candidates)
#: and falls back to its own order for whatever room is still missing.
VictimSelector = Callable[[Sequence[CacheEngineKey], int], Sequence[CacheEngineKey]]


# ---------------------------------------------------------------------------- required
@runtime_checkable
class StorageBackend(Protocol):
    """The interface every tier implements (required). All I/O methods are coroutines.

    Semantics (checked by the contract suite in :mod:`lmcache_core.testing`): ``start``
    is idempotent and the only place for set-up I/O; ``get`` returns ``None`` on a miss
    and a tensor the caller owns; ``get_into`` loads into a caller-owned contiguous
    buffer; ``put`` is an idempotent overwrite that copies unless ``donate=True``;
    batched variants keep their input's order; ``close`` is idempotent.
    """

    name: str

    @property
    def capabilities(self) -> Capabilities:
        """What the backend declares about itself (read-only: a class attribute or an
        instance attribute both satisfy it)."""
        ...

    async def start(self) -> None:
        """Open resources (idempotent; the only place for set-up I/O)."""
        ...

    async def close(self) -> None:
        """Release resources (idempotent)."""
        ...

    async def contains(self, key: CacheEngineKey) -> bool:
        """Whether ``key`` is stored (a cheap check; a later ``get`` may still miss)."""
        ...

    async def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        """The stored tensor (owned by the caller), or ``None`` on a miss."""
        ...

    async def get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        """Load ``key`` into the caller's buffer ``out``; ``True`` on a hit.

        A cancelled call may go on writing into ``out`` until a read or copy it started
        in a thread is over: a caller that cancels does not reuse ``out`` for other data
        (the hierarchy's load deadlines and ``SyncBackend``'s timeout load into private
        buffers for this reason)."""
        ...

    async def put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool = False) -> bool:
        """Store ``value`` under ``key`` (overwriting); ``True`` when stored."""
        ...

    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete ``key``; ``True`` when something was removed."""
        ...

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """``contains`` for each key, in order."""
        ...

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        """``get`` for each key, in order."""
        ...

    async def batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        """``get_into`` for each (key, out) pair, in order."""
        ...

    async def batched_put(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor],
        donate: bool = False,
    ) -> list[bool]:
        """``put`` for each (key, value) pair, in order (a later duplicate wins)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and usage (a fresh dict; safe to serialise as JSON)."""
        ...


# ---------------------------------------------------------------------------- optional
# Thread-safe fast paths: callable from any thread, without the backend's event loop.
# Each must be safe from several threads at once while the loop runs the backend's other
# operations, never block on I/O or wait for the loop, and give the same answers and leave
# the same state as its async counterpart. Per item, ``None`` means "not decided here"
# (the caller asks the async method about those items only); ``None`` overall means
# nothing was done (not started, say) and the async method will raise any error.
@runtime_checkable
class ThreadSafeLoads(Protocol):
    """Optional: loads into caller buffers from any thread (``cpu`` has it)."""

    def try_batched_get_into_threadsafe(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool | None] | None:
        """``batched_get_into``: ``True`` loaded into the buffer, ``False`` not stored."""
        ...


@runtime_checkable
class ThreadSafeContains(Protocol):
    """Optional: presence checks from any thread.

    A backend with this capability that also has :class:`Pinning` declares its pin
    methods thread-safe: the hierarchy takes and ends leases from its callers' threads.
    """

    def try_batched_contains_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[bool | None] | None:
        """``batched_contains``: ``True``/``False`` per key."""
        ...


@runtime_checkable
class ThreadSafePuts(Protocol):
    """Optional: stores from any thread."""

    def try_batched_put_threadsafe(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], donate: bool = False
    ) -> list[bool | None] | None:
        """``batched_put``: ``True`` stored, ``False`` refused. Pairs after the first
        undecided one must be left undecided (the async path then stores them in order)."""
        ...


@runtime_checkable
class PrefixLookups(Protocol):
    """Optional: prefix lookups with leases (the tiered hierarchy has it)."""

    async def lookup_prefix(
        self, keys: Sequence[CacheEngineKey], lease_s: float | None = None
    ) -> PrefixLookup:
        """How many leading ``keys`` are stored, and where; with ``lease_s`` the chunks
        found are pinned until :meth:`release` or until the lease runs out."""
        ...

    async def release(self, keys: Sequence[CacheEngineKey]) -> int:
        """End one lease per key taken by :meth:`lookup_prefix`; how many ended."""
        ...


@runtime_checkable
class ThreadSafeLookups(Protocol):
    """Optional: :class:`PrefixLookups` from any thread, all or nothing."""

    def try_lookup_prefix_threadsafe(
        self, keys: Sequence[CacheEngineKey], lease_s: float | None = None
    ) -> PrefixLookup | None:
        """``lookup_prefix``; ``None`` takes no lease (the caller uses the async path)."""
        ...

    def try_release_threadsafe(self, keys: Sequence[CacheEngineKey]) -> int | None:
        """``release``; ``None`` ends nothing (the caller uses the async path)."""
        ...


@runtime_checkable
class PrefixContains(Protocol):
    """Optional: a native prefix check (the byte-store base has one)."""

    async def contains_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` are stored (keys after that count as missing)."""
        ...


@runtime_checkable
class EvictionEvents(Protocol):
    """Optional: eviction events, needed by a ``write.policy: back`` tier below this one."""

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Call ``listener(key, tensor)`` before an entry is evicted for capacity (``None``
        stops). The tensor is valid during the call only, unless the listener returns
        ``True``: it then owns that memory and the backend never reuses it."""
        ...


@runtime_checkable
class Pinning(Protocol):
    """Optional: pins, so that a lease keeps a chunk from eviction until it is loaded.

    A backend whose ``pin``/``unpin`` do I/O that may wait (index transactions, as the
    disk backend's) also sets the class attribute ``pins_do_io = True``
    (:func:`pins_do_io`): callers that must not block then do not pin from their thread.
    """

    def pin(self, key: CacheEngineKey) -> object | None:
        """Keep ``key``'s entry from eviction; a handle for :meth:`unpin`, ``None`` when
        ``key`` is not stored. Pins nest."""
        ...

    def unpin(self, handle: object) -> None:
        """Undo one :meth:`pin` (``handle`` is what it returned)."""
        ...


@runtime_checkable
class BatchedPinning(Protocol):
    """Optional, with :class:`Pinning`: many pins in one call (under one lock, say)."""

    def pin_many(self, keys: Sequence[CacheEngineKey]) -> list[object | None]:
        """:meth:`Pinning.pin` for each key, in order."""
        ...

    def unpin_many(self, handles: Sequence[object]) -> None:
        """:meth:`Pinning.unpin` for each handle."""
        ...


@runtime_checkable
class ThreadSafeBorrows(Protocol):
    """Optional: read-only views of stored chunks, from any thread (``cpu`` has it).

    A borrow is a pin that also hands out the stored tensor itself, so a caller copies
    straight out of the tier (one copy instead of two through a buffer of its own).
    While borrowed, an entry is never evicted, recycled or overwritten in place (an
    explicit overwrite or removal installs or drops the *index* entry; the borrowed
    memory is kept until :meth:`end_borrows`). The caller must not write into the view
    and must end every borrow it took, after its last read (a device copy included).
    """

    def try_borrow_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[tuple[object, torch.Tensor] | None] | None:
        """Per key ``(handle, view)`` or ``None`` (not stored here); ``None`` overall
        when nothing was borrowed (not started, say)."""
        ...

    def end_borrows(self, handles: Sequence[object]) -> None:
        """End the borrows ``handles`` (what :meth:`try_borrow_threadsafe` returned)."""
        ...


@runtime_checkable
class ReservedPuts(Protocol):
    """Optional (interface 1.2), with :class:`ThreadSafeBorrows`: stores into memory the
    backend lends first (``cpu`` has it), so a caller that produces a value (the vLLM
    connector gathering a chunk from the paged cache) writes it once, into the memory
    the tier then keeps, instead of into a buffer of its own that a put copies again.

    ``try_reserve_threadsafe`` lends writable memory counted against the capacity and
    visible under no key; the caller fills it and then either commits it under a key
    (from then on it is an entry like any stored value: the caller must not write into
    it any more) or aborts it (nothing becomes visible; the memory is recycled unless
    the caller says something may still touch it). Every reservation ends exactly once;
    a second commit or abort is a no-op. A commit may borrow the new entry (as
    :meth:`ThreadSafeBorrows.try_borrow_threadsafe` does), so another reader (a
    write-through to a lower tier) keeps reading the same memory until
    :meth:`ThreadSafeBorrows.end_borrows`. All methods are safe from any thread.
    Backends without it are stored through ``put`` (the hierarchy falls back to it).
    """

    def try_reserve_threadsafe(
        self, dtype: torch.dtype, shape: Sequence[int], fresh: bool = True
    ) -> tuple[object, torch.Tensor] | None:
        """``(handle, writable tensor of dtype/shape)``, or ``None`` (no room, not started,
        or with ``fresh=False`` no recycled memory at hand)."""
        ...

    def commit_reserved(
        self, handle: object, key: CacheEngineKey, borrow: bool = False
    ) -> tuple[bool, object | None]:
        """Publish under ``key``: ``(stored, borrow handle or None)``; ``(False, None)``
        when the reservation had ended (aborted, or the backend closed since)."""
        ...

    def abort_reserved(self, handle: object, reusable: bool = True) -> None:
        """End the reservation with nothing stored (no-op once it ended)."""
        ...


@runtime_checkable
class MaintainableBackend(Protocol):
    """Optional: scan, verify and delete stored objects, so that ``lmcache-core
    inspect/verify/gc`` work on a persistent tier (without it ``inspect`` reports the
    tier as not scannable and ``verify``/``gc`` skip it)."""

    def scan(
        self, *, read_headers: bool = False, progress: ProgressCallback | None = None
    ) -> AsyncIterator[EntryInfo]:
        """Every stored object (with key/namespace when ``read_headers``)."""
        ...

    async def verify_entry(self, entry: EntryInfo) -> bool:
        """Read the object fully and check size, header and checksum."""
        ...

    async def delete_entry(self, entry: EntryInfo) -> bool:
        """Delete one object; ``True`` when something was deleted."""
        ...


@runtime_checkable
class EntryChecks(Protocol):
    """Optional, with :class:`MaintainableBackend`: why an object is bad, for ``verify``."""

    async def check_entry(self, entry: EntryInfo) -> str | None:
        """``None`` when sound, ``"missing"`` when gone, else the reason it is bad."""
        ...


@runtime_checkable
class Reconcilable(Protocol):
    """Optional, with :class:`MaintainableBackend`: repair the tier's own bookkeeping
    (an index against the objects) before ``gc`` applies its rules."""

    async def reconcile(self) -> dict[str, int]:
        """Repair what is inconsistent; counts of what was done, by kind."""
        ...


@runtime_checkable
class VictimSelection(Protocol):
    """Optional: let a placement policy choose eviction victims (in-process tiers)."""

    def set_victim_selector(self, selector: VictimSelector | None) -> None:
        """Ask ``selector`` which entries to evict when room is needed (``None``: the
        backend's own order). It is called with the backend's lock held: it must be
        quick and must not call back into the backend."""
        ...


@runtime_checkable
class EntryCharges(Protocol):
    """Optional: how many bytes of its bound the tier charges for one stored value.

    A placement policy then counts room as the tier does (a tier that adds per-entry
    overhead to ``max_bytes`` would otherwise look roomier to the policy than it is)."""

    def entry_cost(self, nbytes: int) -> int:
        """Bytes of the tier's bound one entry holding an ``nbytes`` value takes (at
        least ``nbytes``); ``n`` such values fit when ``n * entry_cost(nbytes)`` is at
        most the bound. Pure and quick: no I/O, no lock that a put holds."""
        ...


@runtime_checkable
class OpensForMaintenance(Protocol):
    """Optional (on the class): open an existing tier stored in a local directory, for
    ``lmcache-core verify/gc/inspect --path DIR`` (asked of the backend of ``file://``)."""

    @classmethod
    def open_for_maintenance(cls, path: str) -> Any:
        """An unstarted backend on the tier in ``path``; raises
        :class:`~lmcache_core.errors.ConfigError` when ``path`` holds no tier of this kind
        (nothing is created)."""
        ...


@runtime_checkable
class RuntimeNote(Protocol):
    """Optional: what the backend would use in this process (``backends`` shows it)."""

    @classmethod
    def runtime_note(cls) -> str:
        """One line, such as the I/O path the ``gds`` backend would take here."""
        ...


def pins_do_io(backend: object) -> bool:
    """Whether a :class:`Pinning` backend declares that its pins do I/O that may wait
    (class attribute ``pins_do_io = True``; ``False`` when it declares nothing)."""
    return bool(getattr(backend, "pins_do_io", False))


#: Every optional capability, with the words ``backends`` shows for it.
OPTIONAL_PROTOCOLS: dict[type[Any], str] = {
    ThreadSafeLoads: "thread-safe loads",
    ThreadSafeContains: "thread-safe contains",
    ThreadSafePuts: "thread-safe puts",
    ThreadSafeBorrows: "thread-safe borrows (read-only views)",
    ReservedPuts: "reserved puts (fill lent memory, then commit)",
    PrefixLookups: "prefix lookups with leases",
    ThreadSafeLookups: "thread-safe prefix lookups",
    PrefixContains: "native prefix check",
    EvictionEvents: "eviction events",
    Pinning: "pins",
    BatchedPinning: "batched pins",
    MaintainableBackend: "maintenance (scan/verify/delete)",
    EntryChecks: "entry checks",
    Reconcilable: "reconcile",
    VictimSelection: "victim selection",
    EntryCharges: "entry charges",
    OpensForMaintenance: "opens a tier directory for maintenance",
    RuntimeNote: "runtime note",
}
#: What an optional capability needs besides itself.
_NEEDS: dict[type[Any], type[Any]] = {
    BatchedPinning: Pinning,
    EntryChecks: MaintainableBackend,
    Reconcilable: MaintainableBackend,
    OpensForMaintenance: MaintainableBackend,
    ThreadSafeLookups: PrefixLookups,
    ReservedPuts: ThreadSafeBorrows,
}


# ---------------------------------------------------------------------------- checks
def _methods(protocol: type[Any]) -> dict[str, Any]:
    """The methods ``protocol`` declares (name -> function), in declaration order."""
    out = {}
    for n, v in vars(protocol).items():
        fn = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
        if not n.startswith("_") and inspect.isfunction(fn):
            out[n] = fn
    return out


#: Methods every backend class has (those of :class:`StorageBackend`).
REQUIRED_METHODS: tuple[str, ...] = tuple(_methods(StorageBackend))


_METHOD_NAMES: dict[type[Any], tuple[str, ...]] = {}
#: (class, protocol) pairs where the class itself defines every method of the protocol.
_IMPLEMENTED_BY_CLASS: set[tuple[type[Any], Any]] = set()


def _method_names(protocol: type[Any]) -> tuple[str, ...]:
    names = _METHOD_NAMES.get(protocol)
    if names is None:
        names = _METHOD_NAMES[protocol] = tuple(_methods(protocol))
    return names


def missing_members(obj: object, protocol: type[Any]) -> list[str]:
    """The methods of ``protocol`` that ``obj`` (an instance or a class) does not have."""
    return [n for n in _method_names(protocol) if not callable(getattr(obj, n, None))]


def implements(obj: object, protocol: Callable[..., P]) -> TypeGuard[P]:
    """Whether ``obj`` has every method of ``protocol`` (one of this module's protocols).

    This is the one capability check: nothing else looks optional methods up by name.
    (``protocol`` is typed as a callable so that mypy accepts a protocol class and
    narrows ``obj`` to it.)
    """
    cls = type(obj)
    if (cls, protocol) in _IMPLEMENTED_BY_CLASS:  # the common case, on hot paths
        return True
    names = _method_names(protocol)  # type: ignore[arg-type]
    for n in names:  # a loop: cheaper than all() over a generator
        if not callable(getattr(obj, n, None)):
            return False
    if all(callable(inspect.getattr_static(cls, n, None)) for n in names):
        _IMPLEMENTED_BY_CLASS.add((cls, protocol))
    return True


def _version(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return None
    return int(major), int(minor or "0")


def supported_interface_range() -> str:
    """The interface versions this lmcache-core loads, in words (``"1.0"``, ``"1.0 to 1.2"``)."""
    if MIN_INTERFACE_VERSION == INTERFACE_VERSION:
        return INTERFACE_VERSION
    return f"{MIN_INTERFACE_VERSION} to {INTERFACE_VERSION}"


def interface_version_problem(declared: object) -> str | None:
    """Why a backend's declared ``interface_version`` cannot load here, or ``None``."""
    if declared is None:
        return None
    got = _version(str(declared)) if isinstance(declared, str) else None
    if got is None:
        return (
            f"declares interface_version {declared!r}, which is not 'major.minor' "
            f"(this lmcache-core supports backend interface {supported_interface_range()})"
        )
    lo = _version(MIN_INTERFACE_VERSION)
    hi = _version(INTERFACE_VERSION)
    assert lo is not None and hi is not None
    if got[0] != hi[0] or not lo <= got <= hi:
        return (
            f"implements backend interface {declared}, but this lmcache-core supports "
            f"backend interface {supported_interface_range()}"
        )
    return None


@dataclass
class ClassCheck:
    """What :func:`check_backend_class` found: ``problems`` keep the class from being a
    backend; ``warnings`` do not; ``optional`` names the capabilities it implements."""

    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    optional: list[str] = dataclasses.field(default_factory=list)
    interface_version: str | None = None
    capabilities: Capabilities | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def _kind_problems(cls: type[Any], protocol: type[Any]) -> list[str]:
    """Methods of ``cls`` that are sync where ``protocol`` says async, or the reverse."""
    out = []
    for n, decl in _methods(protocol).items():
        impl = inspect.getattr_static(cls, n, None)
        if isinstance(impl, (staticmethod, classmethod)):
            impl = impl.__func__
        if not inspect.isfunction(impl):
            continue  # a callable object or a descriptor: nothing to tell from the class
        want_async = inspect.iscoroutinefunction(decl)
        # an async generator (scan) is declared as a plain function returning an iterator
        if want_async and not inspect.iscoroutinefunction(impl):
            out.append(f"{n} must be a coroutine function (async def)")
        elif not want_async and inspect.iscoroutinefunction(impl):
            out.append(f"{n} must not be a coroutine function (it is called without await)")
    return out


def check_backend_class(cls: type[Any]) -> ClassCheck:
    """Check ``cls`` against :class:`StorageBackend` and the optional protocols.

    Problems name what is missing or wrong: a required method, a method that must be
    (or must not be) ``async def``, ``capabilities`` that is not a :class:`Capabilities`,
    an optional capability implemented in part (``pin`` without ``unpin``), one that
    needs another (``reconcile`` without ``scan``), or an ``interface_version`` this
    lmcache-core does not support. An undeclared ``interface_version`` is a warning.
    """
    where = f"{cls.__module__}.{cls.__qualname__}"
    check = ClassCheck()
    missing = missing_members(cls, StorageBackend)
    if missing:
        check.problems.append(
            f"{where} is not a storage backend: missing {', '.join(missing)} "
            "(subclass lmcache_core.backend.BaseBackend or lmcache_core.blob.BlobBackend)"
        )
    check.problems += [f"{where}.{p}" for p in _kind_problems(cls, StorageBackend)]
    caps = inspect.getattr_static(cls, "capabilities", None)
    if isinstance(caps, Capabilities):
        check.capabilities = caps
    else:
        check.problems.append(
            f"{where}.capabilities must be a lmcache_core.interface.Capabilities "
            f"(got {type(caps).__name__})"
        )
    for proto, words in OPTIONAL_PROTOCOLS.items():
        methods = _methods(proto)
        absent = missing_members(cls, proto)
        if len(absent) == len(methods):
            continue
        if absent:
            have = [m for m in methods if m not in absent]
            check.problems.append(
                f"{where} implements part of {proto.__name__} ({words}): has "
                f"{', '.join(have)} but not {', '.join(absent)}"
            )
            continue
        needs = _NEEDS.get(proto)
        if needs is not None and missing_members(cls, needs):
            check.problems.append(
                f"{where} implements {proto.__name__} ({words}) without {needs.__name__}: "
                f"add {', '.join(missing_members(cls, needs))}"
            )
            continue
        check.problems += [f"{where}.{p}" for p in _kind_problems(cls, proto)]
        check.optional.append(proto.__name__)
    declared = inspect.getattr_static(cls, "interface_version", None)
    check.interface_version = None if declared is None else str(declared)
    problem = interface_version_problem(declared)
    if problem is not None:
        check.problems.append(f"{where} {problem}")
    elif declared is None:
        check.warnings.append(
            f"{where} declares no interface_version (add `interface_version = "
            f'"{INTERFACE_VERSION}"`); assuming {INTERFACE_VERSION}'
        )
    return check
