"""The session pool under the programs it must be safe in (NOTE [ Session pool ] in
tensorstash/memory/_pool.py): threads, fork, DataLoader workers, oneDNN, inductor, spawn,
another torch, and another library's CPU allocator.

Each case runs in a process of its own: the pool is PyTorch's CPU allocator for the
whole process (rule 4), and a case that breaks it must not take the others with it.
Each ends by checking the pool's books (rule 10), and so do the children it forks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from cxx import build, compiler

import tensorstash
from tensorstash.memory import _pool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_pool.compiled is None, reason="the session pool is not built"),
]

# A CPU allocator another library might install: it knows the blocks it made, and
# counts (and leaks, rather than crash on) any other it is asked to free.
_FOREIGN = r"""
#include <Python.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_set>

namespace {
std::mutex mutex;
auto* made = new std::unordered_set<void*>();
std::atomic<long long> wrong{0}, count{0};

void tracked_free(void* block) {
  if (block == nullptr) return;
  {
    std::lock_guard<std::mutex> guard(mutex);
    if (made->erase(block) == 0) {
      wrong++;
      return;
    }
  }
  std::free(block);
}

struct Tracker final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* block = std::aligned_alloc(64, n == 0 ? 64 : (n + 63) / 64 * 64);
    {
      std::lock_guard<std::mutex> guard(mutex);
      made->insert(block);
    }
    count++;
    return {block, block, &tracked_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_free; }
  void copy_data(void* dest, const void* src, std::size_t n) const override {
    default_copy_data(dest, src, n);
  }
};
Tracker* tracker = new Tracker();

PyObject* install(PyObject*, PyObject*) {
  c10::SetCPUAllocator(tracker, 0);
  Py_RETURN_NONE;
}
PyObject* current(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::GetCPUAllocator() == tracker);
}
PyObject* wrong_frees(PyObject*, PyObject*) { return PyLong_FromLongLong(wrong.load()); }
PyObject* made_count(PyObject*, PyObject*) { return PyLong_FromLongLong(count.load()); }

PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, ""},
    {"current", current, METH_NOARGS, ""},
    {"wrong_frees", wrong_frees, METH_NOARGS, ""},
    {"made", made_count, METH_NOARGS, ""},
    {nullptr, nullptr, 0, nullptr},
};
PyModuleDef module = {PyModuleDef_HEAD_INIT, "_foreign", "", -1, methods};
}  // namespace

PyMODINIT_FUNC PyInit__foreign() { return PyModule_Create(&module); }
"""


@pytest.fixture(scope="module")
def foreign() -> Path:
    """A folder holding ``_foreign``, built once per source and torch (cached in /tmp)."""
    if compiler() is None:
        pytest.skip("no C++ compiler ($CXX or g++) to build another library's allocator")
    return build("_foreign", _FOREIGN)


def run(code: str, *, common: bool = True, path: Path | None = None, timeout: float = 90) -> str:
    """Run ``code`` (after ``_COMMON`` where ``common``, and before ``_BOOKS``) as a script
    in a new interpreter (a file, so that spawn can import it); its stdout, after asserting
    it exited 0."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="ts-pool-stress-") as folder:
        script = Path(folder) / "case.py"
        script.write_text((_COMMON if common else "") + textwrap.dedent(code) + _BOOKS)
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


# The end of every case: the pool's books add up (an AssertionError exits 1).
_BOOKS = """
import gc as _gc
from tensorstash.memory import _pool as _checked
_gc.collect()
_checked.check_books()
"""

# Shared by the cases: a disk spill session around a small model, its gradients
# compared bitwise with plain autograd's.
_COMMON = """
import gc, os, sys, tempfile, threading, time
import torch
from torch import nn
import tensorstash as ts
from tensorstash.memory import _pool
MiB = 1 << 20

def spilled_step_matches(model, x, directory, **kwargs):
    # One torch thread for the two steps compared: with two, plain autograd's own
    # matmuls differ by an ulp now and then from run to run, with or without a stash.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with ts.stash(ts.DiskSpill(directory, trim_every=MiB), min_bytes=0, **kwargs):
            loss = model(x).sum()
        loss.backward()
        del loss
        gc.collect()
        return all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    finally:
        torch.set_num_threads(threads)
"""


