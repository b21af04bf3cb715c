"""The torch versions tensorstash supports, and what a feature needs of the torch it runs.

# NOTE [ Support range ]
1. tensorstash needs torch 2.8 or newer. A session reads the innermost pair of
   saved-tensor hooks on its thread (``torch._C._autograd._top_saved_tensors_default_hooks``,
   new in 2.8) to know whether its own hooks are innermost (quiet steps, ``pause``,
   nesting); nothing else tells it. On an older torch ``import tensorstash`` raises
   ImportError naming the version found and the fix.
2. A feature that needs a newer torch than 2.8 steps aside there, with one
   message that names what it needs (:func:`missing`), and the rest runs:
   - planning compiled code through the compiler (``COMPILED``; NOTE [ Compiled
     code ] in planning/compiler.py) needs AOTAutograd's inlined saved-tensor
     hooks and functorch's joint-graph pass (rule 7 there), both torch 2.10.
     Without them ``Auto`` plans a step of compiled code as eager code, its hooks
     around the compiled graphs, and a warning and its plan table say so;
   - the compiler's own offload (``OFFLOAD``; the bench's ``compile:offload``) needs
     ``torch._functorch.config.enable_activation_offloading`` (torch 2.10).
3. What differs between supported versions in a way code can follow is
   followed, never refused: inductor takes one post-grad pass before 2.13 and a
   list from 2.13 (planning/_stowing.py composes the disk tier's placement pass
   with the user's pass either way).
4. Features are found by what the torch has, never by its version number, so
   that a nightly or a vendor build with the API works; the versions in the
   messages say where each API first shipped.
"""

from __future__ import annotations

import functools

import torch

FLOOR = "2.8"
"""The oldest torch tensorstash runs on (rule 1)."""

COMPILED = "planning compiled code through the compiler"
"""Rule 2: ``Auto``'s plans for compiled code (NOTE [ Compiled code ] in planning/compiler.py)."""
COMPILED_FLOOR = "2.10"
OFFLOAD = "the compiler's own activation offload"
"""Rule 2: the bench's ``compile:offload``."""

_NEEDS: dict[str, tuple[str, str]] = {
    COMPILED: (COMPILED_FLOOR, "AOTAutograd's inlined saved-tensor hooks, a joint-graph pass"),
    OFFLOAD: ("2.10", "torch._functorch.config.enable_activation_offloading"),
}


def check_floor() -> None:
    """Rule 1: raise ImportError on a torch older than :data:`FLOOR`."""
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        raise ImportError(
            f"tensorstash needs torch {FLOOR} or newer (it reads the saved-tensor hook stack, "
            f"torch._C._autograd._top_saved_tensors_default_hooks); torch {torch.__version__} "
            f"is installed: pip install 'torch>={FLOOR}'"
        )


@functools.cache
def _has(feature: str) -> bool:
    if feature == COMPILED:
        import torch._functorch.config as functorch_config

        try:
            from torch._functorch._aot_autograd import graph_compile
        except ImportError:
            return False
        inlined = hasattr(graph_compile, "_get_saved_tensor_hook_context")
        return inlined and hasattr(functorch_config, "joint_custom_pass")
    if feature == OFFLOAD:
        import torch._functorch.config as functorch_config

        return hasattr(functorch_config, "enable_activation_offloading")
    raise ValueError(f"tensorstash: unknown feature {feature!r}; this is a bug in tensorstash")


def missing(feature: str) -> str | None:
    """Rule 2: why ``feature`` steps aside on this torch, in a sentence; None where it runs.

    Example:
        >>> missing(COMPILED)  # on torch 2.9
        'planning compiled code through the compiler needs torch 2.10 or newer ...'
    """
    if _has(feature):
        return None
    version, api = _NEEDS[feature]
    return f"{feature} needs torch {version} or newer ({api}); torch {torch.__version__} runs here"
