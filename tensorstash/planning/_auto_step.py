"""Auto's planning of a session's step (the :class:`~tensorstash.session.quiet.Planning`
the session talks to): at the model's first call it plans, wraps the modules the plan
recomputes, turns a Hugging Face model's key-value cache off, hands the step to plain
autograd where the plan allows (NOTE [ Quiet steps ] in auto.py), and watches the memory
a planned CPU step frees; at the session's exit it puts everything back.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.core.policy import Context
from tensorstash.core.stats import StashStats
from tensorstash.memory import _pool
from tensorstash.memory._trim import Watch
from tensorstash.planning import _limit
from tensorstash.planning._auto_choice import Chooser
from tensorstash.planning._auto_plan import plan_step, plan_within
from tensorstash.planning._select import HOST, parse_bytes
from tensorstash.planning.plan import RETURNS_BELOW, Plan
from tensorstash.planning.profile import signature
from tensorstash.session import _modules
from tensorstash.session.quiet import HOOKED, Control, Opening, State
from tensorstash.tiers.recompute import unwrap_for_plan, warm_up, wrap_for_plan

TRIM_LEAST = 16 << 20
"""The least ``trim_every`` "auto" chooses (NOTE [ Returning memory ] in _trim.py, rule 6)."""

POOL_LEAST = 8 << 20
"""The least cap "auto" gives the session pool (NOTE [ Session pool ] in _pool.py, rule 3)."""


class _AutoState:
    """Per-session state of an :class:`~tensorstash.Auto`: its choice for each tensor
    (``choice``, whose ``choose`` the session calls), and its planning of each step."""

    def __init__(self, auto: Any, ctx: Context) -> None:
        self.auto = auto
        self.profile = ctx.profile  # the context holds this state: no reference back to it
        self.stats = ctx.stats
        self.choice = Chooser(auto, ctx)
        self.choice.moves_out = self._limited_alone
        self.choose = self.choice.choose  # bound once: the session calls it per tensor
        self.planned_for = False  # whether this step's plan was made
        self.recomputed: list[tuple[str, nn.Module]] = []
        self.cache_off: list[Any] = []  # model configs whose use_cache was turned off
        self.watch: Watch | None = None  # returns freed memory in a planned CPU step
        self.control: Control | None = None  # the session's, during its step
        self.opening: Opening = HOOKED
        self.root_hook: Any = None  # the model's pre-hook that may make the step quiet
        self.unobserve: Callable[[], None] = _nothing  # stops observing modules (begin)
        self.device = HOST  # the model's, once planned for

    @property
    def plan(self) -> Plan | None:
        """The plan this step follows, or None."""
        return self.choice.plan

    def begin(self, control: Control, opening: Opening) -> None:
        """Plan when the model is first called (a module observer until then).

        Called before the profile starts timing the step, so this observer
        hears of the model's call before the step's does (``entered``). A
        session that opened quiet follows no module: it plans in the model's
        pre-hook (NOTE [ Quiet steps ] rule 4).
        """
        self.control, self.opening = control, opening
        quiet = opening.state is State.OPENED_QUIET
        profile = self.profile
        if quiet:
            profile.began_quiet()
        # Under a memory limit, a profile's first step holds the limit too (NOTE [ Memory
        # limit ] rule 4): Auto's rule 3 does not keep its tensors whole.
        limited = self.auto._parsed[2] is not None
        self.choice.new_step(profile is not None and profile.learning and not limited)
        if profile is not None and torch.is_grad_enabled():
            if not quiet:
                self.unobserve = _modules.observe(self)
            root = profile.root
            if root is not None:  # NOTE [ Quiet steps ] rule 2
                self.root_hook = root.register_forward_pre_hook(
                    self._model_called, with_kwargs=True
                )

    def _limited_alone(self, device: torch.device) -> None:
        """A session under a limit, without a profile, moves its first tensor out of
        ``device``: it returns the memory it moves from then (NOTE [ Memory limit ] rule 4;
        a thread started every step costs about 0.2 ms, so a step that moves nothing
        starts none)."""
        if self.profile is None and self.choice.limit is not None and self.watch is None:
            self.watch = watch_first(self.auto, self.stats, device.type)

    def woke(self) -> None:
        """The session that opened quiet pushed its hooks before the model's call: plan
        at the first module call, as in a session that opened with them."""
        if not self.planned_for:
            self.unobserve = _modules.observe(self)

    def entered(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The first module called: plan for this step and recompute what the plan says."""
        self.unobserve()
        if self.planned_for or not module.training:
            return
        self.planned_for = True
        profile, choice = self.profile, self.choice
        profile.saw_root(module)
        if self.auto.recompute:
            self._without_cache(module)
        if self.auto._parsed[2] is not None:
            plan = self._within_limit(module, args)
            if plan is None:
                return  # nothing measured yet: this step measures (NOTE [ Memory limit ] 4)
        else:
            if not profile.steps:
                return  # the first step measures
            if choice.budget < 0:
                self.device = _device(module, args)
                choice.resolve_limits(self.device)
            plan = plan_step(self.auto, profile, choice.budget, choice.device_type, module)
        choice.follow(plan)
        if plan is not None:
            if plan.recompute and warm_up():
                # Checkpointing's one-time set-up imports torch._dynamo (a second,
                # 70 MiB): only a plan that recomputes pays it, and not in its step.
                profile.set_up_ran()
            self._recompute(plan.recompute)
            self.watch = watch_memory(self.auto, plan, self.stats, choice.device_type)

    def left(self, module: nn.Module) -> None:
        return None

    def _within_limit(self, root: nn.Module, args: tuple[Any, ...]) -> Plan | None:
        """NOTE [ Memory limit ]: the step's room under the limit (rule 2), refused where
        there is none (rule 5); the plan that fits it (rule 3), or None where no real peak
        was measured yet, the budget then one that surely fits (rule 4)."""
        profile, choice = self.profile, self.choice
        self.device = device = _device(root, args)
        choice.resolve_limits(device, room=0)
        limit = choice.limit
        assert limit is not None
        base = _limit.base_now(device)
        room = limit - base
        if room <= 0:
            _limit.refuse(limit, base, device)
        profile.planned_room(room)
        user = choice.user_budget
        if not any(s.peak_bytes is not None for s in profile.peak_steps()):
            first = _limit.first_budget(room, root)
            choice.set_budget(first if user is None else min(user, first))
            self.watch = watch_first(self.auto, self.stats, device.type)
            return None
        target = room - _limit.margin(room, max(profile.overrun(), _limit.spread(profile)))
        plan = plan_within(self.auto, profile, max(0, target), choice.device_type, root, cap=user)
        if plan is None:
            choice.set_budget(_limit.first_budget(room, root))
            return None
        peak = plan.predicted_peak_bytes
        known = not profile.needs_peak(plan.kind)
        over = peak is not None and peak > target and known
        if over and profile.warn_unreachable(-_limit.rounded(limit)):
            _limit.warn_unreachable(limit, base, plan, room - target)
        plan = dataclasses.replace(plan, limit_bytes=limit, base_bytes=base)
        choice.set_budget(plan.budget)
        return plan

    def _model_called(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """NOTE [ Quiet steps ] rule 2: hand the step to plain autograd where its plan allows."""
        self._drop_root_hook()
        session = self.control
        if session is not None and session.opened_quiet:
            self._called_quiet(session, module, args, kwargs)
            return
        plan, profile = self.plan, self.profile
        if not profile.model_called(signature(args, kwargs)):
            return
        if plan is None or not plan.quiet or self._peak_due(plan):
            return
        if session is None or not session.go_quiet():
            return
        paths = tuple(path for path, _ in self.recomputed)
        self._quiet_from_here(profile.went_quiet(module, paths, timed=self.watch is not None))

    def _called_quiet(
        self, session: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """NOTE [ Quiet steps ] rule 4: the model's call in a session that opened quiet."""
        self.entered(module, args)  # no module observer told it of the call
        plan, profile = self.plan, self.profile
        inputs = signature(args, kwargs)
        if (
            plan is not None
            and plan.quiet
            and not self._peak_due(plan)
            and profile.stays_quiet(module, inputs)
            and session.stay_quiet()
        ):
            paths = tuple(path for path, _ in self.recomputed)
            opened = (self.device, self.stats)
            timed = self.watch is not None
            self._quiet_from_here(profile.went_quiet(module, paths, timed=timed, opened=opened))
        elif session.wake(module, args):
            # What a step that began at the session's open took at the model's call.
            if self.planned_for:
                profile.recomputing(
                    tuple(path for path, _ in self.recomputed),
                    self._moves(),
                    peak=self.auto._parsed[2] is not None,
                )
            profile.model_called(inputs)

    def _peak_due(self, plan: Plan) -> bool:
        """Under a memory limit, whether a step of ``plan`` takes the real peak: fewer than
        PEAK_SAMPLES steps of its kind did (NOTE [ Memory limit ] rule 3), and a quiet
        step takes none; nor does a plan predicted far under its room."""
        if plan.limit_bytes is None or plan.base_bytes is None:  # no limit: no peaks due
            return False
        peak = plan.predicted_peak_bytes
        room = plan.limit_bytes - plan.base_bytes
        if peak is not None and peak < _limit.LOOSE_SHARE * room:
            return False
        return self.profile.needs_peak(plan.kind)

    def _quiet_from_here(self, quiet: Any) -> None:
        """The step went quiet (``quiet``: its timing, or None where it is not timed)."""
        if self.watch is not None and quiet is not None:
            # The stats count nothing now: trim until the backward through the output ends,
            # and let the session pool go then, not at the watch's next look.
            self.watch.holding = lambda: not quiet.ended
            if self.watch.lease is not None:
                quiet.when_ended.append(self.watch.lease.close)

    def _drop_root_hook(self) -> None:
        if self.root_hook is not None:
            self.root_hook.remove()
            self.root_hook = None

    def end(self) -> None:
        """The session exits: give every module back, and the session's control."""
        self._drop_root_hook()
        self.unobserve()
        control, self.control = self.control, None
        if control is not None and control.opened_quiet:
            self.profile.did_not_stay_quiet()  # the model was never called, or could not decide
        if self.watch is not None:
            self.watch.exited()  # it stops when the step's saved tensors are freed
            self.watch = None
        for _, module in self.recomputed:
            unwrap_for_plan(module)
        self.recomputed = []
        for config in self.cache_off:
            config.use_cache = True
        self.cache_off = []
        self.planned_for = False

    def _recompute(self, paths: tuple[str, ...]) -> None:
        profile = self.profile
        for path in paths:
            module = profile.module(path)
            if module is not None and wrap_for_plan(module, profile.clock):
                self.recomputed.append((path, module))
        limited = self.auto._parsed[2] is not None
        profile.recomputing(tuple(path for path, _ in self.recomputed), self._moves(), peak=limited)

    def _moves(self) -> frozenset[str]:
        """The stats' tiers the plan moves bytes to, as a step's record will name them."""
        plan = self.plan
        return plan.moved_tiers if plan is not None else frozenset()

    def _without_cache(self, root: nn.Module) -> None:
        """Run a Hugging Face model's training forward without its key-value cache.

        A recomputed region keeps its inputs, and a cache passed from layer to
        layer would keep every layer's keys and values alive through it; Hugging
        Face's own gradient checkpointing turns the cache off for this reason.
        Turned off in every training step of a plan, the first included, so the
        steps it measures are the steps it runs. The configs are those of the
        model and of every module in it: a model of the user's own that wraps
        a Hugging Face one has none at its root, and its cache would stay on
        (docs/figures/auto.md has what that held).
        """
        for config in _cache_configs(root):
            if config.use_cache is True:
                config.use_cache = False
                self.cache_off.append(config)


def watch_memory(auto: Any, plan: Plan, stats: StashStats, device_type: str) -> Watch | None:
    """Lease the session pool, or else trim, while a CPU step whose plan frees memory
    runs (NOTE [ Session pool ] in _pool.py; NOTE [ Returning memory ], 6): the step's
    started ``Watch``, or None."""
    every = auto.trim_every
    if every is None or device_type != "cpu" or not plan.returns_memory:
        return None
    activation, auto_every = plan.activation_bytes, every == "auto"
    if auto_every:
        every = max(POOL_LEAST, activation // 4)  # the pool's cap
    every = int(parse_bytes(every, "tensorstash.Auto", "trim_every"))
    lease = _pool.lease(every) if _pool.compiled is not None else None
    if lease is None and auto_every:
        # No pool, or another allocator holds the CPU (NOTE [ Session pool ] rule 5):
        # trim, and only where the plan frees enough (a plan made for the pool may not).
        if plan.held_bytes > RETURNS_BELOW * activation:
            return None
        every = max(TRIM_LEAST, activation * 3 // 4)
    watch = Watch(every, lambda: _holding(stats), counted=stats.returned, lease=lease)
    watch.start()
    return watch


def watch_first(auto: Any, stats: StashStats, device_type: str) -> Watch | None:
    """Return the memory a CPU step with nothing measured moves out, from its first tensor
    (NOTE [ Memory limit ] rule 4): what its tensors held would else stay in the heap, and
    a step that moves them would hold as much as one that keeps them."""
    if auto.trim_every is None or device_type != "cpu":
        return None
    every = POOL_LEAST if auto.trim_every == "auto" else auto.trim_every
    every = int(parse_bytes(every, "tensorstash.Auto", "trim_every"))
    lease = _pool.lease(every) if _pool.compiled is not None else None
    if lease is None and auto.trim_every == "auto":
        every = TRIM_LEAST
    watch = Watch(every, lambda: _holding(stats), counted=stats.returned, lease=lease)
    watch.start()
    return watch


def _holding(stats: StashStats) -> bool:
    """Whether a session still holds saved tensors; read from another thread.

    The kept bytes are the tier's plus the hot path's (``StashStats.fold``
    moves them), less the kept tensors freed and not yet taken off. A read
    that races with a fold may be off for one poll: the answer only decides
    when a ``Watch`` stops.
    """
    hot = stats.hot
    live = hot.live + sum(tier.live_bytes for tier in stats.tiers.values())
    try:
        live -= hot.pending()
    except RuntimeError:  # the queue changed while copied: ask again next time
        return True
    return live > 0


_configs: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _cache_configs(root: nn.Module) -> tuple[Any, ...]:
    """The distinct configs with a ``use_cache`` of ``root`` and the modules in it.

    Found once per model: a module tree is walked when a model is first planned for.
    """
    found = _configs.get(root)
    if found is None:
        seen: dict[int, Any] = {}
        for module in root.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                seen.setdefault(id(config), config)
        found = _configs[root] = tuple(seen.values())
    return found


def _nothing() -> None:
    return None


def _device(root: nn.Module, args: tuple[Any, ...]) -> torch.device:
    """The device a step of ``root`` called with ``args`` runs on."""
    device = next((a.device for a in args if isinstance(a, Tensor)), None)
    if device is None:
        device = next((p.device for p in root.parameters()), HOST)
    return device
