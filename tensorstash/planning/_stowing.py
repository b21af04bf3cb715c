"""The disk tier inside compiled graphs (rule 12 of NOTE [ Compiled code ] in compiler.py).

A pair that moves (``CompilerHooks`` with ``moving`` bytes) traces, for each tensor a
compiled forward keeps for backward, either the pair's usual pack or
``tensorstash::stow``, which hands the tensor to a tier policy and returns a small
token; its unpack traces ``tensorstash::fetch``, which brings the tensor back from the
token. AOTAutograd inlines both at the forward's end and the backward's start, where
moving saves nothing at the peak, so a post-grad pass (:func:`with_placement`) puts each
stow right after the last forward use of its tensor, and each fetch right before the
first backward use of its value: the tensor leaves memory while the forward goes on, and
comes back when the backward reaches it.

The token owns the packed value: it is a tensor over a :class:`_Holder`'s bytes, and
the holder, with the packed value and its spill file extent, is released when
autograd frees the token with the graph's other saved tensors.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any
from weakref import WeakValueDictionary

import torch
from torch import Tensor, fx

from tensorstash.core.policy import Context, Packed, bug

MOVE_FROM = 256 << 10
"""The least tensor a pair that moves stows (smaller ones cost more calls than bytes)."""

_ids = itertools.count(1)
_HELD: WeakValueDictionary[int, _Holder] = WeakValueDictionary()
_HELD_LOCK = threading.Lock()

OP_TAGS: dict[str, Any] = (
    {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}
)
"""The tags of the ops inlined into compiled graphs: a CUDA graph's replay runs no Python,
so inductor leaves them out of the CUDA graphs it records (rule 8 of NOTE [ Compiled
code ])."""


class _Holder(bytearray):
    """The bytes of a token (its id), and what the token owns: the packed value and the
    policy and session context that unpack it (or the tensor itself, where no session
    stows on this thread)."""

    policy: Any
    ctx: Context | None
    packed: Any


@torch.library.custom_op(
    "tensorstash::stow", mutates_args=(), schema="(Tensor tensor, str scheme) -> Tensor", **OP_TAGS
)
def _stow(tensor: Tensor, scheme: str) -> Tensor:
    from tensorstash.planning import compiler

    holder = _Holder(8)
    target = compiler.stow_target()
    if target is None:
        holder.policy, holder.ctx, holder.packed = None, None, tensor.detach().clone()
    else:
        policy, ctx = target
        holder.policy, holder.ctx = policy, ctx
        packed = holder.packed = policy.pack(tensor.detach(), ctx)
        if isinstance(packed, Packed):  # the session's stats count it while it lives
            ctx.account(packed)
            weakref.finalize(holder, ctx.release, packed)
    count = compiler.thread_count()
    count.moved += tensor.nbytes
    count.tensors += 1
    count.counted(tensor, tensor.nbytes)
    with _HELD_LOCK:
        key = next(_ids)
        _HELD[key] = holder
    holder[:] = key.to_bytes(8, "little")
    return torch.frombuffer(holder, dtype=torch.uint8)  # the storage holds the holder


@_stow.register_fake
def _stow_fake(tensor: Tensor, scheme: str) -> Tensor:
    return torch.empty(8, dtype=torch.uint8)


@torch.library.custom_op(
    "tensorstash::fetch",
    mutates_args=(),
    schema="(Tensor token, SymInt[] shape, SymInt[] stride, ScalarType dtype) -> Tensor",
    **OP_TAGS,
)
def _fetch(token: Tensor, shape: list[int], stride: list[int], dtype: torch.dtype) -> Tensor:
    from tensorstash.planning import compiler

    key = int.from_bytes(bytes(token.tolist()), "little")  # numpy is no dependency
    with _HELD_LOCK:
        holder = _HELD.get(key)
    if holder is None:
        raise bug("a tensor a compiled forward stowed is gone before its backward")
    if holder.policy is None:
        value = holder.packed
    else:
        value = holder.policy.unpack(holder.packed, holder.ctx)
    # A copy the compiled backward owns: it may write over its inputs' buffers, and the
    # value may be a spill file's own pages, read again by another backward.
    out = torch.empty_strided(shape, stride, dtype=dtype)
    out.copy_(value)
    compiler.note_reached()
    return out


@_fetch.register_fake
def _fetch_fake(token: Tensor, shape: list[int], stride: list[int], dtype: torch.dtype) -> Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype)


fx.node.has_side_effect(torch.ops.tensorstash.stow.default)


def movable(tensor: Tensor) -> bool:
    """Whether a tensor a compiled forward keeps can be stowed: a dense CPU tensor of
    at least :data:`MOVE_FROM` bytes, of static shape."""
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return False
    if not tensor.is_contiguous():
        return False
    if any(not isinstance(size, int) for size in tensor.shape):
        return False  # dynamic shapes: the fetch's shape would be a symbol
    return tensor.nbytes >= MOVE_FROM


def stow(tensor: Tensor, scheme: str) -> tuple[Tensor, tuple[int, ...], tuple[int, ...], Any]:
    """What a moving pair's pack traces for ``tensor``: the token, and its layout."""
    token = torch.ops.tensorstash.stow.default(tensor, scheme)
    return token, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def fetch(packed: tuple[Tensor, tuple[int, ...], tuple[int, ...], Any]) -> Tensor:
    """What a moving pair's unpack traces for a stowed value."""
    token, shape, stride, dtype = packed
    return torch.ops.tensorstash.fetch.default(token, list(shape), list(stride), dtype)


