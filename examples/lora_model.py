"""A Llama with LoRA adapters (PEFT) on a frozen base, for ``tensorstash bench --model-script``.

``make()`` builds a 4-layer Llama from a config (no download), puts LoRA adapters on
``q_proj``, ``v_proj``, ``o_proj`` and ``down_proj`` (rank 16, dropout 0.1) as fine-tuning
recipes do, and returns it with a batch of 4 x 256 tokens and its decoder layers as the
blocks, so that every policy and peer of the bench runs on adapters:

    tensorstash bench --model-script examples/lora_model.py:make \\
        --policies none,checkpoint,hf-every:2,hf-offload,trl,disk,auto,auto:50%

Run as a script, it trains one step of it under ``tensorstash.stash`` and prints what
the stash did: python examples/lora_model.py [SCRATCH_DIRECTORY]
(needs ``pip install tensorstash[finetune]``: transformers and peft)
"""

from __future__ import annotations

import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import tensorstash as ts

TOKENS = (4, 256)
"""Sequences and tokens per sequence of the batch."""


class CausalLMLoss(nn.Module):
    """The adapted model called as a trainer calls it: ``model(input_ids=..., labels=...)``,
    returning the loss HF computes (the labels are the inputs; HF shifts them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def make() -> tuple[nn.Module, tuple[Tensor], type[nn.Module]]:
    """The LoRA model, its batch and its blocks (the bench seeds the RNG first)."""
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, max_position_embeddings=TOKENS[1],
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    base = LlamaForCausalLM(config)
    base.loss_type = "ForCausalLM"  # HF's default for a causal LM, named, so it is not announced
    adapters = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.1,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
    )  # fmt: skip
    model = get_peft_model(base, adapters)
    tokens = torch.randint(config.vocab_size, TOKENS)
    return CausalLMLoss(model), (tokens,), LlamaDecoderLayer


def main(directory: str) -> None:
    torch.manual_seed(0)
    model, (tokens,), _ = make()
    model.train()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"{trained:,} of {total:,} parameters trained (the adapters)")
    # Half a megabyte kept at most; on a CPU the rest of what one step saves is spilled.
    with ts.stash(ts.Auto(device_budget="512KiB", directory=directory)) as session:
        loss = model(tokens)
    loss.backward()
    print(f"loss {loss.item():.4f}; the step's activations per tier:")
    print(session.stats.table())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
