"""A Hugging Face Llama for ``tensorstash bench --model-script benchmarks/hf_llama.py:make``.

``make``: 4 decoder layers, hidden size 2048 (16 heads, 4 of them for keys and values),
MLP 5632, vocabulary 32000, a batch of 4 x 2048 tokens, the loss from ``labels`` as a
user's training loop takes it; for a GPU, under ``--dtype bfloat16``. ``tiny``: the same
architecture at 2 layers of 128 on 2 x 64 tokens, to check a run on the CPU.
Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CausalLM(nn.Module):
    """The model called as its users call it: token ids in, the loss from labels out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def _llama(layers: int, hidden: int, mlp: int, heads: int, kv_heads: int, vocab: int) -> Any:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=2048,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # named, so that it is not announced at the first step
    return CausalLM(model), config, LlamaDecoderLayer


def make() -> tuple[nn.Module, tuple[torch.Tensor], type]:
    """The GPU check's Llama: 4 layers of 2048, 4 x 2048 tokens."""
    model, config, layer = _llama(4, 2048, 5632, 16, 4, 32000)
    tokens = torch.randint(config.vocab_size, (4, 2048))
    return model, (tokens,), layer


def tiny() -> tuple[nn.Module, tuple[torch.Tensor], type]:
    """The same architecture, small enough for the CPU."""
    model, config, layer = _llama(2, 128, 256, 4, 2, 1024)
    tokens = torch.randint(config.vocab_size, (2, 64))
    return model, (tokens,), layer
