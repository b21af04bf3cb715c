"""Autograd's harder cases under every policy, each checked against plain autograd.

retain_graph, double backward, several forwards, torch.func (vmap; grad inside
``ts.pause()``), autocast, in-place changes after a save, release of every
resource (after backward and after an exception), the decorator form, nested
sessions and dedupe of a tensor saved twice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    SEED,
    GradMap,
    PolicySpec,
    assert_grads_equal,
    assert_tensors_equal,
    assert_went_to,
    collect_grads,
    fresh_inputs,
    leak_check,
    run_case,
    tier_counts,
    top_saved_tensors_hooks,
    within,
)
from torch import Tensor
from zoo import Boom, Case, Explodes, embedding, mlp, tanh_mlp, transformer, wide_batchnorm

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


REPEATS = 3


def stash(policy: Any) -> Any:
    """A session that sends every saved tensor through ``policy``."""
    return ts.stash(policy, min_bytes=0)


# -- retain_graph ---------------------------------------------------------------------


def two_backwards(case: Case, ctx: Any = None) -> tuple[GradMap, GradMap]:
    """Gradients after ``backward(retain_graph=True)`` and after a second backward."""
    case.model.zero_grad(set_to_none=True)
    leaves = fresh_inputs(case.inputs)
    torch.manual_seed(SEED)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = case.loss(case.model(*leaves))
    loss.backward(retain_graph=True)
    first = collect_grads(case.model, leaves)
    loss.backward()
    return first, collect_grads(case.model, leaves)


def test_retain_graph_first_backward_equal_plain(policy: Any) -> None:
    expected, _ = two_backwards(transformer())
    actual, _ = two_backwards(transformer(), stash(policy))
    assert_grads_equal(expected, actual)


def test_retain_graph_second_backward_equal_plain(policy: Any) -> None:
    _, expected = two_backwards(transformer())
    _, actual = two_backwards(transformer(), stash(policy))
    assert_grads_equal(expected, actual)


def test_retain_graph_released_when_graph_freed(policy: Any, spill_dirs: list[Path]) -> None:
    case = mlp()
    session = stash(policy)
    with session:
        loss = case.step()
    loss.backward(retain_graph=True)
    assert session.stats.live_bytes > 0, "a retained graph should still hold its saved tensors"
    del loss
    leak_check(session, directories=spill_dirs)


# -- double backward --------------------------------------------------------------------


def penalty_grads(case: Case, ctx: Any = None) -> GradMap:
    """A gradient penalty: the loss includes ``|d out / d x|^2`` (create_graph=True).

    The whole step, first-order grad included, runs inside ``ctx``, so the
    tensors saved by the backward graph of the first grad go through it too.
    """
    case.model.zero_grad(set_to_none=True)
    (x,) = fresh_inputs(case.inputs)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = case.model(x)
        (grad_x,) = torch.autograd.grad(case.loss(out), x, create_graph=True)
        loss = out.square().mean() + grad_x.square().sum()
    loss.backward()
    return collect_grads(case.model, (x,))


def test_double_backward_gradient_penalty_equal_plain(policy: Any) -> None:
    expected = penalty_grads(tanh_mlp())
    actual = penalty_grads(tanh_mlp(), stash(policy))
    assert_grads_equal(expected, actual)


# -- several forwards ---------------------------------------------------------------------


def several_forwards(case: Case, ctx: Any = None, count: int = 3) -> GradMap:
    """``count`` forwards on different inputs, then one backward of their summed losses."""
    case.model.zero_grad(set_to_none=True)
    (x,) = case.inputs
    leaves = fresh_inputs([x * (k + 1) for k in range(count)])
    torch.manual_seed(SEED)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = sum(case.loss(case.model(leaf)) for leaf in leaves)
    assert isinstance(loss, Tensor)
    loss.backward()
    return collect_grads(case.model, leaves)


def test_several_forwards_one_backward_equal_plain(policy: Any) -> None:
    expected = several_forwards(transformer())
    actual = several_forwards(transformer(), stash(policy))
    assert_grads_equal(expected, actual)


# -- torch.func ---------------------------------------------------------------------------


def vmap_grads(case: Case, ctx: Any = None) -> GradMap:
    """The model applied per sample with ``torch.func.vmap``, then a regular backward."""
    case.model.zero_grad(set_to_none=True)
    leaves = fresh_inputs(case.inputs)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = case.loss(torch.func.vmap(case.model)(*leaves))
    loss.backward()
    return collect_grads(case.model, leaves)


def test_vmap_inside_stash_equal_plain(policy: Any) -> None:
    expected = vmap_grads(mlp())
    actual = vmap_grads(mlp(), stash(policy))
    assert_grads_equal(expected, actual)


def input_gradient(case: Case) -> Callable[[Tensor], Tensor]:
    """``torch.func.grad`` of the loss with respect to the model's input."""
    return torch.func.grad(lambda x: case.loss(case.model(x)))


