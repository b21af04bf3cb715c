"""Hugging Face integration: :class:`StashTrainerCallback` stashes every training forward.

# NOTE [ Trainer ]
1. Where the session opens. ``Trainer.training_step`` calls ``model(**inputs)``
   (inside ``compute_loss``) and then ``accelerator.backward(loss)``, once per
   micro-batch; callbacks fire only around whole steps (``on_step_begin``
   before the first micro-batch, ``on_substep_end`` after each but the last,
   ``on_step_end`` after the optimizer step). So ``on_train_begin`` registers
   a forward pre-hook and an ``always_call`` forward hook on the model: the
   session opens when the model's forward starts and closes when it returns,
   before backward. The packed values live with the autograd graph and are
   released when backward frees it, as outside the Trainer. The hooks are
   called by the wrappers the Trainer puts around the model (DDP, accelerate's
   mixed-precision forward), and ``on_train_end`` removes them.
2. Which forwards. A session opens only between ``on_step_begin`` and
   ``on_step_end``, with the model in training mode and gradients enabled:
   every micro-batch of gradient accumulation, never evaluation or prediction
   (the Trainer evaluates after ``on_step_end``, in eval mode, without
   gradients, when nothing is saved anyway). A forward that calls the model
   again inside itself stays in the outer session.
3. Exceptions. The forward hook is ``always_call``, so an exception raised in
   the forward closes the session. PyTorch runs no forward hook for a
   ``KeyboardInterrupt`` (nor any other ``BaseException``): a session
   interrupted that way is closed at the callback's next Trainer event, or by
   :meth:`StashTrainerCallback.close`. Closing twice does nothing.
4. Stats. ``on_step_end`` merges the sessions of the step (one per
   micro-batch) into :attr:`StashTrainerCallback.stats`, and adds them to the
   interval since the last log. ``on_log`` adds the interval, averaged per
   optimizer step, to the Trainer's training logs (those with ``"loss"``,
   written every ``logging_steps``) and to that entry of
   ``state.log_history``. Reporting integrations (TensorBoard, W&B) run their
   ``on_log`` before the callbacks given to the Trainer: call
   :meth:`StashTrainerCallback.attach` to run this one first.
5. What the selector learned lives in a :class:`~tensorstash.Profile` shared
   by every training forward (made by the callback for ``policy="auto"``):
   each micro-batch is a step of the profile.
6. ``torch.compile`` (``TrainingArguments(torch_compile=True)``) compiles the
   model with its hooks; dynamo cannot trace pushing saved-tensor hooks, so
   the two hooks are excluded from compilation and run eagerly, outside the
   compiled graphs.
7. The plan. Each step's plan (``Auto`` with its profile) is kept in
   :attr:`StashTrainerCallback.plans`; a plan that differs from the last one
   (what it recomputes, where it moves a call site, the limit or budget it
   holds) is logged with its table to the ``tensorstash`` logger, as a
   warning where it does not hold what it was made for.
8. Checkpoints. ``on_save`` writes the profile beside the Trainer's own state,
   in the checkpoint it just saved (``checkpoint-<step>/tensorstash_profile.json``,
   one file per process: ``tensorstash_profile-<rank>.json`` past the first);
   ``on_train_begin`` of a run resumed from a checkpoint under ``output_dir``
   loads it back, so the resumed run plans from what the first one measured.
   A checkpoint saved elsewhere: :meth:`StashTrainerCallback.load_profile`.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorstash.core.policy import Policy
from tensorstash.core.stats import StashStats
from tensorstash.integrations._plans import PlanLog
from tensorstash.planning.auto import Auto
from tensorstash.planning.profile import Profile
from tensorstash.session.stash import DEFAULT_MIN_BYTES, Session, resolve, stash

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:
    raise ImportError(
        "tensorstash.hf needs Hugging Face transformers (and accelerate, which its Trainer "
        "uses), which are not installed: pip install tensorstash[hf]"
    ) from error

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import Trainer

PREFIX = "tensorstash/"
"""What the keys this callback adds to the Trainer's logs start with."""
PROFILE_FILE = "tensorstash_profile.json"
"""The profile's file in a checkpoint (rule 8 of NOTE [ Trainer ])."""


