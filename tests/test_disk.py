"""Spill files: private, no symlink followed, checked, cleaned up (NOTE [ Spill files ])."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorstash as ts
from tensorstash import disk


def spill_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith("tensorstash-"))


def spilled_step(parent: Path) -> tuple[torch.Tensor, torch.Tensor, ts.Session]:
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(parent), min_bytes=0) as session:
        y = (x * 2).sin()
    return x, y, session


def test_disk_spill_files_are_private(tmp_path: Path) -> None:
    _x, y, _session = spilled_step(tmp_path)
    directory = spill_dirs(tmp_path)[-1]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    y.sum().backward(retain_graph=True)  # waits for the background writer
    files = list(directory.iterdir())
    assert files
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600


def test_disk_spill_removes_files_when_the_graph_is_freed(tmp_path: Path) -> None:
    _x, y, session = spilled_step(tmp_path)
    y.sum().backward()
    del y
    gc.collect()
    assert [p for d in spill_dirs(tmp_path) for p in d.iterdir()] == []
    assert session.stats.live_bytes == 0


def test_disk_spill_does_not_write_through_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"")
    directory = disk.spill_directory(tmp_path)
    (directory.path / "planted.bin").symlink_to(target)
    with pytest.raises(FileExistsError):
        directory.create("planted.bin")
    assert target.read_bytes() == b""


def test_disk_spill_refuses_a_world_writable_directory_without_sticky_bit(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="sticky bit"):
        ts.DiskSpill(open_dir)
    open_dir.chmod(0o1777)
    ts.DiskSpill(open_dir)  # /tmp-like: fine


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_disk_spill_refuses_an_unwritable_directory(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            ts.DiskSpill(tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_disk_spill_names_a_corrupted_file_at_unpack(tmp_path: Path) -> None:
    _x, y, _session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)  # the file is written and read once
    (file,) = [p for d in spill_dirs(tmp_path) for p in d.iterdir()]
    data = bytearray(file.read_bytes())
    data[100] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ts.SpillError, match=r"corrupted.*\[256, 256\]|\[256, 256\].*corrupted"):
        y.sum().backward()


def test_disk_spill_names_a_truncated_file_at_unpack(tmp_path: Path) -> None:
    _x, y, _session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)
    (file,) = [p for d in spill_dirs(tmp_path) for p in d.iterdir()]
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ts.SpillError, match="truncated"):
        y.sum().backward()


def test_disk_spill_names_a_deleted_file_at_unpack(tmp_path: Path) -> None:
    _x, y, _session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)
    for d in spill_dirs(tmp_path):
        for p in d.iterdir():
            p.unlink()
    with pytest.raises(ts.SpillError, match="cannot read back"):
        y.sum().backward()


def test_disk_spill_full_disk_keeps_the_tensor_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(name: str) -> int:  # writes fail with ENOSPC, as on a full disk
        return os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)

    monkeypatch.setattr(disk.spill_directory(tmp_path), "create", full)
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="disk .* is full"):
        with ts.stash(ts.DiskSpill(tmp_path), min_bytes=0) as session:
            y = (x * 2).sin()
        y.sum().backward()
    assert torch.equal(x.grad, 2 * (x * 2).cos())
    assert session.stats.fallbacks["disk full"] == 1
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 0


def test_disk_spill_removes_stale_directories_of_dead_processes(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(child.stdout)
    stale = tmp_path / f"tensorstash-{dead_pid}-abcdef"
    stale.mkdir(mode=0o700)
    (stale / "00000001.bin").write_bytes(b"x" * 10)
    alive = tmp_path / f"tensorstash-{os.getppid()}-abcdef"
    alive.mkdir(mode=0o700)
    unrelated = tmp_path / "tensorstash-notapid"
    unrelated.mkdir()
    removed = disk.remove_stale(tmp_path)
    assert removed == [str(stale)]
    assert alive.exists() and unrelated.exists()


_FORK_SCRIPT = """
import gc, multiprocessing, os, sys
import torch
import tensorstash as ts
from tensorstash import disk

torch.set_num_threads(1)  # a fork after a multi-threaded OpenMP op hangs the child
parent = sys.argv[1]


def dirs():
    return sorted(p for p in os.listdir(parent) if p.startswith("tensorstash-"))


def spill_and_backward():
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(parent), min_bytes=0):
        y = (x * 2).sin().sum()
    y.backward()


if __name__ == "__main__":
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(parent), min_bytes=0):
        y = (x * 2).sin()  # the parent holds a spilled tensor
    mine = dirs()
    pid = os.fork()
    if pid == 0:  # spills too, frees its copy of the parent's values, exits
        code = 1
        try:
            spill_and_backward()
            del y
            gc.collect()
            disk.remove_directories()  # what its exit runs
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert dirs() == mine, (dirs(), mine)  # the child removed its own directory only
    y.sum().backward()  # the parent's files are all there
    del x, y
    gc.collect()
    disk.remove_directories()
    for start in ("fork", "spawn"):  # children that end with os._exit
        child = multiprocessing.get_context(start).Process(target=spill_and_backward)
        child.start()
        child.join(120)
        assert child.exitcode == 0, start
        assert dirs() == [], (start, dirs())
    print("ok")
"""


def test_forked_and_multiprocessing_children_keep_to_their_own_directory(tmp_path: Path) -> None:
    script = tmp_path / "children.py"
    script.write_text(_FORK_SCRIPT)
    spills = tmp_path / "spills"
    spills.mkdir()
    # CPU only: autograd cannot run in a forked child once it has run on a CUDA device.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(script), str(spills)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert spill_dirs(spills) == []