def func_grad_step(
    case: Case, ctx: Any = None, pause: Callable[[], Any] = contextlib.nullcontext
) -> tuple[Tensor, GradMap]:
    """A stashed forward with a ``torch.func.grad`` call in the middle (inside ``pause``).

    Returns the input gradient that ``torch.func.grad`` computed and the
    gradients of the step, whose loss uses it (so backward also runs through
    the graph built under ``pause``).
    """
    case.model.zero_grad(set_to_none=True)
    (x,) = fresh_inputs(case.inputs)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = case.model(x)
        with pause():
            grad_x = input_gradient(case)(x.detach())
        loss = case.loss(out) + (grad_x * x).sum()
    loss.backward()
    return grad_x.detach().clone(), collect_grads(case.model, (x,))


def test_func_grad_inside_pause_result_equal_plain(policy: Any) -> None:
    expected, _ = func_grad_step(mlp())
    actual, _ = func_grad_step(mlp(), stash(policy), ts.pause)
    assert_tensors_equal(expected, actual, "torch.func.grad's result")


def test_func_grad_inside_pause_step_grads_equal_plain(policy: Any) -> None:
    _, expected = func_grad_step(mlp())
    _, actual = func_grad_step(mlp(), stash(policy), ts.pause)
    assert_grads_equal(expected, actual)


def test_func_grad_without_pause_raises(policy: Any) -> None:
    # Documents why ts.pause() exists: torch.func.grad refuses to run while any
    # saved-tensor hooks are pushed.
    case = mlp()
    (x,) = fresh_inputs(case.inputs)
    with stash(policy), pytest.raises(RuntimeError, match="saved tensor hooks"):
        input_gradient(case)(x.detach())


def test_pause_region_bypasses_session(policy: Any) -> None:
    case = mlp()
    session = stash(policy)
    with session, ts.pause():
        loss = case.step()
    loss.backward()
    assert sum(tier_counts(session).values()) == 0, session.stats.table()


def test_pause_region_grads_equal_plain(policy: Any) -> None:
    expected = run_case(mlp())
    actual = run_case(mlp(), within(stash(policy), ts.pause()))
    assert_grads_equal(expected, actual)


def test_pause_restores_session_after_region(spec: PolicySpec, policy: Any) -> None:
    case = mlp()
    session = stash(policy)
    with session:
        with ts.pause():
            pass
        loss = case.step()
    loss.backward()
    assert_went_to(session, spec.tier)


# -- autocast -----------------------------------------------------------------------------


def autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_autocast_bf16_equal_plain(policy: Any) -> None:
    expected = run_case(transformer(), autocast())
    actual = run_case(transformer(), within(stash(policy), autocast()))
    assert_grads_equal(expected, actual)


def test_autocast_bf16_embedding_equal_plain(policy: Any) -> None:
    expected = run_case(embedding(), autocast())
    actual = run_case(embedding(), within(stash(policy), autocast()))
    assert_grads_equal(expected, actual)


# -- buffers changed without a version bump -------------------------------------------


def test_batchnorm_running_stats_updated_after_save_equal_plain(policy: Any) -> None:
    # BatchNorm updates its running stats after autograd saved them (see
    # zoo.wide_batchnorm). Whether background work reads them before, during
    # or after the update is a race, so several steps are run.
    plain, stashed = wide_batchnorm(), wide_batchnorm()
    for _ in range(4):
        assert_grads_equal(run_case(plain), run_case(stashed, stash(policy)))