def test_threads_allocating_while_sessions_start_and_stop_keep_every_value() -> None:
    out = run(
        """
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])
        x = torch.randn(1024, 256)
        stop = threading.Event()
        errors = []

        def churn(seed):
            g = torch.Generator().manual_seed(seed)
            held = []
            while not stop.is_set():
                n = int(torch.randint(1 << 10, 1 << 20, (1,), generator=g))
                value = float(n % 997)
                held.append((torch.full((n,), value), value))
                if len(held) > 8:
                    t, want = held.pop(int(torch.randint(0, len(held), (1,), generator=g)))
                    if not bool((t == want).all()):
                        errors.append(seed)

        threads = [threading.Thread(target=churn, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        ok = True
        with tempfile.TemporaryDirectory() as d:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                ok &= spilled_step_matches(model, x, d)
                lease = _pool.lease(4 * MiB)  # a lease of its own, on and off
                time.sleep(0.002)
                lease.close()
        stop.set()
        for t in threads:
            t.join()
        gc.collect()
        c = _pool.counts()
        print(ok, errors, _pool.installed(), c.live_bytes >= 0, c.hits + c.misses > 0)
        """
    )
    assert out.split() == ["True", "[]", "False", "True", "True"]


def test_a_fork_from_a_thread_while_another_allocates_gives_a_child_that_allocates() -> None:
    out = run(
        """
        torch.set_num_threads(1)
        lease = _pool.lease(8 * MiB)
        stop = threading.Event()

        def churn():
            held = []
            while not stop.is_set():
                held.append(torch.ones(int(1 << 18) + len(held) * 4096))
                if len(held) > 6:
                    del held[:3]

        def forks(results):
            for _ in range(20):
                pid = os.fork()
                if pid == 0:
                    try:
                        blocks = [torch.full((1 << 18,), 2.0) for _ in range(4)]
                        del blocks[:2]
                        again = torch.full((1 << 18,), 3.0)
                        good = bool((blocks[0] == 2).all()) and bool((again == 3).all())
                        _pool.check_books()
                        c = _pool.counts()
                        os._exit(0 if good and not _pool.installed() and c.cached_bytes == 0 else 3)
                    except BaseException:
                        os._exit(2)
                _, status = os.waitpid(pid, 0)
                results.append(os.waitstatus_to_exitcode(status))

        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        results = []
        forker = threading.Thread(target=forks, args=(results,))
        forker.start()
        forker.join(timeout=60)
        stop.set()
        for t in threads:
            t.join()
        lease.close()
        print(len(results), sorted(set(results)))
        """
    )
    assert out.split() == ["20", "[0]"]


def test_a_dataloader_with_fork_and_persistent_workers_runs_under_sessions() -> None:
    out = run(
        """
        from torch.utils.data import DataLoader, Dataset

        class Blocks(Dataset):
            def __len__(self):
                return 32

            def __getitem__(self, i):
                _pool.check_books()  # in a worker forked while the pool serves
                return torch.full((1 << 16,), float(i))  # 256 KiB: pool-sized in a batch

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1 << 16, 16), nn.Tanh(), nn.Linear(16, 1))
        ok = True
        with tempfile.TemporaryDirectory() as d:
            for persistent in (False, True):
                loader = DataLoader(
                    Blocks(), batch_size=8, num_workers=2, persistent_workers=persistent,
                    multiprocessing_context="fork",
                )
                for epoch in range(2):
                    seen = 0
                    lease = _pool.lease(4 * MiB)  # workers forked while the pool serves
                    for batch in loader:
                        seen += int(batch[:, 0].sum())
                        ok &= spilled_step_matches(model, batch, d)
                    lease.close()
                    ok &= seen == sum(range(32))
        print(ok)
        """
    )
    assert out.split() == ["True"]


