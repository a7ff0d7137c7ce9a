// The nccl backend, one rank per CUDA device (run by mpirun with 1 and 2 ranks, label "cuda"): every
// collective against its definition (collective_checks.h) on device buffers, and a split. Skips where forge
// was built without NCCL, no device is visible, or there are fewer devices than ranks (NCCL refuses two
// ranks on one device).
#include <gtest/gtest.h>

#include "comm/collective_checks.h"
#include "forge/comm/comm.h"
#include "forge/comm/nccl/device_memory.h"
#if FORGE_HAVE_CUDA
#include <vector>

#include "forge/kernels/cuda/runtime.h"
#endif

namespace forge::comm::comm_nccl_test {
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

#if FORGE_HAVE_CUDA
// Completion in stream order (what tensor parallelism uses on GPUs): the host does not wait, and the kernels'
// stream, which the communicator follows, runs its later work after the collective. 16 MiB per operation, so
// that a copy racing the collective would see stale values.
TEST(CommNccl, WaitOnStreamOrdersTheKernelsStreamAfterTheCollective) {
  Communicator& w = world();
  if (!devices_for_every_rank(w)) GTEST_SKIP() << "needs NCCL and a CUDA device per rank";
  const int device = w.rank() % nccl::device_count();
  cuda::select_device(device);
  std::unique_ptr<Communicator> nccl = make_nccl(w, device, "tp", cuda::stream());
  const int64_t n = int64_t{1} << 22;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  std::vector<float> host(static_cast<size_t>(n), static_cast<float>(w.rank() + 1));
  cuda::DeviceBuffer sum(bytes), gathered(bytes * static_cast<size_t>(w.size()));
  sum.upload(host.data(), bytes);

  Request reduce = nccl->all_reduce(sum.data(), n, Type::f32, ReduceOp::sum);
  nccl->wait_on_stream(reduce);
  EXPECT_FALSE(reduce.pending());
  // A second operation in flight behind the first, reading its result on the communicator's stream.
  Request gather = nccl->all_gather(sum.data(), gathered.data(), n, Type::f32);
  nccl->wait_on_stream(gather);
  // Downloads run on the kernels' stream and wait for its earlier work, which now includes both collectives.
  std::vector<float> got(static_cast<size_t>(n) * static_cast<size_t>(w.size()));
  gathered.download(got.data(), got.size() * sizeof(float));
  const float want = static_cast<float>(w.size() * (w.size() + 1) / 2);
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << bad << " of " << got.size() << " elements differ; first at " << first << ": "
                     << got[first] << ", want " << want;

  // An operation the host already waited for needs no ordering: wait_on_stream only spends the handle.
  Request done = nccl->all_reduce(sum.data(), 1, Type::f32, ReduceOp::max);
  done.wait();
  nccl->wait_on_stream(done);
  EXPECT_FALSE(done.pending());
}
#endif

}  // namespace
}  // namespace forge::comm::comm_nccl_test
