"""``stash()``: the session that owns ``saved_tensors_hooks``, and ``pause()``.

# NOTE [ Session ]
Every tensor autograd saves inside ``with stash(policy):`` reaches
:meth:`Session.pack`; backward hands back what pack returned to
:meth:`Session.unpack`. Around any policy the session applies these rules:

1. Eligibility. Parameters (and views or casts of them), other leaf tensors
   that require grad (the graph holds them anyway: moving them saves
   nothing), module buffers (see _modules.py: BatchNorm changes its saved
   running statistics in place without bumping their version), tensors under
   ``min_bytes``, and tensors no policy can handle (sparse, nested, meta,
   quantized, conjugate or negative views, functorch wrappers, subclasses such
   as fake tensors) are kept untouched and counted in ``stats.skipped``.
2. Version check. With hooks pushed autograd no longer notices a saved tensor
   changed in place, so the session records ``tensor._version`` at pack and
   compares at unpack, raising as plain autograd would.
3. Dedupe. The same storage, geometry and version saved again while its first
   pack is alive returns that pack (keyed by a weak reference to the storage,
   never by a bare pointer).
4. Order. Each pack remembers (weakly) the one before it; backward unpacks
   roughly in reverse, so unpacking one starts the prefetch of the previous few.
5. Lifetime. The value autograd holds (a :class:`_Saved`) owns the packed
   value; when autograd frees the graph, its ``__del__`` releases its stats and the
   policy's resources. Nothing is freed in unpack: autograd may unpack again.
6. Nesting. Only the innermost hook pair is active, so an inner session wins in
   its region; :func:`pause` pops this thread's sessions' hooks for a region.

# NOTE [ Recent window ]
Backward starts with the tensors saved last (the output head, the loss):
moving them out only makes backward wait for them to come back. A selector
that cannot know which tensors come last (Auto in a first step, before its
Profile has seen a backward) returns :class:`~tensorstash.policy.Defer`: the
session keeps the tensor and puts it in a window; when the window holds more
than ``Defer.window`` bytes saved after its oldest entry, that entry is packed
with its deferred policy (its ``_Saved`` switches to the new packed value, the
stats and the decision log move with it). So whatever was deferred last stays
kept when forward ends, and at most ``window`` bytes plus one tensor wait there.
A tensor changed in place while it waits is not packed (unpack raises, as
autograd would).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from tensorstash import _modules
from tensorstash._verify import check, checksum
from tensorstash.disk import SpillError
from tensorstash.policy import Context, Defer, Held, Keep, Packed, Policy, bug, nbytes_of
from tensorstash.profile import Profile, SiteRecord
from tensorstash.stats import StashStats

DEFAULT_MIN_BYTES = 64 * 1024
"""Tensors smaller than this are kept: moving them costs more time than the bytes are worth."""

PREFETCH_DEPTH = 2
"""How many earlier packs an unpack starts bringing back."""

_local = threading.local()


def _active() -> list[Session]:
    """This thread's sessions whose hooks are pushed, innermost last."""
    active: list[Session] | None = getattr(_local, "active", None)
    if active is None:
        active = _local.active = []
    return active


def _policy_names() -> dict[str, Any]:
    from tensorstash.compress import Lz4
    from tensorstash.cpu import CpuOffload
    from tensorstash.disk import DiskSpill

    names: dict[str, Any] = {"keep": Keep, "cpu": CpuOffload, "lz4": Lz4, "disk": DiskSpill}
    from tensorstash.auto import Auto

    names["auto"] = Auto
    return names


