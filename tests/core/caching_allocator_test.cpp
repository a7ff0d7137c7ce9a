#include "forge/core/caching_allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <thread>
#include <unordered_map>
#include <vector>

#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::caching_allocator_test {
namespace {

// A malloc-backed raw allocator that counts calls, remembers what is outstanding and can run out of memory
// (it refuses any allocation that would take the outstanding bytes past `capacity`).
struct FakeBackend {
  int64_t allocs = 0, frees = 0, failures = 0;
  size_t outstanding = 0, capacity = SIZE_MAX;
  std::unordered_map<void*, size_t> live;  // pointer -> bytes
  std::vector<size_t> sizes;               // of every successful raw allocation, in order

  static void* raw_alloc(size_t bytes, void* ctx) {
    auto* self = static_cast<FakeBackend*>(ctx);
    if (self->outstanding + bytes > self->capacity) {
      ++self->failures;
      return nullptr;
    }
    void* p = std::malloc(bytes);
    ++self->allocs;
    self->outstanding += bytes;
    self->live[p] = bytes;
    self->sizes.push_back(bytes);
    return p;
  }
  static void raw_free(void* ptr, void* ctx) {
    auto* self = static_cast<FakeBackend*>(ctx);
    auto it = self->live.find(ptr);
    ASSERT_NE(it, self->live.end()) << "raw_free of a pointer the backend did not hand out";
    self->outstanding -= it->second;
    self->live.erase(it);
    ++self->frees;
    std::free(ptr);
  }
  AllocatorBackend backend() { return AllocatorBackend{raw_alloc, raw_free, this, "device"}; }
};

constexpr size_t kMiB = size_t{1} << 20;

TEST(CachingAllocator, RoundsSmallTo512BytesAndLargeTo2MiB) {
  EXPECT_EQ(CachingAllocator::round_size(1), 512u);
  EXPECT_EQ(CachingAllocator::round_size(512), 512u);
  EXPECT_EQ(CachingAllocator::round_size(513), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(kMiB - 1), kMiB);  // still small: 512-byte steps
  EXPECT_EQ(CachingAllocator::round_size(kMiB), 2 * kMiB);  // large from 1 MiB on
  EXPECT_EQ(CachingAllocator::round_size(2 * kMiB), 2 * kMiB);
  EXPECT_EQ(CachingAllocator::round_size(2 * kMiB + 1), 4 * kMiB);

  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(1000);
  void* b = alloc.allocate(3 * kMiB);
  EXPECT_EQ(fake.sizes, (std::vector<size_t>{1024, 4 * kMiB}));
  EXPECT_EQ(alloc.stats().allocated_bytes, static_cast<int64_t>(1024 + 4 * kMiB));
  alloc.free(a);
  alloc.free(b);
}

TEST(CachingAllocator, ZeroBytesIsNullAndFreeingNullIsANoOp) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  EXPECT_EQ(alloc.allocate(0), nullptr);
  alloc.free(nullptr);
  EXPECT_EQ(fake.allocs, 0);
}

TEST(CachingAllocator, ReusesAFreedBlockWithoutARawAllocation) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(4096);
  alloc.free(a);
  void* b = alloc.allocate(4000);  // same rounded size
  EXPECT_EQ(b, a);
  EXPECT_EQ(fake.allocs, 1);
  EXPECT_EQ(alloc.stats().cache_hits, 1);
  alloc.free(b);
  void* big = alloc.allocate(10 * kMiB);
  alloc.free(big);
  EXPECT_EQ(alloc.allocate(9 * kMiB + 5), big);  // rounds to 10 MiB: an exact fit
  EXPECT_EQ(fake.allocs, 2);
}

TEST(CachingAllocator, BestFitWithBoundedWaste) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  // Cached large blocks of 16, 18 and 64 MiB.
  void* b16 = alloc.allocate(16 * kMiB);
  void* b18 = alloc.allocate(18 * kMiB);
  void* b64 = alloc.allocate(64 * kMiB);
  alloc.free(b16), alloc.free(b18), alloc.free(b64);
  EXPECT_EQ(alloc.allocate(17 * kMiB), b18);  // 18 MiB: the smallest that fits, 1/18 wasted
  // 40 MiB would strand 24 MiB of the 64 MiB block (more than 1/8): a new raw allocation instead.
  const int64_t before = fake.allocs;
  void* b40 = alloc.allocate(40 * kMiB);
  EXPECT_NE(b40, b64);
  EXPECT_EQ(fake.allocs, before + 1);
  // Small blocks: up to twice the rounded size is acceptable.
  void* s2k = alloc.allocate(2048);
  alloc.free(s2k);
  EXPECT_EQ(alloc.allocate(1024), s2k);
  void* s4k = alloc.allocate(4096);
  alloc.free(s4k);
  EXPECT_NE(alloc.allocate(1024), s4k);  // 4 KiB for 1 KiB: too wasteful
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheirOwnStream) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  const uintptr_t s1 = 0x1000, s2 = 0x2000;
  void* a = alloc.allocate(8192, s1);
  alloc.free(a);
  void* b = alloc.allocate(8192, s2);  // a is cached for s1 only
  EXPECT_NE(b, a);
  EXPECT_EQ(fake.allocs, 2);
  void* c = alloc.allocate(8192, s1);
  EXPECT_EQ(c, a);
  alloc.free(b);
  alloc.free(c);
  // Each block went back to its own stream's cache.
  EXPECT_EQ(alloc.allocate(8192, s2), b);
  EXPECT_EQ(alloc.allocate(8192, s1), a);
}

