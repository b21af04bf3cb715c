// The session pool: PyTorch's CPU allocator while a session that frees memory
// runs (NOTE [ Session pool ] in _pool.py).
//
// A block of at least `least` bytes is a mapping of its own. Freed, it waits in
// the pool, its pages resident, and serves a later request: whole if it is at
// most an eighth larger, else split (the tail waits on its own), or grown in
// place by mremap where no block waiting is large enough, so that only the
// pages it lacks are faulted in. The blocks waiting may hold `cap` bytes, or,
// while the blocks in use hold less than the most they held since the pool was
// installed, up to that difference: the pool holds at most its high-water mark
// plus `cap`. Past that the oldest blocks waiting are unmapped, and all of them
// once the last lease ends; a block freed after that is unmapped at once.
// Unmapped pages leave the process.
// Smaller requests go to the allocator that was installed before, and so does
// every request between leases: once installed, the pool stays PyTorch's CPU
// allocator, so that memory taken with raw_allocate and given back later with
// raw_deallocate reaches the allocator that made it (free_block).

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
#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kPage = 4096;

size_t whole_pages(size_t n) { return (n + kPage - 1) & ~(kPage - 1); }

// Nanoseconds spent in mmap, mremap and munmap, on every thread.
std::atomic<int64_t> mapping_ns{0};

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

struct Counts {
  int64_t hits = 0;      // requests served by a block waiting in the pool, whole or split
  int64_t grown = 0;     // requests served by a block waiting, grown
  int64_t misses = 0;    // requests that mapped a new block
  int64_t unmapped = 0;  // blocks unmapped when freed or at uninstall
  int64_t unmapped_bytes = 0;
};

class Pool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Allocator* before = before_;
    if (before == nullptr) {
      before = c10::GetDefaultCPUAllocator();
    }
    if (nbytes < least_ || !serving_) {
      return before->allocate(nbytes);
    }
    size_t size = whole_pages(nbytes);
    std::vector<std::pair<void*, size_t>> drop;
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

  // Serve blocks from now on. The first time, the pool becomes PyTorch's CPU
  // allocator, and stays it: between leases it hands every request to the one it
  // replaced (see uninstall).
  bool install(size_t cap, size_t least) {
    std::lock_guard<std::mutex> guard(mutex_);
    cap_ = cap;
    least_ = least;
    if (c10::GetCPUAllocator() != this) {
      if (before_ != nullptr) {
        return false;  // another allocator replaced the pool since: it stays out
      }
      c10::Allocator* current = c10::GetCPUAllocator();
      c10::SetCPUAllocator(this, /*priority=*/0);  // no-op under a higher one's
      if (c10::GetCPUAllocator() != this) {
        return false;
      }
      before_ = current;
    }
    if (!serving_) {
      serving_ = true;
      high_ = live_;  // the high-water mark counts from here
    }
    return true;
  }

  void set_cap(size_t cap) {
    std::vector<std::pair<void*, size_t>> drop;
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
  // scratch and workspace memory, which its primitives keep) is given back with
  // raw_deallocate of whichever allocator is installed then, and only the pool
  // knows which of those blocks are its own (free_block).
  void uninstall() {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      serving_ = false;
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
            mapping_ns.load(std::memory_order_relaxed)};
  }

  bool installed() {
    std::lock_guard<std::mutex> guard(mutex_);
    return serving_;
  }

  void after_fork_in_child() { new (&mutex_) std::mutex(); }

  static void free_block(void* block);

 private:
  using Waiting = std::list<std::pair<size_t, void*>>;  // oldest first

  // What the blocks waiting may hold now (see the top of this file).
  size_t allowed() const { return std::max(cap_, high_ - live_); }

  // Under the lock: `size` bytes more in use; the blocks waiting past what they
  // may hold now leave, oldest first, into `drop`.
  void in_use(size_t size, std::vector<std::pair<void*, size_t>>& drop) {
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
  void* take(size_t size, std::vector<std::pair<void*, size_t>>& drop) {
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
      if (rest >= least_) {
        sizes_[tail] = rest;
        wait(tail, rest);
      } else {
        leave(tail, rest, drop);
      }
      have = size;
    }
    counts_.hits++;
    in_use(have, drop);
    return block;
  }

  // The largest block waiting (all are smaller than `size`), grown to `size` by
  // mremap: its pages move resident, and only the rest are faulted in. nullptr
  // when none waits.
  void* grow(size_t size, std::vector<std::pair<void*, size_t>>& drop) {
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
      sizes_.erase(block);
    }
    void* moved;
    {
      Timed timed;
      moved = mremap(block, have, size, MREMAP_MAYMOVE);
    }
    std::lock_guard<std::mutex> guard(mutex_);
    if (moved == MAP_FAILED) {
      leave(block, have, drop);
      return nullptr;
    }
    sizes_[moved] = size;
    counts_.grown++;
    in_use(size, drop);
    return moved;
  }

  void release(void* block) {
    c10::DeleterFnPtr foreign = nullptr;
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto found = sizes_.find(block);
      if (found == sizes_.end()) {
        // Not the pool's: memory the allocator it replaced gave raw_allocate (a
        // request under the pool's least, or one made before the pool came or
        // between leases), given back through the pool's raw_deleter.
        c10::Allocator* before = before_ != nullptr ? before_ : c10::GetDefaultCPUAllocator();
        foreign = before->raw_deleter();
      } else {
        size_t size = found->second;
        live_ -= size;
        if (serving_ && size <= allowed()) {
          while (cached_ + size > allowed()) {
            evict_oldest(drop);  // the newest block freed waits; the oldest leave
          }
          wait(block, size);
        } else {
          leave(block, size, drop);
        }
      }
    }
    if (foreign != nullptr && block != nullptr) {
      foreign(block);
    }
    unmap(drop);
  }

  // Under the lock: the oldest block waiting leaves the pool for good.
  void evict_oldest(std::vector<std::pair<void*, size_t>>& drop) {
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
  // once the lock is let go.
  void leave(void* block, size_t size, std::vector<std::pair<void*, size_t>>& drop) {
    sizes_.erase(block);
    counts_.unmapped++;
    counts_.unmapped_bytes += static_cast<int64_t>(size);
    drop.emplace_back(block, size);
  }

  static void unmap(const std::vector<std::pair<void*, size_t>>& blocks) {
    if (blocks.empty()) {
      return;
    }
    Timed timed;
    for (const auto& [block, size] : blocks) {
      munmap(block, size);
    }
  }

  std::mutex mutex_;
  c10::Allocator* before_ = nullptr;  // the allocator the pool replaced; nullptr: not yet
  std::atomic<bool> serving_{false};  // a lease holds the pool: it maps and keeps blocks
  size_t cap_ = 0;
  size_t least_ = 128 * 1024;
  size_t cached_ = 0;  // bytes of the blocks waiting
  size_t live_ = 0;    // bytes of the blocks in use
  size_t high_ = 0;    // the most live_ was since the pool was installed
  Waiting order_;                                  // the blocks waiting, oldest first
  std::multimap<size_t, Waiting::iterator> waiting_;  // the same, by size
  std::unordered_map<void*, size_t> sizes_;  // every block mapped and not yet unmapped
  Counts counts_;
};

