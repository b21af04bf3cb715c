"""Whether a session's hooks are pushed in its step: the quiet-step machine.

# NOTE [ Quiet-step machine ]
A session's open is in one of these states. What eager code saves meets the
session's hooks in ``HOOKED`` only; in the other states it is kept as plain
autograd keeps it.

- ``HOOKED``: the session's hooks are pushed and it follows modules.
- ``OPENED_QUIET``: it opened with nothing pushed and no module followed
  (rule 11 of NOTE [ Session ]); it waits for the model's call, or for a
  first module call that is not the model's, an inner session, or
  :func:`~tensorstash.pause`, to decide.
- ``QUIET``: the rest of the step runs as plain autograd (rule 10).
- ``CLOSED``: not open.

Transitions, each by one event:

====================  ==============================  ===========================
event                 from                            to
====================  ==============================  ===========================
``open``              CLOSED                          HOOKED, OPENED_QUIET, QUIET
``wake``              OPENED_QUIET                    HOOKED
``stay_quiet``        OPENED_QUIET                    QUIET
``go_quiet``          HOOKED                          QUIET
``close``             any open state                  CLOSED
====================  ==============================  ===========================

Any other event in a state is a bug in the caller, and raises. The session
does what each transition means (pushing or popping its hooks, following
modules); the machine says where the open is and whether an event may happen.

Who decides: the session opens ``HOOKED`` unless the selector's planning for
the step (what the policy's ``begin`` returns, the :class:`Planning`
protocol) gives it an :class:`Opening` saying otherwise, which it may do only
where the session is alone (``alone``: no other hooks pushed, no ``record``
or ``verify``, grad enabled). During the step the planning informs the
session through the :class:`Control` it was handed: ``wake``,
``stay_quiet``, ``go_quiet``; the session answers False where the stack of
hooks no longer lets it (others pushed inside it), and the state does not
change. A session opened inside a region that recomputes its tensors
(rule 8) pushes nothing and takes no state: its open is not a step.

A compiler's hook pair (NOTE [ Compiled code ] in planning/compiler.py) is
orthogonal to the state: an :class:`Opening` may carry a :class:`Pair`, pushed
in the session's place, to which compiled graphs' tensors go; eager code's
tensors are handed to the session's hooks in ``HOOKED`` and kept in ``QUIET``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from tensorstash.core.policy import bug


class State(enum.Enum):
    CLOSED = "closed"
    HOOKED = "hooked"
    OPENED_QUIET = "opened quiet"
    QUIET = "quiet"


class Event(enum.Enum):
    OPEN = "open"
    WAKE = "wake"
    STAY_QUIET = "stay_quiet"
    GO_QUIET = "go_quiet"
    CLOSE = "close"


_OPEN = frozenset({State.HOOKED, State.OPENED_QUIET, State.QUIET})

TRANSITIONS: dict[Event, dict[State, frozenset[State]]] = {
    Event.OPEN: {State.CLOSED: frozenset({State.HOOKED, State.OPENED_QUIET, State.QUIET})},
    Event.WAKE: {State.OPENED_QUIET: frozenset({State.HOOKED})},
    Event.STAY_QUIET: {State.OPENED_QUIET: frozenset({State.QUIET})},
    Event.GO_QUIET: {State.HOOKED: frozenset({State.QUIET})},
    Event.CLOSE: {state: frozenset({State.CLOSED}) for state in _OPEN},
}
"""For each event, the states it leaves and those it may lead to (the table above)."""


class Machine:
    """One open's state, moved only along :data:`TRANSITIONS`."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.CLOSED

    def may(self, event: Event) -> bool:
        """Whether ``event`` may happen in the current state."""
        return self.state in TRANSITIONS[event]

    def move(self, event: Event, to: State) -> None:
        """Take the transition ``event`` to ``to``; a transition the table lacks is a bug."""
        if to not in TRANSITIONS[event].get(self.state, ()):
            raise bug(f"quiet-step machine: {event.value} from {self.state.value} to {to.value}")
        self.state = to

    @property
    def hooked(self) -> bool:
        """Whether the session's hooks are pushed (HOOKED)."""
        return self.state is State.HOOKED

    @property
    def quiet(self) -> bool:
        """Whether the session's hooks are not pushed in an open step (OPENED_QUIET, QUIET)."""
        return self.state is State.QUIET or self.state is State.OPENED_QUIET


# -- what the session and a selector's planning tell each other --------------------------------


class Pair(Protocol):
    """A compiler's hook pair, pushed in the session's place for a step."""

    @property
    def pack(self) -> Callable[[Tensor], Any]: ...

    @property
    def unpack(self) -> Callable[[Any], Tensor]: ...

    def hand(self, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        """Eager code's tensors go to ``pack``/``unpack`` while the pair is pushed."""

    def closed(self) -> None:
        """The step's forward ended (the session closed): read what its graphs kept."""


@dataclass(frozen=True)
class Opening:
    """How a step opens, as the selector's planning says: its first state, and the
    compiler's pair pushed in the session's place, if any."""

    state: State
    pair: Pair | None = None


HOOKED = Opening(State.HOOKED)


class Control(Protocol):
    """What a step's planning may ask of the session during the step."""

    @property
    def opened_quiet(self) -> bool:
        """Whether the step is OPENED_QUIET: nothing pushed yet, undecided."""

    def wake(self, module: Any = None, args: Any = ()) -> bool:
        """OPENED_QUIET to HOOKED: push the hooks, follow modules (``module`` from its call)."""

    def stay_quiet(self) -> bool:
        """OPENED_QUIET to QUIET: the model was called, and the step stays quiet."""

    def go_quiet(self) -> bool:
        """HOOKED to QUIET: pop the hooks and stop following modules."""


class Planning(Protocol):
    """A selector's planning for one step: what its
    ``begin(ctx, control, *, alone, min_bytes)`` returns."""

    @property
    def opening(self) -> Opening:
        """How the step opens."""

    @property
    def plan(self) -> Any:
        """The plan the step follows, or None."""

    @property
    def choose(self) -> Any:
        """The step's choose (``(tensor, ctx, site) -> (policy, reason)``), or None."""

    def woke(self) -> None:
        """The session woke before the model's call: plan at the first module call."""

    def end(self) -> None:
        """The session exits: let go of the step's modules, hooks and ``control``."""
