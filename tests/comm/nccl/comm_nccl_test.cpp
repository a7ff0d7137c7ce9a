// The nccl backend, one rank per CUDA device (run by mpirun with 1 and 2 ranks, label "cuda"): every
// collective against its definition (collective_checks.h) on device buffers, and a split. Skips where forge
// was built without NCCL, no device is visible, or there are fewer devices than ranks (NCCL refuses two
// ranks on one device).
#include <gtest/gtest.h>

#include "comm/collective_checks.h"
#include "forge/comm/comm.h"
#include "forge/comm/nccl/device_memory.h"

namespace forge::comm {
namespace {

class DeviceMemory final : public checks::Memory {
 public:
  void* alloc(int64_t bytes) override { return nccl::device_alloc(bytes); }
  void release(void* ptr) override { nccl::device_free(ptr); }
  void upload(void* dst, const void* src, int64_t bytes) override { nccl::copy_to_device(dst, src, bytes); }
  void download(void* dst, const void* src, int64_t bytes) override { nccl::copy_to_host(dst, src, bytes); }
};

// The verdict must be the same on every rank (they all run the collective or none does).
bool devices_for_every_rank(Communicator& world) {
  const double devices = nccl_usable() ? nccl::device_count() : 0;
  const double fewest = -all_reduce_max(world, -devices);
  return fewest >= world.size();
}

TEST(CommNccl, EveryCollectiveOnDeviceBuffers) {
  Communicator& w = world();
  if (!devices_for_every_rank(w)) GTEST_SKIP() << "needs NCCL and a CUDA device per rank";
  std::unique_ptr<Communicator> nccl = make_nccl(w, w.rank() % nccl::device_count(), "nccl");
  EXPECT_STREQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->size(), w.size());
  EXPECT_EQ(nccl->rank(), w.rank());
  EXPECT_EQ(nccl->world_rank(), w.world_rank());
  EXPECT_EQ(nccl->timeout_seconds(), w.timeout_seconds());
  DeviceMemory memory;
  checks::check_every_collective(*nccl, memory);

  std::unique_ptr<Communicator> half = nccl->split(w.rank() % 2, -w.rank(), "half");
  ASSERT_NE(half, nullptr);
  EXPECT_STREQ(half->backend(), "nccl");
  EXPECT_EQ(half->size(), (w.size() + 1 - w.rank() % 2) / 2);
  checks::check_every_collective(*half, memory);
}

}  // namespace
}  // namespace forge::comm
