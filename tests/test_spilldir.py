"""The private spill directory goes with its last user (rule 8 of NOTE [ Spill files ]).

Its users are the DiskSpill policies that spilled into it and the packed values
whose bytes are in it. While one of them lives the directory and its descriptor
stay; once the last is gone, both go, on every path: a normal spill, a forward
that raises, a full disk (a real 1 MiB tmpfs), a session past ``max_disk_bytes``.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checks import assert_grads_equal, grads_of, open_descriptors, poll
from torch import nn

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def spill_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith("tensorstash-"))


def descriptors_under(parent: Path) -> list[str]:
    """What this process's open descriptors name at or below ``parent`` (the private
    directory's own descriptor included, and files with no name)."""
    root = str(parent.resolve())
    found: list[str] = []
    for _, target in open_descriptors():
        if target == root or target.startswith(root + os.sep):
            found.append(target)
    return sorted(found)


def assert_nothing_left(parent: Path) -> None:
    """After ``gc.collect()``: no private directory and no descriptor below ``parent``
    (work in flight may hold them a moment longer, hence the poll)."""
    gc.collect()
    assert poll(lambda: not descriptors_under(parent), 10), (
        f"descriptors left open below {parent}: {descriptors_under(parent)}"
    )
    assert spill_dirs(parent) == [], f"spill directories left behind: {spill_dirs(parent)}"


def net() -> nn.Module:
    """Four layers; each saves a 512 KiB activation for a batch of 512."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    )


def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(512, 256, requires_grad=True)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


# -- a full disk: a real, small tmpfs ----------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test (root only), unmounted after it."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        pytest.skip("needs Linux's mount(8) to make a small tmpfs")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): needs root "
            "and a kernel that lets this process mount"
        )
    try:
        yield mount
    finally:
        if os.path.ismount(mount):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("background", [True, False], ids=["writer", "inline"])
def test_a_full_tmpfs_can_be_unmounted_once_its_policy_is_gone(
    small_tmpfs: Path, background: bool
) -> None:
    model = net()
    expected = grads_of(model, [batch()], loss)
    policy = ts.DiskSpill(small_tmpfs, background=background)
    session = ts.stash(policy, min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = grads_of(model, [batch()], loss, session)
    assert_grads_equal(expected, actual)
    assert session.stats.fallbacks["disk full"] >= 1, "the tmpfs should have filled up"
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] >= 1, "some should fit"
    assert any("is full" in str(w.message) for w in caught)
    assert spill_dirs(small_tmpfs), "the live policy keeps its directory"

    del policy, session, caught
    assert_nothing_left(small_tmpfs)
    unmounted = subprocess.run(["umount", str(small_tmpfs)], capture_output=True, text=True)
    assert unmounted.returncode == 0, f"umount failed: {unmounted.stderr.strip()}"


# -- the paths that do not fill the disk -------------------------------------------------------


def test_a_normal_spill_keeps_its_directory_until_its_last_user_goes(tmp_path: Path) -> None:
    model = net()
    expected = grads_of(model, [batch()], loss)
    policy = ts.DiskSpill(tmp_path)
    session = ts.stash(policy, min_bytes=0)
    assert_grads_equal(expected, grads_of(model, [batch()], loss, session))
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 3  # x and two tanh outputs
    (directory,) = spill_dirs(tmp_path)
    assert descriptors_under(tmp_path) == [str(directory)], "only the directory stays open"
    del policy, session
    assert_nothing_left(tmp_path)


def test_a_forward_that_raises_leaves_no_directory(tmp_path: Path) -> None:
    x = batch()
    policy = ts.DiskSpill(tmp_path)
    with pytest.raises(RuntimeError, match="fails halfway"), ts.stash(policy, min_bytes=0):
        y = (x * 2).sin().exp()
        assert spill_dirs(tmp_path), "a live graph's directory is there"
        raise RuntimeError("tensorstash tests: a forward that fails halfway")
    del y, policy
    assert_nothing_left(tmp_path)


def test_a_policy_kept_alive_keeps_its_directory_while_its_values_die(tmp_path: Path) -> None:
    model = net()
    expected = grads_of(model, [batch()], loss)
    policy = ts.DiskSpill(tmp_path)
    assert_grads_equal(expected, grads_of(model, [batch()], loss, ts.stash(policy, min_bytes=0)))
    gc.collect()
    (directory,) = spill_dirs(tmp_path)
    assert poll(lambda: descriptors_under(tmp_path) == [str(directory)], 10), (
        "the spill file closes with its graph; the policy keeps the directory"
    )
    assert_grads_equal(expected, grads_of(model, [batch()], loss, ts.stash(policy, min_bytes=0)))
    assert spill_dirs(tmp_path) == [directory], "the next step spills into the same directory"
    del policy
    assert_nothing_left(tmp_path)


def test_a_packed_value_that_outlives_its_policy_keeps_the_directory(tmp_path: Path) -> None:
    x = batch()
    plain = x.detach().clone().requires_grad_()
    policy = ts.DiskSpill(tmp_path)
    with ts.stash(policy, min_bytes=0) as session:
        y = (x * 2).sin().exp()
    del policy, session
    gc.collect()
    assert len(spill_dirs(tmp_path)) == 1, "the graph's values still use the directory"
    y.sum().backward(retain_graph=True)
    (plain * 2).sin().exp().sum().backward()
    assert torch.equal(x.grad, plain.grad)
    gc.collect()
    assert len(spill_dirs(tmp_path)) == 1, "the graph is retained until y goes"
    del y
    assert_nothing_left(tmp_path)


def test_a_session_past_its_cap_leaves_no_directory(tmp_path: Path) -> None:
    model = net()
    expected = grads_of(model, [batch()], loss)
    policy = ts.DiskSpill(tmp_path, max_disk_bytes=600 << 10)
    session = ts.stash(policy, min_bytes=0)
    with pytest.warns(RuntimeWarning, match="disk cap"):
        assert_grads_equal(expected, grads_of(model, [batch()], loss, session))
    assert session.stats.fallbacks["disk cap"] >= 1
    del policy, session
    assert_nothing_left(tmp_path)


_AT_EXIT = textwrap.dedent(
    """
    import sys
    import torch
    import tensorstash as ts

    x = torch.randn(256, 256, requires_grad=True)
    policy = ts.DiskSpill(sys.argv[1])  # alive, with a live graph, when the process exits
    with ts.stash(policy, min_bytes=0):
        y = (x * 2).sin()
    print(len([p for p in __import__("os").listdir(sys.argv[1]) if p.startswith("tensorstash-")]))
    """
)


def test_a_directory_still_in_use_at_exit_is_removed(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _AT_EXIT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert spill_dirs(tmp_path) == []
