"""The embedded model and the measurements behind ``tensorstash bench``.

# NOTE [ Fair comparison ]
Every variant (no stash, each policy, each peer) runs in one process on one
model, and the numbers are only comparable if nothing but the variant differs:

1. Variants are interleaved step by step (A B C A B C ...), so a burst of
   machine noise hits every variant alike instead of one variant's steps.
2. Every step starts from the same weights (a ``state_dict`` copy is
   restored), the same batch and the same RNG seed (dropout masks), so
   a lossless variant must produce gradients bitwise equal to plain autograd.
3. The first rounds are untimed: a warm-up round runs one-time work (lazy
   imports, thread pools, kernel caches), then one round measures the resident
   memory of a step, after free heap memory has been returned to the
   operating system (see rule 5). Later rounds are timed and reported as a
   median, with the heap left warm as in a training loop.
4. The reference gradients come from one plain-autograd step taken before
   the first round; "none" is compared against them as well, which checks that
   the step itself is deterministic.
5. Memory is reported two ways, because no single CPU number covers all
   variants. ``peak_bytes``: on the CPU, the most bytes a stash session held
   in RAM, the sum of the "kept" and "host" tier peaks from its stats (tiers
   peak at different moments, so this is an upper bound when both hold
   bytes; tensors the session skipped, such as parameters and tensors under
   ``min_bytes``, are not in it), ``None`` for variants without a session; on
   CUDA, ``torch.cuda.max_memory_allocated`` over the step, for every variant.
   ``peak_rss_bytes``: the growth of the process's resident set over rule 3's
   memory step, for every variant. glibc keeps freed memory in its heap, so
   without rule 3's trim a step would reuse it and show no growth at all.
6. Variants that run ``Auto`` learn a :class:`~tensorstash.Profile` across
   their steps. Its profile starts afresh at the first timed round, so the
   first timed step shows Auto without a plan and the later ones Auto
   following the plan learned from the step before (``step_times``). One
   step against another is noise on a busy machine, so each ``auto:<budget>``
   variant also has a twin run in the same rounds that never plans (a fresh
   Profile every step): the plan's effect is the median, over the steps that
   follow a plan, of the variant's step over its twin's in the same round
   (``no_plan_step_times``). The two run side by side, in turn first.
7. Timelines (``--plot``) and allocator snapshots (``--memory-snapshot``)
   come from extra untimed rounds after the timed ones: their hooks cost time,
   so no timed step carries them.
8. On CUDA the whole run uses deterministic algorithms
   (``torch.use_deterministic_algorithms``, and ``CUBLAS_WORKSPACE_CONFIG``
   set to ":4096:8" unless the user set it), restored afterwards: some CUDA
   kernels (atomic adds in attention and embedding backward) give different
   bits on every run, and rule 4's check would then say nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import inspect
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as checkpoint_fn

import tensorstash as ts
from tensorstash.stats import human_bytes

# -- the model -----------------------------------------------------------------------


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
    # A step in a few tens of milliseconds: for tests.
    "tiny": ModelConfig(vocab=512, seq_len=64, d_model=128, n_head=4, n_layer=2, batch=4),
    # The default: about 0.1-0.3 s per forward and backward on 2 CPU cores.
    "small": ModelConfig(vocab=2048, seq_len=128, d_model=256, n_head=4, n_layer=4, batch=4),
    # A few seconds per step on 2 CPU cores.
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


# -- what the bench trains -----------------------------------------------------------

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


def _to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Tensors in ``value`` moved to ``device``, floating-point ones cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device, dtype) for key, item in value.items()}
    return value


# -- the variants --------------------------------------------------------------------

# Policies handed to ts.stash, by bench name; factories so each step gets a fresh value.
STASH_POLICIES: dict[str, Callable[[], Any]] = {
    "keep": lambda: "keep",
    "cpu": lambda: "cpu",
    "lz4": lambda: "lz4",
    "disk": lambda: "disk",
    "lz4+disk": lambda: ts.Chain(ts.Lz4(), ts.DiskSpill()),
    "auto": lambda: "auto",
    "recompute": lambda: "auto",  # every block recomputed; their inputs go through Auto
}
BASELINE = "none"
PEERS = ("save_on_cpu", "checkpoint")
ALL_POLICIES: tuple[str, ...] = (BASELINE, *STASH_POLICIES, *PEERS)
AUTO_PREFIX = "auto:"
"""``auto:<budget>`` (e.g. ``auto:8MiB``) runs ``Auto(device_budget=<budget>)``."""
NO_PLAN = " without a plan"
"""The suffix of an ``auto:<budget>`` variant's twin that never plans (rule 6 of the NOTE)."""
DEFAULT_POLICIES: tuple[str, ...] = (*ALL_POLICIES[:7], "auto:8MiB", *ALL_POLICIES[7:])
"""Every policy, and Auto under an 8 MiB budget: it offloads on the CPU, where the
default budget (half of free RAM) keeps everything."""
NEEDS_BLOCKS = ("recompute", "checkpoint")
"""Policies that wrap the model's blocks (see ``Workload.blocks``)."""


