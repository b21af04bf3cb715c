"""What the session hands autograd for a saved tensor, and the tables it keeps of them.

A kept tensor is a :data:`Kept` (C's, or its Python twin :class:`PyKept`); a
tensor a policy packed is a :class:`Saved`; a DTensor's, a
:class:`Distributed`. Rule 3 of NOTE [ Session ] is :class:`Dedupe`, the
recent window of rule 5 :class:`RecentWindow`, and rule 6's order
:class:`Order`.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from tensorstash.core._fastpath import compiled
from tensorstash.core.policy import Defer, Held, Policy
from tensorstash.core.stats import HotCounts
from tensorstash.session import _modules


class Order:
    """The packed value saved last (rule 6): what the next value remembers before it.

    Shared with the C hooks, which read ``last`` for each tensor they keep.
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: weakref.ref[Saved] | None = None


class PyKept:
    """A tensor a policy kept where it is, as autograd holds it (rules 4 and 7).

    Freed on any thread (backward runs on a device's thread), it posts its
    bytes to the session's :class:`~tensorstash.core.stats.HotCounts`. The C
    extension's ``Kept`` is the same (NOTE [ Fast path ] in _fastpath.py).
    """

    __slots__ = ("__weakref__", "hot", "nbytes", "prev", "tensor", "version")

    def __init__(
        self,
        tensor: Tensor,
        version: int,
        nbytes: int,
        hot: HotCounts,
        prev: weakref.ref[Saved] | None,
    ) -> None:
        self.tensor = tensor
        self.version = version
        self.nbytes = nbytes
        self.hot = hot
        self.prev = prev

    def geometry(self) -> tuple[Any, ...]:
        tensor = self.tensor
        return (tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, self.version)

    def changed(self) -> bool:
        """Whether the tensor changed in place since it was saved."""
        return self.tensor._version != self.version

    def __del__(self) -> None:
        self.hot.release(self.nbytes)


Kept: Any = PyKept if compiled is None else compiled.Kept


class Saved:
    """A tensor a policy packed (or a deferred one, kept until it leaves the window)."""

    __slots__ = (
        "__weakref__",
        "checksum",
        "counter",
        "geometry_",
        "origin",
        "packed",
        "policy",
        "prefetched",
        "prev",
        "record",
        "session",
        "storage",
        "version",
    )

    def __init__(self, policy: Policy, packed: Any, source: Tensor, session: Any) -> None:
        self.policy = policy
        self.packed = packed
        self.session = session
        self.version = source._version
        held = packed.tensor if isinstance(packed, Held) else None
        self.counter = held if held is not None else version_counter(source)
        self.prev = session.order.last
        self.prefetched = False
        self.record: Any = None  # the profile's record of its call site
        self.origin = (_modules.current(), source.shape, source.dtype)  # for error messages
        self.checksum: int | Tensor | None = None
        self.geometry_ = (source.storage_offset(), source.shape, source.stride(), source.dtype)
        self.storage = weakref.ref(source.untyped_storage())  # see Dedupe

    def geometry(self) -> tuple[Any, ...]:
        return (*self.geometry_, self.version)

    def where(self) -> str:
        """The module that saved the tensor, for an error message."""
        return f"module '{self.origin[0]}'" if self.origin[0] else "no module (top level)"

    def describe(self) -> str:
        """The saved tensor for an error message: its shape, dtype and module."""
        _, shape, dtype = self.origin
        return f"the tensor of shape {list(shape)} ({dtype}) saved by {self.where()}"

    def changed(self) -> bool:
        """Whether the saved tensor changed in place since it was saved."""
        return self.counter._version != self.version

    def check_version(self) -> None:
        """Raise as autograd would if the saved tensor changed in place (rule 2)."""
        now = self.counter._version
        if now != self.version:
            raise modified(self.counter, now, self.version)

    def __del__(self) -> None:
        """Autograd freed the graph that held this (rule 7): release what it holds."""
        self.session._release_saved(self)

    def switch(self, policy: Policy, packed: Any) -> None:
        """Hold ``packed`` (from ``policy``) instead of the kept tensor (NOTE [ Recent window ])."""
        if self.counter is self.packed.tensor:
            self.counter = version_counter(self.counter)
        self.policy, self.packed = policy, packed


_set_version_counter = torch._C._autograd._unsafe_set_version_counter


def version_counter(tensor: Tensor) -> Tensor:
    """A tensor that shares ``tensor``'s version counter but none of its memory.

    An alias shares the version counter of every view of its storage; emptying
    the alias (with the counter's value preserved) drops its hold on the storage,
    as autograd's own saved variables keep the counter apart from the data.
    """
    alias = tensor.detach()
    version = alias._version
    try:
        alias.set_()  # type: ignore[call-overload]
    finally:  # torch.autograd._unsafe_preserve_version_counter, without its object
        _set_version_counter((alias,), (version,))
    return alias


