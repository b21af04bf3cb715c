// The session pool: PyTorch's CPU allocator, serving large blocks while a session
// that frees memory runs (NOTE [ Session pool ] in _pool.py; the rules cited here).
//
// A block of at least `least` bytes is a mapping of its own. Freed, it waits in
// the pool, its pages resident, and serves a later request: whole if it is at
// most an eighth larger, else split (the tail waits on its own), or grown in
// place by mremap where no block waiting is large enough, so that only the
// pages it lacks are faulted in. The blocks waiting may hold `cap` bytes, or,
// while the blocks in use hold less than the most they held since the pool
// began to serve, up to that difference: the pool holds at most its high-water
// mark plus `cap`. Past that the oldest blocks waiting are unmapped, and all of
// them once the last lease ends; a block freed after that is unmapped at once.
//
// Installed once (rule 4), at import, over c10's default CPU allocator only:
// `before_` is set before the pool is published, and never changes, so a
// request on any thread, at any moment, reaches either that allocator or the
// pool passing it on. Serving is an atomic switched on and off by leases; the
// allocator is never swapped back. Every shared field is an atomic or is read
// and written under `mutex_` (rule 6 for fork).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mremap
#endif
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef TENSORSTASH_TORCH_VERSION
#error "build with -DTENSORSTASH_TORCH_VERSION=\"<torch.__version__>\" (see setup.py)"
#endif

namespace {

constexpr size_t kPage = 4096;

size_t whole_pages(size_t n) { return (n + kPage - 1) & ~(kPage - 1); }

// Nanoseconds spent in mmap, mremap and munmap, on every thread.
std::atomic<int64_t> mapping_ns{0};

// Fault injection for the tests: the next this many munmap calls fail with ENOMEM.
std::atomic<int64_t> failing_unmaps{0};

class Timed {
 public:
  Timed() : start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    auto took = std::chrono::steady_clock::now() - start_;
    mapping_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count(),
                         std::memory_order_relaxed);
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

int unmap_one(void* block, size_t size) {
  int64_t left = failing_unmaps.load(std::memory_order_relaxed);
  while (left > 0) {
    if (failing_unmaps.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
      errno = ENOMEM;
      return -1;
    }
  }
  return munmap(block, size);
}

struct Counts {
  int64_t hits = 0;      // requests served by a block waiting in the pool, whole or split
  int64_t grown = 0;     // requests served by a block waiting, grown
  int64_t misses = 0;    // requests that mapped a new block
  int64_t unmapped = 0;  // blocks unmapped when freed, past the cap or at a lease's end
  int64_t unmapped_bytes = 0;
  int64_t unmap_failures = 0;  // munmap calls that failed (the block is tried again later)
};

// Where the pool stands; _pool.py turns it into words for tensorstash.info().
enum State : int {
  kNotInstalled = 0,  // install() not called yet
  kInstalled = 1,     // PyTorch's CPU allocator
  kOtherBefore = 2,   // another allocator than c10's default was there first: the pool stays out
  kRefused = 3,       // SetCPUAllocator kept a higher-priority allocator
  kDisplaced = 4,     // another allocator was installed after the pool: it serves no more
};

using Blocks = std::vector<std::pair<void*, size_t>>;

class Pool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Allocator* before = replaced();
    if (nbytes < least_.load(std::memory_order_relaxed) ||
        !serving_.load(std::memory_order_acquire) || !still_current()) {
      return before->allocate(nbytes);
    }
    size_t size = whole_pages(nbytes);
    Blocks drop;
    void* block = take(size, drop);
    if (block == nullptr) {
      block = grow(size, drop);
    }
    if (block == nullptr) {
      {
        Timed timed;
        block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      }
      if (block == MAP_FAILED) {
        unmap(drop);
        return before->allocate(nbytes);  // its own error where memory is out
      }
      std::lock_guard<std::mutex> guard(mutex_);
      sizes_[block] = size;
      mapped_.store(sizes_.size(), std::memory_order_relaxed);
      counts_.misses++;
      in_use(size, drop);
    }
    unmap(drop);
    return {block, block, &Pool::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Pool::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Become PyTorch's CPU allocator, once, serving nothing yet (rule 4). The pool
  // goes in only over c10's default allocator, and `before_` is set before it is
  // published: a request that reaches the pool on another thread meanwhile is
  // passed on to the allocator that would have served it.
  int install() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (state_ != kNotInstalled) {
      return state_;
    }
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != c10::GetDefaultCPUAllocator()) {
      state_ = kOtherBefore;
      return state_;
    }
    before_.store(current, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // before_ is seen before the pool
    c10::SetCPUAllocator(this, /*priority=*/0);  // a no-op under a higher priority's
    state_ = c10::GetCPUAllocator() == this ? kInstalled : kRefused;
    return state_;
  }

