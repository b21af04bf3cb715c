"""Hugging Face's own activation checkpointing and offload, as the bench's peers.

# NOTE [ HF peers ]
1. What an HF user has at hand: ``model.activation_checkpointing_enable()``
   (``gradient_checkpointing_enable`` in older transformers), non-reentrant,
   every decoder layer ("checkpoint" on an HF model); ``every_n_layers=k``,
   one layer in ``k`` ("hf-every:<k>"); ``offload=True``, the checkpointed
   layers' inputs held in pinned host memory by torch's ``save_on_cpu``
   ("hf-offload"). Each is turned on as its users turn it on, with HF's own
   call, so each row measures HF's code.
2. Which model: the first ``transformers.PreTrainedModel`` among the
   workload's modules, outermost first: the built-in GPT-2, a model script's
   HF model, the base model inside a PEFT ``PeftModel``. A model that holds
   none, or one that does not support checkpointing, has no HF peer: its row
   is skipped with the reason.
3. Turned on once, on a copy of the model kept for the variant, and left on:
   each enable puts a forward hook on the input embeddings that no disable
   takes off (so the adapters of a frozen base get gradients through
   checkpointed layers) and makes a new checkpoint function that compiled
   graphs guard on. Turned on and off every step on the shared model, the
   hooks stacked and every variant compiled again (NOTE [ Compiled runs ]
   rule 7).
4. ``every_n_layers`` and ``offload`` came with ``activation_checkpointing_enable``;
   a transformers whose method does not take them has no such peer: the row
   is skipped, naming the argument, rather than run as something else.
5. HF's offload pins host memory with ``save_on_cpu(pin_memory=True)``. On the
   CPU the host is the device, there is nothing to move off it, and a torch
   without an accelerator has no pinned memory (transformers 5.25 raises
   there): the row is skipped with that reason, as the compiler's offload is.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

HF_OFFLOAD = "hf-offload"
"""HF's checkpointing of every decoder layer, their inputs held in pinned host memory."""
HF_EVERY_PREFIX = "hf-every:"
"""``hf-every:<k>``: HF's checkpointing of one decoder layer in ``k`` (``every_n_layers=k``)."""
HF_PEERS: tuple[str, ...] = ("hf-every:2", HF_OFFLOAD)
"""The HF peers the bench's defaults and ``--sweep`` run on an HF model."""


def every_n_layers(name: str) -> int | None:
    """The ``k`` of ``hf-every:<k>`` (None for other names).

    Raises:
        ValueError: ``hf-every:`` with no whole number of at least 1 after it.
    """
    if not name.startswith(HF_EVERY_PREFIX):
        return None
    text = name.removeprefix(HF_EVERY_PREFIX)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"tensorstash bench: {name!r}: hf-every:<k> checkpoints one decoder layer in k, "
            f"k a whole number of at least 1 (hf-every:2); got {text!r}"
        )
    return int(text)


def is_hf_peer(name: str) -> bool:
    """Whether ``name`` is one of HF's own peers ("hf-offload", ``hf-every:<k>``)."""
    return name == HF_OFFLOAD or name.startswith(HF_EVERY_PREFIX)


def hf_model(model: nn.Module) -> nn.Module | None:
    """The first ``transformers.PreTrainedModel`` among ``model``'s modules, outermost
    first (rule 2), or None; transformers is not imported for a model that holds none."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # nothing could be one
        return None
    pretrained = transformers.PreTrainedModel
    return next((module for module in model.modules() if isinstance(module, pretrained)), None)


def hf_skip_reason(name: str, model: nn.Module, device: torch.device) -> str | None:
    """Why HF peer ``name`` cannot run on ``model`` on ``device`` (rules 2, 4 and 5), or None."""
    library = hf_model(model)
    if library is None:
        return (
            "needs a Hugging Face model (a transformers PreTrainedModel among the model's "
            "modules, as --model gpt2-hf or a --model-script that returns one)"
        )
    if not getattr(library, "supports_gradient_checkpointing", False):
        return f"{type(library).__name__} does not support HF's activation checkpointing"
    argument = "offload" if name == HF_OFFLOAD else "every_n_layers"
    if argument not in _enable_arguments(library):
        import transformers

        return (
            f"transformers {transformers.__version__} has no activation_checkpointing_enable"
            f"({argument}=...); a newer transformers has it (pip install -U transformers)"
        )
    if name == HF_OFFLOAD and device.type != "cuda":
        return (
            "HF's offload copies the checkpointed layers' inputs to pinned host memory; on the "
            f"{device.type} the host is the device (and without an accelerator torch has no "
            "pinned memory to copy to)"
        )
    return None


def _enable_arguments(library: Any) -> set[str]:
    enable = getattr(library, "activation_checkpointing_enable", None)
    return set() if enable is None else set(inspect.signature(enable).parameters)


def hf_checkpointing(
    model: nn.Module, *, every: int = 1, offload: bool = False
) -> Callable[[], None]:
    """Turn on HF's own gradient checkpointing (rule 1), non-reentrant, as its users turn it
    on, on the HF model in ``model`` (rule 2): every layer, one in ``every``, or with
    ``offload``. Returns what turns it off again.

    Newer transformers call it ``activation_checkpointing_enable`` and warn on the
    old name. The KV cache is turned off with it, in the config, as HF turns it off
    itself in the first forward under checkpointing (with a warning). What it leaves
    behind once turned off is rule 3's: the bench turns it on once, on a copy.

    Raises:
        ValueError: ``model`` holds no HF model.
    """
    library: Any = hf_model(model)
    if library is None:
        raise ValueError(
            f"tensorstash bench: HF checkpointing needs a transformers PreTrainedModel; "
            f"{type(model).__name__} holds none"
        )
    new = hasattr(library, "activation_checkpointing_enable")
    extra: dict[str, Any] = {}
    if every != 1:
        extra["every_n_layers"] = every
    if offload:
        extra["offload"] = True
    use_cache = getattr(library.config, "use_cache", None)
    with hf_quiet():
        if new:
            library.activation_checkpointing_enable({"use_reentrant": False}, **extra)
        else:
            library.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}, **extra
            )
    if use_cache is not None:
        library.config.use_cache = False

    def off() -> None:
        with hf_quiet():
            if new:
                library.activation_checkpointing_disable()
            else:
                library.gradient_checkpointing_disable()
        if use_cache is not None:
            library.config.use_cache = use_cache

    return off


def hf_peer_on(name: str, model: nn.Module) -> Callable[[], None]:
    """Turn on HF peer ``name`` on ``model``: what turns it off again."""
    every = every_n_layers(name)
    return hf_checkpointing(model, every=every or 1, offload=name == HF_OFFLOAD)


@contextlib.contextmanager
def hf_quiet() -> Iterator[None]:
    """transformers' log messages and deprecation warnings held back inside the region."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
