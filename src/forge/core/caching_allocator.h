// A caching, stream-ordered allocator over any raw allocator (cudaMalloc/cudaFree for the GPU; a malloc
// fake in the tests). Raw device allocations are slow and synchronise the device, so freed blocks are kept
// and handed out again:
//   - sizes are rounded up: below 1 MiB to a multiple of 512 B (small blocks), from 1 MiB on to a multiple of
//     2 MiB (large blocks); blocks are never split, so the rounding bounds how much of a block is unused;
//   - stream-ordered reuse: a block remembers the stream it was allocated for, and once freed it is reused
//     only by allocations on that stream. Work on one stream runs in order, so the next user's kernels start
//     after the previous user's have finished without any synchronisation. A block used on another stream
//     must not be freed before that stream's work is done (there is no record_stream);
//   - best fit with a bound on waste: the smallest free block of the stream that is large enough, provided
//     it is at most twice the rounded size (small) or at most an eighth larger (large); otherwise a new
//     raw allocation;
//   - when the raw allocator fails (returns null), every cached block of every stream is released and the
//     allocation retried once; if that fails too, forge::Error "out of <name> memory allocating X
//     (allocated A, reserved R)".
// Releasing a cached block calls raw_free at once, so raw_free must be safe while streams may still run work
// that used the block (cudaFree synchronises the device). Thread-safe: one mutex guards everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace forge {

// The raw allocator underneath. raw_alloc returns null when out of memory (it may throw for other errors).
struct AllocatorBackend {
  void* (*raw_alloc)(size_t bytes, void* ctx) = nullptr;
  void (*raw_free)(void* ptr, void* ctx) = nullptr;
  void* ctx = nullptr;
  std::string name = "device";  // in the out-of-memory message: "out of device memory ..."
};

// Byte counts are of rounded block sizes (what the blocks occupy), like PyTorch's allocated/reserved.
struct CachingAllocatorStats {
  int64_t allocated_bytes = 0;       // in blocks handed out and not yet freed
  int64_t reserved_bytes = 0;        // held from the raw allocator: allocated + cached
  int64_t peak_allocated_bytes = 0;  // maximum of allocated_bytes since construction or reset_peak()
  int64_t raw_allocations = 0;       // successful raw_alloc calls
  int64_t raw_frees = 0;             // raw_free calls
  int64_t cache_hits = 0;            // allocations served from the cache
  int64_t oom_retries = 0;           // raw allocation failures that released the cache and retried
};

class CachingAllocator {
 public:
  static constexpr size_t kSmallLimit = size_t{1} << 20;  // below this a block is small
  static constexpr size_t kSmallRound = 512;
  static constexpr size_t kLargeRound = size_t{2} << 20;

  explicit CachingAllocator(AllocatorBackend backend);
  // Releases the cached blocks. Blocks still handed out are left alone (their memory is not returned).
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` for work on `stream` (an opaque token, e.g. a cudaStream_t). 0 bytes gives
  // nullptr. Throws forge::Error when out of memory.
  void* allocate(size_t bytes, uintptr_t stream = 0);
  // Returns a block to its stream's cache. nullptr is ignored; a pointer this allocator did not hand out,
  // or one already freed, throws forge::Error.
  void free(void* ptr);
  // Releases every cached (free) block to the raw allocator.
  void empty_cache();

  CachingAllocatorStats stats() const;
  void reset_peak();
  // The size a request of `bytes` occupies.
  static size_t round_size(size_t bytes);

 private:
  struct Block {
    size_t size;
    uintptr_t stream;
    bool in_use;
  };
  using FreeSet = std::set<std::pair<size_t, void*>>;  // (size, ptr): lower_bound finds the best fit

  void* take_cached(size_t size, uintptr_t stream);  // under the lock; nullptr when nothing fits
  void release_cached();                             // under the lock

  AllocatorBackend backend_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;  // every block held from the raw allocator
  std::map<uintptr_t, FreeSet> free_;        // cached blocks per stream
  CachingAllocatorStats stats_;
};

// "1.50 GiB", "512 B": for messages.
std::string format_bytes(int64_t bytes);

}  // namespace forge
