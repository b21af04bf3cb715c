"""What modules run inside a stash: their paths, parameters and buffers.

Global module hooks are registered while any session is open. They:

1. Keep this thread's stack of running modules, for the decision log. A module
   first seen at the top of the stack is a root: its submodules are named by
   their paths in it (``blocks.0.attn``), the root by its class name.
2. Remember (weakly) the storages of the parameters and buffers of every module
   that runs, so the session keeps them untouched. Buffers matter: BatchNorm
   saves its running statistics for backward and then updates them in place
   within the same operation, without bumping their version. A DTensor
   parameter's storage is its local tensor's (NOTE [ DTensor ] in _dtensor.py).
3. Stay out of ``torch.compile``: while dynamo traces a module the hooks do
   nothing (dynamo cannot trace weak references, and would bake them into the graph
   if it could). A compiled region then counts as its outermost module, and its
   parameters are recognised as leaves that require grad.
4. Tell observers (a profile measuring a step) of each module call on this
   thread: entered once the module is on the stack, left before it leaves. An
   observer stops on the thread it began on, whichever thread stops it: on
   CUDA a step stops at its first unpack, on the autograd engine's device
   thread, and one stopped there on its own list stayed on the training
   thread's for good (on an H200, after the bench's ``medium`` sweep, 23
   finished steps were still told of every module call of every session).

5. A session that opens quiet (rule 11 of NOTE [ Session ] in stash.py)
   tracks nothing; it asks only to hear of the next module call on its
   thread (:func:`next_call`): one global pre-hook, under the same key every
   time (as in :func:`track`), taken out at that call, so the modules inside
   run torch's path without hooks.

Global forward pre-hooks run before a module's own pre-hooks, and wrappers
swap tensors in from their own: FSDP2 (``fully_shard``) registers the
unsharded parameters of the module it wraps in its pre-forward hook, after
ours has read the sharded ones. So :func:`is_state`, on a miss, reads once more
the tensors of the modules entered since its last read: by the time anything
is saved, every pre-hook of the running modules has run.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from tensorstash.session import _dtensor

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_local = threading.local()
_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_users = 0
_keys: tuple[int, int] | None = None  # our hooks' keys in torch's global hook tables
_filter: Any = None  # our entry in warnings.filters, once made
_next_key: int | None = None  # next_call's hook's key in torch's global pre-hook table
# next_call's callbacks by thread: told of the next module call on that thread.
_next: dict[int, Callable[[nn.Module, Any], None]] = {}
# Parameters and buffers by the address of their data: a weak reference to
# their storage (the entry goes with it) and "parameter" or "buffer". A saved
# tensor is looked up by its address (no storage object is made for it), and
# a hit is trusted only once its storage is the one remembered.
_state: dict[int, tuple[weakref.ref[Any], str]] = {}


def _add(tensor: torch.Tensor, kind: str) -> None:
    key = tensor.data_ptr()
    if key == 0:
        local = _dtensor.local_tensor(tensor)  # a DTensor's data is its local tensor's
        if local is None:
            return  # no data (empty, meta): nothing a saved tensor could share
        tensor, key = local, local.data_ptr()
        if key == 0:
            return
    storage = tensor.untyped_storage()
    found = _state.get(key)
    if found is not None and found[0]() is storage:
        if kind == "parameter" and found[1] != kind:
            _state[key] = (found[0], kind)
        return

    def gone(dead: weakref.ref[Any]) -> None:
        entry = _state.get(key)
        if entry is not None and entry[0] is dead:
            del _state[key]

    _state[key] = (weakref.ref(storage, gone), kind)


class Observer(Protocol):
    """Told of each module call on the thread it watches (a profile's step: NOTE [ Profile ])."""

    def entered(self, module: nn.Module, args: tuple[Any, ...]) -> None: ...

    def left(self, module: nn.Module) -> None: ...


class _Thread:
    """This thread's running modules, how many of them :func:`state_kind` has read,
    and the observers told of module calls (rule 4 of the NOTE above)."""

    __slots__ = ("observers", "reread", "stack")

    def __init__(self) -> None:
        self.stack: list[nn.Module] = []
        self.reread = 0
        self.observers: list[Observer] = []


def _thread() -> _Thread:
    try:
        found: _Thread = _local.thread
    except AttributeError:
        found = _local.thread = _Thread()
    return found


def _stack() -> list[nn.Module]:
    return _thread().stack


def _remember(module: nn.Module) -> None:
    for parameter in module._parameters.values():
        if parameter is not None:
            _add(parameter, "parameter")
    for buffer in module._buffers.values():
        if buffer is not None:
            _add(buffer, "buffer")


def _enter(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return  # traced as a no-op: see rule 3 of the NOTE above
    # Every call, not once per module: wrappers such as FSDP swap parameters in.
    _remember(module)
    stack = _stack()
    if module not in _names:
        if stack:
            _name_tree(stack[0])  # modules set on the model since it was named
        else:
            _name_tree(module)
        if module not in _names:
            _names[module] = f"{current()}.<{type(module).__name__}>"
    stack.append(module)
    observers = _thread().observers
    if observers:
        for observer in tuple(observers):  # an observer may leave while told
            observer.entered(module, args)


def enter(module: nn.Module, args: Any) -> None:
    """Follow ``module`` from inside its call, as this module's pre-hook would have:
    tracking began after its global pre-hooks ran (rule 5)."""
    _enter(module, args)


def _name_tree(root: nn.Module) -> None:
    """Name ``root``'s modules by their paths in it (rule 1); the root by its class.

    torch.compile's wrapper is transparent: a compiled model's modules, and a
    compiled block's, keep the paths they have in the model.
    """
    model = getattr(root, "_orig_mod", root)
    for name, child in root.named_modules():
        path = ".".join(part for part in name.split(".") if part != "_orig_mod")
        _names.setdefault(child, path or type(model).__name__)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    thread = _thread()
    stack = thread.stack
    if stack and stack[-1] is module:
        for observer in tuple(thread.observers):
            observer.left(module)
        stack.pop()
        thread.reread = min(thread.reread, len(stack))


def observe(observer: Observer) -> Callable[[], None]:
    """Tell ``observer`` of the module calls on this thread until the returned call.

    The call may come from any thread: on CUDA, backward runs on the autograd
    engine's device thread, and a step that stops observing at its first
    unpack stops there. It takes the observer off the list of the thread that
    observes, not off the caller's.
    """
    observers = _thread().observers
    observers.append(observer)

    def stop() -> None:
        with contextlib.suppress(ValueError):  # stopped already
            observers.remove(observer)

    return stop


def forget_stack() -> None:
    """Empty this thread's module stack.

    Called when a thread's outermost session exits: a KeyboardInterrupt (a
    BaseException) skips torch's always-called forward hooks, which would leave
    the interrupted modules on the stack and misname every later module.
    """
    thread = _thread()
    thread.stack.clear()
    thread.reread = 0


def is_state(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data is a parameter or buffer of a module that ran in a session."""
    return state_kind(tensor, tensor.data_ptr()) is not None


def state_kind(tensor: torch.Tensor, address: int) -> str | None:
    """ "parameter" or "buffer" if a module that ran in a session holds ``tensor``'s data.

    ``address`` is ``tensor.data_ptr()``: a parameter, a buffer, or a view of
    one starting where it starts. On a miss, the tensors of the modules
    entered since the last miss are read again (their wrappers' pre-forward
    hooks have run since: see the module docstring), at most once per module
    call.
    """
    found = _state.get(address)
    if found is not None and found[0]() is tensor.untyped_storage():
        return found[1]
    # A miss, or an entry for another storage at this address (FSDP2 frees an
    # unsharded parameter's memory with resize_(0), its storage object alive,
    # and the address is handed out again): read the running modules again.
    thread = _thread()
    stack = thread.stack
    if thread.reread >= len(stack):
        return None
    for module in stack[thread.reread :]:
        _remember(module)
    thread.reread = len(stack)
    found = _state.get(address)
    return found[1] if found is not None and found[0]() is tensor.untyped_storage() else None


def current() -> str:
    """The path of the innermost module running on this thread ("" outside any)."""
    stack = _stack()
    return _names.get(stack[-1], type(stack[-1]).__name__) if stack else ""


def track() -> None:
    """Start following modules (one call per open session; see :func:`untrack`).

    The hooks go back into torch's global tables under the keys they had the
    first time: ``torch.compile`` guards on those keys, and new ones each
    session would make a compiled model compile again every step.
    """
    global _users, _keys
    with _lock:
        _users += 1
        if _users > 1:
            return
        _ignore_compile_warning()
        if _keys is None:
            pre = module_hooks.register_module_forward_pre_hook(_enter)
            post = module_hooks.register_module_forward_hook(_leave, always_call=True)
            _keys = (pre.id, post.id)
            return
        pre_key, post_key = _keys
        module_hooks._global_forward_pre_hooks[pre_key] = _enter
        module_hooks._global_forward_hooks[post_key] = _leave
        module_hooks._global_forward_hooks_always_called[post_key] = True


def _ignore_compile_warning() -> None:
    """Silence torch's warning about global module hooks on compiled modules.

    torch warns on each call of a compiled module while global hooks exist,
    because they fire once more for its wrapper; ours allow it. The filter is
    added again only when it is no longer first (``catch_warnings`` restores
    the filters it found): adding one clears every warning registry, and a
    session is opened every step.
    """
    global _filter
    filters = warnings.filters
    if _filter is not None and filters and filters[0] is _filter:
        return
    warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
    _filter = warnings.filters[0]


def next_call(callback: Callable[[nn.Module, Any], None]) -> Callable[[], None]:
    """Call ``callback(module, args)`` at the next module call on this thread, once (rule 5).

    Returns the call that cancels it (a no-op once it was called).
    """
    global _next_key
    ident = threading.get_ident()
    with _lock:
        _next[ident] = callback
        _ignore_compile_warning()
        if _next_key is None:
            _next_key = module_hooks.register_module_forward_pre_hook(_called).id
        else:
            module_hooks._global_forward_pre_hooks[_next_key] = _called

    def cancel() -> None:
        with _lock:
            if _next.get(ident) is callback:
                _drop_next(ident)

    return cancel


def _drop_next(ident: int) -> None:
    del _next[ident]
    if not _next and _next_key is not None:
        module_hooks._global_forward_pre_hooks.pop(_next_key, None)


def _called(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    ident = threading.get_ident()
    with _lock:
        callback = _next.get(ident)
        if callback is None:
            return  # another thread's next call
        _drop_next(ident)
    callback(module, args)


def untrack() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0 and _keys is not None:
            pre_key, post_key = _keys
            module_hooks._global_forward_pre_hooks.pop(pre_key, None)
            module_hooks._global_forward_hooks.pop(post_key, None)
            module_hooks._global_forward_hooks_always_called.pop(post_key, None)
