"""Hostile and odd input: bad arguments, every kind of tensor, spill files under attack.

Bad configuration must fail when the policy is built, with a message that says
what to pass instead. Every tensor kind autograd can save reaches pack without
harm: it is packed exactly or kept untouched (and counted in
``stats.skipped``). Spill files are never written through a planted symlink
and never unpickled.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import spill_descriptors
from torch import Tensor

import tensorstash as ts
from tensorstash.tiers import disk

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


# -- bad arguments ----------------------------------------------------------------------

BAD_ARGUMENTS: list[Any] = [
    # (id, make(tmp_path) -> policy, error, words the message must contain)
    ("lz4-acceleration-too-big", lambda p: ts.Lz4(acceleration=70000), ValueError, "65537"),
    ("lz4-acceleration-bool", lambda p: ts.Lz4(acceleration=True), TypeError, "must be an int"),
    (
        "lz4-pending-negative",
        lambda p: ts.Lz4(max_pending_bytes=-1),
        ValueError,
        "at least 0 bytes",
    ),
    ("lz4-pending-no-size", lambda p: ts.Lz4(max_pending_bytes="lots"), ValueError, "'512MiB'"),
    (
        "cpu-cache-negative",
        lambda p: ts.CpuOffload(max_cached_bytes=-1),
        ValueError,
        "at least 0 bytes",
    ),
    ("cpu-pin-int", lambda p: ts.CpuOffload(pin_memory=1), TypeError, "True or False"),
    ("disk-a-file", lambda p: ts.DiskSpill(p / "a-file"), ValueError, "is not a directory"),
    ("disk-missing", lambda p: ts.DiskSpill(p / "missing"), ValueError, "No such file"),
    ("disk-bytes-path", lambda p: ts.DiskSpill(b"/tmp"), TypeError, "must be a path"),
    (
        "disk-pending-negative",
        lambda p: ts.DiskSpill(max_pending_bytes=-5),
        ValueError,
        "at least 0 bytes",
    ),
    (
        "disk-pending-float",
        lambda p: ts.DiskSpill(max_pending_bytes=1.5),
        TypeError,
        "bytes (an int)",
    ),
    ("auto-budget-negative", lambda p: ts.Auto(device_budget=-1), ValueError, "at least 0 bytes"),
    ("auto-budget-bool", lambda p: ts.Auto(device_budget=True), TypeError, "such as '512MiB'"),
    ("auto-budget-nan", lambda p: ts.Auto(device_budget=math.nan), ValueError, "(0, 1]"),
    ("auto-budget-list", lambda p: ts.Auto(device_budget=[1]), TypeError, "'512MiB'"),
    ("auto-reserve-none", lambda p: ts.Auto(host_reserve=None), TypeError, "such as 0.5"),
    ("auto-reserve-unit", lambda p: ts.Auto(host_reserve="2 parsecs"), ValueError, "'2GB'"),
    ("select-rule-int", lambda p: ts.Select(3), TypeError, "rule must be callable"),
    ("chain-none", lambda p: ts.Chain(None), TypeError, "cannot be a stage"),
    ("chain-auto", lambda p: ts.Chain(ts.Auto()), TypeError, "pass them to stash()"),
    ("stash-none", lambda p: ts.stash(None), TypeError, "name such as 'lz4'"),
    ("stash-upper-name", lambda p: ts.stash("LZ4"), ValueError, "use one of 'keep'"),
    ("stash-record-int", lambda p: ts.stash("keep", record=1), TypeError, "True or False"),
    ("stash-profile", lambda p: ts.stash("keep", profile=3), TypeError, "tensorstash.Profile"),
    ("stash-workers-float", lambda p: ts.stash("keep", workers=2.0), TypeError, "positive int"),
    (
        "auto-directory-missing",
        lambda p: ts.Auto(directory=str(p / "missing")),
        ValueError,
        "No such file",
    ),
    (
        "auto-directory-a-file",
        lambda p: ts.Auto(directory=str(p / "a-file")),
        ValueError,
        "not a directory",
    ),
    ("auto-directory-int", lambda p: ts.Auto(directory=3), TypeError, "must be a path"),
    ("auto-host-probe-int", lambda p: ts.Auto(host_probe=3), TypeError, "host_probe"),
    ("auto-clock-none", lambda p: ts.Auto(clock=None), TypeError, "clock"),
    ("select-clock-int", lambda p: ts.Select(lambda t, m: "keep", clock=3), TypeError, "clock"),
    (
        "select-refresh-negative",
        lambda p: ts.Select(lambda t, m: "keep", refresh_s=-1),
        ValueError,
        "refresh_s",
    ),
    ("stash-policy-class", lambda p: ts.stash(ts.Lz4), TypeError, "Lz4()"),
    ("disk-empty-path", lambda p: ts.DiskSpill(""), ValueError, "directory"),
    ("auto-empty-path", lambda p: ts.Auto(directory=""), ValueError, "empty path"),
    (
        "cpu-inflight-negative",
        lambda p: ts.CpuOffload(max_inflight_bytes=-1),
        ValueError,
        "at least 0 bytes",
    ),
    (
        "select-probe-str",
        lambda p: ts.Select(lambda t, m: "keep", device_probe="cuda"),
        TypeError,
        "device_probe",
    ),
    ("profile-measure-zero", lambda p: ts.Profile(measure_steps=0), ValueError, ">= 1"),
    ("profile-measure-float", lambda p: ts.Profile(measure_steps=2.5), TypeError, "whole"),
    ("profile-measure-bool", lambda p: ts.Profile(measure_steps=True), TypeError, "whole"),
    ("profile-remeasure-negative", lambda p: ts.Profile(remeasure_every=-1), ValueError, ">= 0"),
    ("profile-remeasure-str", lambda p: ts.Profile(remeasure_every="25"), TypeError, "whole"),
    ("profile-stall-negative", lambda p: ts.Profile(stall_s=-0.001), ValueError, ">= 0"),
    ("profile-stall-nan", lambda p: ts.Profile(stall_s=math.nan), ValueError, "finite"),
    ("profile-stall-inf", lambda p: ts.Profile(stall_s=math.inf), ValueError, "finite"),
    ("profile-stall-str", lambda p: ts.Profile(stall_s="2ms"), TypeError, "seconds"),
    ("profile-memory-int", lambda p: ts.Profile(measure_memory=1), TypeError, "True or False"),
    ("profile-clock-float", lambda p: ts.Profile(clock=0.0), TypeError, "clock()"),
]


def bad_argument_params() -> list[Any]:
    return [pytest.param(*case[1:], id=case[0]) for case in BAD_ARGUMENTS]


@pytest.mark.parametrize(("make", "error", "words"), bad_argument_params())
def test_bad_argument_fails_at_construction_saying_what_to_do(
    tmp_path: Path, a_file: Path, make: Callable[[Path], Any], error: type, words: str
) -> None:
    with pytest.raises(error) as raised:
        make(tmp_path)
    message = str(raised.value)
    assert message.startswith("tensorstash."), f"the message should name the API: {message}"
    assert words in message, f"{words!r} not in {message!r}"


def test_profile_takes_no_learned_state_as_an_argument() -> None:
    with pytest.raises(TypeError, match="steps"):
        ts.Profile(steps=5)  # type: ignore[call-arg]
    profile = ts.Profile(measure_steps=1, remeasure_every=0, stall_s=0, measure_memory=False)
    assert (profile.measure_steps, profile.remeasure_every, profile.steps) == (1, 0, 0)


def test_disk_spill_refuses_a_world_writable_directory_for_auto_too(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="sticky bit"):
        ts.Auto(device_budget=0, directory=str(open_dir))


# -- every tensor kind through every policy -----------------------------------------------


class Subclass(torch.Tensor):
    """A plain tensor subclass."""


def _float8() -> Iterator[tuple[str, Callable[[], Tensor]]]:
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            yield name, lambda dtype=dtype: torch.randn(64, 64).to(dtype)


def _integers() -> Iterator[tuple[str, Callable[[], Tensor]]]:
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        name = str(dtype).removeprefix("torch.")
        yield name, lambda d=dtype: torch.randint(-99, 99, (64, 64)).to(d)
    for name in ("uint16", "uint32", "uint64"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            yield name, lambda d=dtype: torch.randint(0, 99, (64, 64)).to(d)


KINDS: dict[str, Callable[[], Tensor]] = {
    "sparse-coo": lambda: torch.randn(64, 64).relu().to_sparse(),
    "sparse-csr": lambda: torch.randn(64, 64).relu().to_sparse_csr(),
    "complex64": lambda: torch.randn(64, 64, dtype=torch.complex64),
    "complex128": lambda: torch.randn(64, 64, dtype=torch.complex128),
    "bool": lambda: torch.randn(64, 64) > 0,
    **dict(_integers()),
    "float16": lambda: torch.randn(64, 64).half(),
    "bfloat16": lambda: torch.randn(64, 64).bfloat16(),
    "float64": lambda: torch.randn(64, 64).double(),
    "specials": lambda: torch.tensor([-0.0, math.nan, math.inf, -math.inf, 1e-45]).repeat(400),
    "0-dim": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 5),
    "empty-strided": lambda: torch.empty(4, 0, 3).transpose(0, 2),
    "30-dims": lambda: torch.randn([1] * 30),
    "30-dims-of-2": lambda: torch.randn([2] * 20),
    "transposed": lambda: torch.randn(64, 48).t(),
    "strided-slice": lambda: torch.randn(64, 64)[::3, 1::2],
    "storage-offset": lambda: torch.randn(64, 64).view(-1)[7:1031],
    "narrow-of-wide": lambda: torch.randn(64, 1024)[:, 5:7],
    "stride-0-expanded": lambda: torch.randn(64, 1).expand(64, 64),
    "stride-0-scalar": lambda: torch.tensor(2.0).expand(32, 32),
    "overlapping": lambda: torch.randn(200).as_strided((10, 10), (1, 1)),
    "conjugate": lambda: torch.randn(64, 64, dtype=torch.complex64).conj(),
    "negative-bit": lambda: torch.randn(64, 64, dtype=torch.complex64).conj().imag,
    "channels-last": lambda: torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last),
    "channels-last-3d": lambda: torch.randn(2, 4, 4, 8, 8).to(memory_format=torch.channels_last_3d),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 0, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)]),
    "meta": lambda: torch.empty(64, 64, device="meta"),
    "subclass": lambda: torch.randn(64, 64).as_subclass(Subclass),
    "parameter": lambda: torch.nn.Parameter(torch.randn(64, 64)),
    **dict(_float8()),
}


def _policies(directory: Path) -> dict[str, Any]:
    return {
        "keep": ts.Keep(),
        "lz4": ts.Lz4(),
        "disk": ts.DiskSpill(directory),
        "cpu+lz4+disk": ts.Chain(ts.CpuOffload(), ts.Lz4(), ts.DiskSpill(directory)),
        "auto-budget-0": ts.Auto(device_budget=0, directory=str(directory)),
    }


class SaveOdd(torch.autograd.Function):
    """Saves ``odd`` (made inside forward, as an op's own result would be) for backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, make: Callable[[], Tensor], box: dict[str, Any]) -> Tensor:
        torch.manual_seed(7)
        odd = make()
        box["saved"] = odd
        ctx.save_for_backward(odd)
        ctx.box = box
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        (got,) = ctx.saved_tensors
        ctx.box["unpacked"] = got
        return grad * 2, None, None


def _elements(tensor: Tensor) -> Tensor:
    """The elements' bits in row-major order (conjugate and negative bits resolved)."""
    tensor = tensor.resolve_conj().resolve_neg()
    flat = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def assert_exact(saved: Tensor, got: Tensor) -> None:
    # A saved parameter comes back as its detached tensor, under hooks as it is plain.
    want_type = torch.Tensor if type(saved) is torch.nn.Parameter else type(saved)
    assert type(got) is want_type
    assert got.dtype == saved.dtype and got.layout == saved.layout
    assert got.device == saved.device
    assert got.is_conj() == saved.is_conj() and got.is_neg() == saved.is_neg()
    if saved.is_nested:
        assert all(torch.equal(a, b) for a, b in zip(saved.unbind(), got.unbind(), strict=True))
        return
    assert got.shape == saved.shape
    if saved.is_meta:
        return
    if saved.layout != torch.strided:
        assert torch.equal(saved.to_dense(), got.to_dense())
        return
    if saved.is_quantized:
        assert torch.equal(saved.int_repr(), got.int_repr())
        assert got.q_scale() == saved.q_scale() and got.q_zero_point() == saved.q_zero_point()
        return
    assert got.stride() == saved.stride()
    assert torch.equal(_elements(saved), _elements(got))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_tensor_kind_is_packed_exactly_or_kept_untouched(spill_dir: Path, kind: str) -> None:
    sessions = []
    for name, policy in _policies(spill_dir).items():
        box: dict[str, Any] = {}
        x = torch.randn(8, requires_grad=True)
        with ts.stash(policy, min_bytes=0) as session:
            y = SaveOdd.apply(x, KINDS[kind], box)
        y.sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
        saved, got = box["saved"], box["unpacked"]
        assert_exact(saved, got)
        table = f"{name}:\n{session.stats.table()}"
        skipped = sum(session.stats.skipped.values())
        packed = sum(t["tensors"] for t in session.stats.to_dict()["tiers"].values()) - skipped
        assert skipped + packed == 1 + session.stats.deduplicated, table
        strided = saved.layout == torch.strided and not saved.is_meta and not saved.is_nested
        if skipped and strided:
            assert got.data_ptr() == saved.data_ptr(), f"kept untouched, yet copied: {table}"
        sessions.append(session)
    del y, box, saved, got
    gc.collect()
    for session in sessions:
        assert session.stats.live_bytes == 0, session.stats.table()


# -- spill files under attack ---------------------------------------------------------------


def _step(policy: Any) -> tuple[Tensor, Tensor, ts.Session]:
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(policy, min_bytes=0) as session:
        y = (x * 2).sin().exp()
    return x, y, session


def _expected_grad(x: Tensor) -> Tensor:
    leaf = x.detach().clone().requires_grad_()
    (leaf * 2).sin().exp().sum().backward()
    assert leaf.grad is not None
    return leaf.grad


def _poll_no_threads(timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(t.name.startswith("tensorstash") for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_planted_symlinks_at_the_next_names_are_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # files get names, briefly
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    directory = disk.spill_directory(tmp_path)
    # The next names the directory hands out are predictable: plant them all.
    planted = [directory.path / f"{directory._count + i:08d}.bin" for i in range(1, 6)]
    for link in planted:
        link.symlink_to(target)
    _, y, _ = _step(ts.DiskSpill(tmp_path))
    with pytest.raises(ts.SpillError, match="cannot write") as raised:
        y.sum().backward()
    assert target.read_bytes() == b"precious"
    assert all(link.is_symlink() for link in planted)
    del y, raised
    gc.collect()
    assert _poll_no_threads(), "the failed step's threads did not stop"
    assert target.read_bytes() == b"precious"
    for link in planted:
        link.unlink(missing_ok=True)


def test_failed_spill_write_frees_the_graph_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # files get names, briefly
    directory = disk.spill_directory(tmp_path)
    for i in range(1, 6):
        (directory.path / f"{directory._count + i:08d}.bin").symlink_to(tmp_path)
    _, y, session = _step(ts.DiskSpill(tmp_path))
    with pytest.raises(ts.SpillError, match="cannot write"):
        y.sum().backward()
    del y  # the error is handled and gone; the session stays open, as in a training loop
    gc.collect()
    assert session.stats.live_bytes == 0, session.stats.table()
    assert _poll_no_threads(), "the failed step's threads did not stop"


@pytest.mark.parametrize("chain", [False, True], ids=["disk", "lz4+disk"])
def test_disk_round_trip_never_unpickles(
    spill_dir: Path, monkeypatch: pytest.MonkeyPatch, chain: bool
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tensorstash must never unpickle spill data")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    spill = ts.DiskSpill(spill_dir)
    x, y, session = _step(ts.Chain(ts.Lz4(), spill) if chain else spill)
    y.sum().backward()
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    assert torch.equal(x.grad, _expected_grad(x))


def test_spill_files_stay_private_under_a_permissive_umask(spill_dir: Path) -> None:
    old = os.umask(0)
    try:
        _, y, _ = _step(ts.DiskSpill(spill_dir))
        y.sum().backward(retain_graph=True)  # every file written
    finally:
        os.umask(old)
    (directory,) = [p for p in spill_dir.iterdir() if p.name.startswith("tensorstash-")]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert list(directory.iterdir()) == []  # spill files have no name
    files = spill_descriptors([spill_dir])
    assert len(files) == 1  # the session's values share one
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)


def test_sticky_world_writable_directory_spills(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    x, y, session = _step(ts.DiskSpill(shared))
    y.sum().backward()
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    assert torch.equal(x.grad, _expected_grad(x))
    del y
    gc.collect()
    assert session.stats.live_bytes == 0
    assert [p for p in shared.iterdir() if any(p.iterdir())] == []


def test_world_writable_directory_turned_unsafe_after_construction_is_refused_at_first_use(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    policy = ts.DiskSpill(shared)
    shared.chmod(0o777)
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(ValueError, match="sticky bit"), ts.stash(policy, min_bytes=0):
        (x * 2).sin()
