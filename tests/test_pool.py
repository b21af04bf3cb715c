"""The session pool (NOTE [ Session pool ] in tensorstash/memory/_pool.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import tensorstash as ts
from tensorstash.memory import _pool

MiB = 1 << 20

pytestmark = pytest.mark.skipif(_pool.compiled is None, reason="the session pool is not built")


def counts() -> _pool.PoolCounts:
    found = _pool.counts()
    assert found is not None
    return found


def extension() -> ModuleType:
    assert _pool.compiled is not None
    return _pool.compiled


@pytest.fixture(autouse=True)
def books_add_up() -> Iterator[None]:
    """After every test, what the pool records adds up to what is in use and waiting."""
    yield
    extension()._fail_books(0, 0)
    extension()._fail_remaps(0)
    extension()._fail_unmaps(0)
    gc.collect()
    books = _pool.check_books()
    assert books is not None
    assert books.recorded_bytes == books.live_bytes + books.cached_bytes


def test_pool_serves_large_cpu_blocks_only_while_leased() -> None:
    assert not _pool.installed()
    before = counts()
    lease = _pool.lease(8 * MiB)
    assert lease is not None and _pool.installed()
    small = torch.empty(1024)  # 4 KiB: the allocator installed before serves it
    assert counts().misses == before.misses
    block = torch.empty(MiB // 4)  # 1 MiB: a mapping of its own
    assert counts().misses == before.misses + 1
    assert counts().live_bytes - before.live_bytes == MiB
    del block
    assert counts().cached_bytes == MiB  # waits for a request of its size
    again = torch.ones(MiB // 4 - 100)  # a little smaller: the same block, filled anew
    assert counts().hits == before.hits + 1 and counts().cached_bytes == 0
    assert bool((again == 1).all())
    lease.close()
    lease.close()  # twice is harmless
    assert not _pool.installed()
    del again, small
    gc.collect()
    after = counts()
    assert after.live_bytes == before.live_bytes and after.cached_bytes == 0


def test_pool_keeps_freed_blocks_to_its_high_water_mark_plus_its_cap_and_unmaps_the_rest() -> None:
    before = counts()
    lease = _pool.lease(2 * MiB)
    assert lease is not None
    blocks = [torch.empty(MiB // 4) for _ in range(4)]
    del blocks[:]
    assert counts().cached_bytes == 4 * MiB  # no more than the blocks in use held
    big = torch.empty(4 * MiB)  # 16 MiB: the newest block waiting, grown
    now = counts()
    assert now.grown == before.grown + 1 and now.misses == before.misses + 4
    assert now.cached_bytes == 2 * MiB  # at the high-water mark: the cap
    assert now.unmapped_bytes - before.unmapped_bytes == MiB  # the oldest left
    del big  # under the high-water mark: it waits, the oldest leave
    assert counts().cached_bytes == 16 * MiB
    assert counts().unmapped_bytes - before.unmapped_bytes == 3 * MiB
    kept = torch.empty(MiB // 4)  # the head of the 16 MiB block; the tail waits
    assert counts().hits == before.hits + 1 and counts().cached_bytes == 15 * MiB
    lease.close()
    assert counts().cached_bytes == 0  # the tail left with the pool
    assert counts().unmapped_bytes - before.unmapped_bytes == 18 * MiB
    del kept  # freed after: unmapped at once
    after = counts()
    assert after.unmapped_bytes - before.unmapped_bytes == 19 * MiB
    assert after.live_bytes == before.live_bytes


def test_pool_blocks_split_and_grown_carry_what_was_written_to_them() -> None:
    lease = _pool.lease(MiB)
    assert lease is not None
    try:
        before = counts()
        block = torch.empty(MiB)  # 4 MiB
        del block  # waiting
        head = torch.full((MiB // 4,), 3.0)  # split from it
        tail = torch.full((3 * MiB // 4,), 5.0)  # the rest: whole
        assert counts().hits == before.hits + 2 and counts().misses == before.misses + 1
        del head
        grown = torch.arange(MiB, dtype=torch.float32)  # no 4 MiB block waits: 1 MiB, grown
        assert counts().grown == before.grown + 1
        assert bool((tail == 5).all()) and torch.equal(grown, torch.arange(MiB).float())
        grown.mul_(2)
        del tail
        assert torch.equal(grown, 2 * torch.arange(MiB).float())
    finally:
        lease.close()


def test_pool_stays_while_any_lease_holds_it_with_the_largest_cap() -> None:
    first, second = _pool.lease(MiB), _pool.lease(4 * MiB)
    assert first is not None and second is not None
    blocks = [torch.empty(MiB // 4) for _ in range(4)]
    del blocks[:]
    big = torch.empty(4 * MiB)  # at a new high-water mark: the cap holds
    assert counts().cached_bytes == 3 * MiB  # under the larger cap
    second.close()
    assert _pool.installed() and counts().cached_bytes == MiB  # the cap left
    del second
    gc.collect()
    assert _pool.installed()
    first.close()
    assert not _pool.installed()
    del big


def test_pool_blocks_carry_bitwise_values_across_every_operation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    x = torch.randn(256, 512)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    lease = _pool.lease(16 * MiB)
    assert lease is not None
    before = counts()
    try:
        model(x).square().sum().backward()
    finally:
        lease.close()
    assert counts().misses > before.misses  # activations and gradients came from the pool
    for got, want in zip(model.parameters(), plain, strict=True):
        assert torch.equal(got.grad, want)  # type: ignore[arg-type]


def test_disk_spill_takes_the_pool_once_it_wrote_trim_every_and_gives_it_back(
    tmp_path: Path,
) -> None:
    x = torch.randn(MiB // 4, requires_grad=True)  # 1 MiB
    with ts.stash(ts.DiskSpill(tmp_path, trim_every=4 * MiB), min_bytes=0) as session:
        y = x
        for _ in range(2):  # 2 MiB written: less than it may keep, no pool
            y = (y * 2).sin()
        assert not _pool.installed()
        for _ in range(4):
            y = (y * 2).sin()
        deadline = time.monotonic() + 5
        while not _pool.installed() and time.monotonic() < deadline:
            time.sleep(0.001)  # the writer may still be at work
        assert _pool.installed()
    y.sum().backward()
    del y
    gc.collect()
    assert not _pool.installed()  # back once the graph was freed
    assert session.stats.live_bytes == 0
    untrimmed = ts.DiskSpill(tmp_path, trim_every=None)
    with ts.stash(untrimmed, min_bytes=0):
        y = x
        for _ in range(8):
            y = (y * 2).sin()
        time.sleep(0.05)
        assert not _pool.installed()  # trim_every=None: nothing is handed back
    y.sum().backward()


def test_disk_spill_with_the_pool_gives_bitwise_gradients_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
    x = torch.randn(1024, 256)  # 1 MiB a saved tensor
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    before = counts()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with ts.stash(ts.DiskSpill(tmp_path, trim_every=2 * MiB), min_bytes=0) as session:
            loss = model(x).sum()
        loss.backward()
        del loss
        gc.collect()
        assert not _pool.installed()
        assert session.stats.live_bytes == 0
        for got, want in zip(model.parameters(), plain, strict=True):
            assert torch.equal(got.grad, want)  # type: ignore[arg-type]
    assert counts().hits > before.hits  # written activations' blocks served later ones
    assert [p for d in tmp_path.iterdir() for p in d.iterdir()] == []


def test_a_child_forked_while_the_pool_serves_allocates_and_exits() -> None:
    lease = _pool.lease(4 * MiB)
    assert lease is not None
    try:
        pid = os.fork()
        if pid == 0:  # the child: the pool's lock is its own
            try:  # no kernel here: OpenMP's threads do not survive a fork
                blocks = [torch.empty(MiB // 4) for _ in range(3)]
                del blocks[1:]
                again = torch.empty(MiB // 4)
                _pool.check_books()
                os._exit(0 if again.numel() == MiB // 4 else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        lease.close()


def test_a_planned_step_counts_the_pools_mapping_as_handing_memory_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]
    )
    x = torch.randn(512, 256)
    with ts.stash(ts.Keep()) as probe:
        loss = model(x).sum()
    loss.backward()
    budget = probe.stats.tiers["kept"].peak_bytes // 3
    profile = ts.Profile()
    before = counts().mapping_s
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        with ts.stash(ts.Auto(device_budget=budget), profile=profile) as session:
            loss = model(x).sum()
        loss.backward()
        del loss
        gc.collect()
        assert session.plan is None or session.plan.returns_memory
    steps = [*profile.history, *profile.quiet_history]
    mapped = counts().mapping_s - before
    assert mapped > 0 and any(s.recomputed and s.trim_s > 0 for s in profile.history)
    assert sum(s.trim_s for s in steps) <= mapped + 1e-9  # no step counts more than the pool did


def test_pool_blocks_split_and_grown_on_many_threads_keep_their_values() -> None:
    lease = _pool.lease(4 * MiB)
    assert lease is not None
    errors: list[str] = []

    def churn(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        held: list[tuple[torch.Tensor, float]] = []
        for step in range(300):
            numel = int(torch.randint(32 << 10, 1 << 20, (1,), generator=generator))
            value = float(seed * 1000 + step)
            held.append((torch.full((numel,), value), value))  # 128 KiB to 4 MiB
            if len(held) > 6:
                tensor, want = held.pop(int(torch.randint(0, len(held), (1,), generator=generator)))
                if not bool((tensor == want).all()):
                    errors.append(f"thread {seed}: a block lost its values")
        for tensor, want in held:
            if not bool((tensor == want).all()):
                errors.append(f"thread {seed}: a block lost its values")

    before = counts()
    try:
        threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        lease.close()
    after = counts()
    assert errors == []
    assert after.hits > before.hits and after.grown > before.grown  # split and grown both ran
    assert after.live_bytes == before.live_bytes and after.cached_bytes == 0


_RAW_RACE = """
import threading, time
import torch
from torch import nn
from tensorstash.memory import _pool
torch.set_num_threads(1)
torch.manual_seed(0)
lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
x = torch.randn(8, 40, 32)
stop = False
def run():
    with torch.no_grad():
        while not stop:
            lstm(x)