def test_an_lstm_through_onednn_with_leases_ending_on_other_threads() -> None:
    out = run(
        """
        torch.set_num_threads(1)
        torch.manual_seed(0)
        lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        x = torch.randn(8, 40, 32)
        stop = threading.Event()

        def run():
            with torch.no_grad():
                while not stop.is_set():
                    lstm(x)

        def leases():
            while not stop.is_set():
                lease = _pool.lease(1 << 20)
                time.sleep(0.0005)
                threading.Thread(target=lease.close).start()  # ends on another thread
                time.sleep(0.0005)

        threads = [threading.Thread(target=run), threading.Thread(target=leases)]
        for t in threads:
            t.start()
        with tempfile.TemporaryDirectory() as d:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                with ts.stash(ts.DiskSpill(d, trim_every=MiB), min_bytes=0):
                    out, _ = lstm(x.requires_grad_())
                out.sum().backward()
        stop.set()
        for t in threads:
            t.join()
        print(_pool.installed(), _pool.counts().misses > 0)
        """
    )
    assert out.split() == ["False", "True"]


def test_a_compiled_cpu_model_under_a_disk_spill_gives_plain_gradients() -> None:
    out = run(
        """
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        compiled = torch.compile(model)
        x = torch.randn(512, 256)
        ok = True
        with tempfile.TemporaryDirectory() as d:
            for _ in range(2):
                compiled(x).sum().backward()  # plain
                want = [p.grad.clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                lease = _pool.lease(8 * MiB)  # inductor's kernels allocate from the pool
                with ts.stash(ts.DiskSpill(d, trim_every=MiB), min_bytes=0):
                    loss = compiled(x).sum()
                loss.backward()
                lease.close()
                ok &= all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
                model.zero_grad(set_to_none=True)
        print(ok, _pool.counts().misses > 0)
        """,
        timeout=110,
    )
    assert out.split() == ["True", "True"]


def test_a_spawned_process_gets_a_pool_of_its_own() -> None:
    out = run(
        common=False,
        code="""
        import multiprocessing as mp

        def child(queue):
            import tempfile
            import torch
            from torch import nn
            import tensorstash as ts
            from tensorstash.memory import _pool
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
            x = torch.randn(1024, 256)
            model(x).sum().backward()
            want = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            with tempfile.TemporaryDirectory() as d:
                with ts.stash(ts.DiskSpill(d, trim_every=1 << 20), min_bytes=0):
                    loss = model(x).sum()
                loss.backward()
            same = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
            _pool.check_books()
            queue.put((same, ts.info().pool, _pool.counts().misses > 0))

        if __name__ == "__main__":
            import tensorstash
            lease = tensorstash.memory._pool.lease(1 << 20)  # the parent serves while it spawns
            context = mp.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            print(*queue.get(timeout=60))
            process.join()
            lease.close()
            print(process.exitcode)
        """,
    )
    assert out.split() == ["True", "True", "True", "0"]


def test_an_extension_built_for_another_torch_falls_back_to_trimming_with_one_warning() -> None:
    out = run(
        common=False,
        code="""
        import gc, tempfile, warnings
        import torch
        from torch import nn
        torch.__version__ = "2.99.0"  # as if another torch were installed since the build
        # One thread: with two, plain autograd's own matmuls differ by an ulp now and then
        # from run to run (3 runs in 30 here, no tensorstash imported).
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            import tensorstash as ts
            from tensorstash.memory import _pool
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
            x = torch.randn(1024, 256)
            model(x).sum().backward()
            want = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            with tempfile.TemporaryDirectory() as d:
                for _ in range(2):
                    with ts.stash(ts.DiskSpill(d, trim_every=1 << 20), min_bytes=0):
                        loss = model(x).sum()
                    loss.backward()
            gc.collect()
        pool = [w for w in said if "session pool" in str(w.message)]
        print(len(pool), _pool.compiled is None, _pool.installed())
        print(torch.equal(model[0].weight.grad, 2 * want[0]))
        print(ts.info().line())
        """,
    )
    first, second, line = out.splitlines()
    assert first.split() == ["1", "True", "False"]
    assert second == "True"
    assert "session pool off (built for torch " in line and "2.99.0 runs" in line


