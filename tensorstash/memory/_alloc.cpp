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
// Made at import, inert, and installed once (rule 4), by the first lease, over
// c10's default CPU allocator only: `before_` is set before the pool is published,
// and never changes, so a request on any thread, at any moment, reaches either
// that allocator or the pool passing it on. Serving is an atomic switched on and
// off by leases; the allocator is never swapped back. Every shared field is an
// atomic or is read and written under `mutex_` (rule 6 for fork).
//
// The books (rule 10): `sizes_` holds every block handed out or waiting. An
// address enters it only once its range is mapped, and leaves it before its
// range is unmapped or moved: once the range is gone, the kernel may hand the
// address to another thread's mmap or mremap at once. An address entered twice
// aborts the process, naming the bug, before the heap can be corrupted. The
// books never throw: where one of their containers cannot grow (bad_alloc), a
// block that would wait leaves the pool instead, and a block that would be
// unmapped later is unmapped at once, so a free never throws and a request
// passes on to the allocator the pool replaced.

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
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef TENSORSTASH_TORCH_VERSION
#error "build with -DTENSORSTASH_TORCH_VERSION=\"<torch.__version__>\" (see setup.py)"
#endif

namespace {

constexpr size_t kPage = 4096;

// `n` rounded up to whole pages; 0 where that does not fit in a size_t.
size_t whole_pages(size_t n) {
  if (n > SIZE_MAX - (kPage - 1)) {
    return 0;
  }
  return (n + kPage - 1) & ~(kPage - 1);
}

// Nanoseconds spent in mmap, mremap and munmap, on every thread.
std::atomic<int64_t> mapping_ns{0};

// Fault injection for the tests (the `_fail_*` functions below).
std::atomic<int64_t> failing_unmaps{0};  // the next this many munmap calls fail with ENOMEM
std::atomic<int64_t> failing_remaps{0};  // the next this many mremap calls fail with ENOMEM
std::atomic<int64_t> passing_books{0};   // the books' next this many allocations succeed,
std::atomic<int64_t> failing_books{0};   // then this many throw std::bad_alloc

// Takes one from `left` where it is positive; whether it did.
bool take_one(std::atomic<int64_t>& left) {
  int64_t now = left.load(std::memory_order_relaxed);
  while (now > 0) {
    if (left.compare_exchange_weak(now, now - 1, std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

// Called before each allocation the books make (a node of `sizes_`, `order_` or
// `waiting_`, a slot in a list of blocks to unmap): throws where the tests asked.
void books_allocate() {
  if (failing_books.load(std::memory_order_relaxed) == 0 || take_one(passing_books)) {
    return;
  }
  if (take_one(failing_books)) {
    throw std::bad_alloc();
  }
}

[[noreturn]] void broken(const char* what, const void* block, size_t size) {
  std::fprintf(stderr,
               "tensorstash: the session pool's books are broken: %s (block %p, %zu bytes); "
               "this is a bug in tensorstash, please report it\n",
               what, block, size);
  std::fflush(stderr);
  std::abort();
}

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
  if (take_one(failing_unmaps)) {
    errno = ENOMEM;
    return -1;
  }
  return munmap(block, size);
}

void* remap_one(void* block, size_t have, size_t size) {
  if (take_one(failing_remaps)) {
    errno = ENOMEM;
    return MAP_FAILED;
  }
  return mremap(block, have, size, MREMAP_MAYMOVE);
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

// A block whose munmap failed (rule 9), described in its own first bytes: the list
// of them needs no memory of its own, so a failed munmap never needs an allocation.
struct Stuck {
  Stuck* next;
  size_t size;
};

// What a round of munmap calls did, brought into the counts under the lock (tally).
struct Unmapped {
  int64_t blocks = 0;
  int64_t bytes = 0;
  int64_t failures = 0;
  Stuck* stuck = nullptr;  // the blocks whose munmap failed, listed in themselves
};

// What check() found: the bytes the books record, and what they should add up to.
struct Books {
  size_t recorded = 0;  // the sizes in `sizes_`
  size_t live = 0;      // live_: blocks handed out
  size_t cached = 0;    // cached_: blocks waiting
  size_t stuck = 0;     // stuck_bytes_: blocks whose munmap failed
  std::string wrong;    // what does not add up; empty where all does
};

class Pool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Allocator* before = replaced();
    size_t size = whole_pages(nbytes);  // 0: nothing to map, or too large to round
    if (size == 0 || nbytes < least_.load(std::memory_order_relaxed) ||
        !serving_.load(std::memory_order_acquire) || !still_current()) {
      return before->allocate(nbytes);
    }
    Blocks drop;
    void* block = take(size, drop);
    if (block == nullptr) {
      block = grow(size, drop);
    }
    if (block == nullptr) {
      block = map_new(size, drop);
    }
    unmap(drop);
    if (block == nullptr) {
      return before->allocate(nbytes);  // its own error where memory is out
    }
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
    before_.store(current, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // before_ is seen before the pool
    c10::SetCPUAllocator(this, /*priority=*/0);  // a no-op under a higher priority's
    state_ = c10::GetCPUAllocator() == this ? kInstalled : kRefused;
    return state_;
  }

  // Serve blocks of at least `least` bytes from now on, keeping up to `cap` bytes
  // waiting; false where the pool is not PyTorch's CPU allocator (not installed, or
  // displaced: rule 4).
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

  std::array<int64_t, 10> counts() {
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

  // The state; before install, kOtherBefore where install would find another
  // allocator (nothing is recorded: install decides).
  int state() {
    std::lock_guard<std::mutex> guard(mutex_);
    if (state_ == kNotInstalled) {
      return c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator() ? kNotInstalled
                                                                     : kOtherBefore;
    }
    if (state_ == kInstalled && c10::GetCPUAllocator() != this) {
      state_ = kDisplaced;
      serving_.store(false, std::memory_order_release);
    }
    return state_;
  }

  // The books, checked (rule 10): the blocks recorded add up to those handed out
  // plus those waiting; every block waiting is recorded with its size and listed
  // twice (by age and by size); the stuck ones add up to stuck_bytes_; and no two
  // blocks, recorded or stuck, overlap. Throws std::bad_alloc where memory is out.
  Books check() {
    std::lock_guard<std::mutex> guard(mutex_);
    Books books;
    books.live = live_;
    books.cached = cached_;
    books.stuck = stuck_bytes_;
    std::string wrong;
    auto say = [&wrong](const std::string& what) {
      wrong += wrong.empty() ? what : "; " + what;
    };
    std::vector<std::pair<uintptr_t, size_t>> ranges;
    for (const auto& [block, size] : sizes_) {
      books.recorded += size;
      ranges.emplace_back(reinterpret_cast<uintptr_t>(block), size);
    }
    if (books.recorded != live_ + cached_) {
      say("the blocks recorded hold " + std::to_string(books.recorded) +
          " bytes, those in use and waiting " + std::to_string(live_) + " + " +
          std::to_string(cached_));
    }
    if (mapped_.load(std::memory_order_relaxed) != sizes_.size()) {
      say("mapped_ is " + std::to_string(mapped_.load()) + ", not " +
          std::to_string(sizes_.size()));
    }
    size_t waiting = 0;
    for (const auto& [size, block] : order_) {
      waiting += size;
      auto found = sizes_.find(block);
      if (found == sizes_.end() || found->second != size) {
        say("a block waiting of " + std::to_string(size) + " bytes is not recorded so");
      }
    }
    if (waiting != cached_) {
      say("the blocks waiting hold " + std::to_string(waiting) + " bytes, cached_ says " +
          std::to_string(cached_));
    }
    if (waiting_.size() != order_.size()) {
      say(std::to_string(order_.size()) + " blocks waiting by age, " +
          std::to_string(waiting_.size()) + " by size");
    }
    for (const auto& [size, at] : waiting_) {
      if (at->first != size) {
        say("a block waiting is listed by size as " + std::to_string(size) + " bytes, by age as " +
            std::to_string(at->first));
      }
    }
    size_t stuck = 0, stuck_blocks = 0;
    for (const Stuck* at = stuck_; at != nullptr; at = at->next) {
      stuck += at->size;
      stuck_blocks++;
      ranges.emplace_back(reinterpret_cast<uintptr_t>(at), at->size);
    }
    if (stuck != stuck_bytes_ || stuck_blocks != stuck_count_.load(std::memory_order_relaxed)) {
      say("the stuck blocks hold " + std::to_string(stuck) + " bytes in " +
          std::to_string(stuck_blocks) + ", stuck_bytes_ says " + std::to_string(stuck_bytes_));
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); i++) {
      if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
        say("two blocks overlap");
        break;
      }
    }
    books.wrong = std::move(wrong);
    return books;
  }

  // pthread_atfork (rule 6): the lock is held across fork, so the child gets the
  // containers whole; the child serves nothing, unmaps the blocks waiting (its
  // copies: the parent's stay), and counts its high-water mark from what it holds.
  // A block another thread was growing is in none of its books (rule 10): the
  // child keeps its copy mapped, and never hands it out.
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

  static void free_block(void* block) noexcept;

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

  // Under the lock: `block`, whose `size` bytes are mapped, enters the books; false
  // where they cannot grow (nothing changed). An address already there aborts.
  bool record(void* block, size_t size) noexcept {
    try {
      books_allocate();
      auto [at, fresh] = sizes_.emplace(block, size);
      if (!fresh) {
        broken("an address mapped anew is recorded already", block, at->second);
      }
    } catch (const std::bad_alloc&) {
      return false;
    }
    mapped_.store(sizes_.size(), std::memory_order_relaxed);
    return true;
  }

  // Under the lock: `block` leaves the books, before its range is unmapped or moved.
  void forget(void* block) noexcept {
    if (sizes_.erase(block) == 0) {
      broken("a block that leaves is not recorded", block, 0);
    }
    mapped_.store(sizes_.size(), std::memory_order_relaxed);
  }

  // Under the lock: `size` bytes more in use; the blocks waiting past what they
  // may hold now leave, oldest first, into `drop`.
  void in_use(size_t size, Blocks& drop) noexcept {
    live_ += size;
    high_ = std::max(high_, live_);
    while (cached_ > allowed()) {
      evict_oldest(drop);
    }
  }

  // Under the lock: the block waiting at `found` leaves the waiting lists.
  void unlist(std::multimap<size_t, Waiting::iterator>::iterator found) noexcept {
    cached_ -= found->first;
    order_.erase(found->second);
    waiting_.erase(found);
  }

  // Under the lock: recorded `block` of `size` bytes waits, the newest; false where
  // the lists cannot grow (then it is in neither: all or nothing).
  bool wait(void* block, size_t size) noexcept {
    try {
      books_allocate();
      order_.emplace_back(size, block);
    } catch (const std::bad_alloc&) {
      return false;
    }
    try {
      books_allocate();
      waiting_.emplace(size, std::prev(order_.end()));
    } catch (const std::bad_alloc&) {
      order_.pop_back();
      return false;
    }
    cached_ += size;
    return true;
  }

  // Under the lock: recorded `block` of `size` bytes, not in use, waits where the
  // pool serves and it fits under what the blocks waiting may hold (the oldest
  // leave to make room), else leaves the pool.
  void settle(void* block, size_t size, Blocks& drop) noexcept {
    if (serving_.load(std::memory_order_relaxed) && size <= allowed()) {
      while (cached_ + size > allowed()) {
        evict_oldest(drop);  // the newest block freed waits; the oldest leave
      }
      wait_or_leave(block, size, drop);
      return;
    }
    forget(block);
    leave(block, size, drop);
  }

  // Under the lock: recorded `block` of `size` bytes waits, or, where the lists
  // cannot grow, leaves the pool.
  void wait_or_leave(void* block, size_t size, Blocks& drop) noexcept {
    if (!wait(block, size)) {
      forget(block);
      leave(block, size, drop);
    }
  }

  // The smallest block waiting of at least `size` bytes: whole where it is at most
  // an eighth larger, else split, its tail waiting on its own (or unmapped, where
  // it is smaller than any block the pool serves). nullptr when none.
  void* take(size_t size, Blocks& drop) noexcept {
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
      auto head = sizes_.find(block);
      if (head == sizes_.end()) {
        broken("a block waiting is not recorded", block, have);
      }
      head->second = size;
      if (rest >= least_.load(std::memory_order_relaxed) && record(tail, rest)) {
        wait_or_leave(tail, rest, drop);
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
  // mremap: its pages move resident, and only the rest are faulted in. It leaves
  // the books before mremap and enters them again where it ends up (rule 10); where
  // mremap fails, it waits again. nullptr when none waits or mremap failed.
  void* grow(size_t size, Blocks& drop) noexcept {
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
      forget(block);
    }
    void* moved;
    {
      Timed timed;
      moved = remap_one(block, have, size);
    }
    std::lock_guard<std::mutex> guard(mutex_);
    if (moved == MAP_FAILED) {  // still mapped where it was, as it was
      if (record(block, have)) {
        settle(block, have, drop);
      } else {
        leave(block, have, drop);
      }
      return nullptr;
    }
    if (!record(moved, size)) {
      leave(moved, size, drop);
      return nullptr;
    }
    counts_.grown++;
    in_use(size, drop);
    return moved;
  }

  // A new mapping of `size` bytes, recorded; nullptr where mmap fails, or the books
  // cannot grow (then it is unmapped).
  void* map_new(size_t size, Blocks& drop) noexcept {
    void* block;
    {
      Timed timed;
      block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (block == MAP_FAILED) {
      return nullptr;
    }
    std::lock_guard<std::mutex> guard(mutex_);
    if (!record(block, size)) {
      leave(block, size, drop);
      return nullptr;
    }
    counts_.misses++;
    in_use(size, drop);
    return block;
  }

  // A DataPtr's deleter, and raw_deallocate's: never throws (a throwing deleter
  // terminates the process).
  void release(void* block) noexcept {
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
          settle(block, size, drop);
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
  void evict_oldest(Blocks& drop) noexcept {
    auto [size, block] = order_.front();
    auto [first, last] = waiting_.equal_range(size);
    auto twin = std::find_if(first, last, [this](const auto& entry) {
      return entry.second == order_.begin();
    });
    if (twin == last) {
      broken("the oldest block waiting is not listed by size", block, size);
    }
    unlist(twin);
    forget(block);
    leave(block, size, drop);
  }

  // Under the lock: a block out of the books leaves the pool for good, into `drop`
  // to be unmapped once the lock is let go, or, where `drop` cannot grow, now.
  void leave(void* block, size_t size, Blocks& drop) noexcept {
    try {
      books_allocate();
      drop.emplace_back(block, size);
      return;
    } catch (const std::bad_alloc&) {
    }
    Unmapped done;
    {
      Timed timed;
      unmap_block(block, size, done);
    }
    tally(done);
  }

  // Unmaps `block`, or, where munmap fails, lists it in `done.stuck` (in its own
  // first bytes: it stays mapped, and is the pool's alone).
  static void unmap_block(void* block, size_t size, Unmapped& done) noexcept {
    if (unmap_one(block, size) == 0) {
      done.blocks++;
      done.bytes += static_cast<int64_t>(size);
      return;
    }
    done.failures++;
    Stuck* stuck = static_cast<Stuck*>(block);
    stuck->next = done.stuck;
    stuck->size = size;
    done.stuck = stuck;
  }

  // Under the lock: what a round of munmap calls did goes into the counts, and the
  // blocks it could not unmap join the stuck ones.
  void tally(Unmapped& done) noexcept {
    counts_.unmapped += done.blocks;
    counts_.unmapped_bytes += done.bytes;
    counts_.unmap_failures += done.failures;
    while (done.stuck != nullptr) {
      Stuck* next = done.stuck->next;
      done.stuck->next = stuck_;
      stuck_ = done.stuck;
      stuck_bytes_ += done.stuck->size;
      stuck_count_.fetch_add(1, std::memory_order_relaxed);
      done.stuck = next;
    }
  }

  // Without the lock: unmap the blocks that left, and those whose munmap failed
  // before. A block whose munmap fails (ENOMEM where the split would pass the
  // process's count of mappings) stays mapped, out of every list but the stuck
  // one, and is tried again at the next unmap: its pages are counted, never reused.
  void unmap(Blocks& blocks) noexcept {
    Stuck* again = nullptr;
    if (stuck_count_.load(std::memory_order_relaxed) != 0) {
      std::lock_guard<std::mutex> guard(mutex_);
      again = stuck_;
      stuck_ = nullptr;
      stuck_bytes_ = 0;
      stuck_count_.store(0, std::memory_order_relaxed);
    }
    if (blocks.empty() && again == nullptr) {
      return;
    }
    Unmapped done;
    {
      Timed timed;
      for (const auto& [block, size] : blocks) {
        unmap_block(block, size, done);
      }
      while (again != nullptr) {
        Stuck* next = again->next;  // read before the block is unmapped
        unmap_block(again, again->size, done);
        again = next;
      }
    }
    std::lock_guard<std::mutex> guard(mutex_);
    tally(done);
  }

  std::mutex mutex_;
  // The allocator the pool replaced: set once, before the pool is published.
  std::atomic<c10::Allocator*> before_{nullptr};
  std::atomic<bool> serving_{false};  // a lease holds the pool: it maps and keeps blocks
  std::atomic<size_t> least_{128 * 1024};
  std::atomic<size_t> mapped_{0};       // sizes_.size(), read without the lock
  std::atomic<size_t> stuck_count_{0};  // blocks in stuck_, read without the lock
  // Under the lock:
  int state_ = kNotInstalled;
  size_t cap_ = 0;
  size_t cached_ = 0;  // bytes of the blocks waiting
  size_t live_ = 0;    // bytes of the blocks in use
  size_t high_ = 0;    // the most live_ was since the pool began to serve
  size_t stuck_bytes_ = 0;
  Waiting order_;                                     // the blocks waiting, oldest first
  std::multimap<size_t, Waiting::iterator> waiting_;  // the same, by size
  std::unordered_map<void*, size_t> sizes_;  // the books: every block handed out or waiting
  Stuck* stuck_ = nullptr;                   // blocks whose munmap failed
  Counts counts_;
};

Pool* pool() {
  static Pool* the_pool = new Pool();  // never destroyed: blocks may be freed at exit
  return the_pool;
}

void Pool::free_block(void* block) noexcept { pool()->release(block); }

void prepare_fork() { pool()->before_fork(); }
void parent_after_fork() { pool()->after_fork_in_parent(); }
void child_after_fork() { pool()->after_fork_in_child(); }

PyObject* py_install(PyObject*, PyObject*) {
  static std::once_flag registered;
  Pool* the_pool;
  try {
    the_pool = pool();
    std::call_once(registered,
                   [] { pthread_atfork(prepare_fork, parent_after_fork, child_after_fork); });
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  int state;
  Py_BEGIN_ALLOW_THREADS state = the_pool->install();
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(state);
}

PyObject* py_serve(PyObject*, PyObject* args) {
  unsigned long long cap, least;
  if (!PyArg_ParseTuple(args, "KK", &cap, &least)) {
    return nullptr;
  }
  if (least < kPage) {
    // A block is whole pages: a request of 0 bytes would round to an empty block.
    PyErr_Format(PyExc_ValueError,
                 "tensorstash.memory._alloc.serve: least=%llu bytes is less than a page; the "
                 "pool maps whole pages, so pass least >= %zu",
                 least, kPage);
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
  std::array<int64_t, 10> c;
  Py_BEGIN_ALLOW_THREADS c = pool()->counts();
  Py_END_ALLOW_THREADS
  return Py_BuildValue("(LLLLLLLLLL)", c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8],
                       c[9]);
}

PyObject* py_check(PyObject*, PyObject*) {
  Books books;
  bool out_of_memory = false;
  Py_BEGIN_ALLOW_THREADS try {
    books = pool()->check();
  } catch (const std::bad_alloc&) {
    out_of_memory = true;
  }
  Py_END_ALLOW_THREADS
  if (out_of_memory) {
    return PyErr_NoMemory();
  }
  return Py_BuildValue("(KKKKs)", static_cast<unsigned long long>(books.recorded),
                       static_cast<unsigned long long>(books.live),
                       static_cast<unsigned long long>(books.cached),
                       static_cast<unsigned long long>(books.stuck), books.wrong.c_str());
}

PyObject* py_allocate(PyObject*, PyObject* args) {
  unsigned long long nbytes;
  if (!PyArg_ParseTuple(args, "K", &nbytes)) {
    return nullptr;
  }
  std::string error;
  unsigned long long address = 0;
  Py_BEGIN_ALLOW_THREADS try {
    c10::DataPtr made = c10::GetCPUAllocator()->allocate(static_cast<size_t>(nbytes));
    address = reinterpret_cast<uintptr_t>(made.get());
  } catch (const std::exception& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(address);
}

PyObject* py_fail_unmaps(PyObject*, PyObject* args) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) {
    return nullptr;
  }
  failing_unmaps.store(n, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyObject* py_fail_remaps(PyObject*, PyObject* args) {
  long long n;
  if (!PyArg_ParseTuple(args, "L", &n)) {
    return nullptr;
  }
  failing_remaps.store(n, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyObject* py_fail_books(PyObject*, PyObject* args) {
  long long after, n;
  if (!PyArg_ParseTuple(args, "LL", &after, &n)) {
    return nullptr;
  }
  failing_books.store(0, std::memory_order_relaxed);
  passing_books.store(after, std::memory_order_relaxed);
  failing_books.store(n, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"install", py_install, METH_NOARGS,
     "install(): become PyTorch's CPU allocator, once, serving nothing yet; returns the state "
     "(see state())."},
    {"serve", py_serve, METH_VARARGS,
     "serve(cap, least): serve CPU blocks of at least `least` bytes (at least a page), keeping "
     "up to `cap` bytes of freed blocks past the high-water mark; False where the pool is not "
     "PyTorch's CPU allocator."},
    {"set_cap", py_set_cap, METH_VARARGS, "set_cap(cap): keep up to `cap` bytes of freed blocks."},
    {"stop", py_stop, METH_NOARGS,
     "Serve no more blocks (the pool stays the CPU allocator, passing requests on) and "
     "unmap the blocks waiting; blocks in use are unmapped when freed."},
    {"serving", py_serving, METH_NOARGS, "Whether the pool serves CPU allocations now."},
    {"state", py_state, METH_NOARGS,
     "0: not installed, 1: installed, 2: another allocator was there first (before install: "
     "is there now), 3: refused by a higher priority, 4: displaced by an allocator installed "
     "later."},
    {"counts", py_counts, METH_NOARGS,
     "(hits, grown, misses, unmapped, unmapped_bytes, cached_bytes, live_bytes, mapping_ns, "
     "unmap_failures, stuck_bytes)."},
    {"_check", py_check, METH_NOARGS,
     "_check(): (recorded_bytes, live_bytes, cached_bytes, stuck_bytes, wrong): the books "
     "checked; `wrong` says what does not add up, empty where all does."},
    {"_allocate", py_allocate, METH_VARARGS,
     "_allocate(nbytes): allocate nbytes through PyTorch's CPU allocator and free them at once; "
     "the address (tests: sizes torch.empty cannot ask for)."},
    {"_fail_unmaps", py_fail_unmaps, METH_VARARGS,
     "_fail_unmaps(n): the next n munmap calls fail with ENOMEM (fault injection for tests)."},
    {"_fail_remaps", py_fail_remaps, METH_VARARGS,
     "_fail_remaps(n): the next n mremap calls fail with ENOMEM (fault injection for tests)."},
    {"_fail_books", py_fail_books, METH_VARARGS,
     "_fail_books(after, n): past the next `after` allocations of the pool's books, n throw "
     "std::bad_alloc (fault injection for tests)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_alloc", "The session pool (see _pool.py).", -1,
                      methods};

}  // namespace

// Importing the module changes nothing: _pool.py reads TORCH_VERSION first and
// calls install() only where it is the torch running (rule 5), at the first lease.
// The pool is made here, inert: a thread started after the import sees it whole,
// whatever c10's plain store of PyTorch's CPU allocator lets it see later.
PyMODINIT_FUNC PyInit__alloc() {
  try {
    pool();
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* made = PyModule_Create(&module);
  if (made != nullptr &&
      PyModule_AddStringConstant(made, "TORCH_VERSION", TENSORSTASH_TORCH_VERSION) < 0) {
    Py_DECREF(made);
    return nullptr;
  }
  return made;
}
