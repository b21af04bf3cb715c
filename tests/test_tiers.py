"""Tiers meet through protocols (NOTE [ Tiers ]); read buffers and returned memory."""

from __future__ import annotations

import gc
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

import tensorstash as ts
from tensorstash.core._layout import Layout, describe, memory, rebuild
from tensorstash.core.policy import Context, Packed, Spillable
from tensorstash.memory._trim import Floor, Trimmer, Watch, find_allocator, resident_bytes
from tensorstash.tiers import _codec
from tensorstash.tiers._buffers import BufferPool


def _payloads() -> dict[str, tuple[Tensor, torch.dtype]]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(300_001, generator=generator)
    return {
        "raw": (dense, dense.dtype),
        "lz4": (torch.zeros(300_001), torch.float32),
        "shuffle": (dense.bfloat16(), torch.bfloat16),
        "bits": (torch.rand(300_003, generator=generator) > 0.5, torch.bool),
        "zeros": (dense.relu(), torch.float32),
    }


@pytest.mark.parametrize("method", _codec.METHODS)
def test_encoded_buffers_come_back_through_with_buffers(method: str) -> None:
    tensor, dtype = _payloads()[method]
    payload = tensor.view(torch.uint8).reshape(-1)
    encoded = _codec.encode(payload, dtype, method)
    # What a storage tier does: copy the buffers out, free the value, read them back.
    pieces = [torch.tensor(bytearray(view), dtype=torch.uint8) for view in encoded.buffers()]
    hollow = encoded.hollow()
    del encoded
    out = torch.empty_like(payload)
    _codec.decode(hollow.with_buffers(pieces), out)
    assert torch.equal(out, payload)


def test_with_buffers_refuses_buffers_that_do_not_fit() -> None:
    payload = torch.zeros(1 << 20, dtype=torch.uint8)
    hollow = _codec.encode(payload, torch.uint8, "lz4").hollow()
    with pytest.raises(ValueError, match="do not fit an encoded value"):
        hollow.with_buffers([payload, payload, payload])


# -- a stage DiskSpill has never heard of ------------------------------------------------------


@dataclass(eq=False, slots=True, weakref_slot=True)
class Halves(Packed):
    """A tensor's bytes in two buffers (a stand-in for any codec's packed value)."""

    layout: Layout | None = None
    front: Tensor | None = None
    back: Tensor | None = None

    def spill_buffers(self, ctx: Context) -> tuple[Halves, list[memoryview]]:
        assert self.front is not None and self.back is not None
        shell = Halves(self.tier, self.nbytes, self.stored_bytes, self.layout)
        return shell, [memory(self.front), memory(self.back)]

    def from_buffers(self, pieces: list[Tensor]) -> Halves:
        front, back = pieces
        return Halves("host", self.nbytes, self.stored_bytes, self.layout, front, back)


@dataclass(frozen=True)
class Halve:
    """A stage of rank 1 that packs to :class:`Halves`."""

    stage_rank: ClassVar[int] = 1

    def pack(self, value: Tensor, ctx: Context) -> Halves:
        layout, payload = describe(value)
        payload = payload.clone()
        half = payload.numel() // 2
        return Halves("host", layout.nbytes, layout.nbytes, layout, payload[:half], payload[half:])

    def unpack(self, packed: Halves, ctx: Context) -> Tensor:
        assert packed.layout is not None and packed.front is not None and packed.back is not None
        return rebuild(packed.layout, torch.cat([packed.front, packed.back]))


def test_disk_spill_writes_any_spillable_value(tmp_path: Path) -> None:
    assert isinstance(Halves("host", 0, 0), Spillable)
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.Chain(Halve(), ts.DiskSpill(tmp_path)), min_bytes=0) as session:
        y = (x * 2).sin().exp()
    y.sum().backward()
    expected = x.detach().clone().requires_grad_()
    (expected * 2).sin().exp().sum().backward()
    assert torch.equal(x.grad, expected.grad)
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 2


@dataclass(frozen=True)
class Opaque:
    """A stage whose packed value gives no buffers."""

    stage_rank: ClassVar[int] = 1

    def pack(self, value: Tensor, ctx: Context) -> Packed:
        return Packed("host", 0, 0)

    def unpack(self, packed: Packed, ctx: Context) -> Any:
        raise AssertionError("never unpacked")


def test_disk_spill_refuses_a_value_without_buffers(tmp_path: Path) -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with (
        pytest.raises(TypeError, match=r"cannot spill a Packed.*spill_buffers and from_buffers"),
        ts.stash(ts.Chain(Opaque(), ts.DiskSpill(tmp_path)), min_bytes=0),
    ):
        (x * 2).sin()


# -- read buffers and returned memory -----------------------------------------------------------