def with_placement(passes: Any) -> Any:
    """The ``post_grad_custom_post_pass`` to compile with: the placement pass
    (:func:`place`) first, then the user's own (one pass, a list of them, or None); None
    where the placement pass is there already.

    Inductor takes a list of passes from torch 2.13 on, and one pass before: there the
    placement pass is one that runs the user's pass after its own (NOTE [ Support range ]
    rule 3 in core/_support.py). Each is an inductor ``CustomGraphPass`` with a ``uuid``,
    so inductor's compile cache stays on where the user's passes keep it on (a pass of
    another kind turns it off). Made on first use, as inductor is imported only where
    something compiles.
    """
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
    except ImportError:  # one pass, before torch 2.13
        if getattr(passes, "tensorstash_placement", False) is True:
            return None
        from torch._inductor import custom_graph_pass

        aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
        return _placement_class(aware is not None and isinstance(passes, aware))(passes)
    theirs = get_custom_graph_passes(passes)
    if any(getattr(each, "tensorstash_placement", False) is True for each in theirs):
        return None
    return [_placement_class()(), *theirs]


@functools.cache
def _placement_class(inference_aware: bool = False) -> type:
    """The placement pass's class: an inductor pass that is told whether the graph is an
    inference graph where the user's own pass it runs after it is (torch 2.12)."""
    from torch._inductor import custom_graph_pass

    base = (
        custom_graph_pass.CustomInferenceAwareGraphPass
        if inference_aware
        else custom_graph_pass.CustomGraphPass
    )

    class Placement(base):  # type: ignore[misc, valid-type]
        tensorstash_placement = True

        def __init__(self, then: Any = None) -> None:
            self.then = then  # the user's own pass, where inductor takes one pass only

        def __call__(self, graph: fx.Graph, *args: Any, **kwargs: Any) -> None:
            place(graph)
            if self.then is not None:
                self.then(graph, *args, **kwargs)

        def uuid(self) -> Any:
            if self.then is None:
                return ("tensorstash-placement", 1)
            theirs = getattr(self.then, "uuid", None)
            key = theirs() if callable(theirs) else None
            return None if key is None else ("tensorstash-placement", 1, key)  # None: no cache

    return Placement


def place(graph: fx.Graph) -> int:
    """Move the stows and fetches of ``graph`` next to their uses: how many moved."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.tensorstash.stow.default:
            source = node.args[0]
            if not isinstance(source, fx.Node):
                continue
            uses = [use for use in source.users if use is not node and use.op != "output"]
            last = max(uses, key=order.__getitem__) if uses else source
            last.append(node)
            moved += 1
        elif node.target is torch.ops.tensorstash.fetch.default and node.users:
            first = min(node.users, key=order.__getitem__)
            first.prepend(node)
            moved += 1
    graph.lint()
    return moved