class Distributed:
    """A DTensor packed as its local tensor (rule 9).

    ``local`` is what pack returned for the local tensor (a tuple, a
    :class:`Kept` or a :class:`Saved`), ``spec`` what rebuilds the DTensor
    around it (None: the local tensor is what unpack returns).
    """

    __slots__ = ("local", "spec")

    def __init__(self, local: Any, spec: Any) -> None:
        self.local = local
        self.spec = spec


def modified(tensor: Tensor, now: int, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{tensor.dtype}] is at version {now}; "
        f"expected version {expected} instead. (Checked by tensorstash, since autograd does "
        "not check saved tensors while saved-tensor hooks are active.) Hint: do not modify "
        "a tensor in place after an operation saved it for backward; use an out-of-place "
        "operation or .clone() it first."
    )


class Dedupe:
    """Rule 3: a storage saved again with the same geometry and version returns its first pack.

    Values are found by the address of the tensor's data, then compared by
    geometry and version. A kept value holds its tensor, so no other storage
    can take its address while it lives; a packed value's storage may die
    first and its address be reused, so it is trusted only while its storage is
    the tensor's (a weak reference, never a bare pointer alone). Values are held
    weakly and dead entries are swept as the table grows, so freeing a value
    costs nothing here. A value whose tensor changed in place since is not
    returned: tensors of one storage may count versions apart (a DTensor's
    local alias and a plain view of the same data, rule 9), so an equal version
    number alone does not prove equal data.
    """

    def __init__(self) -> None:
        self.values: dict[int, weakref.ref[Any] | list[weakref.ref[Any]]] = {}
        self.sweep_at = 1024

    def find(self, tensor: Tensor, address: int) -> Kept | Saved | None:
        entry = self.values.get(address)
        if entry is None:
            return None
        geometry = (
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        for ref in refs(entry):
            value = ref()
            if value is None or value.geometry() != geometry:
                continue
            if isinstance(value, Saved) and value.storage() is not tensor.untyped_storage():
                continue
            if value.changed():  # through a tensor with another version counter (rule 9)
                continue
            return value
        return None

    def sweep(self) -> None:
        """Drop the dead entries; the next sweep comes when the table has doubled."""
        values = self.values
        for dead in [key for key, entry in values.items() if not live(entry)]:
            del values[dead]
        self.sweep_at = max(1024, 2 * len(values))

    def add(self, value: Kept | Saved, address: int) -> None:
        values = self.values
        entry = values.get(address)
        if entry is None:
            values[address] = weakref.ref(value)
            if len(values) >= self.sweep_at:
                self.sweep()
            return
        kept = [ref for ref in refs(entry) if live(ref)]
        kept.append(weakref.ref(value))
        values[address] = kept if len(kept) > 1 else kept[0]


def refs(entry: weakref.ref[Any] | list[weakref.ref[Any]]) -> list[weakref.ref[Any]]:
    return entry if isinstance(entry, list) else [entry]


def live(entry: weakref.ref[Any] | list[weakref.ref[Any]]) -> bool:
    """Whether a dedupe entry still holds a value whose storage lives."""
    for ref in refs(entry):
        value = ref()
        if value is not None and (not isinstance(value, Saved) or value.storage() is not None):
            return True
    return False


class RecentWindow:
    """Deferred tensors, kept until newer ones push them out (NOTE [ Recent window ])."""

    def __init__(self) -> None:
        self._entries: collections.deque[tuple[weakref.ref[Saved], Defer, int]] = (
            collections.deque()
        )
        self.bytes = 0

    def leaving(self, nbytes: int, size: int) -> Iterator[tuple[Saved, Defer]]:
        """The entries that leave as ``nbytes`` more enter a window of ``size`` bytes.

        An entry leaves once the bytes saved after it, the incoming ones
        included, reach ``size``. It leaves before the incoming tensor is
        counted, so kept bytes never hold both.
        """
        entries = self._entries
        while entries and self.bytes - entries[0][2] + nbytes >= size:
            ref, deferred, entry_bytes = entries.popleft()
            self.bytes -= entry_bytes
            waiting = ref()
            if waiting is not None:
                yield waiting, deferred

    def enter(self, saved: Saved, deferred: Defer, nbytes: int) -> None:
        self._entries.append((weakref.ref(saved), deferred, nbytes))
        self.bytes += nbytes