def _auto_policy(name: str) -> Any:
    return ts.Auto(device_budget=name.removeprefix(AUTO_PREFIX))


def _is_policy(name: str) -> bool:
    if name.startswith(AUTO_PREFIX):
        try:
            _auto_policy(name)
        except ValueError:
            return False
        return True
    return name in ALL_POLICIES


def _learns(name: str) -> bool:
    """Whether the variant runs Auto with a Profile (rule 6 of NOTE [ Fair comparison ])."""
    return name == "auto" or name == "recompute" or name.startswith(AUTO_PREFIX)


def resolve_policies(names: Sequence[str]) -> list[str]:
    """Validate bench policy names, drop repeats and put the baseline "none" first.

    Args:
        names: names from :data:`ALL_POLICIES` or ``auto:<budget>``, in the order to run them.

    Returns:
        The names to run, starting with "none" (overhead is measured against it).

    Raises:
        ValueError: a name is not a bench policy.
    """
    unknown = [name for name in names if not _is_policy(name)]
    if unknown:
        raise ValueError(
            f"tensorstash bench: unknown policy {unknown[0]!r}; valid policies are "
            f"{', '.join(ALL_POLICIES)} and auto:<budget> (e.g. auto:8MiB); pass several "
            "comma-separated, e.g. --policies none,lz4"
        )
    resolved = [BASELINE]
    resolved.extend(name for name in dict.fromkeys(names) if name != BASELINE)
    return resolved


@contextlib.contextmanager
def _blocks_recomputed(workload: Workload) -> Iterator[None]:
    """The workload's blocks run under non-reentrant checkpointing inside the region."""
    names = ts.recompute_modules(workload.model, workload.blocks)
    try:
        yield
    finally:
        for name in names:
            ts.unrecompute(workload.model.get_submodule(name))


@contextlib.contextmanager
def variant_context(
    name: str,
    workload: Workload,
    device: torch.device,
    profiles: dict[str, ts.Profile] | None = None,
) -> Iterator[Any]:
    """Run a region under one bench variant.

    Args:
        name: a bench policy name (see :func:`resolve_policies`).
        workload: the model ("checkpoint" and "recompute" wrap its blocks).
        device: where the model runs (``save_on_cpu`` pins memory on CUDA).
        profiles: the Profile of each Auto variant, kept across its steps
            (one is added on first use); None: a fresh Profile each time, as
            for a twin that never plans (``NO_PLAN``, rule 6 of the NOTE).

    Returns:
        A context manager whose value is the stash session, or None for
        variants that are not a stash.
    """
    planless = name.endswith(NO_PLAN)
    name = name.removesuffix(NO_PLAN)
    profile = None
    if _learns(name):
        if profiles is None or planless:
            profile = ts.Profile()
        else:
            profile = profiles.setdefault(name, ts.Profile())
    model = workload.model
    if name == BASELINE:
        yield None
    elif name == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            yield None
    elif name == "checkpoint" and isinstance(model, BenchGPT):
        model.checkpoint = True  # torch's own checkpoint, as a peer that owes nothing to us
        try:
            yield None
        finally:
            model.checkpoint = False
    elif name == "checkpoint":
        with _blocks_recomputed(workload):
            yield None
    elif name == "recompute":
        with _blocks_recomputed(workload), ts.stash("auto", profile=profile) as session:
            yield session
    else:
        policy = _auto_policy(name) if name.startswith(AUTO_PREFIX) else STASH_POLICIES[name]()
        with ts.stash(policy, profile=profile) as session:
            yield session


