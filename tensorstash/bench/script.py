"""``--model-script PATH.py:FUNCTION``: a model of the user's own as the bench's workload."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.bench.hf import hf_checkpointing, hf_model
from tensorstash.bench.workloads import ModelScriptError, Workload, short_repr

MODEL_SCRIPT_PROTOCOL = (
    "def factory() -> (model, batch) or (model, batch, blocks): model(*batch) returns "
    "a scalar loss tensor; batch is a tuple of the forward's arguments (a single tensor "
    "is accepted); blocks, for the checkpoint and recompute policies, is a module class "
    "or a list of submodule names (an HF model checkpoints its own way without them)"
)


def script_workload(spec: str, seed: int) -> Workload:
    """Load ``path.py:function`` and call the function to get a :class:`Workload`.

    The function takes no arguments and returns ``(model, batch)`` or
    ``(model, batch, blocks)`` (see :data:`MODEL_SCRIPT_PROTOCOL`). The global
    RNG is seeded with ``seed`` first, so its random weights repeat.

    Args:
        spec: ``"path/to/script.py:factory"``.
        seed: seeds the global RNG before the function runs.

    Returns:
        The workload, described by ``spec``.

    Raises:
        ModelScriptError: no ``:function`` part, a missing file, a missing or
            non-callable function, or a return value that breaks the protocol.
            Errors raised by the script itself propagate unchanged.

    Example:
        >>> workload = script_workload("my_model.py:make", seed=0)
    """
    path_text, sep, function = spec.rpartition(":")
    if not sep or not path_text or not function:
        raise ModelScriptError(
            f"tensorstash bench: --model-script {spec!r} must be PATH.py:FUNCTION, "
            "e.g. --model-script my_model.py:make"
        )
    path = Path(path_text)
    if not path.is_file():
        raise ModelScriptError(
            f"tensorstash bench: --model-script file {str(path)!r} not found (from "
            f"{str(Path.cwd())!r}); pass the path of a Python file, then :FUNCTION"
        )
    name = "tensorstash_model_script_" + re.sub(r"\W", "_", path.stem)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelScriptError(
            f"tensorstash bench: --model-script {str(path)!r} cannot be imported as a "
            "Python module; pass a .py file"
        )
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up there
    module_spec.loader.exec_module(module)
    factory = getattr(module, function, None)
    if not callable(factory):
        found = sorted(
            key
            for key, value in vars(module).items()
            if callable(value)
            and not key.startswith("_")
            and not isinstance(value, type)
            and getattr(value, "__module__", None) == name
        )
        what = "is not callable" if factory is not None else "is not defined"
        raise ModelScriptError(
            f"tensorstash bench: --model-script {str(path)!r}: {function!r} {what}; "
            f"functions defined there: {', '.join(found) or 'none'}; "
            f"expected {MODEL_SCRIPT_PROTOCOL}"
        )
    torch.manual_seed(seed)
    return _workload_from(factory(), spec)


def _workload_from(result: Any, spec: str) -> Workload:
    """Check a model-script function's return value against the protocol."""
    if not isinstance(result, tuple | list) or len(result) not in (2, 3):
        raise ModelScriptError(
            f"tensorstash bench: {spec} returned {type(result).__name__} "
            f"{short_repr(result)}; expected {MODEL_SCRIPT_PROTOCOL}"
        )
    model, batch, *rest = result
    if not isinstance(model, nn.Module):
        raise ModelScriptError(
            f"tensorstash bench: {spec} returned a {type(model).__name__} as the "
            f"model; expected an nn.Module first: {MODEL_SCRIPT_PROTOCOL}"
        )
    if isinstance(batch, Tensor):
        batch = (batch,)
    if not isinstance(batch, tuple | list):
        raise ModelScriptError(
            f"tensorstash bench: {spec} returned a {type(batch).__name__} as the "
            f"batch; expected a tuple of the forward's arguments: {MODEL_SCRIPT_PROTOCOL}"
        )
    blocks = rest[0] if rest else None
    parameters = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counted = f"{parameters:,} parameters"
    if trained < parameters:  # adapters on a frozen base
        counted += f", {trained:,} trained"
    # An HF model inside checkpoints its own way, as its users turn it on (NOTE [ HF peers ]).
    library = hf_model(model)
    own = library is not None and getattr(library, "supports_gradient_checkpointing", False)
    return Workload(
        model,
        tuple(batch),
        blocks,
        f"model {spec} ({counted})",
        checkpointing=hf_checkpointing if own else None,
        library_model=library,
    )