thread = threading.Thread(target=run)
thread.start()
deadline = time.monotonic() + 1.5
while time.monotonic() < deadline:
    lease = _pool.lease(1 << 20)
    time.sleep(0.0005)
    lease.close()
    time.sleep(0.0005)
stop = True
thread.join()
print("ok")
"""


@pytest.mark.slow  # a subprocess
def test_memory_taken_raw_under_one_allocator_goes_back_to_it_whenever_freed() -> None:
    # oneDNN (an LSTM on the CPU) takes its scratch memory with raw_allocate and gives it
    # back with raw_deallocate of whichever allocator is PyTorch's then. A lease that ends
    # on another thread (Auto's Watch does, at the end of a backward that recomputes an
    # LSTM) while such an op runs handed a pool block to free(): the process aborted.
    done = subprocess.run(
        [sys.executable, "-c", _RAW_RACE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_pool_stays_the_cpu_allocator_between_leases_and_serves_no_block_there() -> None:
    lease = _pool.lease(4 * MiB)
    assert lease is not None
    lease.close()
    before = counts()
    block = torch.empty(MiB // 4)  # between leases: the allocator it replaced serves it
    assert not _pool.installed() and counts().misses == before.misses
    del block
    assert counts().unmapped == before.unmapped


def test_a_forked_child_serves_nothing_and_keeps_none_of_its_parents_waiting_blocks() -> None:
    # Rule 6: a child inherited its parent's serving flag, high-water mark and blocks
    # waiting, so a DataLoader worker forked during a lease could keep up to the parent's
    # high-water mark mapped.
    lease = _pool.lease(4 * MiB)
    assert lease is not None
    try:
        blocks = [torch.empty(MiB) for _ in range(8)]  # 32 MiB in use: the high-water mark
        del blocks[:]
        assert counts().cached_bytes == 32 * MiB
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                now = counts()
                block = torch.empty(MiB)  # not served: the allocator the pool replaced
                after = counts()
                _pool.check_books()
                served = after.misses + after.hits + after.grown - now.misses - now.hits - now.grown
                os.write(write, f"{now.cached_bytes} {int(_pool.installed())} {served}".encode())
                del block
                os._exit(0)
            except BaseException:
                os._exit(2)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        said = os.read(read, 100).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert said == "0 0 0"
        assert counts().cached_bytes == 32 * MiB  # the parent's stay
    finally:
        lease.close()


def test_pool_counts_a_failed_munmap_and_unmaps_the_block_at_a_later_try() -> None:
    assert _pool.compiled is not None
    lease = _pool.lease(0)
    assert lease is not None
    before = counts()
    try:
        block = torch.empty(MiB // 4)
        _pool.compiled._fail_unmaps(1)
        lease.close()
        del block  # freed after the lease: its munmap fails
        failed = counts()
        assert failed.unmap_failures == before.unmap_failures + 1
        assert failed.stuck_bytes == MiB and failed.live_bytes == before.live_bytes
        assert failed.unmapped == before.unmapped
        again = _pool.lease(0)
        assert again is not None
        block = torch.empty(MiB // 2)  # 2 MiB: a new mapping, not the stuck block
        assert counts().misses == failed.misses + 1
        again.close()
        del block  # this unmap tries the stuck block again
        after = counts()
        assert after.stuck_bytes == 0 and after.unmap_failures == failed.unmap_failures
        assert after.unmapped_bytes - before.unmapped_bytes == 3 * MiB
    finally:
        _pool.compiled._fail_unmaps(0)
        lease.close()


def test_pool_built_for_another_torch_is_not_used_and_says_so_once() -> None:
    with pytest.warns(RuntimeWarning, match=r"built for torch .* but torch 2\.99\.0 runs") as said:
        module, why = _pool.load(environ={}, torch_version="2.99.0")
    assert module is None and len(said) == 1
    assert why.startswith("built for torch ") and "2.99.0" in why


def test_pool_is_off_under_tensorstash_pool_0_and_info_says_why() -> None:
    module, why = _pool.load(environ={"TENSORSTASH_POOL": "0"})
    assert module is None and "TENSORSTASH_POOL=0" in why
    lease = _pool.lease(MiB)  # installs the pool, where no test did yet
    assert lease is not None
    lease.close()
    found = ts.info()
    assert found.pool and found.pool_why == "active"
    assert found.pool_installed_at is not None and found.pool_installed_after is not None
    assert found.pool_installed_at <= time.time() and found.pool_installed_after >= 0
    assert "session pool (tensorstash.memory._alloc): active since " in str(found)
    assert found.line().endswith("session pool on") and "\n" not in found.line()


_NEVER_INSTALLED = """
import tempfile
import torch
from torch import nn
import tensorstash as ts
from tensorstash.memory import _pool
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
x = torch.randn(1024, 256)
for policy in ("keep", "cpu", "lz4"):  # CPU sessions that free no memory
    with ts.stash(policy, min_bytes=0):
        loss = model(x).sum()
    loss.backward()
