"""Spill files: private, no symlink followed, checked, cleaned up (NOTE [ Spill files ])."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import xxhash
from checks import leak_check, poll, spill_descriptors, spill_mappings

import tensorstash as ts
from tensorstash.core.policy import Context
from tensorstash.core.stats import StashStats
from tensorstash.memory import _trim
from tensorstash.tiers import _spilldir, _spillfile, disk


def spill_dirs(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith("tensorstash-"))


def spill_file(parent: Path) -> Path:
    """The one spill file open below ``parent``, as a path that opens it."""
    (found,) = spill_descriptors([parent])
    return Path(found)


SMALL, MAPPED = (256, 256), (1024, 512)  # read into a buffer; a mapped extent (rule 4)


def spilled_step(
    parent: Path, shape: tuple[int, int] = SMALL
) -> tuple[torch.Tensor, torch.Tensor, ts.Session]:
    x = torch.randn(*shape, requires_grad=True)
    with ts.stash(ts.DiskSpill(parent), min_bytes=0) as session:
        y = (x * 2).sin()
    return x, y, session


@pytest.mark.skipif(_trim.ALLOCATOR.release is None, reason="no way to hand memory back here")
def test_disk_spill_counts_the_memory_it_hands_back(tmp_path: Path) -> None:
    x = torch.randn(1 << 20, requires_grad=True)
    with ts.stash(ts.DiskSpill(tmp_path, trim_every=1), min_bytes=0) as session:
        y = x
        for _ in range(4):
            y = (y * 2).sin()  # each saves a new 4 MiB tensor: the resident set grows
    y.sum().backward()
    assert session.stats.returns >= 1
    assert "handed back to the OS" in session.stats.table()
    with ts.stash(ts.DiskSpill(tmp_path, trim_every=None), min_bytes=0) as untrimmed:
        y = (x * 2).sin()
    y.sum().backward()
    assert untrimmed.stats.returns == 0


@pytest.mark.skipif(_trim.ALLOCATOR.release is None, reason="no way to hand memory back here")
def test_disk_spill_steps_count_their_growth_from_the_last_spill_steps_hand_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    floor = _trim.Floor()
    monkeypatch.setattr("tensorstash.tiers.disk.FLOOR", floor)
    x = torch.randn(1 << 20, requires_grad=True)
    with ts.stash(ts.DiskSpill(tmp_path, trim_every=1), min_bytes=0):
        y = (x * 2).sin()  # writes one 4 MiB tensor
    assert floor.written == 4 << 20
    y.sum().backward()
    with ts.stash(ts.DiskSpill(tmp_path, trim_every=1), min_bytes=0):
        y = (x * 2).sin()
    assert floor.written == 4 << 20  # this step's writes
    y.sum().backward()


def test_disk_spill_files_are_private_and_nameless(tmp_path: Path) -> None:
    _x, y, _session = spilled_step(tmp_path)
    directory = spill_dirs(tmp_path)[-1]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    y.sum().backward(retain_graph=True)  # waits for the background writer
    assert list(directory.iterdir()) == []  # nothing to open, replace or remove from outside
    assert stat.S_IMODE(os.stat(spill_file(tmp_path)).st_mode) == 0o600


def test_disk_spill_closes_its_file_when_the_graph_is_freed(tmp_path: Path) -> None:
    _x, y, session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)
    assert spill_descriptors([tmp_path]), "the graph is alive: its file should be open"
    del y
    gc.collect()
    assert [p for d in spill_dirs(tmp_path) for p in d.iterdir()] == []
    assert spill_descriptors([tmp_path]) == []
    assert session.stats.live_bytes == 0


def test_disk_spill_without_o_tmpfile_removes_the_name_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    x, y, _session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)
    assert [p for d in spill_dirs(tmp_path) for p in d.iterdir()] == []
    assert stat.S_IMODE(os.stat(spill_file(tmp_path)).st_mode) == 0o600
    assert torch.equal(x.grad, 2 * (x * 2).cos())


@pytest.mark.slow  # many steps of spills: make test-all
def test_disk_spill_reuses_the_extents_of_freed_values(tmp_path: Path) -> None:
    def steps(x: torch.Tensor, session: Any) -> torch.Tensor:
        with session:
            keep = (x * 2).sin()  # 256 KiB stays spilled while the others come and go
            for _ in range(20):
                y = (x * 3).sin()
                y.sum().backward()
                del y
                gc.collect()
        return keep

    x = torch.randn(256, 256, requires_grad=True)
    plain = x.detach().clone().requires_grad_()
    keep = steps(x, ts.stash(ts.DiskSpill(tmp_path), min_bytes=0))
    keep.sum().backward(retain_graph=True)
    size = os.stat(spill_file(tmp_path)).st_size
    assert size <= 3 * x.nbytes, f"the file grew to {size} bytes for two live values"
    steps(plain, contextlib.nullcontext()).sum().backward()
    assert torch.equal(x.grad, plain.grad)


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


@pytest.mark.parametrize("shape", [SMALL, MAPPED])
def test_disk_spill_names_a_corrupted_file_at_unpack(
    tmp_path: Path, shape: tuple[int, int]
) -> None:
    _x, y, _session = spilled_step(tmp_path, shape)
    y.sum().backward(retain_graph=True)  # the file is written and read once
    file = spill_file(tmp_path)
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF
    file.write_bytes(bytes(data))
    name = rf"\[{shape[0]}, {shape[1]}\]"
    with pytest.raises(ts.SpillError, match=rf"corrupted.*{name}|{name}.*corrupted"):
        y.sum().backward()


@pytest.mark.parametrize("shape", [SMALL, MAPPED])
def test_disk_spill_names_a_truncated_file_at_unpack(
    tmp_path: Path, shape: tuple[int, int]
) -> None:
    _x, y, _session = spilled_step(tmp_path, shape)
    y.sum().backward(retain_graph=True)
    file = spill_file(tmp_path)
    file.write_bytes(file.read_bytes()[:1000])
    size = shape[0] * shape[1] * 4
    with pytest.raises(ts.SpillError, match=f"truncated: read 1000 of {size} bytes"):
        y.sum().backward()


class _Kept(torch.autograd.Function):
    """``x.sin()`` whose backward keeps the tensor it unpacked, as user code may."""

    kept: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _Kept.kept.append(x)
        return grad * x.cos()


@pytest.mark.skipif(_spillfile._POPULATE_READ is None, reason="values are read, not mapped")
def test_disk_spill_maps_a_large_value_and_holds_its_extent_while_the_tensor_lives(
    tmp_path: Path,
) -> None:
    """Rule 4: a value read back by mapping its extent shows its own bytes for as long
    as its tensor lives, however many values the session writes after it, and leaves
    nothing mapped once it dies."""
    first = torch.randn(*MAPPED, requires_grad=True)
    with ts.stash(ts.DiskSpill(tmp_path, background=False), min_bytes=0) as session:
        held = (torch.randn(*MAPPED, requires_grad=True) * 1.0).sin()  # keeps the file open
        _Kept.apply(first * 1.0).sum().backward()
        (kept,) = _Kept.kept
        assert spill_mappings([tmp_path]), "a value of 2 MiB is mapped, not read"
        expected = (first * 1.0).detach()
        assert torch.equal(kept, expected)
        for _ in range(3):  # freed extents are taken again first: never the one still mapped
            second = torch.randn(*MAPPED, requires_grad=True)
            (second * 1.0).sin().sum().backward()
        assert torch.equal(kept, expected)
    _Kept.kept.clear()
    del kept, held
    leak_check(session, directories=[tmp_path])


def test_disk_spill_reads_large_values_where_they_cannot_be_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_spillfile, "_POPULATE_READ", None)  # a kernel before 5.14
    x = torch.randn(*MAPPED, requires_grad=True)
    (x * 2).sin().sum().backward()
    expected, x.grad = x.grad, None
    with ts.stash(ts.DiskSpill(tmp_path, background=False), min_bytes=0) as session:
        y = (x * 2).sin()
        assert spill_descriptors([tmp_path])
    y.sum().backward()
    assert torch.equal(x.grad, expected)
    assert not spill_mappings([tmp_path])
    del y
    leak_check(session, directories=[tmp_path])


def test_disk_spill_reads_back_after_its_directory_was_deleted(tmp_path: Path) -> None:
    x, y, _session = spilled_step(tmp_path)
    y.sum().backward(retain_graph=True)
    for d in spill_dirs(tmp_path):
        shutil.rmtree(d)  # a cleaner of old temporary files, say
    x.grad = None
    y.sum().backward()
    assert torch.equal(x.grad, 2 * (x * 2).cos())


def test_disk_spill_makes_its_directory_again_for_a_new_file_in_a_session(
    tmp_path: Path,
) -> None:
    """The directory is looked up once a session and again for each new spill file:
    one deleted once the session's file closed is made again for the next value."""
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(tmp_path, background=False), min_bytes=0) as session:
        y = (x * 2).sin()
        (first,) = spill_dirs(tmp_path)
        del y  # its only value freed: the session's file closes
        gc.collect()
        assert poll(lambda: not spill_descriptors([tmp_path]), 10)
        shutil.rmtree(first)  # a cleaner of old temporary files, say
        z = (x * 3).sin()
    (again,) = spill_dirs(tmp_path)
    assert again != first
    z.sum().backward()
    assert torch.equal(x.grad, 3 * (x * 3).cos())
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2
    del z
    gc.collect()
    assert poll(lambda: not spill_descriptors([tmp_path]), 10)