def test_buffer_pool_reuses_a_buffer_once_its_tensor_dies() -> None:
    pool = BufferPool(max_cached_bytes=1 << 20)
    first = pool.take(100_000)
    address = first.data_ptr()
    assert pool.take(100_000).data_ptr() != address  # still in use
    del first
    gc.collect()
    again = pool.take(100_000)
    assert again.data_ptr() == address
    assert again.numel() == 100_000 and again.dtype == torch.uint8


def test_buffer_pool_unmaps_what_it_cannot_keep() -> None:
    pool = BufferPool(max_cached_bytes=1 << 20)
    buffers = [pool.take(600_000) for _ in range(3)]
    del buffers
    gc.collect()
    assert pool.cached_bytes <= 1 << 20
    assert pool.mapped == 3


def test_buffer_pool_views_keep_the_buffer_in_use() -> None:
    pool = BufferPool()
    data = pool.take(4096)
    data.fill_(7)
    view = data[100:200].view(torch.int32)
    address = data.data_ptr()
    del data
    gc.collect()
    assert pool.take(4096).data_ptr() != address  # the view still holds it
    assert bool((view == 0x07070707).all())


class FakeMemory:
    """A resident set that grows as told, and a release that shrinks it."""

    def __init__(self) -> None:
        self.bytes = 100 << 20
        self.released = 0

    def resident(self) -> int:
        return self.bytes

    def release(self) -> None:
        self.released += 1
        self.bytes -= 8 << 20


class FakeLibc:
    """The symbols an allocator exports, and a count of the bytes ``malloc`` gave out."""

    def __init__(
        self, *, jemalloc: str = "", tcmalloc: str = "", glibc: bool = True, purges: bool = True
    ) -> None:
        # jemalloc / tcmalloc: "" (not loaded), "loaded" (its symbols only), "serving" (malloc too)
        self.purges = purges  # jemalloc 5 and later know "arena.4096.purge"
        self.allocated = 0
        self.calls: list[Any] = []
        self.serving = (
            "jemalloc" if jemalloc == "serving" else "tcmalloc" if tcmalloc == "serving" else ""
        )
        self.malloc = self._fn(self._malloc)
        self.free = self._fn(lambda block: None)
        if jemalloc:
            self.mallctl = self._fn(self._mallctl)
        if tcmalloc:
            self.MallocExtension_GetNumericProperty = self._fn(self._property)
            self.MallocExtension_ReleaseFreeMemory = self._fn(lambda: self.calls.append("release"))
        if glibc:
            self.malloc_trim = self._fn(lambda pad: self.calls.append(("malloc_trim", pad)))

    @staticmethod
    def _fn(call: Callable[..., Any]) -> Any:
        class Fn:  # a ctypes function: argtypes and restype may be set
            def __call__(self, *args: Any) -> Any:
                return call(*args)

        return Fn()

    def _malloc(self, size: int) -> int:
        if self.serving:
            self.allocated += size
        return 4096

    def _mallctl(self, name: bytes, old: Any, size: Any, new: Any, new_size: int) -> int:
        if name == b"thread.allocated":
            old._obj.value = self.allocated if self.serving == "jemalloc" else 0
            return 0
        self.calls.append(name)
        return 0 if self.purges else 2  # ENOENT

    def _property(self, name: bytes, value: Any) -> int:
        value._obj.value = self.allocated if self.serving == "tcmalloc" else 0
        return 1


@pytest.mark.parametrize(
    ("libc", "name", "call"),
    [
        (FakeLibc(), "glibc", ("malloc_trim", 0)),
        (FakeLibc(jemalloc="serving"), "jemalloc", b"arena.4096.purge"),
        (FakeLibc(jemalloc="loaded"), "glibc", ("malloc_trim", 0)),  # another library's copy
        (FakeLibc(tcmalloc="serving"), "tcmalloc", "release"),
        (FakeLibc(tcmalloc="loaded"), "glibc", ("malloc_trim", 0)),
        (FakeLibc(glibc=False), "other", None),
        (FakeLibc(jemalloc="serving", purges=False), "jemalloc", None),
    ],
    ids=[
        "glibc",
        "jemalloc",
        "jemalloc-not-serving",
        "tcmalloc",
        "tcmalloc-not-serving",
        "none",
        "jemalloc-4",
    ],
)
def test_the_allocator_serving_malloc_is_the_one_that_hands_memory_back(
    libc: FakeLibc, name: str, call: Any
) -> None:
    found = find_allocator(libc)
    assert found.name == name
    libc.calls = [c for c in libc.calls if c != b"arena.4096.purge"]  # the one at detection
    if call is None:
        assert found.release is None
        return
    assert found.release is not None
    found.release()
    assert libc.calls == [call]


