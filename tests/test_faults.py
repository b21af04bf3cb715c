"""Faults injected mid-step: full disk, damaged spill files, exceptions, a killed process, low RAM.

Each fault is injected through an argument or a fake (a spill directory
whose ``create`` opens ``/dev/full``, a custom autograd Function that raises,
a host-memory probe that drops) rather than by patching module globals. After
each one the step either fails with a clear tensorstash error or completes
with gradients equal to plain autograd's, and nothing is left behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    assert_grads_equal,
    fresh_inputs,
    leak_check,
    poll,
    run_case,
    spill_descriptors,
)
from torch import Tensor, nn
from zoo import Case, mlp

import tensorstash as ts
from tensorstash.tiers import _spillfile

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20


def stash(policy: Any, **kwargs: Any) -> ts.Session:
    return ts.stash(policy, min_bytes=0, **kwargs)


def spill_files(parent: Path) -> list[Path]:
    """The spill files open below ``parent``, as paths that open them (they have no name)."""
    return [Path(found) for found in spill_descriptors([parent])]


# -- a full disk ------------------------------------------------------------------------


class FullDisk:
    """Makes spill writes fail with ENOSPC, as on a full disk, after ``good`` values.

    The fake replaces the module's write function; :meth:`heal` undoes it.
    """

    def __init__(self, parent: Path, good: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real_write = _spillfile.write_views
        self.good = good
        self.created = 0
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(_spillfile, "write_views", self.write)

    def write(self, fd: int, views: list[memoryview], offset: int) -> int:
        self.created += 1
        if self.created > self.good:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real_write(fd, views, offset)

    def heal(self) -> None:
        self.monkeypatch.setattr(_spillfile, "write_views", self.real_write)


def disk_full_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "is full" in str(w.message)]


@pytest.mark.parametrize("background", [True, False], ids=["writer", "inline"])
def test_disk_full_mid_step_falls_back_and_grads_equal_plain(
    spill_dir: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    expected = run_case(mlp())
    case = mlp()
    full = FullDisk(spill_dir, good=1, monkeypatch=monkeypatch)
    session = stash(ts.DiskSpill(spill_dir, background=background))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = run_case(case, session)
    assert_grads_equal(expected, actual)
    tiers = session.stats.to_dict()["tiers"]
    failed = full.created - 1
    assert failed >= 2, "the step should have tried to spill more tensors than fit"
    assert tiers["disk"]["tensors"] == 1
    assert session.stats.fallbacks["disk full"] == failed
    assert disk_full_warnings(caught), "a full disk must warn"
    assert "DiskSpill(directory=...)" in disk_full_warnings(caught)[0]
    leak_check(session, directories=[spill_dir])


def test_disk_full_warns_once_per_session(spill_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FullDisk(spill_dir, good=0, monkeypatch=monkeypatch)
    session = stash(ts.DiskSpill(spill_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_case(mlp(), session)
    assert session.stats.fallbacks["disk full"] >= 2
    assert len(disk_full_warnings(caught)) == 1


def test_disk_full_then_healed_next_step_spills_again(
    spill_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = run_case(mlp())
    case = mlp()
    full = FullDisk(spill_dir, good=0, monkeypatch=monkeypatch)
    with pytest.warns(RuntimeWarning, match="is full"):
        assert_grads_equal(expected, run_case(case, stash(ts.DiskSpill(spill_dir))))
    full.heal()
    session = stash(ts.DiskSpill(spill_dir))
    assert_grads_equal(expected, run_case(case, session))
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] > 0
    assert not session.stats.fallbacks
    leak_check(session, directories=[spill_dir])


def test_disk_full_under_lz4_chain_keeps_compressed_bytes_in_memory(
    spill_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = run_case(mlp())
    case = mlp()
    FullDisk(spill_dir, good=1, monkeypatch=monkeypatch)
    session = stash(ts.Chain(ts.Lz4(), ts.DiskSpill(spill_dir)))
    with pytest.warns(RuntimeWarning, match="is full"):
        actual = run_case(case, session)
    assert_grads_equal(expected, actual)
    assert session.stats.fallbacks["disk full"] >= 1
    leak_check(session, directories=[spill_dir])


# -- damaged spill files between forward and backward ------------------------------------


def corrupt(parent: Path, keep_last: int = 0) -> None:
    """Flip a byte in every page of every spill file (but the last ``keep_last`` bytes)."""
    for file in spill_files(parent):
        data = bytearray(file.read_bytes())
        for at in range(0, len(data) - keep_last, 4096):
            data[at] ^= 0x5A
        file.write_bytes(bytes(data))


def truncate(parent: Path) -> None:
    for file in spill_files(parent):
        file.write_bytes(file.read_bytes()[:-1])


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupted": (corrupt, "corrupted"),
    "truncated": (truncate, "truncated"),
}


def delete_directory(parent: Path) -> None:
    for directory in parent.iterdir():
        shutil.rmtree(directory)


def grow(parent: Path) -> None:
    for file in spill_files(parent):
        with file.open("ab") as handle:
            handle.write(b"\0" * 5000)


def swap_directory_for_symlink(parent: Path) -> None:
    """Replace each spill directory by a symlink to an empty one."""
    for directory in [d for d in parent.iterdir() if d.name.startswith("tensorstash-")]:
        shutil.rmtree(directory)
        elsewhere = parent / f"elsewhere-{directory.name}"
        elsewhere.mkdir()
        directory.symlink_to(elsewhere, target_is_directory=True)


HARMLESS: dict[str, Callable[[Path], None]] = {
    "directory-deleted": delete_directory,
    "grown": grow,
    "directory-swapped-for-symlink": swap_directory_for_symlink,
}


class Net(nn.Sequential):
    """Three layers whose saved activations are 128 KiB to 512 KiB."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))