TEST(CachingAllocator, OutOfMemoryReleasesTheCacheAndRetries) {
  FakeBackend fake;
  fake.capacity = 10 * kMiB;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(4 * kMiB, 1);
  void* b = alloc.allocate(4 * kMiB, 2);
  alloc.free(a);
  alloc.free(b);
  // 8 MiB is cached; a 6 MiB request fits in neither cached block (waste bound) nor beside them (10 MiB
  // capacity): the allocator releases the cache and retries.
  void* c = alloc.allocate(6 * kMiB, 1);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(fake.failures, 1);
  EXPECT_EQ(fake.frees, 2);
  const auto s = alloc.stats();
  EXPECT_EQ(s.oom_retries, 1);
  EXPECT_EQ(s.reserved_bytes, static_cast<int64_t>(6 * kMiB));
  EXPECT_EQ(s.allocated_bytes, static_cast<int64_t>(6 * kMiB));
  alloc.free(c);
}

TEST(CachingAllocator, OutOfMemoryAfterTheRetryThrowsOneLine) {
  FakeBackend fake;
  fake.capacity = 10 * kMiB;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(8 * kMiB);
  void* cached = alloc.allocate(2 * kMiB);
  alloc.free(cached);
  testing::expect_error_containing(
      [&] { alloc.allocate(4 * kMiB); },
      {"out of device memory allocating 4.00 MiB", "allocated 8.00 MiB", "reserved 8.00 MiB"});
  // The retry released the cached 2 MiB before giving up; the live block is untouched.
  EXPECT_EQ(fake.failures, 2);
  EXPECT_EQ(alloc.stats().reserved_bytes, static_cast<int64_t>(8 * kMiB));
  // With nothing cached there is nothing to release: one attempt, then the error.
  testing::expect_error_containing([&] { alloc.allocate(4 * kMiB); }, {"out of device memory"});
  EXPECT_EQ(fake.failures, 3);
  alloc.free(a);
}

TEST(CachingAllocator, StatsTrackAllocatedReservedPeakAndCounts) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(4 * kMiB);
  void* b = alloc.allocate(1000);
  auto s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes, static_cast<int64_t>(4 * kMiB + 1024));
  EXPECT_EQ(s.reserved_bytes, s.allocated_bytes);
  EXPECT_EQ(s.peak_allocated_bytes, s.allocated_bytes);
  EXPECT_EQ(s.raw_allocations, 2);
  EXPECT_EQ(s.cache_hits, 0);
  alloc.free(a);
  s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes, 1024);
  EXPECT_EQ(s.reserved_bytes, static_cast<int64_t>(4 * kMiB + 1024));  // a is cached, still reserved
  EXPECT_EQ(s.peak_allocated_bytes, static_cast<int64_t>(4 * kMiB + 1024));
  alloc.reset_peak();
  EXPECT_EQ(alloc.stats().peak_allocated_bytes, 1024);
  alloc.free(b);
  alloc.empty_cache();
  s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.reserved_bytes, 0);
  EXPECT_EQ(s.raw_frees, 2);
  EXPECT_EQ(fake.frees, 2);
  EXPECT_TRUE(fake.live.empty());
}

TEST(CachingAllocator, EmptyCacheKeepsLiveBlocks) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  void* live = alloc.allocate(4096);
  void* cached = alloc.allocate(8192);
  alloc.free(cached);
  alloc.empty_cache();
  EXPECT_EQ(fake.frees, 1);
  EXPECT_EQ(fake.live.count(live), 1u);
  alloc.free(live);  // still known to the allocator
  EXPECT_EQ(alloc.allocate(4096), live);
}

TEST(CachingAllocator, DoubleFreeAndUnknownPointersAreRefused) {
  FakeBackend fake;
  CachingAllocator alloc(fake.backend());
  void* a = alloc.allocate(4096);
  alloc.free(a);
  testing::expect_error_containing([&] { alloc.free(a); }, {"already freed", "double free"});
  int not_ours = 0;
  testing::expect_error_containing([&] { alloc.free(&not_ours); },
                                   {"not allocated by this device allocator"});
  // A pointer inside a block is not the block.
  void* b = alloc.allocate(4096);
  testing::expect_error_containing([&] { alloc.free(static_cast<char*>(b) + 16); }, {"not allocated"});
  alloc.free(b);
}

TEST(CachingAllocator, DestructorReleasesTheCache) {
  FakeBackend fake;
  {
    CachingAllocator alloc(fake.backend());
    void* a = alloc.allocate(4096);
    void* b = alloc.allocate(3 * kMiB);
    alloc.free(a);
    alloc.free(b);
  }
  EXPECT_EQ(fake.frees, 2);
  EXPECT_TRUE(fake.live.empty());
}

TEST(CachingAllocator, ConcurrentUseKeepsTheBooksBalanced) {
  FakeBackend fake;  // only touched under the allocator's lock
  CachingAllocator alloc(fake.backend());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&alloc, t] {
      for (int i = 0; i < 2000; ++i) {
        void* p = alloc.allocate(512 * (1 + (i + t) % 7), static_cast<uintptr_t>(t % 2));
        static_cast<char*>(p)[0] = 1;
        alloc.free(p);
      }
    });
  for (auto& th : threads) th.join();
  const auto s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.raw_allocations + s.cache_hits, 8000);
  EXPECT_GT(s.cache_hits, 7000);
  EXPECT_GT(s.reserved_bytes, 0);
}

TEST(CachingAllocator, BackendNeedsBothFunctions) {
  testing::expect_error_containing([] { CachingAllocator alloc(AllocatorBackend{}); },
                                   {"raw_alloc and raw_free"});
}

}  // namespace
}  // namespace forge::caching_allocator_test
