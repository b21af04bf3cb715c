"""The quiet-step machine (NOTE [ Quiet-step machine ] in tensorstash/session/quiet.py):
its table, and every transition as sessions take it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from checks import Ticks, top_saved_tensors_hooks
from torch import nn
from zoo import Block

import tensorstash as ts
from tensorstash.session.quiet import TRANSITIONS, Event, Machine, State

# -- the table ---------------------------------------------------------------------------------


def test_the_table_names_each_transition_of_the_note() -> None:
    moves = {
        (event, start, to)
        for event, starts in TRANSITIONS.items()
        for start, ends in starts.items()
        for to in ends
    }
    opened = (State.HOOKED, State.OPENED_QUIET, State.QUIET)
    assert moves == {
        *((Event.OPEN, State.CLOSED, to) for to in opened),
        (Event.WAKE, State.OPENED_QUIET, State.HOOKED),
        (Event.STAY_QUIET, State.OPENED_QUIET, State.QUIET),
        (Event.GO_QUIET, State.HOOKED, State.QUIET),
        *((Event.CLOSE, start, State.CLOSED) for start in opened),
    }


@pytest.mark.parametrize(
    ("event", "start", "to"), list(itertools.product(Event, State, State)), ids=str
)
def test_a_machine_takes_exactly_the_transitions_of_the_table(
    event: Event, start: State, to: State
) -> None:
    machine = Machine()
    machine.state = start
    allowed = to in TRANSITIONS[event].get(start, ())
    assert machine.may(event) == (start in TRANSITIONS[event])
    if allowed:
        machine.move(event, to)
        assert machine.state is to
    else:
        with pytest.raises(AssertionError, match="quiet-step machine"):
            machine.move(event, to)
        assert machine.state is start


def test_only_hooked_has_the_sessions_hooks_pushed() -> None:
    machine = Machine()
    for state in State:
        machine.state = state
        assert machine.hooked == (state is State.HOOKED)
        assert machine.quiet == (state in (State.OPENED_QUIET, State.QUIET))


# -- sessions taking the transitions -----------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(128) for _ in range(3))
        self.head = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _data() -> torch.Tensor:
    return torch.randn(256, 128, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, str]]]:
    """Every transition a machine takes, as (event, from, to) values."""
    taken: list[tuple[str, str, str]] = []
    move = Machine.move

    def recording(machine: Machine, event: Event, to: State) -> None:
        start = machine.state
        move(machine, event, to)
        taken.append((event.value, start.value, to.value))

    monkeypatch.setattr(Machine, "move", recording)
    yield taken


def _step(model: nn.Module, policy: Any, profile: ts.Profile | None = None) -> ts.Session:
    with ts.stash(policy, profile=profile) as session:
        loss = model(_data())
    loss.backward()
    return session


def _trained() -> tuple[Net, ts.Profile, ts.Auto]:
    """A model whose Auto steps have gone quiet: the next session opens quiet."""
    torch.manual_seed(0)
    model, profile, auto = Net(), ts.Profile(clock=Ticks()), ts.Auto()
    for _ in range(5):
        _step(model, auto, profile)
    return model, profile, auto


def test_a_plain_policy_opens_hooked_and_closes(moves: list[tuple[str, str, str]]) -> None:
    torch.manual_seed(0)
    _step(Net(), "cpu")
    assert moves == [("open", "closed", "hooked"), ("close", "hooked", "closed")]


def test_auto_goes_quiet_at_the_models_call_then_opens_quiet_and_stays(
    moves: list[tuple[str, str, str]],
) -> None:
    torch.manual_seed(0)
    model, profile, auto = Net(), ts.Profile(clock=Ticks()), ts.Auto()
    steps = []
    for _ in range(6):
        start = len(moves)
        _step(model, auto, profile)
        steps.append(moves[start:])
    assert steps[0] == [("open", "closed", "hooked"), ("close", "hooked", "closed")]
    went = [("open", "closed", "hooked"), ("go_quiet", "hooked", "quiet")]
    stayed = [("open", "closed", "opened quiet"), ("stay_quiet", "opened quiet", "quiet")]
    first_quiet = next(i for i, step in enumerate(steps) if step[:2] == went)
    assert steps[first_quiet + 1][:2] == stayed
    assert all(step[:2] == stayed for step in steps[first_quiet + 1 :])
    assert all(step[-1][0] == "close" and step[-1][2] == "closed" for step in steps)


def test_a_session_opened_quiet_wakes_at_a_first_call_that_is_not_the_model(
    moves: list[tuple[str, str, str]],
) -> None:
    model, profile, auto = _trained()
    del moves[:]
    with ts.stash(auto, profile=profile) as session:
        assert session.opened_quiet and top_saved_tensors_hooks() is None
        loss = model.head(model.blocks[0](_data())).square().mean()
        assert not session.opened_quiet and top_saved_tensors_hooks() is not None
    loss.backward()
    assert moves == [
        ("open", "closed", "opened quiet"),
        ("wake", "opened quiet", "hooked"),
        ("close", "hooked", "closed"),
    ]


@pytest.mark.slow  # a trained Auto model: test_plan covers the case in make test
def test_a_session_opened_quiet_wakes_for_an_inner_session_and_pause(
    moves: list[tuple[str, str, str]],
) -> None:
    model, profile, auto = _trained()
    for region in ("inner", "pause"):
        del moves[:]
        with ts.stash(auto, profile=profile):
            if region == "inner":
                with ts.stash("lz4", min_bytes=0):
                    extra = (_data().requires_grad_() * 2).sigmoid().sum()
            else:
                with ts.pause():
                    extra = torch.zeros(())
            loss = model(_data())
        (loss + extra).backward()
        ours = [move for move in moves if move[0] != "open" or move[2] != "hooked"]
        assert ours[:2] == [
            ("open", "closed", "opened quiet"),
            ("wake", "opened quiet", "hooked"),
        ]
        assert ("go_quiet", "hooked", "quiet") in ours  # at the model's call


@pytest.mark.slow  # a trained Auto model: test_plan covers the case in make test
def test_a_session_opened_quiet_with_others_hooks_inside_stays_as_it_opened(
    moves: list[tuple[str, str, str]],
) -> None:
    model, profile, auto = _trained()
    del moves[:]
    others = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ts.stash(auto, profile=profile) as session, others:
        loss = model(_data())
        assert session.opened_quiet  # it could neither stay quiet nor wake
    loss.backward()
    assert moves == [("open", "closed", "opened quiet"), ("close", "opened quiet", "closed")]
    assert session.stats.quiet == 0


@pytest.mark.slow  # a trained Auto model: test_plan covers the case in make test
def test_a_session_that_opened_quiet_and_called_no_module_closes_so(
    moves: list[tuple[str, str, str]],
) -> None:
    _, profile, auto = _trained()
    del moves[:]
    x = _data().requires_grad_()
    with ts.stash(auto, profile=profile):
        y = (x * 2).sigmoid().sum()
    y.backward()
    assert moves == [("open", "closed", "opened quiet"), ("close", "opened quiet", "closed")]


@pytest.mark.slow  # a trained Auto model: test_plan covers the case in make test
def test_the_session_refuses_what_its_state_does_not_allow() -> None:
    torch.manual_seed(0)
    with ts.stash("cpu") as session:
        assert not session.stay_quiet() and not session.wake()  # it did not open quiet
        assert session.go_quiet()  # a plain session may be handed to autograd...
        assert not session.go_quiet()  # ...once
    model, profile, auto = _trained()
    with ts.stash(auto, profile=profile) as session:
        assert not session.go_quiet()  # opened quiet: nothing of its own to pop
        loss = model(_data())
    loss.backward()


def test_a_session_inside_a_recomputed_region_takes_no_state(
    moves: list[tuple[str, str, str]],
) -> None:
    torch.manual_seed(0)
    block = Block(128)
    session = ts.stash("cpu")

    def region(x: torch.Tensor) -> torch.Tensor:
        with session:
            return block(x)

    from torch.utils.checkpoint import checkpoint

    with session:
        loss = checkpoint(region, _data().requires_grad_(), use_reentrant=False).sum()
    loss.backward()
    assert moves == [("open", "closed", "hooked"), ("close", "hooked", "closed")]
    assert session.stats.inside_recompute >= 1
