"""Small deterministic models that exercise what autograd saves, for the policy tests.

Every factory seeds the global RNG and builds a fresh :class:`Case`: calling a
factory twice gives two independent cases with identical parameters and
inputs, so one can run under plain autograd (the oracle) and the other under
tensorstash, and neither sees the other's state (batchnorm running stats,
accumulated ``.grad``).

The models are sized so that a forward and backward take a few tens of
milliseconds on two CPU cores while still saving tensors of tens to hundreds
of KiB: big enough to go through every stage of a policy (compression chunks,
spill files), small enough to run every model under every policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Loss = Callable[[object], Tensor]


@dataclass
class Case:
    """A model, its inputs and the scalar loss of its output.

    Attributes:
        name: the zoo name, used as the test id.
        model: the module, in train mode.
        inputs: positional inputs; those with ``requires_grad`` get gradients
            that the checks compare too.
        loss: maps the model's output to a scalar.
    """

    name: str
    model: nn.Module
    inputs: tuple[Tensor, ...]
    loss: Loss

    def step(self) -> Tensor:
        """The forward pass and the loss (no backward)."""
        return self.loss(self.model(*self.inputs))


def weighted_sum(seed: int) -> Loss:
    """A loss ``sum(out * w)`` with fixed random weights ``w``.

    Fixed random weights make every output element's gradient different, so
    a permuted or misaligned saved tensor changes the gradients (a plain
    ``sum()`` would hide many such mistakes).
    """
    weights: dict[tuple[torch.Size, torch.dtype, torch.device], Tensor] = {}

    def loss(out: object) -> Tensor:
        if isinstance(out, tuple):
            out = out[0]
        assert isinstance(out, Tensor)
        key = (out.shape, out.dtype, out.device)
        if key not in weights:
            gen = torch.Generator().manual_seed(seed)
            weights[key] = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        return (out * weights[key]).sum()

    return loss


# -- the models -------------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self, width: int = 256, hidden: int = 512, classes: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Cnn(nn.Module):
    """Conv, batchnorm and in-place ReLU; used in channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.body(x)
        return self.head(x.mean(dim=(2, 3)))


class Block(nn.Module):
    """A residual MLP block with dropout: the unit the profile and plan tests time and recompute."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class TransformerBlock(nn.Module):
    """Pre-norm attention block: layernorm, SDPA with dropout, GELU MLP, dropout."""

    def __init__(self, dim: int = 128, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.p = p
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        p = self.p if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, dim)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)
        return self.head(out)


class EmbeddingHead(nn.Module):
    """Embedding lookup with integer indices, then a classifier over the vocabulary."""

    def __init__(self, vocab: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, 128)
        self.out = nn.Linear(128, vocab)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens)))
        logits = self.out(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Reused(nn.Module):
    """One linear layer applied twice in a forward (its weight is saved twice)."""

    def __init__(self, dim: int = 192) -> None:
        super().__init__()
        self.shared = nn.Linear(dim, dim)
        self.other = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.sigmoid(self.shared(x))
        h = torch.tanh(self.other(h))
        return self.shared(h) * h


class ViewHeavy(nn.Module):
    """Saves views: transposes, strided and narrow slices, stride-0 expands, permutes.

    Covers both ways a saved view can be laid out: a dense span (transpose,
    permute, expand, a slice at an offset) and a narrow slice of a wide tensor,
    whose span is many times its element count.
    """

    def __init__(self, channels: int = 16, width: int = 24) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(1, channels, 1, width))
        self.mix = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        # A stride-0 broadcast of a non-parameter tensor, saved by mul.
        mean = x.mean(dim=2, keepdim=True).expand_as(x)
        a = torch.sin(x * mean)
        # A broadcast parameter: stride 0 over the parameter's storage.
        a = a * self.scale.expand_as(a)
        # A transposed view saved by cos and mul, a permuted one saved by pow.
        t = a.transpose(1, 2)
        b = t * torch.cos(t)
        c = b.permute(0, 3, 2, 1).pow(2)
        # A transposed view saved by bmm, next to the untransposed tensor.
        u = a.flatten(0, 1)
        g = torch.bmm(u.transpose(1, 2), u) @ self.mix
        # A slice at a storage offset, not contiguous, whose span is close to its
        # element count, saved by abs and mul.
        s = a[:, 1:, 1:-1, :]
        d = s * torch.exp(-s.abs())
        # A narrow slice of a wide tensor (span many times its elements).
        n = a.narrow(3, 2, 2)
        e = torch.sigmoid(n) * n
        batch = x.shape[0]
        parts = (c.sum(dim=1), g.reshape(batch, -1), d, e)
        return torch.cat([part.reshape(batch, -1) for part in parts], dim=1)


# -- factories ----------------------------------------------------------------------


def mlp(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = Mlp()
    x = torch.randn(128, 256, requires_grad=True)
    return Case("mlp", model, (x,), weighted_sum(seed))


def cnn(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = Cnn().to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 32, 32).to(memory_format=torch.channels_last).requires_grad_()
    return Case("cnn", model, (x,), weighted_sum(seed))


def transformer(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = TransformerBlock()
    x = torch.randn(4, 64, 128, requires_grad=True)
    return Case("transformer", model, (x,), weighted_sum(seed))


def lstm(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = Recurrent()
    x = torch.randn(8, 40, 32, requires_grad=True)
    return Case("lstm", model, (x,), weighted_sum(seed))


def embedding(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = EmbeddingHead()
    tokens = torch.randint(0, 512, (16, 32))
    targets = torch.randint(0, 512, (16, 32))
    return Case("embedding", model, (tokens, targets), lambda loss: loss)


def reused(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = Reused()
    x = torch.randn(128, 192, requires_grad=True)
    return Case("reused", model, (x,), weighted_sum(seed))


def views(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = ViewHeavy()
    x = torch.randn(8, 16, 32, 24, requires_grad=True)
    return Case("views", model, (x,), weighted_sum(seed))


ZOO: dict[str, Callable[[], Case]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "lstm": lstm,
    "embedding": embedding,
    "reused": reused,
    "views": views,
}
"""Every model, by name: ``ZOO[name]()`` builds a fresh case."""


# -- models for single autograd cases (not in ZOO) --------------------------------------


def tanh_mlp(seed: int = 0) -> Case:
    """A smooth MLP (tanh everywhere) for double backward: every second derivative is non-zero."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)
    )
    x = torch.randn(128, 64, requires_grad=True)
    return Case("tanh_mlp", model, (x,), weighted_sum(seed))