def test_the_pool_stays_out_where_another_allocator_came_first(foreign: Path) -> None:
    # Rule 4: the pool goes in only over c10's default allocator. Installed over another
    # at a session's start, it took that allocator's place, and a raw block taken on
    # another thread while it did went to the wrong one's deleter.
    out = run(
        common=False,
        code="""
        import threading, tempfile, time
        import torch
        from torch import nn
        import _foreign
        _foreign.install()
        torch.set_num_threads(1)
        lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        x = torch.randn(8, 40, 32)
        stop = threading.Event()

        def run():
            with torch.no_grad():
                while not stop.is_set():
                    lstm(x)

        thread = threading.Thread(target=run)
        thread.start()
        import tensorstash as ts
        from tensorstash.memory import _pool
        with tempfile.TemporaryDirectory() as d:
            for _ in range(20):
                with ts.stash(ts.DiskSpill(d, trim_every=1 << 16), min_bytes=0):
                    out, _ = lstm(x.requires_grad_())
                out.sum().backward()
        stop.set()
        thread.join()
        print(_foreign.current(), _foreign.wrong_frees(), _pool.installed(), ts.info().pool)
        """,
        path=foreign,
    )
    assert out.split() == ["True", "0", "False", "False"]


def test_an_allocator_installed_after_the_pool_displaces_it_for_good(foreign: Path) -> None:
    # Rule 8: a library installing its CPU allocator after tensorstash was imported. The
    # pool used to take the allocator back at the next session, and to go on serving
    # blocks through the lease it held when the other came.
    out = run(
        common=False,
        code="""
        import gc, tempfile
        import torch
        from torch import nn
        import tensorstash as ts
        from tensorstash.memory import _pool
        import _foreign
        MiB = 1 << 20
        lease = _pool.lease(4 * MiB)
        first = torch.empty(MiB)  # the pool's
        _foreign.install()  # while the lease holds the pool
        second = torch.empty(MiB)  # the other's
        print(_pool.installed(), _foreign.made() > 0)
        del first, second
        lease.close()
        torch.set_num_threads(1)
        lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        x = torch.randn(8, 40, 32)
        with tempfile.TemporaryDirectory() as d:
            for _ in range(5):
                with ts.stash(ts.DiskSpill(d, trim_every=1 << 16), min_bytes=0):
                    out, _ = lstm(x.requires_grad_())
                out.sum().backward()
        gc.collect()
        again = _pool.lease(MiB)
        print(_foreign.current(), _foreign.wrong_frees(), again is None, _pool.installed())
        print(_pool.counts().live_bytes, "another library" in ts.info().pool_why)
        """,
        path=foreign,
    )
    assert out.split() == ["False", "True", "True", "0", "True", "False", "0", "True"]


def test_the_pool_installed_while_other_threads_allocate_and_take_memory_raw() -> None:
    # Rule 4: the first lease installs the pool, here while an LSTM (oneDNN's scratch
    # memory, taken with raw_allocate and given back with raw_deallocate of whichever
    # allocator is installed then) and plain allocations run on other threads. What
    # c10's allocator gave before must go back to it, through the pool.
    out = run(
        """
        torch.set_num_threads(1)
        torch.manual_seed(0)
        lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        x = torch.randn(8, 40, 32)
        stop = threading.Event()

        def run():
            with torch.no_grad():
                while not stop.is_set():
                    lstm(x)

        def churn():
            held = []
            while not stop.is_set():
                held.append(torch.ones((1 << 16) + 1024 * len(held)))
                if len(held) > 6:
                    del held[:3]

        before = _pool.compiled.state()
        threads = [threading.Thread(target=f) for f in (run, run, churn)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])
        with tempfile.TemporaryDirectory() as d:
            ok = all(spilled_step_matches(model, torch.randn(1024, 256), d) for _ in range(3))
        stop.set()
        for t in threads:
            t.join()
        print(before, _pool.compiled.state(), ok, ts.info().pool_installed_at is not None)
        """
    )
    assert out.split() == ["0", "1", "True", "True"]