def forward_then_written(policy: Any, parent: Path) -> tuple[ts.Session, Tensor]:
    """A forward whose spill files are all written (the writer is polled, not joined)."""
    torch.manual_seed(1)
    x = torch.randn(512, 64, requires_grad=True)
    with stash(policy) as session:
        loss = Net()(x * 1).square().sum()
    wait_written(session)
    return session, loss


def wait_written(session: ts.Session) -> None:
    """Poll until the writer wrote every spilled value: bytes waiting for it
    count in "host" until they are written."""
    assert poll(lambda: not session.stats.to_dict()["tiers"]["host"]["live_bytes"], 10), (
        "the spill files were never written"
    )


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_spill_file_raises_spill_error_naming_the_tensor(
    spill_dir: Path, damage: str
) -> None:
    session, loss = forward_then_written(ts.DiskSpill(spill_dir), spill_dir)
    assert spill_files(spill_dir), "the forward should have spilled"
    harm, words = DAMAGE[damage]
    harm(spill_dir)
    with pytest.raises(ts.SpillError, match=words) as raised:
        loss.backward()
    message = str(raised.value)
    del raised  # its traceback holds the packed value
    assert "torch.float32 tensor of shape [512, " in message
    assert "rerun the step" in message
    del loss
    leak_check(session)