def wide_batchnorm(seed: int = 0) -> Case:
    """BatchNorm over many features: its running stats are 1 MiB tensors.

    In train mode ``native_batch_norm`` saves ``running_mean`` and
    ``running_var`` for backward and then updates them in place inside the
    same op, without bumping their version counter. Plain autograd is not
    affected (train-mode backward does not read them); a policy that copies,
    compresses or writes the saved bytes in the background reads a buffer
    that is changing under it.
    """
    torch.manual_seed(seed)
    # The tanh output saved ahead of the stats keeps background work busy while
    # the batch-norm kernel runs, so the race is likely on every step.
    model = nn.Sequential(nn.Tanh(), nn.BatchNorm1d(1 << 18))
    x = torch.randn(4, 1 << 18, requires_grad=True)
    return Case("wide_batchnorm", model, (x,), weighted_sum(seed))


class Explodes(nn.Module):
    """Runs ``inner`` and then raises ``error``, as a forward that fails halfway does."""

    def __init__(self, inner: nn.Module, error: type[BaseException]) -> None:
        super().__init__()
        self.inner = inner
        self.error = error

    def forward(self, *inputs: Tensor) -> Tensor:
        self.inner(*inputs)
        raise self.error("tensorstash tests: a forward that fails halfway")


class Boom(Exception):
    """The error :class:`Explodes` raises."""


# -- Hugging Face language models with LoRA adapters (transformers and peft; not in ZOO) -----

LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "v_proj", "o_proj", "down_proj"),
}
"""The modules LoRA adapts in each HF model of :data:`HF_MODELS`, as fine-tuning recipes
name them (GPT-2's are ``Conv1D``: weights stored input-major, ``fan_in_fan_out``)."""


class LanguageModelLoss(nn.Module):
    """An HF causal language model called as its users call it:
    ``model(input_ids=..., labels=...)``, returning the loss HF computes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def hf_gpt2(seed: int = 0) -> nn.Module:
    """A two-layer GPT-2 from a config (no download), dropout on, seeded weights."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # HF's default, named, so it is not announced
    return model


def hf_llama(seed: int = 0) -> nn.Module:
    """A two-layer Llama from a config (no download): grouped-query attention, SwiGLU."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


HF_MODELS: dict[str, Callable[[int], nn.Module]] = {"gpt2": hf_gpt2, "llama": hf_llama}
"""The HF models, by name: ``HF_MODELS[name](seed)`` builds one without adapters."""


def with_lora(model: nn.Module, name: str, *, seed: int = 0, dropout: float = 0.1) -> nn.Module:
    """``model`` (an :data:`HF_MODELS` model) with fresh LoRA adapters (PEFT) on
    :data:`LORA_TARGETS`: its own weights frozen, the adapters seeded by ``seed``. LoRA's
    ``B`` starts at zero, so it is seeded at random too: the adapters' gradients are then
    all non-zero from the first step."""
    import peft

    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGETS[name]),
        fan_in_fan_out=name == "gpt2",
    )
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for parameter_name, parameter in adapted.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, 0.02)
    return adapted


def lora(name: str, seed: int = 0) -> Case:
    """An HF model of :data:`HF_MODELS` with LoRA adapters, its loss from ``labels``."""
    model = LanguageModelLoss(with_lora(HF_MODELS[name](seed), name, seed=seed)).train()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (4, 32), generator=generator)
    return Case(f"lora-{name}", model, (tokens,), lambda loss: loss)  # type: ignore[arg-type,return-value]
