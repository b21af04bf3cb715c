"""What modules run inside a stash: their paths, parameters and buffers.

Global module hooks are registered while any session is open. They do two
things:

1. Keep this thread's stack of running modules, for the decision log. A module
   first seen at the top of the stack is a root: its submodules are named by
   their paths in it (``blocks.0.attn``), the root by its class name.
2. Remember (weakly) the storages of the parameters and buffers of every module
   that runs, so the session keeps them untouched. Buffers matter: BatchNorm
   saves its running statistics for backward and then updates them in place
   within the same operation, without bumping their version.
3. Stay out of ``torch.compile``: while dynamo traces a module the hooks do
   nothing (dynamo cannot trace weak references, and would bake them into the graph
   if it could). A compiled region then counts as its outermost module, and its
   parameters are recognised as leaves that require grad.

Global forward pre-hooks run before a module's own pre-hooks, and wrappers
swap tensors in from their own: FSDP2 (``fully_shard``) registers the
unsharded parameters of the module it wraps in its pre-forward hook, after
ours has read the sharded ones. So :func:`is_state`, on a miss, reads once more
the tensors of the modules entered since its last read: by the time anything
is saved, every pre-hook of the running modules has run.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_local = threading.local()
_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_users = 0
_handles: list[RemovableHandle] = []
# Storages of parameters and buffers, by address of the storage object: a weak
# reference to it, dropped with it. A dict lookup by integer is what keeps the
# pack hook cheap (a WeakSet makes a weak reference for every lookup).
_parameters: dict[int, weakref.ref[Any]] = {}
_buffers: dict[int, weakref.ref[Any]] = {}


def _add(table: dict[int, weakref.ref[Any]], storage: Any) -> None:
    key = id(storage)
    found = table.get(key)
    if found is not None and found() is storage:
        return

    def gone(dead: weakref.ref[Any]) -> None:
        if table.get(key) is dead:
            del table[key]

    table[key] = weakref.ref(storage, gone)


def _holds(table: dict[int, weakref.ref[Any]], storage: Any) -> bool:
    found = table.get(id(storage))
    return found is not None and found() is storage


def _stack() -> list[nn.Module]:
    stack: list[nn.Module] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _remember(module: nn.Module) -> None:
    for parameter in module._parameters.values():
        if parameter is not None:
            _add(_parameters, parameter.untyped_storage())
    for buffer in module._buffers.values():
        if buffer is not None:
            _add(_buffers, buffer.untyped_storage())


def _enter(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced as a no-op: see rule 3 of the NOTE above
    # Every call, not once per module: wrappers such as FSDP swap parameters in.
    _remember(module)
    stack = _stack()
    if module not in _names:
        if stack:
            _names[module] = f"{current()}.<{type(module).__name__}>"
        else:
            root = getattr(module, "_orig_mod", module)  # torch.compile's wrapper
            for name, child in module.named_modules():
                name = name.removeprefix("_orig_mod").removeprefix(".")
                _names.setdefault(child, name or type(root).__name__)
    stack.append(module)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = _stack()
    if stack and stack[-1] is module:
        stack.pop()
        _local.reread = min(getattr(_local, "reread", 0), len(stack))


def forget_stack() -> None:
    """Empty this thread's module stack.

    Called when a thread's outermost session exits: a KeyboardInterrupt (a
    BaseException) skips torch's always-called forward hooks, which would leave
    the interrupted modules on the stack and misname every later module.
    """
    _stack().clear()
    _local.reread = 0


def is_state(storage: Any) -> bool:
    """Whether a storage holds a parameter or buffer of a module that ran in a session."""
    return state_kind(storage) is not None


def state_kind(storage: Any) -> str | None:
    """ "parameter" or "buffer" if a module that ran in a session holds ``storage``.

    On a miss, the tensors of the modules entered since the last miss are read
    again (their wrappers' pre-forward hooks have run since: see the module
    docstring), at most once per module call.
    """
    kind = _kind(storage)
    if kind is not None:
        return kind
    stack = _stack()
    reread: int = getattr(_local, "reread", 0)
    if reread >= len(stack):
        return None
    for module in stack[reread:]:
        _remember(module)
    _local.reread = len(stack)
    return _kind(storage)


def _kind(storage: Any) -> str | None:
    if _holds(_parameters, storage):
        return "parameter"
    return "buffer" if _holds(_buffers, storage) else None


def current() -> str:
    """The path of the innermost module running on this thread ("" outside any)."""
    stack = _stack()
    return _names.get(stack[-1], type(stack[-1]).__name__) if stack else ""


def track() -> None:
    """Start following modules (one call per open session; see :func:`untrack`)."""
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            # torch warns on each call of a compiled module while global hooks
            # exist, because they fire once more for its wrapper; ours allow it.
            warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
            _handles.append(module_hooks.register_module_forward_pre_hook(_enter))
            _handles.append(module_hooks.register_module_forward_hook(_leave, always_call=True))


def untrack() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()
