"""recompute(): regions whose activations are dropped in forward and recomputed in backward.

# NOTE [ Recompute ]
1. Recompute cannot be a per-tensor pack: unpack would need the region's
   function and inputs. A region is run under non-reentrant
   ``torch.utils.checkpoint`` (RNG state preserved, so dropout repeats
   exactly; keyword arguments and tuple outputs pass through).
2. Non-reentrant checkpointing is itself a saved-tensor hook pair, pushed
   only inside the region. What the region must keep, its inputs, is saved
   outside that pair, so it goes through the enclosing stash: one model mixes
   recomputed blocks with offloaded ones.
3. A stash opened inside a region (a model that stashes its own forward,
   checkpointed from outside) passes through: it pushes no hooks, in forward
   and while backward recomputes the region, so the region's own hooks keep
   what it recomputes, and the session counts the pass in
   ``stats.inside_recompute`` (rule 8 of NOTE [ Session ] in stash.py).
   Under reentrant checkpointing the region runs without grad in forward and
   with it, outside any hooks, while backward recomputes it: a stash there
   packs the recomputation like any other forward.
4. A module keeps its identity and its ``state_dict`` keys: its ``forward`` is
   wrapped on the instance, and unwrapped by :func:`unrecompute`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn
from torch.utils.checkpoint import checkpoint

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=nn.Module)

_WRAPPED = "_tensorstash_forward"


def _checkpointed(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    return run


def recompute(module_or_fn: M | F) -> M | F:
    """Drop a region's activations in forward and recompute them in backward.

    Args:
        module_or_fn: an ``nn.Module`` (wrapped in place and returned, same
            object, same ``state_dict``) or a function (a wrapped copy is returned).

    Returns:
        The module, or the wrapped function.

    Raises:
        TypeError: neither a module nor a callable.

    Example:
        >>> blocks = [tensorstash.recompute(block) for block in model.blocks]
        >>> with tensorstash.stash("lz4"):  # the blocks' inputs are compressed
        ...     loss = model(x).sum()

    .. warning::
        The region runs twice (forward, then again in backward): side effects
        in it happen twice, and it must compute the same thing both times.
    """
    if isinstance(module_or_fn, nn.Module):
        if _WRAPPED not in vars(module_or_fn):
            original = module_or_fn.forward
            setattr(module_or_fn, _WRAPPED, original)
            module_or_fn.forward = _checkpointed(original)
        return module_or_fn
    if not callable(module_or_fn):
        raise TypeError(
            "tensorstash.recompute: expected an nn.Module or a function; got "
            f"{type(module_or_fn).__name__} {module_or_fn!r}"
        )
    return _checkpointed(module_or_fn)  # type: ignore[return-value]


def unrecompute(module: M) -> M:
    """Undo :func:`recompute` on a module (its activations are saved again)."""
    original = vars(module).pop(_WRAPPED, None)
    if original is not None:
        del module.forward
    return module


def recompute_modules(
    model: nn.Module, which: Callable[[str, nn.Module], bool] | Iterable[str] | type[nn.Module]
) -> list[str]:
    """Recompute many submodules at once.

    Args:
        model: the model whose submodules to wrap (in place).
        which: a predicate ``(name, module) -> bool``, the submodule names
            (as in ``model.named_modules()``), or a module class.

    Returns:
        The names of the wrapped submodules.

    Raises:
        ValueError: a name that is not a submodule of ``model``.

    Example:
        >>> tensorstash.recompute_modules(model, GPTBlock)
        ['blocks.0', 'blocks.1', ...]
    """
    named = dict(model.named_modules())
    if isinstance(which, type):
        kind = which
        chosen = [name for name, module in named.items() if isinstance(module, kind)]
    elif callable(which):
        predicate = which
        chosen = [name for name, module in named.items() if predicate(name, module)]
    else:
        chosen = list(which)
        missing = [name for name in chosen if name not in named]
        if missing:
            raise ValueError(
                f"tensorstash.recompute_modules: {missing} are not submodules of the model; "
                f"names look like {list(named)[1:4]}"
            )
    # A module inside one already wrapped would be checkpointed twice: skip it.
    wrapped: list[str] = []
    for name in chosen:
        if any(name.startswith(f"{outer}.") or outer == "" for outer in wrapped):
            continue
        recompute(named[name])
        wrapped.append(name)
    return wrapped