@pytest.mark.parametrize("harm", list(HARMLESS))
def test_spill_file_outlives_what_is_done_to_its_directory(spill_dir: Path, harm: str) -> None:
    """A spill file has no name: what happens to the directory, or past the
    file's end, leaves every value's bytes as they were written."""

    def step(harm: Callable[[Path], None] | None) -> list[Tensor]:
        torch.manual_seed(1)
        x = torch.randn(512, 64, requires_grad=True)
        net = Net()
        with stash(ts.DiskSpill(spill_dir)) as session:
            loss = net(x * 1).square().sum()
        wait_written(session)
        if harm is not None:
            assert spill_files(spill_dir), "the forward should have spilled"
            harm(spill_dir)
        loss.backward()
        del loss
        leak_check(session)
        return [x.grad, *(p.grad for p in net.parameters())]

    for want, got in zip(step(None), step(HARMLESS[harm]), strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_damaged_spill_file_under_lz4_chain_raises_spill_error(
    spill_dir: Path, damage: str
) -> None:
    torch.manual_seed(1)
    x = torch.randn(512, 64, requires_grad=True)
    with stash(ts.Chain(ts.Lz4(), ts.DiskSpill(spill_dir))) as session:
        loss = Net()(x * 1).square().sum()
    loss.backward(retain_graph=True)  # every file written and read once
    harm, words = DAMAGE[damage]
    harm(spill_dir)
    with pytest.raises(ts.SpillError, match=words):
        loss.backward()
    del loss
    leak_check(session)


def test_damaged_spill_file_error_names_the_module(spill_dir: Path) -> None:
    _, loss = forward_then_written(ts.DiskSpill(spill_dir), spill_dir)
    corrupt(spill_dir, keep_last=512 * 64 * 4)  # the last value: square()'s input
    with pytest.raises(ts.SpillError, match=r"shape \[512, 256\].*saved by module '[12]'"):
        loss.backward()


def test_damaged_spill_file_error_says_when_no_module_saved_it(spill_dir: Path) -> None:
    _, loss = forward_then_written(ts.DiskSpill(spill_dir), spill_dir)
    corrupt(spill_dir)
    with pytest.raises(ts.SpillError, match=r"shape \[512, 64\].*no module \(top level\)"):
        loss.backward()


def test_spill_directory_deleted_next_step_equal_plain(spill_dir: Path) -> None:
    expected = run_case(mlp())
    case = mlp()
    session, loss = forward_then_written(ts.DiskSpill(spill_dir), spill_dir)
    delete_directory(spill_dir)
    loss.backward()  # the file has no name: deleting the directory leaves it be
    del loss
    after = stash(ts.DiskSpill(spill_dir))
    assert_grads_equal(expected, run_case(case, after))
    assert after.stats.to_dict()["tiers"]["disk"]["tensors"] > 0
    leak_check(session, after, directories=[spill_dir])


def test_spill_directory_deleted_leaks_no_descriptor(spill_dir: Path) -> None:
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    x = torch.randn(256, 256, requires_grad=True)

    def step() -> None:
        with stash(ts.DiskSpill(spill_dir)):
            y = (x * 2).sin()
        y.sum().backward()
        delete_directory(spill_dir)

    step()
    before = process.num_fds()
    for _ in range(4):
        step()
    assert process.num_fds() == before


# -- exceptions and KeyboardInterrupt in backward and inside pack ------------------------


class Interrupted(Exception):
    """The error the fault injectors raise (besides KeyboardInterrupt)."""


ERRORS = [
    pytest.param(Interrupted, id="exception"),
    pytest.param(KeyboardInterrupt, id="keyboard-interrupt"),
]


class RaiseInBackward(torch.autograd.Function):
    """Saves its input and raises ``error`` in backward, after reading what it saved."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, error: type[BaseException]) -> Tensor:
        ctx.save_for_backward(x)
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        (x,) = ctx.saved_tensors
        assert x.shape == grad.shape
        raise ctx.error("tensorstash tests: a backward that fails halfway")


class FailsInBackward(nn.Module):
    """The zoo MLP with a Function between fc2 and fc3 that raises in backward."""

    def __init__(self, case: Case, error: type[BaseException] | None) -> None:
        super().__init__()
        self.inner = case.model
        self.error = error

    def forward(self, x: Tensor) -> Tensor:
        inner = self.inner
        h = torch.relu(inner.fc2(torch.tanh(inner.fc1(x))))
        if self.error is not None:
            h = RaiseInBackward.apply(h, self.error)
        return inner.fc3(h)


def backward_fails(case: Case, policy: Any, error: type[BaseException]) -> ts.Session:
    session = stash(policy)
    model = FailsInBackward(case, error)
    with session:
        loss = case.loss(model(*fresh_inputs(case.inputs)))
    with pytest.raises(error, match="fails halfway"):
        loss.backward()
    return session


@pytest.mark.parametrize("error", ERRORS)
def test_exception_mid_backward_leaves_nothing_behind(
    policy: Any, spill_dirs: list[Path], error: type[BaseException]
) -> None:
    session = backward_fails(mlp(), policy, error)
    assert session.stats.unpacks > 0, "backward should have unpacked before failing"
    leak_check(session, directories=spill_dirs)


@pytest.mark.parametrize("error", ERRORS)
def test_exception_mid_backward_next_step_equal_plain(
    policy: Any, error: type[BaseException]
) -> None:
    expected = run_case(mlp())
    case = mlp()
    backward_fails(case, policy, error)
    assert_grads_equal(expected, run_case(case, stash(policy)))


@pytest.mark.parametrize("error", ERRORS)
def test_backward_hook_raising_leaves_nothing_behind(
    policy: Any, spill_dirs: list[Path], error: type[BaseException]
) -> None:
    expected = run_case(mlp())
    case = mlp()

    def hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        raise error("tensorstash tests: a backward hook that fails halfway")

    handle = case.model.fc2.register_full_backward_hook(hook)
    session = stash(policy)
    with session:
        loss = case.step()
    with pytest.raises(error, match="fails halfway"):
        loss.backward()
    handle.remove()
    del loss
    leak_check(session, directories=spill_dirs)
    assert_grads_equal(expected, run_case(case, stash(policy)))


class FailingRule:
    """A Select rule that spills the first ``good`` tensors, then raises ``error``."""

    def __init__(self, directory: Path, good: int, error: type[BaseException]) -> None:
        self.policy = ts.DiskSpill(directory)
        self.good = good
        self.error = error
        self.calls = 0

    def __call__(self, tensor: Tensor, memory: ts.Memory) -> Any:
        self.calls += 1
        if self.calls > self.good:
            raise self.error("tensorstash tests: a rule that fails halfway")
        return self.policy


@pytest.mark.parametrize("error", ERRORS)
def test_exception_inside_pack_leaves_nothing_behind(
    spill_dir: Path, error: type[BaseException]
) -> None:
    expected = run_case(mlp())
    case = mlp()
    session = stash(ts.Select(FailingRule(spill_dir, good=2, error=error)))
    with pytest.raises(error, match="fails halfway"), session:
        case.step()
    tiers = session.stats.to_dict()["tiers"]
    # Packed before the rule failed: on disk, or in host RAM if freed before the writer got them.
    assert tiers["disk"]["tensors"] + tiers["host"]["tensors"] == 2
    leak_check(session, directories=[spill_dir])
    assert_grads_equal(expected, run_case(case, stash(ts.DiskSpill(spill_dir))))


@pytest.mark.parametrize("error", ERRORS)
def test_forward_hook_raising_mid_model_leaves_nothing_behind(
    policy: Any, spill_dirs: list[Path], error: type[BaseException]
) -> None:
    expected = run_case(mlp())
    case = mlp()

    def hook(module: nn.Module, args: Any) -> None:
        raise error("tensorstash tests: a forward that fails halfway")

    handle = case.model.fc3.register_forward_pre_hook(hook)
    session = stash(policy)
    with pytest.raises(error, match="fails halfway"), session:
        case.step()
    handle.remove()
    leak_check(session, directories=spill_dirs)
    assert_grads_equal(expected, run_case(case, stash(policy)))


# -- a process killed mid-step ------------------------------------------------------------

KILLED_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import tensorstash as ts
    from tensorstash.tiers import disk

    parent = sys.argv[1]
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(parent), min_bytes=0) as session:
        y = (x * 2).sin().exp()
    directory = disk.spill_directory(__import__("pathlib").Path(parent)).path
    while session.stats.to_dict()["tiers"]["disk"]["tensors"] < 2:
        time.sleep(0.01)
    print(directory, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)

NEXT_PROCESS = textwrap.dedent(
    """
    import sys
    import torch
    import tensorstash as ts

    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(sys.argv[1]), min_bytes=0) as session:
        y = (x * 2).sin()
    y.sum().backward()
    print(session.stats.to_dict()["tiers"]["disk"]["tensors"])
    """
)


def python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def sleeper() -> Iterator[int]:
    """The pid of a live process that is not this one."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait()


