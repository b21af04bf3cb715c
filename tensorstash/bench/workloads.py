"""What the bench trains: the embedded model, or a user's through ``--model-script``."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.bench.model import BenchGPT, Block, make_batch, resolve_config

Batch = tuple[Any, ...]
"""The positional arguments of the model's forward; ``model(*batch)`` returns the loss."""


@dataclass(frozen=True)
class Workload:
    """What the bench trains: a model whose ``model(*batch)`` returns a scalar loss.

    Attributes:
        model: the model; the bench moves it to its device and dtype.
        batch: the forward's arguments, the same at every step (tensors are
            moved to the device, floating-point ones cast to the dtype).
        blocks: the submodules that "checkpoint" and "recompute" wrap, in any
            form :func:`tensorstash.recompute_modules` takes (a module class,
            submodule names, or a predicate); None when the model has none,
            and then those two policies cannot run.
        description: one line that names the model in the table's title.
    """

    model: nn.Module
    batch: Batch
    blocks: Any
    description: str


def builtin_workload(config_name: str, seed: int) -> Workload:
    """The embedded :class:`BenchGPT` of size ``config_name`` and its batch, seeded by ``seed``."""
    config = resolve_config(config_name)
    torch.manual_seed(seed)
    return Workload(
        BenchGPT(config),
        make_batch(config, seed=seed),
        Block,
        f"model {config_name} ({config.describe()})",
    )


class ModelScriptError(ValueError):
    """A ``--model-script`` that cannot be loaded or does not follow its protocol."""


MODEL_SCRIPT_PROTOCOL = (
    "def factory() -> (model, batch) or (model, batch, blocks): model(*batch) returns "
    "a scalar loss tensor; batch is a tuple of the forward's arguments (a single tensor "
    "is accepted); blocks, for the checkpoint and recompute policies, is a module class "
    "or a list of submodule names"
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
            f"{_short(result)}; expected {MODEL_SCRIPT_PROTOCOL}"
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
    return Workload(model, tuple(batch), blocks, f"model {spec} ({parameters:,} parameters)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Tensors in ``value`` moved to ``device``, floating-point ones cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    if isinstance(value, tuple | list):
        return type(value)(to_device(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device, dtype) for key, item in value.items()}
    return value


def checked_loss(loss: Any, workload: Workload) -> Tensor:
    """``loss`` if it is a scalar tensor that backward can start from."""
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        got = (
            f"a tensor of shape {tuple(loss.shape)} (requires_grad={loss.requires_grad})"
            if isinstance(loss, Tensor)
            else f"{type(loss).__name__} {_short(loss)}"
        )
        raise ModelScriptError(
            f"tensorstash bench: {workload.description}: model(*batch) returned {got}; it "
            "must return a scalar loss that requires grad (wrap the model in a module that "
            "computes the loss)"
        )
    return loss
