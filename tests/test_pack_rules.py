"""The pack rules (NOTE [ Pack rules ] in tensorstash/session/rules.py), case by case: the
C hooks and the Python hooks decide each case alike, and as the rule says."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from checks import top_saved_tensors_hooks
from torch import nn

import tensorstash as ts
from tensorstash.core import _fastpath
from tensorstash.session.rules import ORDER
from tensorstash.session.values import Saved

stash = importlib.import_module("tensorstash.session.stash")
MIN_BYTES = 4096


class _Sub(torch.Tensor):
    pass


@dataclass(frozen=True)
class Case:
    rule: str  # the rule of ORDER that decides it
    make: Callable[[], Any]  # made inside the session: (the tensor to pack, what holds it)
    kind: str  # what pack returns: "tuple" (held untouched), "kept", "saved", "same"
    held: str = "same"  # what is held: the tensor itself, or it "detached"
    skipped: str | None = None  # the reason counted in stats.skipped, if any
    policy: str = "keep"


def _parameter() -> nn.Parameter:
    return nn.Parameter(torch.randn(64, 64))


def _buffer() -> tuple[torch.Tensor, Any]:
    module = nn.Linear(64, 64)
    module.register_buffer("table", torch.randn(64, 64))
    module(torch.randn(2, 64))  # called inside the session: its state is known
    return module.table, module


def _output() -> tuple[torch.Tensor, Any]:
    x = torch.randn(64, 64, requires_grad=True)
    return x + 1, x  # the output of the last op made: held detached


def _small_output() -> tuple[torch.Tensor, Any]:
    x = torch.randn(4, requires_grad=True)
    return x + 1, x


def _view_of_leaf() -> tuple[torch.Tensor, Any]:
    leaf = torch.randn(128, 64, requires_grad=True)
    return leaf[:64], leaf


def _input() -> tuple[torch.Tensor, Any]:
    x = torch.randn(64, 64, requires_grad=True)
    y = x + 1
    (y * 2).sum()  # a later op: y is no longer the last node's output
    return y, x


CASES = {
    "sparse": Case(
        "size", lambda: (torch.randn(64, 64).to_sparse(), None), "tuple", skipped="sparse"
    ),
    "parameter": Case("type", lambda: (_parameter(), None), "tuple", skipped="parameter"),
    "subclass": Case(
        "type",
        lambda: (torch.randn(64, 64).as_subclass(_Sub), None),
        "tuple",
        skipped="tensor subclass",
    ),
    "small output": Case("small", _small_output, "tuple", held="detached"),
    "small input": Case("small", lambda: (torch.randn(4), None), "tuple"),
    "output": Case("held", _output, "kept", held="detached"),
    "input": Case("held", _input, "kept"),
    "leaf": Case(
        "eligible", lambda: (torch.randn(64, 64, requires_grad=True), None), "tuple", skipped="leaf"
    ),
    "transposed parameter": Case(
        "eligible",
        lambda: ((p := _parameter()).t(), p),
        "tuple",
        held="detached",
        skipped="parameter",
    ),
    "cast parameter": Case(
        "eligible",
        lambda: ((p := _parameter()).double(), p),
        "tuple",
        held="detached",
        skipped="parameter",
    ),
    "view of a leaf": Case(
        "eligible", _view_of_leaf, "tuple", held="detached", skipped="parameter"
    ),
    "mkldnn": Case(
        "storage", lambda: (torch.randn(64, 64).to_mkldnn(), None), "tuple", skipped="mkldnn"
    ),
    "module buffer": Case("state", _buffer, "tuple", skipped="buffer"),
    "saved twice": Case("dedupe", lambda: (torch.randn(64, 64), None), "same"),
    "kept": Case("choice", lambda: (torch.randn(64, 64), None), "kept"),
    "moved": Case("choice", lambda: (torch.randn(64, 64), None), "saved", policy="cpu"),
}


def test_the_cases_cover_every_rule() -> None:
    assert {case.rule for case in CASES.values()} == set(ORDER)


def _pack(case: Case, path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Pack ``case``'s tensor with the hooks of ``path``: what came back, and the counts."""
    if path == "python":
        monkeypatch.setattr(stash, "compiled", None)
    with ts.stash(case.policy, min_bytes=MIN_BYTES) as session:
        tensor, keep_alive = case.make()
        pack, _ = top_saved_tensors_hooks()
        assert (type(pack.__self__).__name__ == "Hooks") == (path == "c")
        value = pack(tensor)
        again = pack(tensor) if case.kind == "same" else None
    monkeypatch.undo()
    if isinstance(value, tuple):
        kind, holding = "tuple", value[0]
    elif isinstance(value, Saved):
        kind, holding = "saved", None
    else:
        kind, holding = "kept", value.tensor
    if again is not None:
        kind = "same" if again is value else "twice"
    held = None if holding is None else ("same" if holding is tensor else "detached")
    if held == "detached":
        assert holding.data_ptr() == tensor.data_ptr() and holding.grad_fn is None
    stats = session.stats
    counts = (
        dict(stats.skipped),
        stats.deduplicated,
        {name: (tier.tensors, tier.bytes) for name, tier in stats.tiers.items()},
    )
    del keep_alive, value, again
    return kind, held, counts


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("path", ["c", "python"])
def test_each_case_is_decided_as_its_rule_says(
    name: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "c" and _fastpath.compiled is None:
        pytest.skip("the C extension is not built")
    case = CASES[name]
    if case.rule == "storage" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn in this build")
    kind, held, (skipped, _, _) = _pack(case, path, monkeypatch)
    assert kind == case.kind
    if kind in ("tuple", "kept"):
        assert held == case.held
    reasons = [text for text in skipped if case.skipped and case.skipped in text]
    assert bool(reasons) == (case.skipped is not None), skipped


@pytest.mark.skipif(_fastpath.compiled is None, reason="the C extension is not built")
@pytest.mark.parametrize("name", list(CASES))
def test_the_c_and_python_paths_decide_each_case_alike(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    if case.rule == "storage" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn in this build")
    assert _pack(case, "c", monkeypatch) == _pack(case, "python", monkeypatch)