@pytest.mark.slow  # two new Python processes
def test_killed_process_spill_directory_removed_by_next_process(
    tmp_path: Path, sleeper: int
) -> None:
    killed = python(KILLED_CHILD, str(tmp_path))
    assert killed.returncode == -9, killed.stderr
    stale = Path(killed.stdout.strip())
    # The killed process's spill file had no name: the kernel freed it with the process.
    assert stale.parent == tmp_path and stale.is_dir() and list(stale.iterdir()) == []

    # What the next process must leave alone.
    keep: list[Path] = []
    live = tmp_path / f"tensorstash-{sleeper}-live0001"
    live.mkdir(mode=0o700)
    (live / "00000001.bin").write_bytes(b"live")
    keep.append(live)
    for name in ("tensorstash-notapid", "tensorstash-", "tensorstash-12x-abc", "other-123-abc"):
        (tmp_path / name).mkdir()
        keep.append(tmp_path / name)
    dead_pid = int(stale.name.split("-")[1])
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    link = tmp_path / f"tensorstash-{dead_pid}-link0001"
    link.symlink_to(outside, target_is_directory=True)
    keep.append(link)
    plain_file = tmp_path / f"tensorstash-{dead_pid}-file0001"
    plain_file.write_bytes(b"not a directory")
    keep.append(plain_file)
    if os.geteuid() == 0:  # another user's directory of a dead pid
        foreign = tmp_path / f"tensorstash-{dead_pid}-user0001"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 4242, 4242)
        keep.append(foreign)

    after = python(NEXT_PROCESS, str(tmp_path))
    assert after.returncode == 0, after.stderr
    assert int(after.stdout) == 1
    assert not stale.exists(), "the killed process's spill directory should be removed"
    for path in keep:
        assert os.path.lexists(path), f"{path.name} is not provably stale but was removed"
    assert (outside / "precious").read_bytes() == b"precious"
    assert (live / "00000001.bin").read_bytes() == b"live"
    # The next process removed its own directory at exit.
    ours = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink() and p not in keep]
    assert ours == []


