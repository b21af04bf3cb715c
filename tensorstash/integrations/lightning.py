"""Lightning integration: :class:`StashCallback` stashes the forward of every training step.

# NOTE [ Lightning ]
1. Where the session opens. Lightning runs ``on_train_batch_start``, then the
   forward inside the optimizer closure, then ``on_before_backward``; a batch
   skipped by ``on_train_batch_start`` returning -1 never reaches
   ``on_train_batch_end``, and an exception reaches only ``on_exception``.
   Opening a session in one hook and closing it in another would leave hooks
   pushed on some of those paths. So ``setup`` replaces the LightningModule's
   ``training_step`` (an instance attribute, which the strategies call, DDP's
   forward redirection included) with one that runs the original inside
   ``with stash(...)``: the session covers exactly the forwards that build the
   graph, and a ``with`` block exits once, on every path.
2. Backward runs after the session has closed (automatic optimization and
   gradient accumulation). The packed values live with the graph and release
   their files, buffers and threads when autograd frees it, as a session does
   outside Lightning. Under manual optimization ``manual_backward`` runs inside
   the session; that is fine too.
3. ``teardown`` and ``on_exception`` restore the original ``training_step``
   (and ``validation_step``); restoring twice does nothing.
4. One session per ``training_step`` call. ``on_train_batch_end`` merges the
   sessions of the batch (one, unless the optimizer calls its closure several
   times, as LBFGS does) into :attr:`StashCallback.stats` and logs them with
   ``pl_module.log_dict``, so ``log_every_n_steps`` and every logger apply.
5. Validation runs without gradients by default (``inference_mode``), so it
   saves nothing; ``stash_validation=True`` wraps ``validation_step`` too, for
   validation steps that enable gradients.
6. What the selector learned lives in a :class:`~tensorstash.Profile` (made by
   the callback for ``policy="auto"``); ``state_dict`` writes its last step as
   plain lists and numbers, so it round-trips through a checkpoint, loaded
   with ``weights_only=True`` or not.
7. The plan. Each batch's plan (``Auto`` with its profile) is kept in
   ``callback.plans``; a plan that differs from the last one (what it
   recomputes, where it moves a call site, the limit or budget it holds) is
   logged with its table to the ``tensorstash`` logger, as a warning where it
   does not hold what it was made for.
8. ``lightning.pytorch`` and ``pytorch_lightning`` are separate packages whose
   Trainers accept only their own ``Callback``. :class:`StashCallback` is built
   on ``lightning.pytorch`` when it is installed, otherwise on
   ``pytorch_lightning``; ``PLStashCallback`` is always built on
   ``pytorch_lightning``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from tensorstash.core.policy import Policy
from tensorstash.core.stats import StashStats
from tensorstash.integrations._plans import PlanLog
from tensorstash.planning.auto import Auto
from tensorstash.planning.profile import Profile
from tensorstash.session.stash import DEFAULT_MIN_BYTES, Session, resolve, stash

_INSTALL = "pip install tensorstash[lightning]"

try:
    from lightning.pytorch import Callback as _Callback

    PACKAGE = "lightning.pytorch"
except ImportError:
    try:
        from pytorch_lightning import Callback as _Callback  # type: ignore[assignment]

        PACKAGE = "pytorch_lightning"
    except ImportError as error:
        raise ImportError(
            "tensorstash.lightning needs Lightning (the lightning or pytorch_lightning "
            f"package), which is not installed: {_INSTALL}"
        ) from error


class _StashCallbackBase:
    """The callback's behaviour, shared by the classes built on either Lightning package."""

    def __init__(
        self,
        policy: Policy | str = "auto",
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        workers: int = 2,
        record: bool = False,
        profile: Profile | None = None,
        log_stats: bool = True,
        stash_validation: bool = False,
    ) -> None:
        api = f"tensorstash.lightning.{type(self).__name__}"
        for name, value in (("log_stats", log_stats), ("stash_validation", stash_validation)):
            if not isinstance(value, bool):
                raise TypeError(f"{api}: {name} must be True or False; got {value!r}")
        resolved = resolve(policy)
        if profile is None and isinstance(resolved, Auto):
            profile = Profile()
        # Checks the arguments now, with stash()'s messages, instead of at the first step.
        stash(resolved, min_bytes=min_bytes, workers=workers, record=record, profile=profile)
        self.policy = resolved
        self.min_bytes = min_bytes
        self.workers = workers
        self.record = record
        self.profile = profile
        self.log_stats = log_stats
        self.stash_validation = stash_validation
        self.stats: StashStats | None = None
        self.validation_stats: StashStats | None = None
        self._train_sessions: list[Session] = []
        self._validation_sessions: list[Session] = []
        self._restore: list[Callable[[], None]] = []
        self.plans = PlanLog(f"tensorstash.lightning.{type(self).__name__}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.policy!r}, min_bytes={self.min_bytes}, "
            f"stash_validation={self.stash_validation})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Spawned processes (ddp_spawn) get a pickled copy: without this run's
        # sessions, stats (which hold locks) and wrapped methods.
        state = self.__dict__.copy()
        state.update(stats=None, validation_stats=None, _restore=[])
        state.update(_train_sessions=[], _validation_sessions=[])
        return state

    def _session(self) -> Session:
        return stash(
            self.policy,
            min_bytes=self.min_bytes,
            workers=self.workers,
            record=self.record,
            profile=self.profile,
        )

    # Wrapping the steps (rules 1 and 3 of NOTE [ Lightning ]) -----------------------

    def _wrap(self, pl_module: Any, name: str, sessions: list[Session]) -> None:
        previous = pl_module.__dict__.get(name)
        step = getattr(pl_module, name)

        @functools.wraps(step)
        def stashed(*args: Any, **kwargs: Any) -> Any:
            session = self._session()
            sessions.append(session)
            with session:
                return step(*args, **kwargs)

        setattr(pl_module, name, stashed)

        def restore() -> None:
            if pl_module.__dict__.get(name) is not stashed:
                return  # replaced since: leave the newer attribute alone
            if previous is None:
                delattr(pl_module, name)
            else:
                setattr(pl_module, name, previous)

        self._restore.append(restore)

    def _unwrap(self) -> None:
        restore, self._restore = self._restore, []
        for undo in reversed(restore):
            undo()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unwrap()
        self._train_sessions.clear()
        self._validation_sessions.clear()
        self._wrap(pl_module, "training_step", self._train_sessions)
        if self.stash_validation:
            self._wrap(pl_module, "validation_step", self._validation_sessions)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unwrap()
        self._train_sessions.clear()
        self._validation_sessions.clear()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "exception")

    # Stats (rule 4) -----------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._train_sessions.clear()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._train_sessions:
            return
        self.plans.saw(self._train_sessions[-1].plan, trainer.global_step)
        self.stats = _merged([s.stats for s in self._train_sessions])
        self._train_sessions.clear()
        if self.log_stats:
            pl_module.log_dict(self.stats.metrics(), on_step=True, on_epoch=False, batch_size=1)

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._validation_sessions.clear()

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._validation_sessions:
            self.validation_stats = _merged([s.stats for s in self._validation_sessions])
            self._validation_sessions.clear()

    # Checkpoints (rule 6) -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.profile is None:
            return {}
        return {"profile": self.profile.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("profile")
        if state is None:
            return
        if self.profile is None:
            warnings.warn(
                f"tensorstash.lightning.{type(self).__name__}: the checkpoint holds a "
                "tensorstash profile but this callback has none, so it is not used; pass "
                "profile=tensorstash.Profile() (or policy='auto') to plan from it",
                stacklevel=2,
            )
            return
        self.profile.load_state_dict(state)


class StashCallback(_StashCallbackBase, _Callback):
    """Stash the tensors each training step saves for backward (Lightning callback).

    Every ``training_step`` runs inside ``tensorstash.stash(policy, ...)``, under
    automatic and manual optimization and with gradient accumulation; backward
    runs on the packed values after the step returns. Built on
    ``lightning.pytorch`` when it is installed, otherwise on
    ``pytorch_lightning`` (see :data:`PACKAGE`; :class:`PLStashCallback` is
    always the ``pytorch_lightning`` one). See NOTE [ Lightning ].

    Args:
        policy: where saved tensors go, as for :func:`tensorstash.stash`.
        min_bytes: tensors smaller than this many bytes are kept as they are.
        workers: threads for compression and reads, per session.
        record: keep a decision log (``stats.decisions``).
        profile: a :class:`~tensorstash.Profile` shared by every step's session;
            made by the callback when ``policy`` is ``"auto"`` or an ``Auto``. It
            is saved in checkpoints and restored on resume.
        log_stats: log each training batch's stats (``tensorstash/host_bytes``,
            ``tensorstash/compression_ratio``, ...; see :func:`metrics`) with
            ``pl_module.log_dict``, at the trainer's ``log_every_n_steps``.
        stash_validation: also stash ``validation_step`` (which saves nothing
            unless it enables gradients).

    Attributes:
        stats: the :class:`~tensorstash.StashStats` of the last training batch.
        validation_stats: those of the last validation batch (``stash_validation``).
        profile: the profile the sessions update, or None.

    Raises:
        TypeError, ValueError: a bad argument, with what to pass instead.

    Example:
        >>> from tensorstash.lightning import StashCallback
        >>> callback = StashCallback(tensorstash.Chain(tensorstash.Lz4(), tensorstash.DiskSpill()))
        >>> trainer = lightning.Trainer(callbacks=[callback], max_steps=100)
        >>> trainer.fit(model, loader)
        >>> print(callback.stats.table())

    .. warning::
        The callback replaces ``training_step`` on the LightningModule instance
        between ``setup`` and ``teardown``. Code that calls ``torch.func.grad``
        (or ``vjp``, ``jacrev``) inside ``training_step`` must do it inside
        ``tensorstash.pause()``.
    """


_pl_class: type[_StashCallbackBase] | None = None


def _build_pl_class() -> type[_StashCallbackBase]:
    if PACKAGE == "pytorch_lightning":
        return StashCallback
    try:
        import pytorch_lightning
    except ImportError as error:
        raise ImportError(
            "tensorstash.lightning.PLStashCallback is for Trainers of the pytorch_lightning "
            "package, which is not installed; use tensorstash.lightning.StashCallback with "
            "lightning.pytorch, or pip install pytorch-lightning"
        ) from error
    return type(
        "PLStashCallback",
        (_StashCallbackBase, pytorch_lightning.Callback),
        {
            "__module__": __name__,
            "__qualname__": "PLStashCallback",
            "__doc__": "StashCallback built on pytorch_lightning.Callback (see StashCallback).",
        },
    )


def __getattr__(name: str) -> Any:
    """``PLStashCallback``: :class:`StashCallback` for ``pytorch_lightning`` Trainers."""
    global _pl_class
    if name == "PLStashCallback":
        if _pl_class is None:
            _pl_class = _build_pl_class()
        return _pl_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _merged(parts: list[StashStats]) -> StashStats:
    """The sessions of one batch (run one after the other) as one."""
    return parts[0] if len(parts) == 1 else StashStats.combined(parts)