def resolve(policy: Policy | str) -> Policy:
    """A policy object from a policy or its name ("keep", "cpu", "lz4", "disk", "auto").

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor an object with ``pack`` and ``unpack``.
    """
    if isinstance(policy, str):
        names = _policy_names()
        factory = names.get(policy)
        if factory is None:
            raise ValueError(
                f"tensorstash.stash: unknown policy name {policy!r}; use one of "
                f"{', '.join(repr(n) for n in names)} or a policy object such as "
                "tensorstash.Chain(tensorstash.Lz4(), tensorstash.DiskSpill())"
            )
        return factory()  # type: ignore[no-any-return,unused-ignore]
    if isinstance(policy, type):
        raise TypeError(
            f"tensorstash.stash: policy is the class {policy.__name__}, not a policy; "
            f"pass an instance: {policy.__name__}()"
        )
    if not (callable(getattr(policy, "pack", None)) and callable(getattr(policy, "unpack", None))):
        raise TypeError(
            f"tensorstash.stash: policy must be a policy object (with pack and unpack) or a "
            f"name such as 'lz4'; got {type(policy).__name__} {policy!r}"
        )
    return policy


# -- what autograd holds --------------------------------------------------------------


class _Saved:
    """One saved tensor as autograd holds it: the policy, its packed value, a version stamp."""

    __slots__ = (
        "__weakref__",
        "checksum",
        "counter",
        "origin",
        "owner",
        "packed",
        "policy",
        "prefetched",
        "prev",
        "record",
        "version",
    )

    def __init__(self, policy: Policy, packed: Any, source: Tensor, prev: _Saved | None) -> None:
        self.policy = policy
        self.packed = packed
        self.owner: tuple[Context, dict[Any, Any], tuple[Any, ...]] | None = None
        self.version = source._version
        held = packed.tensor if isinstance(packed, Held) else None
        self.counter = held if held is not None else _version_counter(source)
        self.prev = None if prev is None else weakref.ref(prev)
        self.prefetched = False
        self.record: SiteRecord | None = None
        self.origin = (_modules.current(), source.shape, source.dtype)  # for error messages
        self.checksum: int | Tensor | None = None

    def where(self) -> str:
        """The module that saved the tensor, for an error message."""
        return f"module '{self.origin[0]}'" if self.origin[0] else "no module (top level)"

    def describe(self) -> str:
        """The saved tensor for an error message: its shape, dtype and module."""
        _, shape, dtype = self.origin
        return f"the tensor of shape {list(shape)} ({dtype}) saved by {self.where()}"

    def check_version(self) -> None:
        """Raise as autograd would if the saved tensor changed in place (rule 2)."""
        now = self.counter._version
        if now != self.version:
            raise _modified(self.counter, now, self.version)

    def __del__(self) -> None:
        """Autograd freed the graph that held this (rule 5): release what it holds."""
        if self.owner is not None:
            ctx, dedupe, key = self.owner
            _release(ctx, self.packed, dedupe, key)

    def switch(self, policy: Policy, packed: Any) -> None:
        """Hold ``packed`` (from ``policy``) instead of the kept tensor (NOTE [ Recent window ])."""
        if self.counter is self.packed.tensor:
            self.counter = _version_counter(self.counter)
        self.policy, self.packed = policy, packed


def _version_counter(tensor: Tensor) -> Tensor:
    """A tensor that shares ``tensor``'s version counter but none of its memory.

    An alias shares the version counter of every view of its storage; emptying
    the alias (with the counter's value preserved) drops its hold on the storage,
    as autograd's own saved variables keep the counter apart from the data.
    """
    alias = tensor.detach()
    with torch.autograd._unsafe_preserve_version_counter(alias):
        alias.set_()  # type: ignore[call-overload]
    return alias