def test_disk_spill_full_disk_keeps_the_tensor_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full() -> int:  # writes fail with ENOSPC, as on a full disk
        return os.open("/dev/full", os.O_RDWR | os.O_CLOEXEC)

    monkeypatch.setattr(disk.spill_directory(tmp_path), "anonymous", full)
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
from tensorstash.tiers import disk

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


@pytest.mark.slow
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


# -- nothing outlives the graph (rule 6 of NOTE [ Spill files ]) ------------------------------


@pytest.mark.slow  # rounds of writes in flight: make test-all
@pytest.mark.parametrize("background", [True, False], ids=["writer", "inline"])
def test_disk_spill_graphs_freed_mid_write_leave_no_file(tmp_path: Path, background: bool) -> None:
    for _ in range(30):
        h = torch.randn(256, 1024, requires_grad=True)
        with ts.stash(ts.DiskSpill(tmp_path, background=background), min_bytes=0):
            for _ in range(20):
                h = h * 1.0001
        del h  # the writer is still at work on most of the 20 values
        gc.collect()
        assert [p for d in spill_dirs(tmp_path) for p in d.iterdir()] == []
        # At most the write in flight holds the file; it closes once that ends.
        assert poll(lambda: not spill_descriptors([tmp_path]), 2.0), (
            "a spill file outlived its graph"
        )


