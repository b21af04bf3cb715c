// Replays of the session pool's races, step by step (NOTE [ Session pool ] in
// tensorstash/memory/_pool.py, rule 10); tests/test_pool_replay.py builds and runs them.
//
// The pool's source is included unchanged (TENSORSTASH_POOL_SOURCE names it), with its
// calls to mmap and mremap routed through the functions below. They do what the kernel
// may do, on cue: mremap(MREMAP_MAYMOVE) always moves the block, and can park the
// thread that grows it right after the move, while the range it left is free; the
// next mmap, or mremap, of another thread can be made to land in that range, as the
// kernel's own choice may. Each case then frees every block and checks the books.
//
// A Python module, `_pool_replay`, so that the process has torch's libc10 and Python
// loaded the way the real extension has: run(case) returns "ok", or raises
// RuntimeError saying what did not add up; a heap the pool corrupted kills the process.

#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace replay {

std::mutex mutex;
std::condition_variable changed;
bool park = false;           // park the thread of the next mremap after it moved the block
bool parked = false;         // a thread is parked there
bool let_go = false;         // and may go on
void* left = nullptr;        // the range the parked thread's block left
void* land = nullptr;        // where the next mmap or mremap lands
void* lie = nullptr;         // what the next mmap returns, mapping nothing
std::string missed;          // what did not happen as the case needs

void* mmap_(void* address, size_t size, int protection, int flags, int fd, off_t offset) {
  void* at;
  void* fake;
  {
    std::lock_guard<std::mutex> guard(mutex);
    at = land;
    fake = lie;
    land = lie = nullptr;
  }
  if (fake != nullptr) {
    return fake;
  }
  if (at != nullptr) {
    return ::mmap(at, size, protection, flags | MAP_FIXED_NOREPLACE, fd, offset);
  }
  return ::mmap(address, size, protection, flags, fd, offset);
}

void* mremap_(void* block, size_t have, size_t size, int flags) {
  void* at;
  bool parking;
  {
    std::lock_guard<std::mutex> guard(mutex);
    at = land;
    parking = park;
    land = nullptr;
    park = false;
  }
  // The block moves: to `at`, or to a range the kernel picks, reserved for it.
  void* target = ::mmap(at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
                        (at != nullptr ? MAP_FIXED_NOREPLACE : 0), -1, 0);
  if (target == MAP_FAILED || (at != nullptr && target != at)) {
    std::lock_guard<std::mutex> guard(mutex);
    missed = "the range to move into was not free";
    return ::mremap(block, have, size, flags);
  }
  void* moved = ::mremap(block, have, size, flags | MREMAP_FIXED, target);
  if (parking && moved != MAP_FAILED) {
    std::unique_lock<std::mutex> guard(mutex);
    left = block;
    parked = true;
    changed.notify_all();
    changed.wait(guard, [] { return let_go; });
  }
  return moved;
}

}  // namespace replay

#define mmap replay::mmap_
#define mremap replay::mremap_
#include TENSORSTASH_POOL_SOURCE
#undef mmap
#undef mremap