def test_trimmer_releases_once_the_resident_set_grew() -> None:
    memory = FakeMemory()
    trimmer = Trimmer(16 << 20, release=memory.release, resident=memory.resident)
    memory.bytes += 15 << 20
    trimmer.moved()
    assert memory.released == 0
    memory.bytes += 1 << 20
    trimmer.moved()
    assert memory.released == 1
    memory.bytes += 15 << 20  # 15 MiB above what the last call left
    trimmer.moved()
    assert memory.released == 1
    assert trimmer.calls == 1


def test_trimmer_counts_each_call_and_the_bytes_the_resident_set_fell_by() -> None:
    memory = FakeMemory()
    stats = ts.StashStats()
    trimmer = Trimmer(16 << 20, memory.release, memory.resident, counted=stats.returned)
    memory.bytes += 15 << 20
    trimmer.moved()
    assert (stats.returns, stats.returned_bytes) == (0, 0)
    memory.bytes += 1 << 20
    trimmer.moved()
    assert (stats.returns, stats.returned_bytes) == (1, 8 << 20)
    memory.bytes += 24 << 20  # 16 MiB above what the last call left
    trimmer.moved()
    assert (stats.returns, stats.returned_bytes) == (2, 16 << 20)
    data = stats.to_dict()
    assert (data["returns"], data["returned_bytes"]) == (2, 16 << 20)
    assert "handed back to the OS: 16.0 MiB in 2 call(s)" in stats.table()
    assert stats.metrics(per=2)["tensorstash/returned_bytes"] == 8 << 20
    total = ts.StashStats.combined([stats, data])
    assert (total.returns, total.returned_bytes) == (4, 32 << 20)


def test_trimmer_counts_a_spill_steps_growth_from_where_the_last_spill_step_handed_back() -> None:
    # In training a step begins with the free memory the last one left resident.
    memory, floor = FakeMemory(), Floor()
    first = Trimmer(16 << 20, memory.release, memory.resident, floor=floor)
    first.moved(20 << 20)  # a spill step: 20 MiB written
    memory.bytes += 16 << 20
    first.moved()
    assert memory.released == 1 and floor.resident == 108 << 20
    memory.bytes += 10 << 20  # left resident when the next step begins
    second = Trimmer(16 << 20, memory.release, memory.resident, floor=floor)
    memory.bytes += 6 << 20  # 16 MiB above the floor, 6 above this step's start
    second.moved()
    assert memory.released == 2
    # After a step that wrote less than trim_every, growth counts from the step's start:
    # the memory it left is not a spill's to hand back.
    memory.bytes += 10 << 20
    third = Trimmer(16 << 20, memory.release, memory.resident, floor=floor)
    memory.bytes += 6 << 20
    third.moved()
    assert memory.released == 2
    without = Trimmer(16 << 20, memory.release, memory.resident)  # no floor: its own start
    memory.bytes += 15 << 20
    without.moved()
    assert memory.released == 2


def test_floor_starts_empty_in_a_forked_child() -> None:
    floor = Floor()
    floor.handed_back(1 << 20)
    floor.wrote(64 << 20)
    floor._forget()
    assert floor.begin(8 << 20, 1) == 8 << 20


def test_trimmer_without_a_release_never_reads_memory() -> None:
    def resident() -> int:
        raise AssertionError("read the resident set")

    Trimmer(16 << 20, release=None, resident=resident).moved()
    Trimmer(None, release=lambda: None, resident=resident).moved()


def test_watch_trims_while_the_step_holds_and_stops_when_it_holds_nothing() -> None:
    memory = FakeMemory()
    holding = [True]
    watch = Watch(16 << 20, lambda: holding[0], memory.release, memory.resident, 0.001)
    watch.start()
    memory.bytes += 20 << 20
    _wait_for(lambda: memory.released == 1)
    memory.bytes -= 30 << 20  # freed: the next growth counts from here
    _wait_for(lambda: watch.trimmer._base == memory.bytes)
    memory.bytes += 10 << 20
    time.sleep(0.02)
    assert memory.released == 1
    watch.exited()  # exited, still holding: it goes on
    time.sleep(0.02)
    assert watch._thread.is_alive()
    holding[0] = False
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive()


def test_watch_without_a_release_starts_no_thread() -> None:
    watch = Watch(16 << 20, lambda: True, release=None)
    watch.start()
    assert not watch._thread.is_alive()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux /proc only")
def test_resident_bytes_reads_this_process_through_one_descriptor_and_a_forked_childs_own() -> None:
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    resident_bytes()
    descriptors = process.num_fds()
    for _ in range(100):
        resident_bytes()
    assert process.num_fds() == descriptors
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own resident set; no torch here (its threads did not fork)
        try:
            before = resident_bytes()
            grown = b"\x01" * (64 << 20)  # every page written
            os.write(write, f"{resident_bytes() - before} {len(grown)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    grew = int(os.read(read, 64).split()[0]) if ready else -1
    os.close(read)
    os.waitpid(pid, 0)
    assert grew >= 60 << 20  # read through the parent's descriptor, it would not move


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
