"""The session's rules: eligibility, dedupe, arguments, nesting, pause (NOTE [ Session ])."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import tensorstash as ts


def hooks_pushed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class Doubled(torch.Tensor):
    """A tensor subclass: policies must leave it untouched."""


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: torch.randn(64, 64).to_sparse(), "sparse_coo layout"),
        (lambda: torch.randn(64, 64).to_sparse_csr(), "sparse_csr layout"),
        (lambda: torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.randn(64, 64, dtype=torch.complex64).conj(), "conjugate or negative view"),
        (lambda: torch.randn(64, 64).as_subclass(Doubled), "tensor subclass"),
        (lambda: torch.empty(64, 64, device="meta"), "meta device"),
    ],
)
def test_session_keeps_tensors_no_policy_can_handle(make: object, reason: str) -> None:
    tensor = make()  # type: ignore[operator]
    session = ts.stash("disk", min_bytes=0)
    saved = session.pack(tensor)
    assert session.unpack(saved) is not None
    assert session.stats.skipped[reason] == 1
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 0


def test_session_keeps_nested_tensors_untouched() -> None:
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    session = ts.stash("lz4", min_bytes=0)
    assert session.unpack(session.pack(nested)) is not None
    assert session.stats.skipped["nested tensor"] == 1


def test_session_keeps_parameters_and_their_views() -> None:
    linear = torch.nn.Linear(256, 256)
    with ts.stash("disk", min_bytes=0) as session:
        hidden = torch.randn(4, 256, requires_grad=True) * 1
        linear(hidden).sum().backward()
    assert session.stats.skipped["parameter"] >= 1
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 1  # the input only


def test_session_keeps_tensors_under_min_bytes() -> None:
    x = torch.randn(100, requires_grad=True)
    with ts.stash("disk", min_bytes=1024) as session:
        (x * 2).sin().sum().backward()
    assert session.stats.skipped["under min_bytes"] == 1
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 0


def test_session_packs_a_storage_saved_twice_once() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    a = torch.randn(256, 256, requires_grad=True)
    b = torch.randn(256, 256, requires_grad=True)

    def step() -> list[torch.Tensor]:
        h = x * 2  # saved by both matmuls
        ((h @ a).sum() + (h @ b).sum()).backward()
        grads = [t.grad.clone() for t in (x, a, b)]
        for t in (x, a, b):
            t.grad = None
        return grads

    expected = step()
    with ts.stash("disk", min_bytes=0) as session:
        actual = step()
    assert session.stats.deduplicated == 1
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 1
    for e, a_ in zip(expected, actual, strict=True):
        assert torch.equal(e, a_)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "zip"}, ValueError, "unknown policy name 'zip'"),
        ({"policy": 3}, TypeError, "policy must be a policy object"),
        ({"policy": "keep", "min_bytes": -1}, ValueError, "min_bytes must be at least 0 bytes"),
        ({"policy": "keep", "min_bytes": 1.5}, TypeError, "min_bytes"),
        ({"policy": "keep", "workers": 0}, TypeError, "workers must be a positive int"),
    ],
)
def test_stash_rejects_bad_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ts.stash(**kwargs)  # type: ignore[arg-type]


def test_the_name_auto_is_one_auto_whose_sessions_keep_their_own_steps() -> None:
    # stash("auto") at every step parses nothing again; each session plans from its own profile.
    assert ts.stash("auto").policy is ts.stash().policy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(512, 64)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    profiles = [ts.Profile(), ts.Profile()]
    for step in range(4):
        for profile in profiles[: 1 + step % 2]:
            model.zero_grad(set_to_none=True)
            with ts.stash("auto", profile=profile):
                loss = model(x).sum()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            assert all(torch.equal(e, g) for e, g in zip(expected, grads, strict=True))
    assert [p.steps for p in profiles] == [4, 2]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: ts.Chain(), ValueError, "no stages"),
        (lambda: ts.Chain(ts.DiskSpill(), ts.Lz4()), ValueError, "out of order"),
        (lambda: ts.Chain(ts.Lz4(), ts.Lz4()), ValueError, "out of order"),
        (lambda: ts.Chain(ts.Keep(), ts.DiskSpill()), TypeError, "cannot be a stage"),
        (lambda: ts.Chain("lz4"), TypeError, "cannot be a stage"),
        (lambda: ts.Lz4(acceleration=0), ValueError, "acceleration must be >= 1"),
        (lambda: ts.Lz4(acceleration="fast"), TypeError, "acceleration must be an int"),
        (lambda: ts.CpuOffload(pin_memory="yes"), TypeError, "pin_memory must be True or False"),
        (lambda: ts.DiskSpill(directory=3), TypeError, "directory must be a path"),
        (lambda: ts.DiskSpill(directory="/no/such/dir"), ValueError, "cannot be used"),
    ],
)
def test_policies_reject_bad_arguments(make: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_chain_flattens_nested_chains() -> None:
    chain = ts.Chain(ts.CpuOffload(), ts.Chain(ts.Lz4(), ts.DiskSpill()))
    assert [type(s) for s in chain.stages] == [ts.CpuOffload, ts.Lz4, ts.DiskSpill]


def test_inner_session_wins_in_its_region() -> None:
    x = torch.randn(128, 128, requires_grad=True)
    with ts.stash("disk", min_bytes=0) as outer:
        a = (x * 2).sin()
        with ts.stash("keep", min_bytes=0) as inner:
            b = (x * 3).sin()
        c = (x * 4).sin()
    (a + b + c).sum().backward()
    assert outer.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    assert inner.stats.to_dict()["tiers"]["kept"]["tensors"] == 1
    assert not hooks_pushed()


def test_pause_saves_as_plain_autograd_and_restores_the_session() -> None:
    x = torch.randn(128, 128, requires_grad=True)
    with ts.stash("disk", min_bytes=0) as session:
        with ts.pause():
            assert not hooks_pushed()
            y = (x * 2).sin()
        assert hooks_pushed()
    y.sum().backward()
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 0
    assert not hooks_pushed()


def test_stash_works_as_a_decorator_more_than_once() -> None:
    session = ts.stash("disk", min_bytes=0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin().sum()

    x = torch.randn(64, 64, requires_grad=True)
    forward(x).backward()
    forward(x).backward()
    expected, x.grad = x.grad, None
    stashed = session(forward)
    stashed(x).backward()
    stashed(x).backward()
    assert torch.equal(x.grad, expected)
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    assert not hooks_pushed()


def test_session_entered_inside_itself_raises_and_says_what_to_do() -> None:
    x = torch.randn(128, 128, requires_grad=True)
    session = ts.stash("disk", min_bytes=0)
    with session:
        y = (x * 2).sin()
        with pytest.raises(RuntimeError, match=r"open already on this thread.*decorate"), session:
            pass
        z = (y * 3).cos()
    z.sum().backward()
    expected = x.detach().clone().requires_grad_()
    ((expected * 2).sin() * 3).cos().sum().backward()
    assert torch.equal(x.grad, expected.grad)
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    assert not hooks_pushed()
    with session:  # closed again: it opens as before
        assert hooks_pushed()


def test_session_entered_on_two_threads_at_once_raises_on_the_second() -> None:
    session = ts.stash("disk", min_bytes=0)
    opened, tried = threading.Event(), threading.Event()
    seen: list[BaseException] = []

    def other() -> None:
        assert opened.wait(30)
        try:
            with session:
                pass
        except RuntimeError as error:
            seen.append(error)
        tried.set()

    thread = threading.Thread(target=other)
    thread.start()
    x = torch.randn(128, 128, requires_grad=True)
    with session:
        opened.set()
        assert tried.wait(30)
        y = (x * 2).sin()
    thread.join(30)
    y.sum().backward()
    assert len(seen) == 1 and "open on another thread" in str(seen[0]), seen
    assert "decorate the function" in str(seen[0])
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 1


def test_decorated_function_calls_itself_under_pause_in_a_session_of_its_own() -> None:
    session = ts.stash("disk", min_bytes=0)
    seen: list[bool] = []

    @session
    def deep(depth: int, x: torch.Tensor) -> torch.Tensor:
        seen.append(hooks_pushed())
        y = (x * 2).sin()
        if depth == 0:
            return y
        with ts.pause():  # the call inside opens its own session: nothing else is pushed
            return deep(depth - 1, y)

    x = torch.randn(64, 64, requires_grad=True)
    deep(2, x).sum().backward()
    expected = x.detach().clone().requires_grad_()
    (((expected * 2).sin() * 2).sin() * 2).sin().sum().backward()
    assert torch.equal(x.grad, expected.grad)
    assert seen == [True, True, True]
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 3
    assert not hooks_pushed()


def test_decorated_function_with_a_profile_on_two_threads_at_once_raises() -> None:
    model = torch.nn.Linear(64, 64)
    session = ts.stash("auto", profile=ts.Profile())
    opened, tried = threading.Event(), threading.Event()

    @session
    def forward(x: torch.Tensor, wait: bool) -> torch.Tensor:
        if wait:
            opened.set()
            assert tried.wait(30)
        return model(x).sum()

    thread = threading.Thread(target=lambda: forward(torch.randn(8, 64), True).backward())
    thread.start()
    assert opened.wait(30)
    try:
        with pytest.raises(RuntimeError, match="profile measures one step at a time"):
            forward(torch.randn(8, 64), False)
    finally:
        tried.set()
        thread.join(30)
    forward(torch.randn(8, 64), False).backward()  # one at a time: as before
    assert not hooks_pushed()


def test_session_exited_out_of_order_raises() -> None:
    outer, inner = ts.stash("keep"), ts.stash("keep")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert not hooks_pushed()


def test_stats_table_and_dict_name_every_tier() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash("lz4", min_bytes=0) as session:
        y = (x * 2).relu()
    y.sum().backward()
    data = session.stats.to_dict()
    assert set(data["tiers"]) == {"kept", "host", "disk"}
    for tier in data["tiers"].values():
        assert set(tier) == {"tensors", "bytes", "stored_bytes", "live_bytes", "peak_bytes"}
    table = session.stats.table()
    for word in ("kept", "host", "disk", "compression"):
        assert word in table
    del y
    gc.collect()
    assert session.stats.live_bytes == 0


@pytest.mark.parametrize("policy", ["keep", "auto", "lz4"])
def test_session_is_freed_without_the_garbage_collector(policy: str) -> None:
    import gc
    import weakref

    x = torch.randn(256, 256, requires_grad=True)
    gc.disable()
    try:
        session = ts.stash(policy, min_bytes=0, profile=ts.Profile())
        with session:
            y = (x * 2).sin()
        y.sum().backward()
        freed = weakref.ref(session)
        del session, y
        assert freed() is None, "a reference cycle keeps the session until gc runs"
    finally:
        gc.enable()


def test_sessions_add_their_warning_filter_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a warning filter clears every warning registry in the process: a session
    opened every step adds torch.compile's filter only when it is no longer first."""
    import warnings

    with ts.stash(ts.Keep()):
        pass
    added: list[object] = []
    real = warnings.filterwarnings

    def counting(*args: object, **kwargs: object) -> None:
        added.append(kwargs.get("message"))
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(warnings, "filterwarnings", counting)
    for _ in range(3):
        with ts.stash(ts.Keep()):
            pass
    assert added == []
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # now first: the session's filter goes in front again
        with ts.stash(ts.Keep()):
            pass
        assert len(added) == 1
        assert "torch.compile" in str(warnings.filters[0][1].pattern)