namespace replay {

constexpr size_t kMiB = 1 << 20;

struct Failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void expect(bool holds, const std::string& what) {
  if (!holds) {
    throw Failed(what);
  }
}

template <typename P, typename = void>
struct Checks : std::false_type {};
template <typename P>
struct Checks<P, std::void_t<decltype(std::declval<P&>().check())>> : std::true_type {};

// The pool's own check of its books, where its source has one.
template <typename P>
void check(P* the_pool) {
  if constexpr (Checks<P>::value) {
    auto books = the_pool->check();
    expect(books.wrong.empty(), "the books: " + books.wrong);
  }
}

// Parks the next thread to grow a block right after mremap moved it; the range it
// left, once it is parked.
void* wait_parked() {
  std::unique_lock<std::mutex> guard(mutex);
  bool came = changed.wait_for(guard, std::chrono::seconds(30), [] { return parked; });
  expect(came, "no request grew a block: " + missed);
  return left;
}

void go_on() {
  std::lock_guard<std::mutex> guard(mutex);
  let_go = true;
  changed.notify_all();
}

void land_next_at(void* at) {
  std::lock_guard<std::mutex> guard(mutex);
  land = at;
}

// A miss (or, with `by_growing`, a grow) of another thread lands in the range a grow
// moved from, while the moving thread is parked between its mremap and its lock.
void replay_a_block_landing_where_a_grow_left(bool by_growing) {
  Pool* the_pool = pool();
  expect(the_pool->install() == kInstalled, "the pool could not be installed");
  expect(the_pool->serve(64 * kMiB, 128 << 10), "the pool does not serve");
  auto before = the_pool->counts();
  c10::DataPtr first = the_pool->allocate(kMiB);
  void* vacated = first.get();
  c10::DataPtr small;
  if (by_growing) {
    small = the_pool->allocate(kMiB / 4);
    small.clear();  // waits: the other thread grows it into the range left
  }
  first.clear();  // waits: the largest, grown by the next request larger than it
  {
    std::lock_guard<std::mutex> guard(mutex);
    park = true;
  }
  c10::DataPtr grown;
  std::thread mover([&] { grown = the_pool->allocate(4 * kMiB); });
  void* at = wait_parked();
  land_next_at(at);
  c10::DataPtr other = the_pool->allocate(kMiB);  // a miss, or the small block grown
  go_on();
  mover.join();
  expect(at == vacated && grown.get() != vacated, "the grown block did not move: " + missed);
  expect(other.get() == vacated, "the other block did not land where it left: " + missed);
  check(the_pool);
  other.clear();  // where its record was lost, this goes to free()
  grown.clear();
  the_pool->stop();
  check(the_pool);
  auto after = the_pool->counts();
  expect(after[6] == before[6], "blocks in use: " + std::to_string(after[6] - before[6]) +
                                    " bytes after every block was freed");
  expect(after[5] == 0, "blocks waiting after the pool stopped: " + std::to_string(after[5]));
  int64_t grows = by_growing ? 2 : 1;
  expect(after[1] - before[1] == grows && after[2] - before[2] == 2,
         "grown " + std::to_string(after[1] - before[1]) + ", mapped " +
             std::to_string(after[2] - before[2]));
  expect(after[3] - before[3] == 2, "unmapped " + std::to_string(after[3] - before[3]) +
                                        " blocks, not the two freed");
}

// An address mapped anew that the books hold already (here: an mmap that lies) must
// stop the process, not overwrite the record of a block in use.
void replay_an_address_recorded_twice() {
  Pool* the_pool = pool();
  expect(the_pool->install() == kInstalled, "the pool could not be installed");
  expect(the_pool->serve(64 * kMiB, 128 << 10), "the pool does not serve");
  c10::DataPtr first = the_pool->allocate(kMiB);
  {
    std::lock_guard<std::mutex> guard(mutex);
    lie = first.get();
  }
  c10::DataPtr second = the_pool->allocate(2 * kMiB);
  throw Failed("the pool recorded an address it holds already, and went on");
}

PyObject* run(PyObject*, PyObject* args) {
  const char* name;
  if (!PyArg_ParseTuple(args, "s", &name)) {
    return nullptr;
  }
  std::string which = name;
  try {
    if (which == "miss") {
      replay_a_block_landing_where_a_grow_left(false);
    } else if (which == "grow") {
      replay_a_block_landing_where_a_grow_left(true);
    } else if (which == "twice") {
      replay_an_address_recorded_twice();
    } else {
      throw Failed("no case " + which);
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyUnicode_FromString("ok");
}

PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "run(case): replay 'miss', 'grow' or 'twice'; 'ok'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool_replay", nullptr, -1, methods};

}  // namespace replay

PyMODINIT_FUNC PyInit__pool_replay() { return PyModule_Create(&replay::module); }
