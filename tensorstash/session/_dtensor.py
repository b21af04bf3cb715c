"""Distributed tensors packed as their local tensors (rule 9 of NOTE [ Session ]).

# NOTE [ DTensor ]
Under tensor parallelism (``torch.distributed.tensor``) autograd saves
``DTensor`` activations: a wrapper around this rank's local tensor and a spec
(mesh, placements, global shape and stride). The wrapper holds no data of its
own, so the session packs the local tensor and rebuilds the wrapper at unpack:

1. Placements. A DTensor is rebuilt from its local tensor and the same spec
   object, so its mesh, placements, global shape and stride are the ones saved.
   That is exact for the placements whose fields are all there is to them:
   ``Shard``, ``Replicate``, ``Partial`` and ``_StridedShard`` (:data:`REBUILT`).
   A DTensor with any other placement (torch's ``_MaskPartial``, whose mask
   buffer belongs to the DTensor it was made for, ``_NormPartial``, a
   placement of one's own) is kept whole, reason "DTensor placement <class>";
   so is one whose local tensor is not a plain strided tensor (a float8
   subclass: "tensor subclass").
2. Pending collectives. ``to_local()`` of a DTensor whose reduction is still in
   flight returns an ``AsyncCollectiveTensor`` (and a DTensor's local tensor may
   be one): its bytes are valid only once the collective is waited for. It is
   waited for at pack (the op saving it has done so already) and unpacked as
   the tensor it resolved to, which every op treats as it treats the wrapper.
3. Versions. A DTensor's in-place op changes its local tensor without bumping
   the local tensor's version: autograd checks the wrapper's. So the session
   packs, instead of the local tensor, a plain alias of its data that shares
   the wrapper's version counter (:func:`alias`): rules 2 and 3 (the
   version check, dedupe) then see the DTensor's version, as autograd does. A
   change made through the local tensor itself (``to_local()`` under no_grad,
   then in place) bumps neither; autograd does not see it, nor does the
   session, as with ``.data``.
4. Nothing here imports ``torch.distributed``: a DTensor (or an
   AsyncCollectiveTensor) exists only once its module is imported, so the
   classes are looked up in ``sys.modules``. tensorstash imports and works where
   ``torch.distributed`` is unavailable.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tensorstash.core._reasons import SUBCLASS, Reason, Why, reason

_DTENSOR = "torch.distributed.tensor._api"
_COLLECTIVES = "torch.distributed._functional_collectives"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
REBUILT = ("Shard", "Replicate", "Partial", "_StridedShard")
"""The placements a DTensor is rebuilt with (rule 1); the others keep it as it is."""

_rebuilt: frozenset[type] = frozenset()


@dataclass(frozen=True, slots=True)
class Part:
    """What the session packs of a distributed tensor.

    Attributes:
        local: this rank's tensor (a pending collective's result waited for).
        spec: the DTensor's spec, to rebuild it at unpack; None for a pending
            collective's result, unpacked as ``local`` (rule 2).
        kept: why the wrapper is kept whole (rule 1), or None.
    """

    local: Tensor
    spec: Any
    kept: Reason | None


def _class(module: str, name: str) -> type | None:
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


def _rebuilt_placements() -> frozenset[type]:
    """The classes of :data:`REBUILT` (with their C++ bases, which ops may return)."""
    global _rebuilt
    if not _rebuilt:
        placements = sys.modules[_PLACEMENTS]
        classes = [getattr(placements, name) for name in REBUILT]
        bases = [c.__mro__[1] for c in classes if c.__mro__[1].__module__.startswith("torch._C")]
        _rebuilt = frozenset(classes + bases)
    return _rebuilt


def _resolved(tensor: Tensor, collective: type | None) -> Tensor:
    """``tensor``, or what a pending collective's result resolves to (rule 2)."""
    if collective is not None and type(tensor) is collective:
        return tensor.trigger_wait()  # type: ignore[attr-defined]
    return tensor


def local_part(tensor: Tensor) -> Part | None:
    """The local tensor of a DTensor or of a pending collective's result; None for other tensors."""
    kind = type(tensor)
    collective = _class(_COLLECTIVES, "AsyncCollectiveTensor")
    spec = None
    if kind is collective:
        local = _resolved(tensor, collective)
    elif kind is _class(_DTENSOR, "DTensor"):
        spec = tensor._spec  # type: ignore[attr-defined]
        local = _resolved(tensor._local_tensor, collective)  # type: ignore[attr-defined]
        rebuilt = _rebuilt_placements()
        for placement in spec.placements:
            if type(placement) not in rebuilt:
                return Part(local, spec, reason(Why.PLACEMENT, type(placement).__name__))
    else:
        return None
    plain = type(local) is Tensor and local.layout is torch.strided
    if not plain or local.dtype is not tensor.dtype or local.is_conj() or local.is_neg():
        return Part(local, spec, SUBCLASS)  # no plain alias could stand for it (rule 3)
    return Part(local, spec, None)


def alias(wrapper: Tensor, local: Tensor) -> Tensor:
    """A plain tensor over ``local``'s data sharing ``wrapper``'s version counter (rule 3).

    ``detach`` shares the version counter of the tensor it is called on; below
    the wrapper's dispatch it aliases the wrapper itself (whose storage holds no
    data), and ``set_`` then points the alias at the local tensor's data.
    """
    with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        view = Tensor.detach(wrapper)
    version = view._version
    view.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
    torch._C._autograd._unsafe_set_version_counter((view,), (version,))  # set_ bumped it
    return view


def local_tensor(tensor: Tensor) -> Tensor | None:
    """A DTensor's local tensor, as it holds it; None for any other tensor."""
    if type(tensor) is _class(_DTENSOR, "DTensor"):
        return tensor._local_tensor  # type: ignore[attr-defined]
    return None


def rebuild(local: Tensor, spec: Any) -> Tensor:
    """The DTensor of ``spec`` around ``local`` (``local`` itself if ``spec`` is None).

    The constructor makes no autograd node and no communication: autograd gives
    the unpacked tensor its place in the graph.
    """
    if spec is None:
        return local
    dtensor: Any = sys.modules[_DTENSOR].DTensor
    return dtensor(local, spec, requires_grad=False)