# -- host memory running low mid-forward --------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DroppingHost:
    """A host probe that reads plenty of RAM until :meth:`drop`, then very little."""

    def __init__(self) -> None:
        self.available = 64 << 30
        self.calls = 0

    def __call__(self, device: torch.device) -> tuple[int, int]:
        self.calls += 1
        return self.available, 64 << 30

    def drop(self) -> None:
        self.available = 256 * MiB


class Deep(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 128)
        )


def low_memory_step(
    budget: int | str, *, advance_clock: bool, spill_dir: Path
) -> tuple[ts.Session, list[Tensor], DroppingHost]:
    """A step of :class:`Deep` whose host probe drops when layer "2" starts."""
    model = Deep()
    probe, clock = DroppingHost(), Clock()
    policy = ts.Auto(
        device_budget=budget,
        host_reserve="1GiB",
        directory=str(spill_dir),
        host_probe=probe,
        clock=clock,
    )

    def low(module: nn.Module, args: Any) -> None:
        probe.drop()
        if advance_clock:
            clock.now += 1.0  # past refresh_s: the next decision reads the probe again

    model[2].register_forward_pre_hook(low)
    torch.manual_seed(1)
    x = torch.randn(256, 128, requires_grad=True)
    with stash(policy, record=True) as session:
        loss = model(x * 1).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return session, grads, probe


def plain_deep() -> list[Tensor]:
    model = Deep()
    torch.manual_seed(1)
    x = torch.randn(256, 128, requires_grad=True)
    model(x * 1).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def offloaded_rows(session: ts.Session) -> list[dict[str, Any]]:
    skipped = ("parameter", "deduplicated", "under min_bytes")
    return [row for row in session.decisions if row["reason"] not in skipped]


def test_host_memory_low_mid_forward_switches_reason_to_disk(spill_dir: Path) -> None:
    session, grads, _ = low_memory_step(0, advance_clock=True, spill_dir=spill_dir)
    rows = offloaded_rows(session)
    before = [row for row in rows if row["module"] in ("0", "1")]
    after = [row for row in rows if row["module"] in ("2", "3", "4")]
    assert before and after
    assert all(row["reason"].startswith("device budget reached") for row in before), before
    assert all(row["reason"].startswith("host memory low") for row in after), after
    assert all(row["tier"] == "disk" for row in after)
    for want, got in zip(plain_deep(), grads, strict=True):
        assert torch.equal(want, got)
    del session
    leak_check(directories=[spill_dir])


def test_host_memory_low_is_seen_only_after_refresh_s(spill_dir: Path) -> None:
    session, grads, _ = low_memory_step(0, advance_clock=False, spill_dir=spill_dir)
    reasons = {row["reason"].split(";")[0] for row in offloaded_rows(session)}
    assert not any(r.startswith("host memory low") for r in reasons), reasons
    for want, got in zip(plain_deep(), grads, strict=True):
        assert torch.equal(want, got)


def test_host_memory_low_mid_forward_spills_cpu_tensors_under_budget(spill_dir: Path) -> None:
    session, grads, _ = low_memory_step("1GiB", advance_clock=True, spill_dir=spill_dir)
    rows = offloaded_rows(session)
    before = [row for row in rows if row["module"] in ("0", "1")]
    after = [row for row in rows if row["module"] in ("2", "3", "4")]
    assert all(row["tier"] == "kept" for row in before)
    assert after and all(row["tier"] == "disk" for row in after), after
    assert all(row["reason"].startswith("host memory low") for row in after)
    for want, got in zip(plain_deep(), grads, strict=True):
        assert torch.equal(want, got)