def test_disk_spill_counts_bytes_waiting_for_the_writer_as_host(tmp_path: Path) -> None:
    ctx = Context(StashStats())
    ctx.opened()
    gate = threading.Event()
    ctx.writer().submit(gate.wait)  # the writer is busy: the next value waits
    try:
        packed = ts.DiskSpill(tmp_path, background=True).pack(torch.randn(256, 256), ctx)
        ctx.account(packed)
        assert packed.tier == "host"
        assert ctx.stats.to_dict()["tiers"]["host"]["live_bytes"] == 256 * 256 * 4
    finally:
        gate.set()
    assert packed.written is not None
    packed.written.result()
    assert packed.tier == "disk"
    assert ctx.stats.to_dict()["tiers"]["disk"]["live_bytes"] == 256 * 256 * 4
    del packed
    ctx.closed()


# -- who writes and reads (rule 3 of NOTE [ Spill files ]) ------------------------------------


@pytest.mark.parametrize("spare", [0, 1], ids=["torch-uses-every-core", "a-core-to-spare"])
def test_disk_spill_writes_on_the_training_thread_only_without_a_spare_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: int
) -> None:
    monkeypatch.setattr(disk, "usable_cores", lambda: torch.get_num_threads() + spare)
    ctx = Context(StashStats())
    ctx.opened()
    packed = ts.DiskSpill(tmp_path).pack(torch.randn(256, 256), ctx)
    assert isinstance(packed, disk.Spilled)
    assert packed.inline is (spare == 0)
    assert (ctx._writer is None) is (spare == 0), "a writer thread only with a core to spare"
    if spare == 0:
        assert packed.written is not None and packed.written.done()
        assert packed.tier == "disk", "written before pack returned"
    del packed
    ctx.closed()