class StashTrainerCallback(TrainerCallback):
    """Stash the forward of every training step of a ``transformers.Trainer``.

    Each training forward (each micro-batch under gradient accumulation) runs
    inside its own ``tensorstash.stash(policy, ...)``; backward runs after it,
    as in a plain loop. Evaluation and prediction are never stashed. See
    NOTE [ Trainer ] in this module.

    Args:
        policy: a policy or its name, as for :func:`tensorstash.stash`.
        min_bytes: tensors smaller than this many bytes are kept as they are.
        workers: threads for compression and reads, per session.
        record: keep a decision log; the last step's rows are in
            ``callback.stats.decisions``.
        profile: the :class:`~tensorstash.Profile` every training forward
            updates; ``None`` makes one for ``Auto`` policies.
        log_stats: add the stats to the Trainer's training logs
            (``tensorstash/host_bytes``, ``tensorstash/compression_ratio``,
            ``tensorstash/wait_seconds``, ...; see :meth:`tensorstash.StashStats.metrics`).

    Attributes:
        stats: the last optimizer step's stats, all its micro-batches together
            (``None`` before the first step ends).
        forwards: how many training forwards ran inside a stash.
        plans: the plans the steps followed (``plans.plan``: the last;
            ``plans.changes``: each new one with its step and table).

    Raises:
        TypeError, ValueError: a bad policy or argument, with what to pass instead.

    Example:
        >>> from tensorstash.hf import StashTrainerCallback
        >>> callback = StashTrainerCallback(tensorstash.Lz4())
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
        >>> trainer.train()
        >>> print(callback.stats.table())

    .. warning::
        The session covers the model's forward. A loss computed outside the
        model (``compute_loss_func``, label smoothing) saves its tensors
        unstashed. A ``KeyboardInterrupt`` inside the forward leaves the
        session open until the next Trainer event or :meth:`close`.
    """

    def __init__(
        self,
        policy: Policy | str = "auto",
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        workers: int = 2,
        record: bool = False,
        profile: Profile | None = None,
        log_stats: bool = True,
    ) -> None:
        if not isinstance(log_stats, bool):
            raise TypeError(
                f"tensorstash.hf.StashTrainerCallback: log_stats must be True or False; "
                f"got {log_stats!r}"
            )
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
        self.stats: StashStats | None = None
        self.forwards = 0
        self._armed = False
        self._handles: list[RemovableHandle] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._step: list[StashStats] = []
        self._interval = StashStats()
        self._interval_steps = 0
        self.plans = PlanLog("tensorstash.hf.StashTrainerCallback")
        self._plan: Any = None

    def __repr__(self) -> str:
        return f"StashTrainerCallback({self.policy!r}, min_bytes={self.min_bytes})"

    def attach(self, trainer: Trainer) -> None:
        """Put this callback first among ``trainer``'s callbacks.

        The reporting integrations (``report_to``: TensorBoard, W&B, ...) come
        before the callbacks given to the Trainer, so they log before this
        callback adds its keys; attached first, its keys reach them too.
        """
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)

    def close(self) -> None:
        """Close the sessions this thread left open (rule 3 of NOTE [ Trainer ]).

        Needed only after a ``KeyboardInterrupt`` inside the model's forward;
        the callback calls it at each Trainer event. Closing twice does nothing.
        """
        open_ = self._open_sessions()
        while open_:
            session = open_.pop()
            if session is not None:
                self._exit(session)

    # Forward hooks (rules 1 to 3) -----------------------------------------------------

    def _open_sessions(self) -> list[Session | None]:
        """This thread's model calls in progress, outermost first: a session or None."""
        open_: list[Session | None] | None = getattr(self._local, "open", None)
        if open_ is None:
            open_ = self._local.open = []
        return open_

    # Run eagerly under torch.compile: dynamo cannot trace pushing hooks (rule 6).
    @torch.compiler.disable
    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        open_ = self._open_sessions()
        nested = bool(open_)
        # Pushed first, so that the forward hook pops this call's entry even if
        # opening the session raises.
        open_.append(None)
        if nested or not self._armed or not module.training or not torch.is_grad_enabled():
            return
        session = stash(
            self.policy,
            min_bytes=self.min_bytes,
            workers=self.workers,
            record=self.record,
            profile=self.profile,
        )
        session.__enter__()
        open_[-1] = session
        self.forwards += 1

    @torch.compiler.disable
    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        open_ = self._open_sessions()
        if open_:
            session = open_.pop()
            if session is not None:
                self._exit(session)

    def _exit(self, session: Session) -> None:
        session.__exit__(None, None, None)
        with self._lock:
            self._step.append(session.stats)
            self._plan = session.plan

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # Trainer events ------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self.close()
        self._armed = False
        self._remove_hooks()
        self._interval, self._interval_steps = StashStats(), 0
        with self._lock:
            self._step = []
        if model is None:
            raise ValueError(
                "tensorstash.hf.StashTrainerCallback: on_train_begin received no model, "
                "whose forward the callback hooks; add the callback to a transformers.Trainer "
                "(Trainer(..., callbacks=[callback])) rather than calling its events yourself"
            )
        self._handles = [
            model.register_forward_pre_hook(self._forward_begins, prepend=True),
            model.register_forward_hook(self._forward_ends, always_call=True),
        ]
        if state.global_step > 0 and self.profile is not None:  # resumed (rule 8)
            self.load_profile(_checkpoint(args, state), args.process_index, missing_ok=True)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the profile into the checkpoint just saved (rule 8 of NOTE [ Trainer ])."""
        if self.profile is None:
            return
        checkpoint = _checkpoint(args, state)
        if not os.path.isdir(checkpoint):
            return  # the Trainer saved nothing here (save_strategy, a hyperparameter search)
        path = os.path.join(checkpoint, _profile_file(args.process_index))
        with open(path + ".tmp", "w") as file:
            json.dump(self.profile.state_dict(), file)
        os.replace(path + ".tmp", path)

    def load_profile(self, checkpoint: str, rank: int = 0, *, missing_ok: bool = False) -> bool:
        """Load the profile ``on_save`` wrote into ``checkpoint`` (a directory), for the
        process of ``rank``; False where there is none and ``missing_ok``.

        Raises:
            FileNotFoundError: no profile there, and not ``missing_ok``.
            ValueError: the callback has no profile to load it into, or the file is not
                a profile's state.
        """
        api = "tensorstash.hf.StashTrainerCallback.load_profile"
        if self.profile is None:
            raise ValueError(
                f"{api}: this callback has no profile to load into; pass "
                "profile=tensorstash.Profile() (or policy='auto')"
            )
        path = os.path.join(checkpoint, _profile_file(rank))
        if not os.path.exists(path):
            if missing_ok:
                return False
            raise FileNotFoundError(
                f"{api}: no tensorstash profile at {path!r}; the callback writes one into "
                "each checkpoint it sees saved (on_save)"
            )
        with open(path) as file:
            self.profile.load_state_dict(json.load(file))
        return True

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()
        self._armed = True

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()
        self._armed = False
        with self._lock:
            parts, self._step = self._step, []
            plan, self._plan = self._plan, None
        self.plans.saw(plan, state.global_step)
        if parts:
            self.stats = parts[0] if len(parts) == 1 else StashStats.combined(parts)
            if self.log_stats:
                self._interval.merge(self.stats, decisions=False)
                self._interval_steps += 1

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()
        self._armed = False
        self._remove_hooks()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.log_stats or logs is None or "loss" not in logs or not self._interval_steps:
            return
        values = self._interval.metrics(PREFIX, per=self._interval_steps)
        self._interval, self._interval_steps = StashStats(), 0
        logs.update(values)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(values)


def _profile_file(rank: int) -> str:
    return PROFILE_FILE if rank == 0 else PROFILE_FILE.replace(".json", f"-{rank}.json")


def _checkpoint(args: TrainingArguments, state: TrainerState) -> str:
    """The directory the Trainer saves the checkpoint of ``state``'s step into."""
    return os.path.join(args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