def test_the_pool_stays_out_where_another_allocator_came_after_import(foreign: Path) -> None:
    # Rule 4: an allocator installed after tensorstash was imported, but before any
    # session needed the pool, keeps its place; the pool never goes in.
    out = run(
        common=False,
        code="""
        import gc, tempfile
        import torch
        from torch import nn
        import tensorstash as ts
        from tensorstash.memory import _pool
        import _foreign
        print(ts.info().pool_why)
        _foreign.install()
        torch.set_num_threads(1)
        lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        x = torch.randn(8, 40, 32)
        with tempfile.TemporaryDirectory() as d:
            for _ in range(5):
                with ts.stash(ts.DiskSpill(d, trim_every=1 << 16), min_bytes=0):
                    out, _ = lstm(x.requires_grad_())
                out.sum().backward()
        gc.collect()
        found = ts.info()
        print(_foreign.current(), _foreign.wrong_frees(), _pool.lease(1 << 20) is None)
        print(found.pool, found.pool_installed_at, "before a session needed" in found.pool_why)
        """,
        path=foreign,
    )
    assert out.split() == ["ready", "True", "0", "True", "False", "None", "True"]


_RACE = """
import threading, time
import torch
from torch import nn
from tensorstash.memory import _pool
torch.set_num_threads(1)
lstm = nn.LSTM(16, 32, batch_first=True)
x = torch.randn(4, 20, 16)
stop = threading.Event()

def churn():
    held = []
    while not stop.is_set():
        held.append(torch.empty((1 << 16) + 1024 * len(held)))
        if len(held) > 4:
            del held[:2]
        with torch.no_grad():
            lstm(x)

threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads:
    t.start()
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    lease = _pool.lease(1 << 20)
    time.sleep(0.001)
    threading.Thread(target=lease.close).start()
stop.set()
for t in threads:
    t.join()
_pool.check_books()
print(_pool.compiled.__file__)
print("ok")
"""


@pytest.mark.skipif(
    os.environ.get("TENSORSTASH_TSAN", "") in ("", "0"),
    reason="the sanitizer step: set TENSORSTASH_TSAN=1 (needs g++ with libtsan; about a minute)",
)
def test_the_pool_has_no_data_race_under_thread_sanitizer(tmp_path: Path) -> None:
    # Every shared field is an atomic or under the lock. Built with -fsanitize=thread, the
    # pool was once reported racing on before_ and least_ (read in allocate, written in
    # install); torch and libgomp are not instrumented, so reports from them (OpenMP
    # barriers TSan cannot see) are not the pool's and are left out. The threads start
    # before the first lease installs the pool (rule 4). A copy of the package holds the
    # instrumented build, and the case checks that it is the one loaded.
    library = subprocess.run(
        ["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(library):
        pytest.skip("no libtsan here")
    package = Path(tensorstash.__file__).parent
    copy = tmp_path / "tensorstash"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("_alloc*.so", "__pycache__"))
    built = copy / "memory" / f"_alloc{sysconfig.get_config_var('EXT_SUFFIX')}"
    root = Path(torch.__file__).parent
    subprocess.run(
        [
            "g++", "-fsanitize=thread", "-O1", "-g", "-shared", "-fPIC", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTENSORSTASH_TORCH_VERSION={json.dumps(torch.__version__)}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{root / 'include'}",
            str(package / "memory" / "_alloc.cpp"), f"-L{root / 'lib'}", "-lc10",
            "-o", str(built),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path),
        LD_PRELOAD=library,
        TSAN_OPTIONS="report_signal_unsafe=0 halt_on_error=0",
    )
    done = subprocess.run(
        ["setarch", "-R", sys.executable, "-c", _RACE],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.stdout.split() == [str(built), "ok"], done.stderr[-4000:]
    reports = done.stderr.split("WARNING: ThreadSanitizer")[1:]
    ours = [report for report in reports if "_alloc.cpp" in report]
    assert ours == [], ours[0][:4000]
