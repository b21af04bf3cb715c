"""What the bench trains: the embedded model, an HF GPT-2, or a user's model.

A workload is a model whose ``model(*batch)`` returns a scalar loss, the batch,
and what the "checkpoint" and "recompute" variants wrap. The built-in ones are
named by ``--model``; ``--model-script`` loads a user's (see script.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.bench.hf import hf_checkpointing, hf_quiet
from tensorstash.bench.model import CONFIGS, BenchGPT, Block, make_batch, resolve_config

Batch = tuple[Any, ...]
"""The positional arguments of the model's forward; ``model(*batch)`` returns the loss."""

HF_GPT2 = "gpt2-hf"
"""The built-in Hugging Face model: a 4-layer GPT-2 (needs ``transformers``)."""

MODELS: tuple[str, ...] = (*CONFIGS, HF_GPT2)
"""Every name ``--model`` takes: the embedded sizes, then the HF GPT-2."""


@dataclass(frozen=True)
class Workload:
    """What the bench trains: a model whose ``model(*batch)`` returns a scalar loss.

    Attributes:
        model: the model; the bench moves it to its device (weights stay float32:
            ``--dtype bfloat16`` runs the forward under autocast).
        batch: the forward's arguments, the same at every step (tensors are
            moved to the device).
        blocks: the submodules that "checkpoint" and "recompute" wrap, in any
            form :func:`tensorstash.recompute_modules` takes (a module class,
            a submodule path or class name, a list of those, or a predicate);
            None when the model has none, and then "recompute" cannot run, nor
            "checkpoint" on a model without ``checkpointing``.
        description: one line that names the model in the table's title.
        checkpointing: turns on, on the model given (``model``, or a copy of
            it), checkpointing of every block the model's own way (the embedded
            model's flag, HF's ``activation_checkpointing_enable``), and returns
            what turns it off again; for the "checkpoint" variant (a script's
            model that holds an HF model gets HF's). None: torch's checkpoint is
            put on ``blocks``.
        library_model: the model as its library builds it, when ``model`` wraps
            it to return the loss (HF: the ``GPT2LMHeadModel``, or the base model
            inside a PEFT model); peers that look for an output head are given it.
    """

    model: nn.Module
    batch: Batch
    blocks: Any
    description: str
    checkpointing: Callable[[nn.Module], Callable[[], None]] | None = None
    library_model: nn.Module | None = None


class ModelScriptError(ValueError):
    """A ``--model-script`` that cannot be loaded or does not follow its protocol."""


class WorkloadUnavailable(ValueError):
    """A built-in model whose optional dependency is not installed."""


def builtin_workload(name: str, seed: int) -> Workload:
    """The built-in model called ``name`` and its batch, its weights seeded by ``seed``.

    Args:
        name: one of :data:`MODELS`: an embedded size ("tiny", "small", "medium",
            "large") or "gpt2-hf".
        seed: seeds the weights and the batch.

    Raises:
        ValueError: an unknown name.
        WorkloadUnavailable: "gpt2-hf" without ``transformers`` installed.
    """
    if name == HF_GPT2:
        return hf_gpt2_workload(seed)
    config = resolve_config(name)
    torch.manual_seed(seed)
    model = BenchGPT(config)
    return Workload(
        model,
        make_batch(config, seed=seed),
        Block,
        f"model {name} ({config.describe()})",
        checkpointing=_flag_checkpointing,
    )


def _flag_checkpointing(model: nn.Module) -> Callable[[], None]:
    """torch's own checkpoint on every block, a peer that owes nothing to tensorstash."""
    setattr(model, "checkpoint", True)  # noqa: B010 (an nn.Module's flag, not a submodule)
    return lambda: setattr(model, "checkpoint", False)


# -- Hugging Face GPT-2 ------------------------------------------------------------------

HF_BATCH = (4, 128)
"""Sequences and tokens per sequence of the HF GPT-2 workload."""


class CausalLMLoss(nn.Module):
    """An HF causal language model called as users call it: ``model(input_ids=..., labels=...)``.

    Returns the loss HF computes from ``labels`` (the inputs: HF shifts them);
    every other argument, ``use_cache`` included, is left at its default.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def hf_gpt2_workload(seed: int) -> Workload:
    """A 4-layer GPT-2 from ``transformers`` (d=256, vocab 2048, no dropout), batch 4x128.

    Raises:
        WorkloadUnavailable: ``transformers`` is not installed.
    """
    if importlib.util.find_spec("transformers") is None:
        raise WorkloadUnavailable(
            f"tensorstash bench: --model {HF_GPT2} builds its model with transformers, which "
            "is not installed; run `pip install tensorstash[hf]` (or `pip install "
            f"transformers`), or pick an embedded model: {', '.join(CONFIGS)}"
        )
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    with hf_quiet():  # it says the default bos/eos ids lie outside this vocabulary
        config = transformers.GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        torch.manual_seed(seed)
        library_model = transformers.GPT2LMHeadModel(config)
    # HF's default for a causal LM, named, so it is not announced at the first step.
    library_model.loss_type = "ForCausalLM"
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, HF_BATCH, generator=generator)
    return Workload(
        CausalLMLoss(library_model),
        (tokens,),
        GPT2Block,
        f"model {HF_GPT2} (transformers GPT2LMHeadModel: 4 layers, d=256, 4 heads, "
        f"vocab 2048, batch {HF_BATCH[0]}x{HF_BATCH[1]}, loss from labels)",
        checkpointing=hf_checkpointing,
        library_model=library_model,
    )


# -- helpers of the step ----------------------------------------------------------------


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors in ``value`` (nested in tuples, lists and dicts) moved to ``device``."""
    if isinstance(value, Tensor):
        return value.to(device=device)
    if isinstance(value, tuple | list):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    return value


def checked_loss(loss: Any, workload: Workload) -> Tensor:
    """``loss`` if it is a scalar tensor that backward can start from."""
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        got = (
            f"a tensor of shape {tuple(loss.shape)} (requires_grad={loss.requires_grad})"
            if isinstance(loss, Tensor)
            else f"{type(loss).__name__} {short_repr(loss)}"
        )
        raise ModelScriptError(
            f"tensorstash bench: {workload.description}: model(*batch) returned {got}; it "
            "must return a scalar loss that requires grad (wrap the model in a module that "
            "computes the loss)"
        )
    return loss
