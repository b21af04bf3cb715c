"""Memory over one step, for ``--plot``: live bytes per tier and real memory, per module.

Recorded in an extra untimed round (rule 7 of NOTE [ Fair comparison ]): its
hooks cost time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.memory._memory import real_memory_now

TIMELINE_TIERS = ("kept", "host", "disk")


class Timeline:
    """Live bytes per tier and real memory over one step, sampled at every module.

    Each module's forward hook takes a sample when the module returns, and a
    hook on its output's gradient takes one when backward reaches it, just
    before its saved tensors are used and freed. A sample reads the live
    bytes per tier of the stash session (none without one) and the real
    memory above its value at the start of the step: the resident set on the
    CPU, ``torch.cuda.memory_allocated`` on CUDA (NOTE [ Real memory ]).

    Attributes:
        t_s: seconds since the step started, one per sample.
        tiers: live bytes of "kept", "host" and "disk", one list each.
        real: real memory above the start, one per sample.
        backward_at_s: when backward started.
        session: the stash session to read (set once it is open).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.t_s: list[float] = []
        self.tiers: dict[str, list[int]] = {tier: [] for tier in TIMELINE_TIERS}
        self.real: list[int] = []
        self.backward_at_s = 0.0
        self.session: Any = None
        self._device = device
        self._model = model
        self._start = 0.0
        self._base = 0
        self._handles: list[Any] = []

    def __enter__(self) -> Timeline:
        self._start = time.perf_counter()
        self._base = real_memory_now(self._device)
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
        self.real.append(real_memory_now(self._device) - self._base)

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
        """A JSON-ready copy: ``t_s``, one list per tier, ``real`` and ``backward_at_s``."""
        return {
            "t_s": [round(t, 6) for t in self.t_s],
            **{name: list(values) for name, values in self.tiers.items()},
            "real": list(self.real),
            "backward_at_s": self.backward_at_s,
        }