class _Untouched:
    """A tensor kept as it is (not eligible), with its version stamp."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version


def _modified(tensor: Tensor, now: int, expected: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{tensor.dtype}] is at version {now}; "
        f"expected version {expected} instead. (Checked by tensorstash, since autograd does "
        "not check saved tensors while saved-tensor hooks are active.) Hint: do not modify "
        "a tensor in place after an operation saved it for backward; use an out-of-place "
        "operation or .clone() it first."
    )


# -- eligibility ------------------------------------------------------------------------

_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_PARAMETER_COPIES = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0"})


def _is_parameter(tensor: Tensor) -> bool:
    """A parameter, a view of one, or a cast of one (autocast's bf16 weight copies)."""
    # The caller checked the type: a plain tensor or exactly a Parameter.
    if type(tensor) is _Parameter:
        return True
    base = tensor._base
    if base is not None and (
        isinstance(base, torch.nn.Parameter) or (base.requires_grad and base.is_leaf)
    ):
        return True
    grad_fn = tensor.grad_fn
    if grad_fn is not None and type(grad_fn).__name__ in _PARAMETER_COPIES:
        nexts = grad_fn.next_functions
        return len(nexts) == 1 and type(nexts[0][0]).__name__ == "AccumulateGrad"
    return False


def _ineligible(tensor: Tensor, min_bytes: int) -> str | None:
    """Why a tensor must be kept untouched (rule 1), or None if a policy may take it.

    The checks run cheapest and most common first: this is the hot path of
    every small saved tensor.
    """
    if type(tensor) not in _PLAIN:
        return "tensor subclass"
    if tensor.layout != torch.strided:
        return f"{str(tensor.layout).removeprefix('torch.')} layout"
    if tensor.is_nested:
        return "nested tensor"
    if tensor.numel() * tensor.element_size() < min_bytes:
        return "under min_bytes"
    if _WRAPPED is not None and _WRAPPED(tensor):
        return "functorch wrapper"
    if not (tensor.is_cpu or tensor.is_cuda):
        return f"{tensor.device.type} device"
    if tensor.is_quantized:
        return "quantized"
    if tensor.is_conj() or tensor.is_neg():
        return "conjugate or negative view"
    if _is_parameter(tensor):
        return "parameter"
    if tensor.requires_grad and tensor.is_leaf:
        return LEAF
    return None  # the caller checks for buffers, with the storage it needs anyway


_Parameter = torch.nn.Parameter
LEAF = "leaf that requires grad"
"""The reason logged for a saved leaf that is not a parameter (a model input, usually)."""
_PLAIN = (Tensor, _Parameter)


# -- the session --------------------------------------------------------------------------


class Session(contextlib.ContextDecorator):
    """A stash session; see :func:`stash` and NOTE [ Session ].

    Attributes:
        policy: where eligible tensors go.
        min_bytes: tensors smaller than this are kept.
        stats: what the session did (:class:`~tensorstash.StashStats`).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        min_bytes: int,
        workers: int,
        record: bool,
        profile: Profile | None,
        verify: bool = False,
    ) -> None:
        self.policy = policy
        self.verify = verify
        self.min_bytes = min_bytes
        self.record = record
        self.profile = profile
        self.stats = StashStats()
        self._ctx = Context(self.stats, workers=workers)
        self._ctx.profile = profile
        self._last: weakref.ref[_Saved] | None = None
        self._window: collections.deque[tuple[weakref.ref[_Saved], Defer, int]] = (
            collections.deque()
        )
        self._window_bytes = 0
        self._dedupe: dict[tuple[Any, ...], tuple[weakref.ref[Any], weakref.ref[_Saved]]] = {}

    def __repr__(self) -> str:
        return f"tensorstash.stash({self.policy!r}, min_bytes={self.min_bytes})"

    # Context manager ---------------------------------------------------------------

    def __enter__(self) -> Session:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint":
            raise RuntimeError(
                "tensorstash.stash: cannot open a stash inside a recomputed (checkpointed) "
                "region: it would take the tensors the region recomputes. Open the stash "
                "around the model instead; the region's inputs go through it (see "
                "NOTE [ Recompute ] in tensorstash/recompute.py)"
            )
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        if self.profile is not None:
            self.profile.start_step()
        _active().append(self)
        self._ctx.opened()
        _modules.track()
        return self

    def __exit__(self, *exc: object) -> None:
        active = _active()
        if not active or active[-1] is not self:
            raise RuntimeError(
                "tensorstash.stash: sessions were exited out of order; exit the innermost "
                "stash first (use them as nested `with` blocks)"
            )
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] != self.pack:
            raise RuntimeError(
                "tensorstash.stash: other saved-tensor hooks are still pushed inside this "
                "session; close them before the session ends"
            )
        torch._C._autograd._pop_saved_tensors_default_hooks()
        active.pop()
        if not active:
            _modules.forget_stack()
        _modules.untrack()
        self._ctx.closed()
        self._ctx.flush_warnings()

    # Hooks ----------------------------------------------------------------------------

    def pack(self, tensor: Tensor) -> Any:
        """The pack hook: decide, dedupe, pack, account (NOTE [ Session ])."""
        start = time.perf_counter()
        reason = _ineligible(tensor, self.min_bytes)
        storage = None
        if reason is None:
            storage = tensor.untyped_storage()
            reason = _modules.state_kind(storage)
        if reason is not None:
            self.stats.skip(reason, nbytes_of(tensor))
            if self.record:
                self._log(tensor, "kept", nbytes_of(tensor), reason)
            return _Untouched(tensor)
        key = self._dedupe_key(tensor, storage)
        found = self._dedupe.get(key)
        if found is not None and found[0]() is storage:
            saved = found[1]()
            if saved is not None:
                self.stats.count_dedupe()
                if self.record:
                    self._log(tensor, getattr(saved.packed, "tier", "kept"), 0, "deduplicated")
                return saved
        record = None
        if self.profile is not None:
            site = self.profile.site(_modules.current(), tensor)
            record = self.profile.record_pack(site, nbytes_of(tensor))
            self._ctx.site, self._ctx.record = site, record
        policy, reason = self.policy, None
        choose = getattr(policy, "choose", None)
        if choose is not None:  # a selector: NOTE [ Selection ] in auto.py
            policy, reason = choose(tensor, self._ctx)
        deferred = policy if isinstance(policy, Defer) else None
        if deferred is not None:
            policy = _KEEP
            self._make_room(nbytes_of(tensor), deferred.window)
        packed = policy.pack(tensor, self._ctx)
        self._ctx.site = self._ctx.record = None
        if self.record and isinstance(packed, Packed):
            why = reason or f"policy {type(policy).__name__}"
            if deferred is not None:
                why = f"{why}; {_RECENT}"
            self._ctx.attach_row(packed, self._log(tensor, packed.tier, packed.stored_bytes, why))
        saved = _Saved(policy, packed, tensor, None if self._last is None else self._last())
        if self.verify:
            saved.checksum = checksum(tensor)
        if record is not None:
            record.offloaded = getattr(packed, "tier", "kept") != "kept"
            saved.record = record
        self._remember(saved, key, storage)
        if deferred is not None:
            self._window.append((weakref.ref(saved), deferred, nbytes_of(tensor)))
            self._window_bytes += nbytes_of(tensor)
        self.stats.timed("pack", time.perf_counter() - start)
        self._ctx.flush_warnings()
        return saved

    def unpack(self, saved: Any) -> Tensor:
        """The unpack hook: check the version, prefetch earlier packs, unpack."""
        if isinstance(saved, _Untouched):
            if saved.tensor._version != saved.version:
                raise _modified(saved.tensor, saved.tensor._version, saved.version)
            return saved.tensor
        if not isinstance(saved, _Saved):
            raise bug(f"unpack received {type(saved).__name__}")
        start = time.perf_counter()
        saved.check_version()
        self._prefetch_before(saved)
        record, profile = saved.record, self.profile
        began = profile.clock() if record is not None and profile is not None else 0.0
        try:
            tensor = saved.policy.unpack(saved.packed, self._ctx)
        except SpillError as error:
            # The error also waits in its policy's future: without its traceback,
            # which now holds this frame (and so the packed value).
            message, cause = str(error), error.__cause__
            error.__traceback__ = None
            raise SpillError(f"{message} It was saved by {saved.where()}.") from cause
        if record is not None and profile is not None:
            record.unpack_s += profile.clock() - began
        if isinstance(tensor, Held):
            tensor = tensor.value()
        if not isinstance(tensor, Tensor):
            raise bug(f"policy {saved.policy!r} unpacked to {type(tensor).__name__}")
        if saved.checksum is not None:
            check(saved.checksum, tensor, f"{saved.describe()}, unpacked by {saved.policy!r},")
        self.stats.timed("unpack", time.perf_counter() - start)
        self._ctx.flush_warnings()
        return tensor

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """The decision log (``record=True``): one row per saved tensor, in pack order.

        Each row has ``module`` (path of the module that saved it), ``op`` (the
        operation that produced it), ``shape``, ``dtype``, ``bytes``, ``tier``,
        ``stored_bytes`` and ``reason``; tier and stored bytes are updated as
        background compression and writes finish.
        """
        return self.stats.decisions

    # Internals -------------------------------------------------------------------------

    def _log(self, tensor: Tensor, tier: str, stored: int, reason: str) -> dict[str, Any]:
        grad_fn = tensor.grad_fn
        row = {
            "module": _modules.current(),
            "op": type(grad_fn).__name__ if grad_fn is not None else None,
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "bytes": nbytes_of(tensor),
            "tier": tier,
            "stored_bytes": stored,
            "reason": reason,
        }
        self.stats.log(row)
        return row

    @staticmethod
    def _dedupe_key(tensor: Tensor, storage: Any) -> tuple[Any, ...]:
        return (
            id(storage),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )

    def _remember(self, saved: _Saved, key: tuple[Any, ...], storage: Any) -> None:
        packed = saved.packed
        if isinstance(packed, Packed):
            self._ctx.account(packed)
        self._dedupe[key] = (weakref.ref(storage), weakref.ref(saved))
        self._last = weakref.ref(saved)
        saved.owner = (self._ctx, self._dedupe, key)

    def _make_room(self, nbytes: int, size: int) -> None:
        """Pack what leaves the recent window as ``nbytes`` more enter it.

        An entry leaves once the bytes saved after it, the incoming ones
        included, reach ``size`` (NOTE [ Recent window ]). It leaves before the
        incoming tensor is counted, so kept bytes never hold both.
        """
        window = self._window
        site, record = self._ctx.site, self._ctx.record
        self._ctx.site = self._ctx.record = None
        while window and self._window_bytes - window[0][2] + nbytes >= size:
            ref, oldest, oldest_bytes = window.popleft()
            self._window_bytes -= oldest_bytes
            waiting = ref()
            if waiting is not None:
                self._pack_deferred(waiting, oldest)
        self._ctx.site, self._ctx.record = site, record

    def _pack_deferred(self, saved: _Saved, deferred: Defer) -> None:
        held = saved.packed
        if not isinstance(held, Held) or held.tensor is None:
            return
        tensor = held.tensor
        if tensor._version != saved.version:
            return  # changed in place: unpack raises, as autograd would
        packed = deferred.policy.pack(tensor, self._ctx)
        if isinstance(packed, Packed):
            reason = held.row["reason"] if held.row is not None else ""
            self._ctx.replace(held, packed, reason.replace(f"; {_RECENT}", ""))
        else:
            self._ctx.release(held)
        saved.switch(deferred.policy, packed)
        if saved.record is not None:
            saved.record.offloaded = getattr(packed, "tier", "kept") != "kept"

    def _prefetch_before(self, saved: _Saved) -> None:
        ref = saved.prev
        for _ in range(PREFETCH_DEPTH):
            earlier = ref() if ref is not None else None
            if earlier is None:
                return
            prefetch = getattr(earlier.policy, "prefetch", None)
            if prefetch is not None and not earlier.prefetched:
                earlier.prefetched = True
                prefetch(earlier.packed, self._ctx)
            ref = earlier.prev


_KEEP = Keep()
_RECENT = "saved last: kept for backward to start with"


def _release(ctx: Context, packed: Any, dedupe: dict[Any, Any], key: tuple[Any, ...]) -> None:
    """When a :class:`_Saved` is freed: forget its dedupe entry and its live bytes."""
    entry = dedupe.get(key)
    if entry is not None and entry[1]() is None:
        del dedupe[key]
    if isinstance(packed, Packed):
        ctx.release(packed)


def stash(
    policy: Policy | str = "auto",
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    workers: int = 2,
    record: bool = False,
    profile: Profile | None = None,
    verify: bool = False,
) -> Session:
    """Move the tensors autograd saves for backward out of the way.

    Every tensor saved inside the session goes through ``policy`` (see NOTE
    [ Session ] in this module for what is kept untouched). Gradients equal
    plain autograd's bit for bit under every lossless policy.

    Args:
        policy: a policy object (``Keep()``, ``CpuOffload()``, ``Lz4()``,
            ``DiskSpill()``, a ``Chain`` of them, ``Select``/``Auto``) or its name:
            "keep", "cpu", "lz4", "disk", "auto".
        min_bytes: tensors smaller than this many bytes are kept as they are.
        workers: threads for compression and reads.
        record: keep a decision log, one row per saved tensor (module, shape,
            dtype, bytes, tier, stored bytes, reason): ``session.decisions``
            and ``stats.to_dict()["decisions"]``.
        profile: a :class:`~tensorstash.Profile` this session updates, given to
            the session of every step; ``Auto`` plans with it from step two.
        verify: take a checksum of every tensor a policy packs and check it
            when backward unpacks it, raising :class:`~tensorstash.VerifyError`
            on a mismatch instead of computing a wrong gradient (NOTE [ Verify ]
            in _verify.py; it costs a pass over the bytes at pack and at unpack).

    Returns:
        A :class:`Session`: a context manager and a decorator; ``session.stats``
        holds its counters.

    Raises:
        TypeError, ValueError: a bad policy or argument, with what to pass instead.

    Example:
        >>> import tensorstash as ts
        >>> with ts.stash(ts.Chain(ts.Lz4(), ts.DiskSpill())) as s:
        ...     loss = model(batch).sum()
        >>> loss.backward()
        >>> print(s.stats.table())

    .. warning::
        ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` refuse to run
        while saved-tensor hooks are pushed: call them inside :func:`pause`.
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise TypeError(
            f"tensorstash.stash: min_bytes must be a non-negative int (bytes); got {min_bytes!r}"
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TypeError(f"tensorstash.stash: workers must be a positive int; got {workers!r}")
    if not isinstance(record, bool):
        raise TypeError(f"tensorstash.stash: record must be True or False; got {record!r}")
    if not isinstance(verify, bool):
        raise TypeError(f"tensorstash.stash: verify must be True or False; got {verify!r}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(
            f"tensorstash.stash: profile must be a tensorstash.Profile; got {profile!r}"
        )
    return Session(
        resolve(policy),
        min_bytes=min_bytes,
        workers=workers,
        record=record,
        profile=profile,
        verify=verify,
    )


@contextlib.contextmanager
def pause() -> Iterator[None]:
    """Save tensors as plain autograd would inside this region, even within a stash.

    Pops this thread's tensorstash hooks for the region and pushes them back
    after, so ``torch.func.grad`` and friends (which refuse to run while hooks
    are pushed) work inside it, and an output head can stay in memory.

    Example:
        >>> with tensorstash.stash("lz4"):
        ...     h = body(x)
        ...     with tensorstash.pause():
        ...         g = torch.func.grad(loss_fn)(h.detach())
    """
    popped: list[Session] = []
    active = _active()
    for session in reversed(active):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] != session.pack:
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
        popped.append(session)
    del active[len(active) - len(popped) :]
    try:
        yield
    finally:
        for session in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(session.pack, session.unpack)
            active.append(session)
