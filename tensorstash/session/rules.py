"""The pack rules: what the session holds of a saved tensor, and when it keeps one untouched.

# NOTE [ Pack rules ]
A saved tensor meets these checks in this order (rules 1 to 4 of NOTE
[ Session ]): the first that decides, decides. :data:`ORDER` names them;
``Session.pack`` is their statement in Python, and ``pack_fast`` in
core/_fast.c follows the same order for a plain Tensor, reading the same
attributes, and hands the tensor to ``Session.pack`` at the first check it
does not take on itself. tests/test_pack_rules.py holds the two equal, case
by case.

1. ``size``: a tensor with no plain size (sparse) is kept untouched.
2. ``type``: a tensor that is not a plain Tensor (a parameter, a DTensor, a
   subclass) goes to the subclass path (rule 9 of NOTE [ Session ]). [C: hands over]
3. ``held``: what the session would hold of it without a copy (:func:`held`):
   the tensor, or, where it is the output of the op saving it, the tensor
   detached.
4. ``small``: under ``min_bytes``, it is held as it is, counted as small.
5. ``eligible``: a leaf that requires grad, a parameter's view or copy
   (:func:`ineligible`) is kept untouched. [C: hands over]
6. ``storage``: a tensor without storage (mkldnn, functorch wrappers) is
   kept untouched. [C: hands over]
7. ``state``: a module's parameter or buffer, by address, is kept untouched.
   [C: hands over where it may be one]
8. ``dedupe``: a storage saved before with the same geometry and version
   returns that value (rule 3 of NOTE [ Session ]). [C: hands over where the
   address was seen]
9. ``choice``: the selector's or the policy's choice; ``Keep`` makes a kept
   value, any other policy packs (:func:`unusual` is asked first). [C: keeps,
   or calls the session's packing of a chosen policy]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tensorstash.core import _reasons
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.session import _dtensor

ORDER = ("size", "type", "held", "small", "eligible", "storage", "state", "dedupe", "choice")
"""The pack rules in the order both paths check them."""

_Parameter = torch.nn.Parameter
_sequence_nr = torch._C._autograd._get_sequence_nr


def held(tensor: Tensor, grad_fn: Any) -> Tensor:
    """What to hold of a saved tensor without copying it (rule 1).

    Autograd holds a saved input as it is, but a saved output detached: the
    output's ``grad_fn`` is the node saving it, and holding the output whole
    from that node would make a cycle that only backward breaks. The node saving
    a tensor is the last one made on this thread, so an output is recognised by
    its node's sequence number (the next number to hand out, less one).
    ``grad_fn`` is the tensor's, read once by the caller.
    """
    if grad_fn is not None and grad_fn._sequence_nr() == _sequence_nr() - 1:
        return tensor.detach()
    return tensor


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_STRIDED = torch.strided
LEAF = _reasons.LEAF.text()
"""The reason logged for a saved leaf that is not a parameter (a model input, usually)."""


def node_types(*makers: Any) -> frozenset[type]:
    """The autograd node classes of the ops ``makers`` run on a leaf."""
    leaf = torch.zeros(2, 2, requires_grad=True)
    return frozenset(type(make(leaf).grad_fn) for make in makers)


PARAMETER_COPIES = node_types(
    lambda w: w.t(), lambda w: w.transpose(0, 1), lambda w: w.to(torch.float64)
)
"""Nodes of a parameter's copies that share nothing with it (autocast's casts, ``weight.t()``)."""
ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).expand(2).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


def ineligible(tensor: Tensor, grad_fn: Any) -> Reason | None:
    """Why a plain tensor of at least ``min_bytes`` is kept untouched, from what is cheap to ask.

    A leaf that requires grad, a parameter, a view of one or a cast of one
    (autocast's bf16 weight copies, ``weight.t()``). ``grad_fn`` is the
    tensor's. The caller checks module state by address, and :func:`unusual`
    before a policy moves the tensor.
    """
    if grad_fn is None:
        if tensor.requires_grad:
            return _reasons.LEAF
    elif type(grad_fn) in PARAMETER_COPIES:
        nexts = grad_fn.next_functions
        if len(nexts) == 1 and type(nexts[0][0]) is ACCUMULATE_GRAD:
            return _reasons.PARAMETER
    base = tensor._base
    if base is not None and (type(base) is _Parameter or (base.requires_grad and base.is_leaf)):
        return _reasons.PARAMETER
    return None


def unusual(tensor: Tensor) -> Reason | None:
    """Why no policy can move a plain tensor (rule 1): checked before one tries.

    Keeping such a tensor is what the session would do anyway, so the kept
    path does not ask.
    """
    if tensor.layout is not _STRIDED:
        return reason(Why.LAYOUT, str(tensor.layout).removeprefix("torch."))
    if tensor.is_nested:
        return Reason(Why.NESTED)
    if _WRAPPED is not None and _WRAPPED(tensor):
        return Reason(Why.FUNCTORCH)
    if not (tensor.is_cpu or tensor.is_cuda):
        return reason(Why.DEVICE, tensor.device.type)
    if tensor.is_quantized:
        return Reason(Why.QUANTIZED)
    if tensor.is_conj() or tensor.is_neg():
        return Reason(Why.CONJUGATE)
    return None


def unsized_reason(tensor: Tensor) -> Reason:
    """Why a plain tensor without ``nbytes`` (sparse, nested) is kept untouched."""
    if tensor.is_nested:
        return Reason(Why.NESTED)
    return reason(Why.LAYOUT, str(tensor.layout).removeprefix("torch."))


def subclass_reason(tensor: Tensor) -> Reason:
    """Why a tensor that is not a plain Tensor is kept untouched."""
    return _reasons.PARAMETER if type(tensor) is _Parameter else _reasons.SUBCLASS


def distributed_reason(tensor: Tensor, part: _dtensor.Part) -> Reason | None:
    """Why a DTensor of at least ``min_bytes`` is kept whole (rule 9), or None.

    A parameter, a view or cast of one, a leaf that requires grad (asked of the
    DTensor: its local tensor has no autograd history), or a placement or
    local tensor it cannot be rebuilt with.
    """
    if isinstance(tensor, _Parameter):  # a DTensor parameter is a Parameter by a flag
        return _reasons.PARAMETER
    return ineligible(tensor, tensor.grad_fn) or part.kept