found = ts.info()
print(_pool.compiled.state(), sum(_pool.counts()[:5]), found.pool, found.pool_why,
      found.pool_installed_at, "(not installed yet)" in found.line())
with tempfile.TemporaryDirectory() as d:  # a disk spill past trim_every: the pool goes in
    with ts.stash(ts.DiskSpill(d, trim_every=1 << 20), min_bytes=0):
        loss = model(x).sum()
    loss.backward()
found = ts.info()
print(_pool.compiled.state(), found.pool_why, found.pool_installed_at is not None,
      " since " in str(found), _pool.check_books().live_bytes)
"""


@pytest.mark.slow  # a subprocess
def test_a_process_that_runs_no_cpu_session_freeing_memory_keeps_pytorchs_cpu_allocator() -> None:
    # Rule 4: the pool is installed at the first lease, not at import. State 0 is "not
    # installed, and c10's default CPU allocator is PyTorch's CPU allocator".
    done = subprocess.run(
        [sys.executable, "-c", _NEVER_INSTALLED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()
    assert before.split() == ["0", "0", "True", "ready", "None", "True"]
    assert after.split() == ["1", "active", "True", "True", "0"]


def test_pool_refuses_to_serve_blocks_under_a_page() -> None:
    with pytest.raises(ValueError, match=r"serve: least=0 bytes .* pass least >= 4096"):
        extension().serve(MiB, 0)
    with pytest.raises(ValueError, match=r"least=4095 bytes"):
        extension().serve(MiB, 4095)
    assert not _pool.installed()


@pytest.mark.parametrize("nbytes", [0, 2**64 - 1, 2**64 - 4096, 2**63])
def test_pool_passes_empty_and_unroundable_requests_to_the_allocator_it_replaced(
    nbytes: int,
) -> None:
    # A request of 0 bytes, or one whose size rounds past SIZE_MAX to 0, once took a
    # waiting block "of 0 bytes": its tail at its own address, both handed out and waiting.
    lease = _pool.lease(4 * MiB)
    assert lease is not None
    try:
        waiting = torch.empty(MiB // 4)
        del waiting
        before = counts()
        assert before.cached_bytes == MiB
        if nbytes == 0:
            assert extension()._allocate(0) == 0  # c10's allocator: no block for no bytes
        else:
            with pytest.raises(RuntimeError, match="alloc"):  # c10's own error
                extension()._allocate(nbytes)
        after = counts()
        assert after.cached_bytes == MiB and after.live_bytes == before.live_bytes
        assert (after.hits, after.grown, after.misses) == (before.hits, before.grown, before.misses)
    finally:
        lease.close()


def test_pool_puts_a_block_back_where_mremap_fails() -> None:
    lease = _pool.lease(8 * MiB)
    assert lease is not None
    try:
        block = torch.full((MiB // 4,), 7.0)  # 1 MiB
        del block
        before = counts()
        extension()._fail_remaps(1)
        big = torch.ones(MiB)  # 4 MiB: grow the 1 MiB block; mremap fails, a new mapping
        after = counts()
        assert after.grown == before.grown and after.misses == before.misses + 1
        assert after.cached_bytes == MiB and after.unmapped == before.unmapped  # it waits again
        again = torch.ones(MiB // 4)  # and serves the next request of its size
        assert counts().hits == before.hits + 1 and counts().cached_bytes == 0
        assert bool((big == 1).all()) and bool((again == 1).all())
    finally:
        lease.close()


# The allocations the pool's books make on a free that waits: a node of the list by
# age, then one of the list by size; where a block leaves, a slot in the list to unmap.
@pytest.mark.parametrize(
    ("after", "failing", "munmap_fails"),
    [(0, 1, False), (1, 1, False), (0, 2, False), (0, 2, True)],
    ids=["list-by-age", "list-by-size", "list-to-unmap-too", "list-to-unmap-and-munmap"],
)
def test_a_free_whose_books_cannot_grow_unmaps_the_block_and_never_throws(
    after: int, failing: int, munmap_fails: bool
) -> None:
    # A DataPtr's deleter that throws terminates the process; a half-done wait left a
    # block listed by age but not by size, and the pool's cached bytes then underflowed.
    lease = _pool.lease(8 * MiB)
    assert lease is not None
    try:
        block = torch.empty(MiB // 4)
        before = counts()
        extension()._fail_books(after, failing)
        extension()._fail_unmaps(2 if munmap_fails else 0)  # at once, and tried again
        del block  # would wait; its lists cannot grow: it leaves the pool
        extension()._fail_books(0, 0)
        now = counts()
        assert now.cached_bytes == 0 and now.live_bytes == before.live_bytes - MiB
        if munmap_fails:  # unmapped at once, where nothing was left to list it: stuck
            assert now.stuck_bytes == MiB and now.unmap_failures == before.unmap_failures + 2
            assert now.unmapped == before.unmapped
        else:
            assert now.unmapped == before.unmapped + 1
            assert now.unmapped_bytes == before.unmapped_bytes + MiB
        books = _pool.check_books()
        assert books is not None and books.stuck_bytes == now.stuck_bytes
        block = torch.empty(MiB // 4)  # the pool serves on, and a free waits again
        del block
        assert counts().cached_bytes == MiB
    finally:
        extension()._fail_books(0, 0)
        lease.close()
    assert counts().stuck_bytes == 0  # the lease's end unmapped the stuck block too


@pytest.mark.parametrize(
    ("path", "failing"),
    [("map", 1), ("split", 1), ("split", 2), ("split", 3), ("grow", 1), ("grow", 2)],
)
def test_a_request_whose_books_cannot_grow_is_served_and_the_books_add_up(
    path: str, failing: int
) -> None:
    lease = _pool.lease(16 * MiB)
    assert lease is not None
    try:
        if path == "split":
            waiting = torch.empty(MiB)  # 4 MiB, split below: its tail cannot wait
            del waiting
        elif path == "grow":
            waiting = torch.empty(MiB // 4)  # 1 MiB, grown below: its new place not recorded
            del waiting
        before = counts()
        extension()._fail_books(0, failing)
        made = torch.full((MiB // 4,) if path == "split" else (MiB,), 3.0)
        extension()._fail_books(0, 0)
        after = counts()
        books = _pool.check_books()
        assert books is not None and books.recorded_bytes == after.live_bytes + after.cached_bytes
        left = after.unmapped_bytes - before.unmapped_bytes
        if path == "map":  # its mapping left; the allocator the pool replaced served it
            assert after.misses == before.misses and after.live_bytes == before.live_bytes
            assert left == 4 * MiB
        elif path == "split":  # the head is handed out, the tail left
            assert after.hits == before.hits + 1 and after.cached_bytes == 0
            assert after.live_bytes == before.live_bytes + MiB and left == 3 * MiB
        else:  # the grown block left; a new mapping served it
            assert after.grown == before.grown and after.misses == before.misses + 1
            assert after.live_bytes == before.live_bytes + 4 * MiB and left == 4 * MiB
        assert bool((made == 3).all())
        del made
    finally:
        extension()._fail_books(0, 0)
        lease.close()