# -- measurements --------------------------------------------------------------------


def _current_rss() -> int:
    """The process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)


def _high_water_rss() -> int | None:
    """Linux's VmHWM, the process's peak resident set, or None where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_high_water_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _high_water_rss() is not None


def return_free_memory() -> None:
    """Collect garbage and hand glibc's free heap memory back to the OS (best effort)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """Measures how far the resident set grows over a region.

    Uses Linux's resettable high-water mark when it can, else samples
    ``psutil`` RSS from a thread every millisecond (which may miss short peaks).

    Example:
        >>> with PeakRss() as meter:
        ...     run_step()
        >>> meter.delta_bytes
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.delta_bytes = 0
        self._interval_s = interval_s
        self._start = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self._start = _current_rss()
        if not _reset_high_water_rss():
            self._sampled = self._start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is None:
            peak = _high_water_rss() or _current_rss()
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled, _current_rss())
        self.delta_bytes = max(0, peak - self._start)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sampled = max(self._sampled, _current_rss())


TIMELINE_TIERS = ("kept", "host", "disk")


class Timeline:
    """Live bytes per tier over one step, sampled at every module's forward and backward.

    Each module's forward hook takes a sample when the module returns, and a
    hook on its output's gradient takes one when backward reaches it, just
    before its saved tensors are used and freed. A sample reads the live
    bytes per tier of the stash session (none without one) and, on CUDA,
    ``torch.cuda.memory_allocated`` above its value at the start of the step.

    Attributes:
        t_s: seconds since the step started, one per sample.
        tiers: live bytes of "kept", "host" and "disk", one list each.
        device: CUDA allocated bytes above the start, one per sample (None on the CPU).
        backward_at_s: when backward started.
        session: the stash session to read (set once it is open).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.t_s: list[float] = []
        self.tiers: dict[str, list[int]] = {tier: [] for tier in TIMELINE_TIERS}
        self.device: list[int] | None = [] if device.type == "cuda" else None
        self.backward_at_s = 0.0
        self.session: Any = None
        self._cuda = device if device.type == "cuda" else None
        self._model = model
        self._start = 0.0
        self._base = 0
        self._handles: list[Any] = []

    def __enter__(self) -> Timeline:
        self._start = time.perf_counter()
        if self._cuda is not None:
            self._base = torch.cuda.memory_allocated(self._cuda)
        self._handles = [m.register_forward_hook(self._forward) for m in self._model.modules()]
        self.sample()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def sample(self) -> None:
        """Record the live bytes now."""
        self.t_s.append(time.perf_counter() - self._start)
        tiers = None if self.session is None else self.session.stats.tiers
        for name, values in self.tiers.items():
            values.append(0 if tiers is None else int(tiers[name].live_bytes))
        if self.device is not None and self._cuda is not None:
            self.device.append(torch.cuda.memory_allocated(self._cuda) - self._base)

    def backward_starts(self) -> None:
        """Mark the end of forward."""
        self.sample()
        self.backward_at_s = self.t_s[-1]

    def _forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.sample()
        outputs = output if isinstance(output, tuple | list) else (output,)
        for value in outputs:
            if isinstance(value, Tensor) and value.requires_grad:
                value.register_hook(self._backward)

    def _backward(self, grad: Tensor) -> None:
        self.sample()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: ``t_s``, one list per tier, ``device`` and ``backward_at_s``."""
        return {
            "t_s": [round(t, 6) for t in self.t_s],
            **{name: list(values) for name, values in self.tiers.items()},
            "device": None if self.device is None else list(self.device),
            "backward_at_s": self.backward_at_s,
        }


@dataclass(frozen=True)
class StepResult:
    """What one step of one variant measured."""

    seconds: float
    grads_equal: bool
    stats: dict[str, Any] | None
    cuda_peak_bytes: int | None
    timeline: dict[str, Any] | None = None


