"""CpuOffload: CPU tensors are kept; the pinned pool reuses buffers only once copies finish."""

from __future__ import annotations

import pytest
import torch

import tensorstash as ts
from tensorstash.tiers.cpu import CpuOffload, Inflight, OnHost, PinnedPool


class FakeEvent:
    """An event whose completion the test controls."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def make_pool(max_cached: int = 1 << 20) -> tuple[PinnedPool, list[int]]:
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return PinnedPool(allocate, max_cached), made


def test_pinned_pool_reuses_a_buffer_of_the_exact_size() -> None:
    pool, made = make_pool()
    first = pool.take(1000)
    pool.give(first, None)
    assert pool.take(1000) is first
    assert pool.take(1001) is not first  # no rounding: other sizes get their own buffer
    assert made == [1000, 1001]


def test_pinned_pool_waits_for_the_last_copy_before_reuse() -> None:
    pool, _ = make_pool()
    buffer = pool.take(4096)
    copy = FakeEvent(done=False)
    pool.give(buffer, copy)
    assert pool.take(4096) is not buffer  # a copy still reads it
    copy.done = True
    assert pool.take(4096) is buffer


def test_pinned_pool_never_hands_out_a_buffer_a_view_still_reads() -> None:
    # A later stage of a Chain (Lz4 keeping raw bytes, a spill write in flight)
    # may hold a view of the buffer after its packed value is freed.
    pool, made = make_pool()
    buffer = pool.take(4096)
    view = buffer[100:200]
    pool.give(buffer, None)
    other = pool.take(4096)
    assert other is not buffer
    pool.give(other, None)
    assert pool.take(4096) is other  # the next free buffer, not the one in use
    del view
    assert pool.take(4096) is buffer
    assert made == [4096, 4096]


def test_pinned_pool_keeps_a_buffer_a_later_stage_still_reads() -> None:
    pool, _ = make_pool()
    buffer = pool.take(4096)
    packed = OnHost("host", 4096, 4096, payload=buffer)
    read_by_next_stage = packed.ready()  # what Lz4 or DiskSpill keep while they work
    del packed
    pool.give(buffer, None)  # what freeing the packed value does
    assert pool.take(4096) is not buffer
    del read_by_next_stage
    assert pool.take(4096) is buffer


def fake_copy(nbytes: int, done: bool = False) -> OnHost:
    source = torch.empty(nbytes, dtype=torch.uint8)
    return OnHost("host", nbytes, nbytes, source=source, copied=FakeEvent(done))


def test_inflight_drops_the_sources_of_finished_copies_only() -> None:
    inflight = Inflight()
    first, second = fake_copy(1000, done=True), fake_copy(1000)
    inflight.add(first, 1000)
    inflight.add(second, 1000)
    inflight.reap()
    assert first.source is None and second.source is not None
    assert inflight.nbytes == 1000
    assert not second.copied.waited


def test_a_packed_value_that_still_holds_its_source_comes_back_as_it() -> None:
    # Rule 5 of NOTE [ Streams ]: no copy back (this test has no CUDA: a copy back
    # would fail), the consumer waits for the producer's event.
    source, produced = torch.arange(8, dtype=torch.uint8), FakeEvent(done=False)
    packed = OnHost("host", 8, 8, source=source, produced=produced, copied=FakeEvent(False))
    device_bytes, event = CpuOffload()._bring_back(packed, None)  # type: ignore[arg-type]
    assert device_bytes is source and event is produced


def test_inflight_waits_for_the_oldest_copies_beyond_its_bound() -> None:
    inflight = Inflight()
    copies = [fake_copy(1000) for _ in range(4)]
    for packed in copies:
        inflight.add(packed, 1000)
    inflight.reap(max_bytes=2500)
    assert [packed.copied.waited for packed in copies] == [True, True, False, False]
    assert [packed.source is None for packed in copies] == [True, True, False, False]
    assert inflight.nbytes == 2000
    inflight.reap(max_bytes=0)
    assert all(packed.source is None for packed in copies) and inflight.nbytes == 0


@pytest.mark.parametrize("name", ["max_inflight_bytes", "max_cached_bytes"])
def test_cpu_offload_byte_limits_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be at least 0 bytes"):
        ts.CpuOffload(**{name: -1})
    with pytest.raises(TypeError, match=rf"{name} must be bytes \(an int\)"):
        ts.CpuOffload(**{name: 1.5})


def test_pinned_pool_caches_at_most_max_cached_bytes() -> None:
    pool, _ = make_pool(max_cached=1500)
    a, b = pool.take(1000), pool.take(1000)
    pool.give(a, None)
    pool.give(b, None)
    assert pool.cached_bytes == 1000


def test_pinned_pool_close_waits_for_pending_copies() -> None:
    pool, _ = make_pool()
    copy = FakeEvent()
    pool.give(pool.take(10), copy)
    pool.close()
    assert copy.waited and pool.cached_bytes == 0


def test_cpu_offload_keeps_cpu_tensors_and_says_so_not_as_a_fallback() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.CpuOffload(), min_bytes=0) as session:
        y = (x * 2).sin()
    y.sum().backward()
    data = session.stats.to_dict()
    assert data["nothing_to_do"] == {"already in host memory (CpuOffload)": 1}
    assert data["fallbacks"] == {} and data["tiers"]["kept"]["tensors"] == 1
    table = session.stats.table()
    assert "nothing to do: already in host memory (CpuOffload): 1" in table, table
    assert "fallbacks" not in table, table
    assert torch.equal(x.grad, 2 * (x * 2).cos())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "policy",
    [ts.CpuOffload(), ts.CpuOffload(pin_memory=False), ts.Chain(ts.CpuOffload(), ts.Lz4())],
    ids=["pinned", "unpinned", "cpu+lz4"],
)
def test_cpu_offload_cuda_gradients_are_bitwise(policy: object) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)
    ).cuda()
    x = torch.randn(512, 512, device="cuda", requires_grad=True)

    def step() -> list[torch.Tensor]:
        model.zero_grad()
        x.grad = None
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    expected = step()
    with ts.stash(policy, min_bytes=0) as session:  # type: ignore[arg-type]
        loss = model(x).square().sum()
    model.zero_grad()
    x.grad = None
    loss.backward()
    actual = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    assert session.stats.to_dict()["tiers"]["host"]["tensors"] >= 1
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a)
