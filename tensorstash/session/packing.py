"""The session's hooks: what a saved tensor becomes at pack, and what comes back at unpack.

:class:`Packing` is rules 1 to 7 and 9 of NOTE [ Session ] (the checks in the
order of NOTE [ Pack rules ] in rules.py); the session pushes its ``pack`` and
``unpack`` (or the C hooks, which hand it what they do not take), and opens and
closes around it.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from torch import Tensor

from tensorstash.core import _reasons
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core.policy import (
    Context,
    Defer,
    Held,
    Keep,
    Packed,
    Policy,
    ReadBackError,
    bug,
    nbytes_of,
)
from tensorstash.core.stats import Decision, StashStats
from tensorstash.session import _dtensor, _modules
from tensorstash.session._verify import check, checksum
from tensorstash.session.rules import (
    distributed_reason,
    held,
    ineligible,
    subclass_reason,
    unsized_reason,
    unusual,
)
from tensorstash.session.values import (
    Dedupe,
    Distributed,
    Kept,
    Order,
    RecentWindow,
    Saved,
    modified,
)
from tensorstash.tiers.recompute import saving_plan_inputs

PREFETCH_DEPTH = 2
"""How many earlier packs an unpack starts bringing back."""

_Tensor = Tensor
_perf_counter = time.perf_counter


class Packing:
    """A session's pack and unpack hooks, and the values they share (NOTE [ Session ]).

    Args:
        policy: where eligible tensors go.
        min_bytes: tensors smaller than this are kept.
        record: keep the decision log.
        verify: checksum at pack, check at unpack.
        profile: the session's profile, or None.
        ctx: the session's context (its stats, threads, pools).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        min_bytes: int,
        record: bool,
        verify: bool,
        profile: Any,
        ctx: Context,
    ) -> None:
        self.policy = policy
        self.min_bytes = min_bytes
        self.record = record
        self.verify = verify
        self.profile = profile
        self._ctx = ctx
        self._stats: StashStats = ctx.stats
        self.choose: Any = getattr(policy, "choose", None)  # the step's (rule 4)
        self.step: Any = None  # the profile's step being measured
        self.order = Order()  # the value packed last (rule 6)
        self._window = RecentWindow()
        self.dedupe = Dedupe()
        self.hot = self._stats.hot  # counted without a lock: see HotCounts
        self.kept_tier = self._stats.tiers["kept"]

    def pack(self, tensor: Tensor, wrapper: Tensor | None = None) -> Any:
        """The pack hook: the rules of NOTE [ Session ], in order.

        ``wrapper`` is the DTensor when ``tensor`` is its local tensor (rule 9).
        """
        # Rule 1: eligibility; for a plain Tensor, the size first (most tensors are small).
        try:
            nbytes = tensor.nbytes
        except RuntimeError:  # sparse tensors have no plain size
            return self._untouched(tensor, unsized_reason(tensor), nbytes_of(tensor))
        if type(tensor) is not _Tensor:  # parameters, DTensors (rule 9), other subclasses
            return self._pack_subclass(tensor, nbytes)
        grad_fn = tensor.grad_fn
        hold = held(tensor, grad_fn)
        if nbytes < self.min_bytes:
            hot = self.hot
            hot.small_tensors += 1
            hot.small_bytes += nbytes
            if self.record:
                self._log(tensor, "kept", nbytes, _reasons.UNDER_MIN_BYTES, wrapper)
            return (hold, tensor._version)
        why = ineligible(tensor, grad_fn)
        if why is not None:
            return self._untouched(tensor, why, nbytes, wrapper)
        try:
            address = tensor.data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage: mkldnn, functorch wrappers
            why = unusual(tensor) or _reasons.SUBCLASS
            return self._untouched(tensor, why, nbytes, wrapper)
        kind = _modules.state_kind(tensor, address) if address else None
        if kind is not None:
            why = _reasons.BUFFER if kind == "buffer" else _reasons.PARAMETER
            return self._untouched(tensor, why, nbytes, wrapper)
        # Rule 2 is in the values made below: each records the version.
        # Rule 3: dedupe.
        hot = self.hot
        if hot.released:
            hot.drain()
        found = self.dedupe.find(tensor, address) if nbytes else None
        if found is not None:
            return self._deduplicated(tensor, found, wrapper)
        # Rule 4: choice.
        record = site = None
        if self.profile is not None and not saving_plan_inputs():
            site = self.profile.site(_modules.current(), tensor)
            record = self.profile.record_pack(site, nbytes)
        policy: Any = self.policy
        why = None
        if self.choose is not None:
            policy, why = self.choose(tensor, self._ctx, site)
        if type(policy) is not Keep or self.verify:
            return self.pack_chosen(tensor, address, policy, why, record, wrapper)
        kept = Kept(hold, tensor._version, nbytes, hot, self.order.last)
        hot.tensors += 1
        hot.bytes += nbytes
        live = hot.live = hot.live + nbytes
        if live + self.kept_tier.live_bytes > hot.peak:
            hot.peak = live + self.kept_tier.live_bytes
        self.dedupe.add(kept, address)
        if self.record:
            self._log(tensor, "kept", nbytes, why or _policy_reason(policy), wrapper)
        return kept

    def unpack(self, saved: Any) -> Tensor:
        """The unpack hook: check the version (rule 2), prefetch earlier packs (rule 6), unpack."""
        kind = type(saved)
        if kind is tuple:
            tensor, version = saved
            if tensor._version != version:
                raise modified(tensor, tensor._version, version)
            return tensor
        if kind is Kept:
            tensor = saved.tensor
            if tensor._version != saved.version:
                raise modified(tensor, tensor._version, saved.version)
            self.hot.unpacks += 1
            if saved.prev is not None:
                self.prefetch_from(saved.prev)
            return tensor
        if kind is not Saved:
            if kind is Distributed:  # rule 9
                return _dtensor.rebuild(self.unpack(saved.local), saved.spec)
            raise bug(f"unpack received {type(saved).__name__}")
        return self._unpack(saved)

    @property
    def unpack_hook(self) -> Any:
        """The unpack hook to push: with a profile's step, one that tells it backward began.

        Made when pushed, not kept: a bound method kept on the session would be
        a reference cycle, left for the garbage collector at every step.
        """
        return self.unpack if self.step is None else self._unpack_first

    def _unpack_first(self, saved: Any) -> Tensor:
        """The unpack hook of a session with a profile: backward's start ends its step's forward."""
        step = self.step
        if step is not None:
            step.backward_started()
        return self.unpack(saved)

    def _deduplicated(
        self, tensor: Tensor, found: Kept | Saved, wrapper: Tensor | None
    ) -> Kept | Saved:
        """Rule 3: a value already packed for this storage, geometry and version."""
        self._stats.count_dedupe()
        if self.record:
            packed = found.packed if isinstance(found, Saved) else None
            tier = packed.tier if isinstance(packed, Packed) else "kept"
            self._log(tensor, tier, 0, _reasons.DEDUPLICATED, wrapper)
        return found

    def _untouched(
        self, tensor: Tensor, why: Reason, nbytes: int, wrapper: Tensor | None = None
    ) -> tuple[Tensor, int]:
        """Rule 1: keep ``tensor`` as it is, counted in ``stats.skipped``."""
        self._stats.skip(why, nbytes)
        if self.record:
            self._log(tensor, "kept", nbytes, why, wrapper)
        return (held(tensor, tensor.grad_fn), tensor._version)

    def _pack_subclass(self, tensor: Tensor, nbytes: int) -> Any:
        """Rule 1 for a tensor that is not a plain Tensor; rule 9 for a DTensor."""
        part = _dtensor.local_part(tensor)
        if part is None:
            why = _reasons.UNDER_MIN_BYTES if nbytes < self.min_bytes else subclass_reason(tensor)
            return self._untouched(tensor, why, nbytes)
        local = part.local
        nbytes = nbytes_of(local)
        small = nbytes < self.min_bytes
        kept = _reasons.UNDER_MIN_BYTES if small else distributed_reason(tensor, part)
        if kept is not None:  # kept whole, counted and logged as its local tensor
            self._stats.skip(kept, nbytes)
            if self.record:
                self._log(local, "kept", nbytes, kept, tensor)
            return (held(tensor, tensor.grad_fn), tensor._version)
        return Distributed(self.pack(_dtensor.alias(tensor, local), tensor), part.spec)

    def pack_chosen(
        self,
        tensor: Tensor,
        address: int,
        policy: Any,
        why: Reason | None,
        record: Any,
        wrapper: Tensor | None,
    ) -> Saved | tuple[Tensor, int]:
        """Rules 4 to 6 for a tensor a policy packs (or a selector defers)."""
        odd = unusual(tensor)
        if odd is not None:
            return self._untouched(tensor, odd, tensor.nbytes, wrapper)
        start = _perf_counter()
        deferred = policy if isinstance(policy, Defer) else None
        if deferred is not None:
            policy = _KEEP
            for waiting, leaving in self._window.leaving(tensor.nbytes, deferred.window):
                self._pack_deferred(waiting, leaving)
        packed = policy.pack(tensor, self._ctx)
        saved = Saved(policy, packed, tensor, self)
        if self.record and isinstance(packed, Packed):
            why = why or _policy_reason(policy)
            row = self._log(tensor, packed.tier, packed.stored_bytes, why, wrapper)
            row.waiting = deferred is not None
            self._ctx.attach_row(packed, row)
        if self.verify:
            saved.checksum = checksum(tensor)
        if record is not None:
            record.offloaded = getattr(packed, "tier", "kept") != "kept"
            saved.record = record
        if isinstance(packed, Packed):
            self._ctx.account(packed)
        if address:
            self.dedupe.add(saved, address)
        self.order.last = weakref.ref(saved)
        if deferred is not None:
            self._window.enter(saved, deferred, tensor.nbytes)
        self._stats.timed("pack", _perf_counter() - start)
        self._ctx.flush_warnings()
        return saved

    def _unpack(self, saved: Saved) -> Tensor:
        start = _perf_counter()
        saved.check_version()
        if saved.prev is not None:
            self.prefetch_from(saved.prev)
        record, profile = saved.record, self.profile
        began = profile.clock() if record is not None and profile is not None else 0.0
        try:
            tensor = saved.policy.unpack(saved.packed, self._ctx)
        except ReadBackError as error:
            # The error also waits in its policy's future: without its traceback,
            # which now holds this frame (and so the packed value).
            message, cause = str(error), error.__cause__
            error.__traceback__ = None
            raise type(error)(f"{message} It was saved by {saved.where()}.") from cause
        if record is not None and profile is not None:
            record.unpack_s += profile.clock() - began
        if isinstance(tensor, Held):
            tensor = tensor.value()
        if not isinstance(tensor, Tensor):
            raise bug(f"policy {saved.policy!r} unpacked to {type(tensor).__name__}")
        if saved.checksum is not None:
            check(saved.checksum, tensor, f"{saved.describe()}, unpacked by {saved.policy!r},")
        self._stats.timed("unpack", _perf_counter() - start)
        self._ctx.flush_warnings()
        return tensor

    def _log(
        self, tensor: Tensor, tier: Any, stored: int, why: Reason, wrapper: Tensor | None = None
    ) -> Decision:
        """Log a row for ``tensor`` (a DTensor's local tensor: with its ``wrapper``'s op)."""
        grad_fn = (tensor if wrapper is None else wrapper).grad_fn
        row = Decision(
            module=_modules.current(),
            op=type(grad_fn).__name__ if grad_fn is not None else None,
            shape=list(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            bytes=tensor.nbytes,
            tier=tier,
            stored_bytes=stored,
            reason=why,
        )
        self._stats.log(row)
        return row

    def _pack_deferred(self, saved: Saved, deferred: Defer) -> None:
        holding = saved.packed
        if not isinstance(holding, Held) or holding.tensor is None:
            return
        tensor = holding.tensor
        if tensor._version != saved.version:
            return  # changed in place: unpack raises, as autograd would
        packed = deferred.policy.pack(tensor, self._ctx)
        if isinstance(packed, Packed):
            self._ctx.replace(holding, packed)
        else:
            self._ctx.release(holding)
        saved.switch(deferred.policy, packed)
        if saved.record is not None:
            saved.record.offloaded = getattr(packed, "tier", "kept") != "kept"

    def prefetch_from(self, ref: weakref.ref[Saved]) -> None:
        """Rule 6: start bringing back the packed values before an unpacked one."""
        found: weakref.ref[Saved] | None = ref
        for _ in range(PREFETCH_DEPTH):
            earlier = found() if found is not None else None
            if earlier is None:
                return
            prefetch = getattr(earlier.policy, "prefetch", None)
            if prefetch is not None and not earlier.prefetched:
                earlier.prefetched = True
                prefetch(earlier.packed, self._ctx)
            found = earlier.prev

    def _release_saved(self, saved: Saved) -> None:
        """Rule 7 for a packed value: release its resources."""
        packed = saved.packed
        if isinstance(packed, Packed):
            self._ctx.release(packed)


_KEEP = Keep()


def _policy_reason(policy: Any) -> Reason:
    return reason(Why.POLICY, type(policy).__name__)