# -- in-place changes after a save ------------------------------------------------------


def modify_saved_input() -> Tensor:
    x = torch.randn(256, 256, requires_grad=True)
    y = x * 2
    z = y.sin()  # saves y
    y.add_(1)
    return z.sum()


def modify_saved_output() -> Tensor:
    x = torch.randn(256, 256, requires_grad=True)
    z = (x * 2).exp()  # saves its result z
    z.mul_(2)
    return z.sum()


def modify_base_of_saved_view() -> Tensor:
    x = torch.randn(256, 256, requires_grad=True)
    y = x * 2
    z = y[::2, 1:].sin()  # saves a view of y
    y.add_(1)
    return z.sum()


def modify_view_of_saved_tensor() -> Tensor:
    x = torch.randn(256, 256, requires_grad=True)
    y = x * 2
    z = y.sin()  # saves y
    y[:, 0].zero_()
    return z.sum()


INPLACE = [
    pytest.param(modify_saved_input, id="input"),
    pytest.param(modify_saved_output, id="output"),
    pytest.param(modify_base_of_saved_view, id="base-of-view"),
    pytest.param(modify_view_of_saved_tensor, id="view"),
]


@pytest.mark.parametrize("step", INPLACE)
def test_inplace_after_save_raises(policy: Any, step: Callable[[], Tensor]) -> None:
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step().backward()  # the oracle: plain autograd raises
    with stash(policy):
        loss = step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# -- releasing resources ---------------------------------------------------------------


def test_backward_releases_everything(policy: Any, spill_dirs: list[Path]) -> None:
    case = mlp()
    session = stash(policy)
    with session:
        loss = case.step()
    assert session.stats.live_bytes > 0, "the forward should hold its saved tensors"
    loss.backward()
    del loss
    leak_check(session, directories=spill_dirs)


def explode(case: Case, session: Any, error: type[BaseException] = Boom) -> None:
    """A forward under ``session`` that raises ``error`` after the model saved its tensors."""
    with pytest.raises(error), session:
        Explodes(case.model, error)(*fresh_inputs(case.inputs))


ERRORS = [
    pytest.param(Boom, id="exception"),
    pytest.param(KeyboardInterrupt, id="keyboard-interrupt"),
]


@pytest.mark.parametrize("error", ERRORS)
def test_exception_mid_forward_pops_hooks(policy: Any, error: type[BaseException]) -> None:
    explode(mlp(), stash(policy), error)
    assert top_saved_tensors_hooks() is None


@pytest.mark.parametrize("error", ERRORS)
def test_exception_mid_forward_leaves_nothing_behind(
    policy: Any, spill_dirs: list[Path], error: type[BaseException]
) -> None:
    session = stash(policy)
    explode(mlp(), session, error)
    assert sum(tier_counts(session).values()) > 0, "the forward should have saved tensors"
    leak_check(session, directories=spill_dirs)


def test_exception_mid_forward_next_step_equal_plain(policy: Any) -> None:
    expected = run_case(mlp())
    case = mlp()
    explode(case, stash(policy))
    assert_grads_equal(expected, run_case(case, stash(policy)))


# -- the decorator ---------------------------------------------------------------------


def decorated_step(case: Case, session: Any) -> Callable[[], GradMap]:
    """A training step whose forward is a function decorated with ``session``."""

    @session
    def forward(*inputs: Tensor) -> Tensor:
        return case.loss(case.model(*inputs))

    def step() -> GradMap:
        case.model.zero_grad(set_to_none=True)
        leaves = fresh_inputs(case.inputs)
        torch.manual_seed(SEED)
        forward(*leaves).backward()
        return collect_grads(case.model, leaves)

    return step


def test_stash_decorator_grads_equal_plain(policy: Any) -> None:
    expected = run_case(transformer())
    step = decorated_step(transformer(), stash(policy))
    assert_grads_equal(expected, step())


def test_stash_decorator_works_on_every_call(policy: Any) -> None:
    expected = run_case(transformer())
    step = decorated_step(transformer(), stash(policy))
    step()
    assert_grads_equal(expected, step())


def test_stash_decorator_counts_in_session(spec: PolicySpec, policy: Any) -> None:
    session = stash(policy)
    decorated_step(mlp(), session)()
    assert_went_to(session, spec.tier)