def test_disk_spill_keeps_device_and_staged_values_on_the_writer(tmp_path: Path) -> None:
    ctx = Context(StashStats())
    spill = ts.DiskSpill(tmp_path)
    shared = spill._shared(ctx)
    assert spill._in_background("host", shared), "a copy from a device may still be in flight"
    assert not ts.DiskSpill(tmp_path, background=False)._in_background("kept", shared)
    assert ts.DiskSpill(tmp_path, background=True)._in_background("kept", shared)


def test_disk_spill_inline_is_bitwise_reads_at_unpack_and_asks_the_kernel_to_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    advised: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    layers = [torch.randn(256, 256) for _ in range(6)]

    def forward() -> torch.Tensor:
        h = x
        for w in layers:
            h = (h @ w).tanh()
        return h.sum()

    forward().backward()
    expected, x.grad = x.grad, None
    with ts.stash(ts.DiskSpill(tmp_path, background=False), min_bytes=0) as session:
        loss = forward()
    assert session.stats.to_dict()["tiers"]["host"]["live_bytes"] == 0, "all written at pack"
    loss.backward()
    assert torch.equal(x.grad, expected)
    assert advised and all(a == os.POSIX_FADV_WILLNEED for _, _, a in advised)
    assert all(offset % 4096 == 0 and length % 4096 == 0 for offset, length, _ in advised)
    assert session._ctx._pool is None and session._ctx._writer is None, "no thread was started"
    del loss
    gc.collect()
    assert session.stats.live_bytes == 0
    assert spill_descriptors([tmp_path]) == []


def test_disk_spill_inline_write_error_is_raised_at_unpack_and_frees_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int, views: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(_spillfile, "write_views", broken)
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(tmp_path, background=False), min_bytes=0) as session:
        y = (x * 2).sin()  # pack returns: the error waits for the step's backward
    with pytest.raises(ts.SpillError, match=r"cannot write .* Input/output error"):
        y.sum().backward()
    del y
    gc.collect()
    assert session.stats.live_bytes == 0
    assert spill_descriptors([tmp_path]) == []


def test_disk_spill_refuses_a_background_that_is_not_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="background must be True, False or None"):
        ts.DiskSpill(tmp_path, background="yes")  # type: ignore[arg-type]


# -- directories that cannot hold spill files (rule 1) ----------------------------------------


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_disk_spill_refuses_proc_at_construction() -> None:
    with pytest.raises(ValueError, match=r"DiskSpill: cannot make a spill directory in '/proc'"):
        ts.DiskSpill("/proc")