  // Serve blocks from now on, keeping up to `cap` bytes waiting; false where the
  // pool is not PyTorch's CPU allocator (not installed, or displaced: rule 4).
  bool serve(size_t cap, size_t least) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (state_ == kInstalled && c10::GetCPUAllocator() != this) {
      state_ = kDisplaced;
    }
    if (state_ != kInstalled) {
      serving_.store(false, std::memory_order_release);
      return false;
    }
    cap_ = cap;
    least_.store(least, std::memory_order_relaxed);
    if (!serving_.load(std::memory_order_relaxed)) {
      high_ = live_;  // the high-water mark counts from here
      serving_.store(true, std::memory_order_release);
    }
    return true;
  }

  void set_cap(size_t cap) {
    Blocks drop;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      cap_ = cap;
      while (cached_ > allowed()) {
        evict_oldest(drop);
      }
    }
    unmap(drop);
  }

  // Serve no more blocks: every request goes to the allocator the pool replaced,
  // the blocks waiting are unmapped, and those in use will be when freed. The pool
  // stays PyTorch's CPU allocator: memory taken with raw_allocate (oneDNN's
  // scratch memory) is given back with raw_deallocate of whichever allocator is
  // installed then, and only the pool knows which of those blocks are its own.
  void stop() {
    Blocks drop;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      serving_.store(false, std::memory_order_release);
      while (!order_.empty()) {
        evict_oldest(drop);
      }
    }
    unmap(drop);
  }

  std::vector<int64_t> counts() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {counts_.hits,
            counts_.grown,
            counts_.misses,
            counts_.unmapped,
            counts_.unmapped_bytes,
            static_cast<int64_t>(cached_),
            static_cast<int64_t>(live_),
            mapping_ns.load(std::memory_order_relaxed),
            counts_.unmap_failures,
            static_cast<int64_t>(stuck_bytes_)};
  }

  bool serving() { return serving_.load(std::memory_order_acquire) && still_current(); }

  int state() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (state_ == kInstalled && c10::GetCPUAllocator() != this) {
      state_ = kDisplaced;
      serving_.store(false, std::memory_order_release);
    }
    return state_;
  }

  // pthread_atfork (rule 6): the lock is held across fork, so the child gets the
  // containers whole; the child serves nothing, unmaps the blocks waiting (its
  // copies: the parent's stay), and counts its high-water mark from what it holds.
  void before_fork() { mutex_.lock(); }
  void after_fork_in_parent() { mutex_.unlock(); }
  void after_fork_in_child() {
    Blocks drop;
    serving_.store(false, std::memory_order_relaxed);
    while (!order_.empty()) {
      evict_oldest(drop);
    }
    high_ = live_;
    mutex_.unlock();
    unmap(drop);
  }

  static void free_block(void* block);

 private:
  using Waiting = std::list<std::pair<size_t, void*>>;  // oldest first

  // The allocator the pool replaced. It is c10's default (install), so where a
  // thread could see the pool before `before_` (c10 publishes the pool with a plain
  // store), the default is the right answer too.
  c10::Allocator* replaced() const {
    c10::Allocator* before = before_.load(std::memory_order_acquire);
    return before != nullptr ? before : c10::GetDefaultCPUAllocator();
  }

  // Whether the pool is still PyTorch's CPU allocator; where another library
  // installed its own since, the pool stops serving for good (rule 4).
  bool still_current() {
    if (c10::GetCPUAllocator() == this) {
      return true;
    }
    std::lock_guard<std::mutex> guard(mutex_);
    state_ = kDisplaced;
    serving_.store(false, std::memory_order_release);
    return false;
  }

  // Under the lock: what the blocks waiting may hold now (see the top of this file).
  size_t allowed() const { return std::max(cap_, high_ - live_); }

  // Under the lock: `size` bytes more in use; the blocks waiting past what they
  // may hold now leave, oldest first, into `drop`.
  void in_use(size_t size, Blocks& drop) {
    live_ += size;
    high_ = std::max(high_, live_);
    while (cached_ > allowed()) {
      evict_oldest(drop);
    }
  }

  // Under the lock: the block waiting at `found` leaves the waiting lists.
  void unlist(std::multimap<size_t, Waiting::iterator>::iterator found) {
    cached_ -= found->first;
    order_.erase(found->second);
    waiting_.erase(found);
  }

  // Under the lock: `block` of `size` bytes waits, the newest.
  void wait(void* block, size_t size) {
    order_.emplace_back(size, block);
    waiting_.emplace(size, std::prev(order_.end()));
    cached_ += size;
  }

  // The smallest block waiting of at least `size` bytes: whole where it is at most
  // an eighth larger, else split, its tail waiting on its own (or unmapped, where
  // it is smaller than any block the pool serves). nullptr when none.
  void* take(size_t size, Blocks& drop) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = waiting_.lower_bound(size);
    if (found == waiting_.end()) {
      return nullptr;
    }
    size_t have = found->first;
    void* block = found->second->second;
    unlist(found);
    if (have > size + size / 8) {
      size_t rest = have - size;
      void* tail = static_cast<char*>(block) + size;
      sizes_[block] = size;
      if (rest >= least_.load(std::memory_order_relaxed)) {
        sizes_[tail] = rest;
        wait(tail, rest);
      } else {
        leave(tail, rest, drop);
      }
      mapped_.store(sizes_.size(), std::memory_order_relaxed);
      have = size;
    }
    counts_.hits++;
    in_use(have, drop);
    return block;
  }

  // The largest block waiting (all are smaller than `size`), grown to `size` by
  // mremap: its pages move resident, and only the rest are faulted in. nullptr
  // when none waits.
  void* grow(size_t size, Blocks& drop) {
    void* block;
    size_t have;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (waiting_.empty()) {
        return nullptr;
      }
      auto largest = std::prev(waiting_.end());
      have = largest->first;
      block = largest->second->second;
      unlist(largest);
    }
    void* moved;
    {
      Timed timed;
      moved = mremap(block, have, size, MREMAP_MAYMOVE);
    }
    std::lock_guard<std::mutex> guard(mutex_);
    if (moved == MAP_FAILED) {
      leave(block, have, drop);
      mapped_.store(sizes_.size(), std::memory_order_relaxed);
      return nullptr;
    }
    sizes_.erase(block);
    sizes_[moved] = size;
    counts_.grown++;
    in_use(size, drop);
    return moved;
  }

  void release(void* block) {
    if (block == nullptr) {
      return;
    }
    if (mapped_.load(std::memory_order_relaxed) != 0) {
      Blocks drop;
      bool own = false;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        auto found = sizes_.find(block);
        if (found != sizes_.end()) {
          own = true;
          size_t size = found->second;
          live_ -= size;
          if (serving_.load(std::memory_order_relaxed) && size <= allowed()) {
            while (cached_ + size > allowed()) {
              evict_oldest(drop);  // the newest block freed waits; the oldest leave
            }
            wait(block, size);
          } else {
            leave(block, size, drop);
          }
        }
      }
      if (own) {
        unmap(drop);
        return;
      }
    }
    // Not the pool's: memory the allocator it replaced gave raw_allocate (a
    // request under `least`, or one made between leases), given back through the
    // pool's raw_deleter. A block in `sizes_` was mapped before it was handed
    // out, so `mapped_` counted it before its free could start.
    replaced()->raw_deleter()(block);
  }

  // Under the lock: the oldest block waiting leaves the pool for good.
  void evict_oldest(Blocks& drop) {
    auto [size, block] = order_.front();
    auto [first, last] = waiting_.equal_range(size);
    for (auto it = first; it != last; ++it) {
      if (it->second == order_.begin()) {
        waiting_.erase(it);
        break;
      }
    }
    order_.pop_front();
    cached_ -= size;
    leave(block, size, drop);
  }

  // Under the lock: a block leaves the pool for good, into `drop` to be unmapped
  // once the lock is let go; `mapped_` is brought up to date by the caller.
  void leave(void* block, size_t size, Blocks& drop) {
    sizes_.erase(block);
    mapped_.store(sizes_.size(), std::memory_order_relaxed);
    drop.emplace_back(block, size);
  }

  // Without the lock: unmap the blocks that left, and those whose munmap failed
  // before. A block whose munmap fails (ENOMEM where the split would pass the
  // process's count of mappings) stays mapped, out of every list but `stuck_`,
  // and is tried again at the next unmap: its pages are counted, never reused.
  void unmap(Blocks& blocks) {
    if (stuck_count_.load(std::memory_order_relaxed) != 0) {
      std::lock_guard<std::mutex> guard(mutex_);
      blocks.insert(blocks.end(), stuck_.begin(), stuck_.end());
      stuck_.clear();
      stuck_bytes_ = 0;
      stuck_count_.store(0, std::memory_order_relaxed);
    }
    if (blocks.empty()) {
      return;
    }
    Blocks failed;
    int64_t done = 0, done_bytes = 0;
    {
      Timed timed;
      for (const auto& [block, size] : blocks) {
        if (unmap_one(block, size) == 0) {
          done++;
          done_bytes += static_cast<int64_t>(size);
        } else {
          failed.emplace_back(block, size);
        }
      }
    }
    std::lock_guard<std::mutex> guard(mutex_);
    counts_.unmapped += done;
    counts_.unmapped_bytes += done_bytes;
    counts_.unmap_failures += static_cast<int64_t>(failed.size());
    for (const auto& [block, size] : failed) {
      stuck_.emplace_back(block, size);
      stuck_bytes_ += size;
    }
    stuck_count_.store(stuck_.size(), std::memory_order_relaxed);
  }

  std::mutex mutex_;
  // The allocator the pool replaced: set once, before the pool is published.
  std::atomic<c10::Allocator*> before_{nullptr};
  std::atomic<bool> serving_{false};  // a lease holds the pool: it maps and keeps blocks
  std::atomic<size_t> least_{128 * 1024};
  std::atomic<size_t> mapped_{0};       // sizes_.size(), read without the lock
  std::atomic<size_t> stuck_count_{0};  // stuck_.size(), read without the lock
  // Under the lock:
  int state_ = kNotInstalled;
  size_t cap_ = 0;
  size_t cached_ = 0;  // bytes of the blocks waiting
  size_t live_ = 0;    // bytes of the blocks in use
  size_t high_ = 0;    // the most live_ was since the pool began to serve
  size_t stuck_bytes_ = 0;
  Waiting order_;                                     // the blocks waiting, oldest first
  std::multimap<size_t, Waiting::iterator> waiting_;  // the same, by size
  std::unordered_map<void*, size_t> sizes_;  // every block handed out or waiting
  Blocks stuck_;                             // blocks whose munmap failed
  Counts counts_;
};