Pool* pool() {
  static Pool* the_pool = new Pool();  // never destroyed: blocks may be freed at exit
  return the_pool;
}

void Pool::free_block(void* block) { pool()->release(block); }

void child_after_fork() { pool()->after_fork_in_child(); }

PyObject* py_install(PyObject*, PyObject* args) {
  unsigned long long cap, least;
  if (!PyArg_ParseTuple(args, "KK", &cap, &least)) {
    return nullptr;
  }
  bool done;
  Py_BEGIN_ALLOW_THREADS done = pool()->install(cap, least);
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

PyObject* py_uninstall(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS pool()->uninstall();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_installed(PyObject*, PyObject*) { return PyBool_FromLong(pool()->installed()); }

PyObject* py_counts(PyObject*, PyObject*) {
  std::vector<int64_t> c = pool()->counts();
  return Py_BuildValue("(LLLLLLLL)", c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
}

PyMethodDef methods[] = {
    {"install", py_install, METH_VARARGS,
     "install(cap, least): serve CPU blocks of at least `least` bytes from the pool, "
     "keeping up to `cap` bytes of freed blocks past the high-water mark; False where it cannot (another "
     "allocator was installed with a higher priority)."},
    {"set_cap", py_set_cap, METH_VARARGS, "set_cap(cap): keep up to `cap` bytes of freed blocks."},
    {"uninstall", py_uninstall, METH_NOARGS,
     "Serve no more blocks (the pool stays the CPU allocator, passing requests on) and "
     "unmap the blocks waiting; blocks in use are unmapped when freed."},
    {"installed", py_installed, METH_NOARGS, "Whether the pool serves CPU allocations."},
    {"counts", py_counts, METH_NOARGS,
     "(hits, grown, misses, unmapped, unmapped_bytes, cached_bytes, live_bytes, mapping_ns)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_alloc", "The session pool (see _pool.py).", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__alloc() {
  pthread_atfork(nullptr, nullptr, child_after_fork);
  return PyModule_Create(&module);
}