def test_disk_spill_refuses_a_file_as_directory(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        ts.DiskSpill(file)


def test_disk_spill_directory_that_stops_taking_directories_fails_at_first_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "later-read-only"
    parent.mkdir()
    policy = ts.DiskSpill(parent)

    def read_only(*args: object, **kwargs: object) -> str:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    x = torch.randn(256, 256, requires_grad=True)
    with (
        pytest.raises(ValueError, match=r"cannot make a spill directory.*Read-only"),
        ts.stash(policy, min_bytes=0),
    ):
        (x * 2).sin()


_MOUNTS = [
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n",
    "30 22 0:25 / /scratch/ram rw,nosuid shared:9 - tmpfs tmpfs rw,size=1024k\n",
]


def test_filesystem_reads_the_longest_mount_point() -> None:
    assert _spilldir.filesystem(Path("/scratch/ram/run"), lambda: _MOUNTS) == "tmpfs"
    assert _spilldir.filesystem(Path("/scratch/disk"), lambda: _MOUNTS) == "ext4"


def test_disk_spill_on_a_ram_filesystem_warns_once(tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    mounts = [*_MOUNTS, f"31 22 0:26 / {ram} rw - ramfs ramfs rw\n"]
    with pytest.warns(RuntimeWarning, match=r"ramfs.*Pass DiskSpill\(directory=\.\.\.\)"):
        assert _spilldir.warn_if_ram_backed(ram, lambda: mounts) == "ramfs"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _spilldir.warn_if_ram_backed(ram, lambda: mounts) == "ramfs"  # no second warning
        assert _spilldir.warn_if_ram_backed(tmp_path, lambda: _MOUNTS) is None


@pytest.mark.skipif(
    _spilldir.filesystem(Path("/dev/shm")) != "tmpfs", reason="needs /dev/shm on tmpfs"
)
def test_disk_spill_in_dev_shm_warns_at_construction() -> None:
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        with pytest.warns(RuntimeWarning, match="tmpfs, which keeps files in RAM"):
            ts.DiskSpill(shm)
    finally:
        shutil.rmtree(shm)


# -- a cap on the disk a session uses (rule 5) ------------------------------------------------


def test_disk_spill_past_its_cap_keeps_tensors_in_memory(tmp_path: Path) -> None:
    x = torch.randn(256, 256, requires_grad=True)  # (x * 2).sin().exp() saves two 256 KiB tensors
    policy = ts.DiskSpill(tmp_path, max_disk_bytes=300 << 10)
    with pytest.warns(RuntimeWarning, match=r"max_disk_bytes=307200.*disk cap"):
        with ts.stash(policy, min_bytes=0, record=True) as session:
            y = (x * 2).sin().exp()
        y.sum().backward()
    expected = x.detach().clone().requires_grad_()
    (expected * 2).sin().exp().sum().backward()
    assert torch.equal(x.grad, expected.grad)
    assert session.stats.fallbacks["disk cap"] == 1
    tiers = session.stats.to_dict()["tiers"]
    assert tiers["disk"]["tensors"] == 1 and tiers["kept"]["tensors"] == 1
    assert any("disk cap reached" in row["reason"] for row in session.decisions)
    del y
    gc.collect()
    assert session.stats.live_bytes == 0


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("max_disk_bytes", -1, ValueError, "must be at least 0 bytes"),
        ("max_disk_bytes", "lots", ValueError, "must be bytes"),
        ("max_disk_bytes", [1], TypeError, "must be None, bytes"),
        ("trim_every", -1, ValueError, "must be at least 0 bytes"),
        ("trim_every", 1.5, TypeError, "must be None, bytes"),
        ("trim_every", "50%", ValueError, "takes no share"),
    ],
)
def test_disk_spill_checks_its_sizes(
    field: str, value: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"DiskSpill: {field} {match}"):
        ts.DiskSpill(**{field: value})  # type: ignore[arg-type]


def test_disk_spill_takes_sizes_in_the_one_grammar() -> None:
    spill = ts.DiskSpill(max_disk_bytes="1GiB", max_pending_bytes="8 MiB", trim_every="64MB")
    assert (spill.max_disk_bytes, spill.max_pending_bytes) == (1 << 30, 8 << 20)
    assert spill.trim_every == 64_000_000


def test_disk_spill_writes_and_reads_every_byte_through_short_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces, batches and calls that move fewer bytes than asked lose nothing (rule 4)."""
    piece, iov_max = _spillfile.PIECE, _spillfile.IOV_MAX
    sizes = [0, 3, piece + 5, 1, *([7] * (iov_max + 3)), 2 * piece]
    payload = os.urandom(sum(sizes))
    views, start = [], 0
    for size in sizes:
        views.append(memoryview(payload)[start : start + size])
        start += size
    real_write, real_read = os.pwritev, os.preadv
    calls = []

    def short_write(fd: int, buffers: list[memoryview], offset: int) -> int:
        assert len(buffers) <= iov_max
        calls.append(sum(b.nbytes for b in buffers))
        return real_write(fd, [bytes(b"".join(buffers)[:100_003])], offset)

    def short_read(fd: int, buffers: list[memoryview], offset: int) -> int:
        (view,) = buffers
        return real_read(fd, [view[:65_537]], offset)

    monkeypatch.setattr(os, "pwritev", short_write)
    monkeypatch.setattr(os, "preadv", short_read)
    fd = disk.spill_directory(tmp_path).anonymous()
    try:
        digest = _spillfile.write_views(fd, views, 4096)
        assert digest == xxhash.xxh3_64_intdigest(payload)
        assert max(calls) < 2 * piece  # written a piece or a batch at a time
        back = bytearray(len(payload) + 100)
        read = xxhash.xxh3_64()
        got = _spillfile.read_into(fd, memoryview(back), 4096, read)
        assert got == len(payload)  # the file's end stops the read
        assert bytes(back[:got]) == payload
        assert read.intdigest() == digest
    finally:
        os.close(fd)