def test_stash_decorator_pops_hooks(policy: Any) -> None:
    @stash(policy)
    def forward() -> None:
        assert top_saved_tensors_hooks() is not None

    forward()
    assert top_saved_tensors_hooks() is None


DEPTH = 3


def recursive_step(case: Case, session: Any = None) -> GradMap:
    """A step whose forward applies the model ``DEPTH + 1`` times through a function that
    calls itself, decorated with ``session`` (plain autograd without): its gradients."""

    def deep(depth: int, x: Tensor) -> Tensor:
        y = case.model(x)
        return y if depth == 0 else forward(depth - 1, y)

    forward = deep if session is None else session(deep)
    case.model.zero_grad(set_to_none=True)
    leaves = fresh_inputs(case.inputs)
    torch.manual_seed(SEED)
    case.loss(forward(DEPTH, *leaves)).backward()
    return collect_grads(case.model, leaves)


def test_stash_decorated_function_calls_itself_grads_equal_plain(
    spec: PolicySpec, policy: Any, spill_dirs: list[Path]
) -> None:
    expected = recursive_step(transformer())
    session = stash(policy)
    assert_grads_equal(expected, recursive_step(transformer(), session))
    assert_went_to(session, spec.tier)
    once, case = stash(policy), transformer()
    with once:  # one application of the model, as each call makes
        case.model(*fresh_inputs(case.inputs))
    assert sum(tier_counts(session).values()) == (DEPTH + 1) * sum(tier_counts(once).values())
    leak_check(session, once, directories=spill_dirs)


