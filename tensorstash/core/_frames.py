"""Functions dynamo runs as they are, never traced (rule 12 of NOTE [ Session ] in
session/stash.py).

Autograd calls a saved-tensor hook from the frame that saves the tensor. Where
that frame runs under dynamo's frame callback (eager code inside a compiled
function, past a graph break; a recompute region inside a compiled model),
dynamo would take the hook's frame for user code and compile it, with fake
tensors, and fail there. Dynamo reads, for each code object, what to do with
its frames: :func:`keep_out` tells it to run the function's frames, and every
frame they call, with its callback off. That costs a call nothing: dynamo's
frame hook is not even installed outside compiled code, and inside it the
answer is one lookup on the code object. (``torch._dynamo.disable`` does the
same by switching the callback off and on around every call, which costs two
switches a call, on every call, once dynamo is imported.)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

_KEPT_OUT: set[types.CodeType] = set()

try:
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )
except ImportError:  # a build without dynamo: nothing traces the hooks
    _SKIP: Any = None
else:
    _SKIP = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


def keep_out(*functions: Callable[..., Any] | None) -> None:
    """Have dynamo run each function, and all it calls, as it is, never traced.

    Functions and bound methods are marked (their code, for the process, once);
    builtins (the C hooks) and None are passed over.
    """
    if _SKIP is None:
        return
    for function in functions:
        code = _code(function)
        if code is not None and code not in _KEPT_OUT:
            set_code_exec_strategy(code, _SKIP)
            _KEPT_OUT.add(code)


def kept_out(function: Callable[..., Any]) -> bool:
    """Whether :func:`keep_out` marked ``function``'s code."""
    code = _code(function)
    return code is not None and code in _KEPT_OUT


def _code(function: Any) -> types.CodeType | None:
    function = getattr(function, "__func__", function)  # a bound method
    code = getattr(function, "__code__", None)
    return code if isinstance(code, types.CodeType) else None
