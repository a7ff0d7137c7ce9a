#include "forge/core/caching_allocator.h"

#include <algorithm>

#include "forge/core/error.h"

namespace forge {

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (bytes < (int64_t{1} << 20)) return fmt::format("{:.2f} KiB", b / 1024);
  if (bytes < (int64_t{1} << 30)) return fmt::format("{:.2f} MiB", b / (1 << 20));
  return fmt::format("{:.2f} GiB", b / (1 << 30));
}

CachingAllocator::CachingAllocator(AllocatorBackend backend) : backend_(std::move(backend)) {
  if (!backend_.raw_alloc || !backend_.raw_free)
    fail("CachingAllocator: the backend needs both raw_alloc and raw_free");
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    release_cached();
  } catch (...) {
    // A destructor must not throw; a failing raw_free at teardown leaves the memory to the process exit.
  }
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes < kSmallLimit)
    return std::max(kSmallRound, (bytes + kSmallRound - 1) / kSmallRound * kSmallRound);
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
}

void* CachingAllocator::take_cached(size_t size, uintptr_t stream) {
  auto per_stream = free_.find(stream);
  if (per_stream == free_.end()) return nullptr;
  FreeSet& set = per_stream->second;
  auto it = set.lower_bound({size, nullptr});
  if (it == set.end()) return nullptr;
  // Blocks are never split, so a block much larger than asked for would strand the difference.
  const size_t limit = size < kSmallLimit ? 2 * size : size + size / 8;
  if (it->first > limit) return nullptr;
  void* ptr = it->second;
  set.erase(it);
  if (set.empty()) free_.erase(per_stream);
  return ptr;
}

void CachingAllocator::release_cached() {
  for (auto& [stream, set] : free_) {
    for (const auto& [size, ptr] : set) {
      backend_.raw_free(ptr, backend_.ctx);
      blocks_.erase(ptr);
      stats_.reserved_bytes -= static_cast<int64_t>(size);
      ++stats_.raw_frees;
    }
  }
  free_.clear();
}

void* CachingAllocator::allocate(size_t bytes, uintptr_t stream) {
  if (bytes == 0) return nullptr;
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  void* ptr = take_cached(size, stream);
  if (ptr) {
    ++stats_.cache_hits;
  } else {
    ptr = backend_.raw_alloc(size, backend_.ctx);
    if (!ptr && !free_.empty()) {
      // The cached blocks of other sizes or streams may be what stands in the way.
      ++stats_.oom_retries;
      release_cached();
      ptr = backend_.raw_alloc(size, backend_.ctx);
    }
    if (!ptr)
      fail("out of {} memory allocating {} (allocated {}, reserved {})", backend_.name, format_bytes(size),
           format_bytes(stats_.allocated_bytes), format_bytes(stats_.reserved_bytes));
    ++stats_.raw_allocations;
    stats_.reserved_bytes += static_cast<int64_t>(size);
    blocks_[ptr] = Block{size, stream, false};
  }
  Block& block = blocks_.at(ptr);
  block.in_use = true;
  stats_.allocated_bytes += static_cast<int64_t>(block.size);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return ptr;
}

void CachingAllocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end())
    fail("CachingAllocator::free: pointer {} was not allocated by this {} allocator", ptr, backend_.name);
  Block& block = it->second;
  if (!block.in_use) fail("CachingAllocator::free: pointer {} was already freed (double free)", ptr);
  block.in_use = false;
  stats_.allocated_bytes -= static_cast<int64_t>(block.size);
  free_[block.stream].emplace(block.size, ptr);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached();
}

CachingAllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
}

}  // namespace forge