def test_stash_decorated_function_on_two_threads_at_once_grads_equal_plain(
    spec: PolicySpec, policy: Any, spill_dirs: list[Path]
) -> None:
    expected = run_case(mlp())
    once = stash(policy)
    run_case(mlp(), once)
    cases = [mlp(), mlp()]  # a model each: backward accumulates into its parameters
    both_open = threading.Barrier(2, timeout=60)
    session = stash(policy)

    @session
    def forward(case: Case, *inputs: Tensor) -> Tensor:
        loss = case.loss(case.model(*inputs))
        both_open.wait()  # each thread's call holds its session open here at once
        return loss

    grads: list[list[GradMap]] = [[], []]
    errors: list[BaseException] = []

    def steps(index: int) -> None:
        case = cases[index]
        try:
            for _ in range(REPEATS):
                case.model.zero_grad(set_to_none=True)
                leaves = fresh_inputs(case.inputs)
                forward(case, *leaves).backward()
                grads[index].append(collect_grads(case.model, leaves))
        except BaseException as error:  # reported on the main thread
            errors.append(error)
            both_open.abort()

    threads = [threading.Thread(target=steps, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, f"a thread failed: {errors[0]!r}"
    for actual in (*grads[0], *grads[1]):
        assert_grads_equal(expected, actual)
    assert len(grads[0]) == len(grads[1]) == REPEATS
    assert_went_to(session, spec.tier)
    total = sum(tier_counts(session).values())
    assert total == 2 * REPEATS * sum(tier_counts(once).values()), session.stats.table()
    leak_check(session, once, directories=spill_dirs)


# -- nested sessions -------------------------------------------------------------------


def nested_step(x0: Tensor, outer: Any, inner: Any) -> Tensor:
    """Three saves: ``x`` and ``c`` under ``outer``, ``a`` under ``inner``."""
    with outer:
        x = x0 * 1.5  # saves nothing (a Python scalar)
        a = x.sin()  # saves x
        with inner:
            b = a.cos()  # saves a
        c = b.exp()  # saves its result c
    return c.sum()


def test_nested_stash_inner_region_counted_by_inner_only(policy: Any) -> None:
    x0 = torch.randn(256, 256, requires_grad=True)
    outer, inner = stash(policy), stash(ts.Keep())
    nested_step(x0, outer, inner).backward()
    assert tier_counts(inner) == {"kept": 1, "host": 0, "disk": 0}, inner.stats.table()
    assert sum(tier_counts(outer).values()) == 2, outer.stats.table()


def test_nested_stash_grads_equal_plain(policy: Any) -> None:
    torch.manual_seed(SEED)
    x = torch.randn(256, 256)
    plain = x.clone().requires_grad_()
    nested_step(plain, contextlib.nullcontext(), contextlib.nullcontext()).backward()
    stashed = x.clone().requires_grad_()
    nested_step(stashed, stash(policy), stash(ts.Keep())).backward()
    assert_grads_equal({"input:0": plain.grad}, {"input:0": stashed.grad})


def test_nested_stash_outer_restored_after_inner(spec: PolicySpec, policy: Any) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    outer = stash(policy)
    with outer:
        with stash(ts.Keep()):
            pass
        # relu saves its result, half zeros: compressible, so lz4 does not keep it raw.
        # Two of them: a deferring selector keeps the one saved last.
        loss = torch.relu(torch.relu(x * 1.5) - 0.1).sum()
    loss.backward()
    assert_went_to(outer, spec.tier)


# -- the same tensor saved twice ------------------------------------------------------


def shared_operand(h0: Tensor, a0: Tensor, b0: Tensor) -> Tensor:
    """``h @ a + h @ b``: the two matmuls save ``h`` twice, ``a`` and ``b`` once."""
    h, a, b = h0.clone(), a0.clone(), b0.clone()  # clone saves nothing
    return (h @ a + h @ b).sum()


def shared_inputs() -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(SEED)
    return (
        torch.randn(128, 256, requires_grad=True),
        torch.randn(256, 128, requires_grad=True),
        torch.randn(256, 128, requires_grad=True),
    )


def test_same_tensor_saved_twice_deduplicated(policy: Any) -> None:
    session = stash(policy)
    with session:
        loss = shared_operand(*shared_inputs())
    loss.backward()
    assert session.stats.to_dict()["deduplicated"] >= 1, session.stats.table()


def test_same_tensor_saved_twice_packed_once(policy: Any) -> None:
    session = stash(policy)
    with session:
        loss = shared_operand(*shared_inputs())
    loss.backward()
    # Three distinct tensors (h, a, b) reach the session four times.
    assert sum(tier_counts(session).values()) == 3, session.stats.table()


def test_same_tensor_saved_twice_grads_equal_plain(policy: Any) -> None:
    plain = shared_inputs()
    shared_operand(*plain).backward()
    stashed = shared_inputs()
    with stash(policy):
        loss = shared_operand(*stashed)
    loss.backward()
    names = ("input:0", "input:1", "input:2")
    assert_grads_equal(
        {n: t.grad for n, t in zip(names, plain, strict=True)},
        {n: t.grad for n, t in zip(names, stashed, strict=True)},
    )


# -- unpacking more than once ------------------------------------------------------------


def test_saved_tensor_unpacked_twice_equal_original(policy: Any) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with stash(policy):
        y = x.clone()
        z = y.sin()  # saves y
    first = z.grad_fn._saved_self
    second = z.grad_fn._saved_self
    assert_tensors_equal(y.detach(), first, "the first unpack of a saved tensor")
    assert_tensors_equal(y.detach(), second, "the second unpack of a saved tensor")


def relu_base() -> Tensor:
    """A 256 x 256 tensor with a graph, half zeros (so lz4 compresses it rather than keep it)."""
    return torch.relu(torch.randn(256, 256, requires_grad=True) * 1.5)


VIEWS = [
    pytest.param(lambda t: t.t(), id="transpose"),
    pytest.param(lambda t: t[:, :1].expand(-1, 256), id="expand"),
    pytest.param(lambda t: t[1::3, 2:], id="slice-at-offset"),
    pytest.param(lambda t: t.narrow(1, 3, 2), id="narrow"),
    pytest.param(
        lambda t: t.view(16, 16, 16, 16).contiguous(memory_format=torch.channels_last),
        id="channels-last",
    ),
]


@pytest.mark.parametrize("make_view", VIEWS)
def test_saved_view_unpacked_with_same_geometry(
    policy: Any, make_view: Callable[[Tensor], Tensor]
) -> None:
    with stash(policy):
        view = make_view(relu_base())
        out = view.sin()  # saves the view
    assert_tensors_equal(view.detach(), out.grad_fn._saved_self, "the unpacked view")