@dataclass(frozen=True)
class Row:
    """One variant's result (see NOTE [ Fair comparison ] for how it is measured).

    Attributes:
        policy: the variant's name.
        peak_bytes: CPU: the most activation bytes the stash held in RAM
            ("kept" plus "host" tier peaks, rule 5 of the NOTE; None without a
            stash session). CUDA: ``torch.cuda.max_memory_allocated`` over a step.
        peak_rss_bytes: growth of the resident set over the variant's memory step.
        step_s: median seconds of a forward and backward over the timed steps.
        step_times: every timed step, in seconds, in order.
        overhead: ``step_s`` over the ``step_s`` of "none".
        grads_equal: every step's gradients bitwise equal to plain autograd's.
        tiers: the stash's per-tier counters of the last step (None without a session).
        compression_ratio: original over stored bytes of what left the device
            (None without a session).
        step_overheads: each timed step over the step of "none" in the same round.
        step_peak_bytes: each timed step's peak, as ``peak_bytes`` measures it.
        no_plan_step_times: ``auto:<budget>`` rows, with two timed steps or
            more: each timed step of the same Auto without a plan (a fresh
            Profile every step), run in the same rounds (rule 6 of the NOTE).
        no_plan_peak_bytes: the peak of each of those steps.
        timeline: live bytes per tier over one untimed step (see :class:`Timeline`),
            when the bench was asked for timelines; else None.
    """

    policy: str
    peak_bytes: int | None
    peak_rss_bytes: int
    step_s: float
    step_times: tuple[float, ...]
    overhead: float
    grads_equal: bool
    tiers: dict[str, dict[str, int]] | None
    compression_ratio: float | None
    step_overheads: tuple[float, ...] = ()
    step_peak_bytes: tuple[int | None, ...] = ()
    no_plan_step_times: tuple[float, ...] = ()
    no_plan_peak_bytes: tuple[int | None, ...] = ()
    timeline: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        data = asdict(self)
        for name in _SEQUENCES:
            data[name] = list(data[name])
        return data

    def plan_effect(self) -> PlanEffect | None:
        """Rule 6 of the NOTE: this row's steps 2 on against its twin without a plan.

        None unless an ``auto:<budget>`` row has two timed steps or more and
        its twin's steps.
        """
        count = len(self.step_times)
        twin = self.no_plan_step_times
        if not self.policy.startswith(AUTO_PREFIX) or count < 2 or len(twin) != count:
            return None
        mine = self.step_times[1:]
        return PlanEffect(
            steps=count,
            ratio=statistics.median(a / b for a, b in zip(mine, twin[1:], strict=True)),
            step_s=statistics.median(mine),
            no_plan_step_s=statistics.median(twin[1:]),
            peak_bytes=_largest(self.step_peak_bytes[1:]),
            no_plan_peak_bytes=_largest(self.no_plan_peak_bytes[1:]),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        """The row :meth:`to_dict` wrote (e.g. read back from ``--json``)."""
        fields = dict(data)
        for name in _SEQUENCES:
            fields[name] = tuple(fields.get(name, ()))
        return cls(**fields)


@dataclass(frozen=True)
class PlanEffect:
    """Auto following its plan against its twin without one (see :meth:`Row.plan_effect`).

    Attributes:
        steps: the timed steps; the comparison covers steps 2 to ``steps``.
        ratio: median over those steps of the row's step over its twin's, same round.
        step_s, no_plan_step_s: median step time of each over those steps.
        peak_bytes, no_plan_peak_bytes: largest known peak of each over those steps.
    """

    steps: int
    ratio: float
    step_s: float
    no_plan_step_s: float
    peak_bytes: int | None
    no_plan_peak_bytes: int | None


def _largest(peaks: Sequence[int | None]) -> int | None:
    known = [peak for peak in peaks if peak is not None]
    return max(known) if known else None


_SEQUENCES = (
    "step_times",
    "step_overheads",
    "step_peak_bytes",
    "no_plan_step_times",
    "no_plan_peak_bytes",
)


class _Bench:
    """The workload on its device, its weights and reference gradients, shared by every step."""

    def __init__(
        self, workload: Workload, device: torch.device, dtype: torch.dtype, seed: int
    ) -> None:
        self.workload = Workload(
            workload.model.to(device=device, dtype=dtype).train(),
            _to_device(workload.batch, device, dtype),
            workload.blocks,
            workload.description,
        )
        self.model = self.workload.model
        self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.batch = self.workload.batch
        self.device = device
        self.seed = seed
        self.reference: list[Tensor | None] = []
        self.profiles: dict[str, ts.Profile] = {}

    def step(
        self, name: str, *, meter: PeakRss | None = None, timeline: bool = False
    ) -> StepResult:
        """Run one forward and backward under variant ``name`` and measure it.

        Args:
            name: the variant.
            meter: when given, free heap memory is returned to the OS first and
                the meter measures the step's resident memory (rule 3 of the NOTE).
            timeline: record live bytes per tier over the step (:class:`Timeline`).

        Returns:
            The step's time, gradient check, stash stats, CUDA peak and timeline.
        """
        self._reset()
        if meter is not None:
            return_free_memory()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        trace = Timeline(self.model, self.device) if timeline else None
        with meter or contextlib.nullcontext(), trace or contextlib.nullcontext():
            start = time.perf_counter()
            with variant_context(name, self.workload, self.device, self.profiles) as session:
                if trace is not None:
                    trace.session = session
                loss = _checked_loss(self.model(*self.batch), self.workload)
                if trace is not None:
                    trace.backward_starts()
                loss.backward()
            if cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            del loss
            if trace is not None:
                trace.sample()
        stats = None if session is None else session.stats.to_dict()
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
        recorded = None if trace is None else trace.to_dict()
        return StepResult(seconds, self._grads_equal(), stats, peak, recorded)

    def take_reference(self) -> None:
        """Run plain autograd once and keep its gradients (rule 4 of the NOTE)."""
        self.step(BASELINE)
        self.reference = [_grad_copy(p) for p in self.model.parameters()]

    def _reset(self) -> None:
        """Same weights, no gradients, same RNG state (rule 2 of the NOTE)."""
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def _grads_equal(self) -> bool:
        """Whether every parameter's gradient equals the reference bitwise."""
        grads = [p.grad for p in self.model.parameters()]
        if len(grads) != len(self.reference):
            return False
        return all(
            (g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
            for g, r in zip(grads, self.reference, strict=True)
        )


def _checked_loss(loss: Any, workload: Workload) -> Tensor:
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


def _grad_copy(parameter: Tensor) -> Tensor | None:
    """A detached copy of ``parameter.grad`` (None if it has none)."""
    return None if parameter.grad is None else parameter.grad.detach().clone()


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` called ``name``; ValueError listing the valid names."""
    if name not in CONFIGS:
        raise ValueError(
            f"tensorstash bench: unknown model {name!r}; valid models are "
            f"{', '.join(CONFIGS)}; pass one with --model"
        )
    return CONFIGS[name]


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ValueError if it is CUDA and CUDA is missing."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"tensorstash bench: device {str(device)!r} requested but torch "
            f"{torch.__version__} sees no CUDA device; run with --device cpu or on a "
            "machine with a GPU and a CUDA build of torch"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensorstash bench: device {str(device)!r} is not supported; use cpu or cuda"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``; ValueError listing the valid names."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        dtype = str(dtype)
    if dtype not in DTYPES:
        raise ValueError(
            f"tensorstash bench: dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}"
        )
    return DTYPES[dtype]


def check_memory_snapshot(device: str | torch.device) -> None:
    """Raise ValueError unless ``device`` can record allocator snapshots (CUDA)."""
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"tensorstash bench: --memory-snapshot records the CUDA caching allocator's "
            f"history and needs --device cuda (got {str(device)!r}); on the CPU use --plot "
            "for live bytes per tier over a step"
        )


def snapshot_file(directory: Path, policy: str) -> Path:
    """Where ``--memory-snapshot`` writes the snapshot of ``policy``: a safe file name."""
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', policy)}.pickle"


def check_blocks(names: Sequence[str], workload: Workload) -> None:
    """Raise ValueError if a policy in ``names`` wraps blocks the workload does not name."""
    blockless = [name for name in names if name in NEEDS_BLOCKS and workload.blocks is None]
    if blockless:
        raise ValueError(
            f"tensorstash bench: policy {blockless[0]!r} wraps the model's blocks, and "
            f"{workload.description} names none; return (model, batch, blocks) from the "
            "model script (blocks: a module class or submodule names), or leave "
            f"{' and '.join(NEEDS_BLOCKS)} out of --policies"
        )


def planned_steps(
    policies: Sequence[str],
    steps: int,
    warmup: int = 1,
    *,
    timeline: bool = False,
    memory_snapshot: bool = False,
) -> int:
    """How many steps :func:`run_bench` runs: the reference, untimed, timed and extra rounds."""
    names = resolve_policies(policies)
    rounds = warmup + 1 + steps + int(timeline) + int(memory_snapshot)
    twins = len(_with_twins(names, steps)) - len(names)
    return 1 + len(names) * rounds + twins * (warmup + 1 + steps)


def _with_twins(names: Sequence[str], steps: int) -> list[str]:
    """``names``, each ``auto:<budget>`` followed by its twin that never plans (rule 6).

    Side by side in every round, the two run in the same state of the heap
    and the page cache, whatever the variants before them left.
    """
    if steps < 2:  # no step follows a plan
        return list(names)
    every: list[str] = []
    for name in names:
        every.append(name)
        if name.startswith(AUTO_PREFIX):
            every.append(name + NO_PLAN)
    return every


def _round_order(every: list[str], index: int) -> list[str]:
    """The variants of timed round ``index``: a twin goes first in every other round.

    Whichever of two variants runs first pays for what the variant before
    them left behind, so the pair alternates (rule 6 of the NOTE).
    """
    order = list(every)
    if index % 2:
        for position, name in enumerate(order):
            if name.endswith(NO_PLAN):
                order[position - 1], order[position] = name, order[position - 1]
    return order


def run_bench(
    config_name: str = "small",
    policies: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 3,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    *,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    workload: Workload | None = None,
    timeline: bool = False,
    memory_snapshot: str | Path | None = None,
) -> list[Row]:
    """Train a model for a few steps under each policy and measure them.

    The variants are interleaved and compared as NOTE [ Fair comparison ]
    describes; "none" (plain autograd) is always run first, as the baseline.

    Args:
        config_name: a key of :data:`CONFIGS`: "tiny", "small", "medium" or "large".
        policies: names from :data:`ALL_POLICIES` or ``auto:<budget>``.
        steps: timed steps per variant.
        device: "cpu" or "cuda".
        dtype: "float32" or "bfloat16": the model's parameter dtype.
        seed: seeds the weights, the batch and dropout.
        warmup: untimed warm-up steps per variant, before the one untimed step
            that measures resident memory.
        progress: called with the variant's name after every step.
        workload: a model of your own (see :func:`script_workload`) instead of
            the embedded one; ``config_name`` is then unused.
        timeline: run one more untimed step per variant that records live
            bytes per tier (``Row.timeline``, for :func:`tensorstash._plot.plot`).
        memory_snapshot: a directory: run one more untimed step per variant
            under ``torch.cuda.memory._record_memory_history`` and dump it to
            ``<directory>/<policy>.pickle`` for https://pytorch.org/memory_viz
            (CUDA only).

    Returns:
        One :class:`Row` per variant, "none" first.

    Raises:
        ValueError: an unknown model, policy or dtype, ``steps < 1``, CUDA
            requested without a CUDA device, a snapshot asked for off CUDA, or
            "checkpoint"/"recompute" asked for on a workload without blocks.
        ModelScriptError: the model does not return a scalar loss.

    Example:
        >>> for row in run_bench("tiny", ["lz4", "disk"], steps=2):
        ...     print(row.policy, row.overhead, row.grads_equal)
    """
    names = resolve_policies(policies)
    if steps < 1 or warmup < 0:
        raise ValueError(
            f"tensorstash bench: steps={steps}, warmup={warmup}; pass steps >= 1 "
            "(--steps 1) and warmup >= 0"
        )
    resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
    if memory_snapshot is not None:
        check_memory_snapshot(resolved_device)
    if workload is None:
        workload = builtin_workload(config_name, seed)
    check_blocks(names, workload)
    with _deterministic(resolved_device):
        bench = _Bench(workload, resolved_device, resolved_dtype, seed)
        return _rounds(bench, names, steps, warmup, progress, timeline, memory_snapshot)


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Rule 8 of NOTE [ Fair comparison ]: deterministic CUDA kernels for the run."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _rounds(
    bench: _Bench,
    names: list[str],
    steps: int,
    warmup: int,
    progress: Callable[[str], None] | None,
    timeline: bool,
    memory_snapshot: str | Path | None,
) -> list[Row]:
    """The rounds of :func:`run_bench`, in the order NOTE [ Fair comparison ] gives."""
    tick = progress or (lambda name: None)
    bench.take_reference()
    tick(BASELINE)
    every = _with_twins(names, steps)
    untimed, rss = _untimed_rounds(bench, every, warmup, tick)
    bench.profiles.clear()  # rule 6: Auto starts learning at the first timed step
    timed: dict[str, list[StepResult]] = {name: [] for name in every}
    for index in range(steps):  # rule 1: interleaved
        for name in _round_order(every, index):
            timed[name].append(bench.step(name))
            tick(name)
    traces: dict[str, dict[str, Any] | None] = dict.fromkeys(names)
    if timeline:  # rule 7
        for name in names:
            traces[name] = bench.step(name, timeline=True).timeline
            tick(name)
    if memory_snapshot is not None:
        _snapshot_round(bench, names, Path(memory_snapshot), tick)
    baseline = [r.seconds for r in timed[BASELINE]]
    rows = []
    for name in names:
        row = _row(name, untimed[name], timed[name], rss[name], baseline, traces[name])
        twin = timed.get(name + NO_PLAN)
        if twin is not None:
            checked = untimed[name + NO_PLAN] + twin
            row = replace(
                row,
                grads_equal=row.grads_equal and all(r.grads_equal for r in checked),
                no_plan_step_times=tuple(r.seconds for r in twin),
                no_plan_peak_bytes=tuple(_peak_bytes([r]) for r in twin),
            )
        rows.append(row)
    return rows


def _untimed_rounds(
    bench: _Bench, names: list[str], warmup: int, tick: Callable[[str], None]
) -> tuple[dict[str, list[StepResult]], dict[str, int]]:
    """Rule 3 of the NOTE: warm-up rounds, then one round that measures resident memory.

    Returns:
        Each variant's untimed steps, and its resident memory growth in bytes.
    """
    results: dict[str, list[StepResult]] = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            results[name].append(bench.step(name))
            tick(name)
    rss: dict[str, int] = {}
    for name in names:
        meter = PeakRss()
        results[name].append(bench.step(name, meter=meter))
        rss[name] = meter.delta_bytes
        tick(name)
    return results, rss


def _snapshot_round(
    bench: _Bench, names: list[str], directory: Path, tick: Callable[[str], None]
) -> None:
    """Rule 7 of the NOTE: one step per variant under the CUDA allocator's history."""
    from torch.cuda import memory as cuda_memory

    directory.mkdir(parents=True, exist_ok=True)
    # Each file holds one step: the history of the step before is dropped where torch can.
    fresh = "clear_history" in inspect.signature(cuda_memory._record_memory_history).parameters
    options: dict[str, Any] = {"clear_history": True} if fresh else {}
    for name in names:
        torch.cuda.synchronize(bench.device)
        cuda_memory._record_memory_history(max_entries=200_000, device=bench.device, **options)
        try:
            bench.step(name)
            cuda_memory._dump_snapshot(str(snapshot_file(directory, name)))
        finally:
            cuda_memory._record_memory_history(enabled=None, device=bench.device)
        tick(name)


def _row(
    name: str,
    untimed: list[StepResult],
    timed: list[StepResult],
    rss_bytes: int,
    baseline: list[float],
    timeline: dict[str, Any] | None,
) -> Row:
    """Summarise a variant's steps (see ``Row`` for what each field means)."""
    every = untimed + timed
    step_s = statistics.median(r.seconds for r in timed)
    baseline_s = statistics.median(baseline)
    last = every[-1].stats
    return Row(
        policy=name,
        peak_bytes=_peak_bytes(every),
        peak_rss_bytes=rss_bytes,
        step_s=step_s,
        step_times=tuple(r.seconds for r in timed),
        overhead=step_s / baseline_s if baseline_s > 0 else float("nan"),
        grads_equal=all(r.grads_equal for r in every),
        tiers=None if last is None else last["tiers"],
        compression_ratio=None if last is None else float(last["compression_ratio"]),
        step_overheads=tuple(
            r.seconds / base if base > 0 else float("nan")
            for r, base in zip(timed, baseline, strict=True)
        ),
        step_peak_bytes=tuple(_peak_bytes([r]) for r in timed),
        timeline=timeline,
    )


def _peak_bytes(results: list[StepResult]) -> int | None:
    """The largest peak over the steps (see ``Row.peak_bytes``)."""
    peaks: list[int] = []
    for result in results:
        if result.cuda_peak_bytes is not None:
            peaks.append(result.cuda_peak_bytes)
        elif result.stats is not None:
            tiers = result.stats["tiers"]
            peaks.append(int(tiers["kept"]["peak_bytes"]) + int(tiers["host"]["peak_bytes"]))
    return max(peaks) if peaks else None


# -- the table -----------------------------------------------------------------------

_HEADERS = (
    "policy",
    "peak memory",
    "peak RSS +",
    "kept / host / disk",
    "ratio",
    "step",
    "overhead",
    "grads equal",
)
_LEFT = {0, 3}


def _cells(row: Row) -> list[str]:
    """A row's table cells, in the order of ``_HEADERS``."""
    if row.tiers is None:
        tiers = "-"
    else:
        tiers = " / ".join(human_bytes(row.tiers[t]["bytes"]) for t in ("kept", "host", "disk"))
    return [
        row.policy,
        _human(row.peak_bytes),
        human_bytes(row.peak_rss_bytes),
        tiers,
        "-" if row.compression_ratio is None else f"{row.compression_ratio:.2f}x",
        f"{row.step_s:.3f} s",
        f"{row.overhead:.2f}x",
        "yes" if row.grads_equal else "NO",
    ]


def format_table(rows: Sequence[Row], *, device: str | torch.device = "cpu") -> str:
    """The rows as an aligned plain-text table, one line per policy, with a legend.

    Args:
        rows: results of :func:`run_bench`.
        device: where they were measured (changes what "peak memory" means).

    Returns:
        The table, without a trailing newline.
    """
    table = [list(_HEADERS), *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(_HEADERS))]
    lines = [
        "  ".join(
            cell.ljust(width) if i in _LEFT else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.extend(_legend(torch.device(device)))
    lines.extend(_learning(rows))
    return "\n".join(lines)


def _legend(device: torch.device) -> list[str]:
    """Lines under the table that say what each column measures."""
    if device.type == "cuda":
        peak = "peak memory: torch.cuda.max_memory_allocated over a step, weights included"
    else:
        peak = 'peak memory: most activation bytes a stash held in RAM at once ("kept" + "host")'
    return [
        "",
        peak,
        "peak RSS +: growth of resident memory over an untimed step, after trimming the heap",
        "kept / host / disk: original bytes saved per tier; ratio: original / stored bytes moved",
        "step: median of the timed steps (variants interleaved); overhead: step / step of none",
        "grads equal: bitwise equal to plain autograd on every parameter, every step",
    ]


def _learning(rows: Sequence[Row]) -> list[str]:
    """Lines on ``auto:<budget>`` rows: their plan against their twin without one (rule 6).

    Plain "auto" is left out: on the CPU its default budget keeps everything,
    so its plan changes nothing.
    """
    lines: list[str] = []
    for row in rows:
        effect = row.plan_effect()
        if effect is None:
            continue
        span = "step 2" if effect.steps == 2 else f"steps 2-{effect.steps}"
        lines.append(
            f"{row.policy}: {span}, step time {effect.ratio:.2f}x that without a plan "
            f"(median of same-round ratios); peak {_human(effect.peak_bytes)} "
            f"against {_human(effect.no_plan_peak_bytes)} without"
        )
    if lines:
        lines[:0] = [
            "",
            "Auto planning from its Profile (step 1 has no plan yet), against the same Auto",
            "without a plan (a fresh Profile every step), run in the same rounds:",
        ]
    return lines


def _human(nbytes: int | None) -> str:
    return "-" if nbytes is None else human_bytes(nbytes)
