"""The embedded GPT-style model of ``tensorstash bench``, its sizes and its batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as checkpoint_fn


@dataclass(frozen=True)
class ModelConfig:
    """Size of the embedded GPT-style decoder and of its batch.

    Attributes:
        vocab: vocabulary size (the output head is tied to the token embedding).
        seq_len: tokens per sequence.
        d_model: width of the residual stream.
        n_head: attention heads; must divide ``d_model``.
        n_layer: transformer blocks.
        batch: sequences per step.
        dropout: dropout probability (embeddings, attention, residual branches).
    """

    vocab: int
    seq_len: int
    d_model: int
    n_head: int
    n_layer: int
    batch: int
    dropout: float = 0.1

    def describe(self) -> str:
        """A one-line summary such as ``'4 layers, d=256, 4 heads, batch 8x128'``."""
        return (
            f"{self.n_layer} layers, d={self.d_model}, {self.n_head} heads, "
            f"vocab {self.vocab}, batch {self.batch}x{self.seq_len}"
        )


CONFIGS: dict[str, ModelConfig] = {
    # The smallest: for tests.
    "tiny": ModelConfig(vocab=512, seq_len=64, d_model=128, n_head=4, n_layer=2, batch=4),
    # The default: a step of a fraction of a second on a small CPU.
    "small": ModelConfig(vocab=2048, seq_len=128, d_model=256, n_head=4, n_layer=4, batch=4),
    # A CPU run that takes its time: several times the default's step.
    "medium": ModelConfig(vocab=8192, seq_len=256, d_model=512, n_head=8, n_layer=8, batch=8),
    # For a GPU: about 10 GiB of activations in float32, a fraction of that in weights.
    "large": ModelConfig(vocab=32768, seq_len=1024, d_model=2048, n_head=16, n_layer=8, batch=8),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError(
                f"tensorstash.bench.ModelConfig: d_model={config.d_model} is not divisible "
                f"by n_head={config.n_head}; pick n_head among the divisors of d_model"
            )
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            part.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(y))


class Mlp(nn.Module):
    """The position-wise feed-forward network: 4x wider, GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then MLP, each on a residual branch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = Mlp(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class BenchGPT(nn.Module):
    """A GPT-style decoder that returns its cross-entropy loss.

    Args:
        config: the model's size.

    Attributes:
        checkpoint: when True (and training), every block runs under
            non-reentrant ``torch.utils.checkpoint``: its activations are
            recomputed in backward instead of saved.

    Example:
        >>> model = BenchGPT(CONFIGS["tiny"])
        >>> inputs, targets = make_batch(CONFIGS["tiny"], seed=0)
        >>> model(inputs, targets).backward()
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.checkpoint = False
        self.wte = nn.Embedding(config.vocab, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            if self.checkpoint and self.training:
                x = checkpoint_fn(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output head
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_batch(
    config: ModelConfig, *, seed: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """A deterministic synthetic batch of next-token prediction.

    Args:
        config: the model's size (vocabulary, batch and sequence length).
        seed: seeds a private ``torch.Generator``; the global RNG is untouched.
        device: where the tokens go.

    Returns:
        ``(inputs, targets)``, int64 tensors of shape ``(batch, seq_len)``;
        targets are the inputs shifted by one token.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        config.vocab, (config.batch, config.seq_len + 1), generator=generator
    ).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def resolve_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` called ``name``; ValueError listing the valid names."""
    if name not in CONFIGS:
        raise ValueError(
            f"tensorstash bench: unknown model {name!r}; valid models are "
            f"{', '.join(CONFIGS)}; pass one with --model"
        )
    return CONFIGS[name]