Pool* pool() {
  static Pool* the_pool = new Pool();  // never destroyed: blocks may be freed at exit
  return the_pool;
}

void Pool::free_block(void* block) { pool()->release(block); }

void prepare_fork() { pool()->before_fork(); }
void parent_after_fork() { pool()->after_fork_in_parent(); }
void child_after_fork() { pool()->after_fork_in_child(); }

PyObject* py_install(PyObject*, PyObject*) {
  static std::once_flag registered;
  std::call_once(registered,
                 [] { pthread_atfork(prepare_fork, parent_after_fork, child_after_fork); });
  int state;
  Py_BEGIN_ALLOW_THREADS state = pool()->install();
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(state);
}

PyObject* py_serve(PyObject*, PyObject* args) {
  unsigned long long cap, least;
  if (!PyArg_ParseTuple(args, "KK", &cap, &least)) {
    return nullptr;
  }
  bool done;
  Py_BEGIN_ALLOW_THREADS done = pool()->serve(cap, least);
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(done);
}

PyObject* py_set_cap(PyObject*, PyObject* args) {
  unsigned long long cap;
  if (!PyArg_ParseTuple(args, "K", &cap)) {
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS pool()->set_cap(cap);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_stop(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS pool()->stop();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_serving(PyObject*, PyObject*) { return PyBool_FromLong(pool()->serving()); }

PyObject* py_state(PyObject*, PyObject*) {
  int state;
  Py_BEGIN_ALLOW_THREADS state = pool()->state();
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(state);
}

PyObject* py_counts(PyObject*, PyObject*) {
  std::vector<int64_t> c;
  Py_BEGIN_ALLOW_THREADS c = pool()->counts();
  Py_END_ALLOW_THREADS
  return Py_BuildValue("(LLLLLLLLLL)", c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8],
                       c[9]);
}

PyObject* py_fail_unmaps(PyObject*, PyObject* args) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) {
    return nullptr;
  }
  failing_unmaps.store(n, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"install", py_install, METH_NOARGS,
     "install(): become PyTorch's CPU allocator, once, serving nothing yet; returns the state "
     "(see state())."},
    {"serve", py_serve, METH_VARARGS,
     "serve(cap, least): serve CPU blocks of at least `least` bytes, keeping up to `cap` bytes "
     "of freed blocks past the high-water mark; False where the pool is not PyTorch's CPU "
     "allocator."},
    {"set_cap", py_set_cap, METH_VARARGS, "set_cap(cap): keep up to `cap` bytes of freed blocks."},
    {"stop", py_stop, METH_NOARGS,
     "Serve no more blocks (the pool stays the CPU allocator, passing requests on) and "
     "unmap the blocks waiting; blocks in use are unmapped when freed."},
    {"serving", py_serving, METH_NOARGS, "Whether the pool serves CPU allocations now."},
    {"state", py_state, METH_NOARGS,
     "0: not installed, 1: installed, 2: another allocator was there first, 3: refused by a "
     "higher priority, 4: displaced by an allocator installed later."},
    {"counts", py_counts, METH_NOARGS,
     "(hits, grown, misses, unmapped, unmapped_bytes, cached_bytes, live_bytes, mapping_ns, "
     "unmap_failures, stuck_bytes)."},
    {"_fail_unmaps", py_fail_unmaps, METH_VARARGS,
     "_fail_unmaps(n): the next n munmap calls fail with ENOMEM (fault injection for tests)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_alloc", "The session pool (see _pool.py).", -1,
                      methods};

}  // namespace

// Importing the module changes nothing: _pool.py reads TORCH_VERSION first and
// calls install() only where it is the torch running (rule 5).
PyMODINIT_FUNC PyInit__alloc() {
  PyObject* made = PyModule_Create(&module);
  if (made != nullptr &&
      PyModule_AddStringConstant(made, "TORCH_VERSION", TENSORSTASH_TORCH_VERSION) < 0) {
    Py_DECREF(made);
    return nullptr;
  }
  return made;
}
