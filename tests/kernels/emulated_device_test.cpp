// The device emulation (kernels/emulated_device.h): while it lives Device::cuda is usable and runs the CPU
// kernels on memory the host cannot touch outside ops and copies. A host read of device memory or a freed
// allocation dies naming the address; a host pointer (or a freed one) handed to a device op is one line
// naming the op and the field.
#include "forge/kernels/emulated_device.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/tensor.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::emulated_device_test {
namespace {

Tensor device_copy(const std::vector<float>& host) {
  Tensor t = Tensor::empty({static_cast<int64_t>(host.size())}, DType::f32, Device::cuda);
  device_memory(Device::cuda)
      .copy(t.raw(), Device::cuda, host.data(), Device::cpu, host.size() * sizeof(float));
  return t;
}

std::vector<float> host_copy(const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.numel()));
  device_memory(Device::cuda)
      .copy(host.data(), Device::cpu, t.raw(), Device::cuda, host.size() * sizeof(float));
  return host;
}

TEST(EmulatedDevice, RunsTheCpuKernelsOnDeviceTensors) {
  const bool usable_before = device_usable(Device::cuda);
  {
    EmulatedDevice emulation;
    EXPECT_TRUE(device_usable(Device::cuda));
    const auto x = testing::random_floats(1000, 1), y = testing::random_floats(1000, 2);
    {
      Tensor dx = device_copy(x), dy = device_copy(y);
      EXPECT_EQ(EmulatedDevice::live_allocations(), 2);
      ops::add_inplace(dy.f32(), dx.f32(), 1000, Device::cuda);
      std::vector<float> want = y;
      ops::add_inplace(want.data(), x.data(), 1000);
      EXPECT_EQ(host_copy(dy), want);
      EXPECT_EQ(ops::sum_squares(dx.f32(), 1000, Device::cuda), ops::sum_squares(x.data(), 1000));
      Tensor zeros = Tensor::zeros({7}, DType::f32, Device::cuda);
      EXPECT_EQ(host_copy(zeros), std::vector<float>(7, 0.0f));
      EXPECT_EQ(EmulatedDevice::ops_run(), 2);
      EXPECT_EQ(host_copy(dx.to(Device::cpu).to(Device::cuda)), x);
    }
    EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
  }
  EXPECT_EQ(device_usable(Device::cuda), usable_before);  // the backend's own again
}

TEST(EmulatedDevice, HostPointersHandedToDeviceOpsAreOneLine) {
  EmulatedDevice emulation;
  Tensor d = Tensor::zeros({16}, DType::f32, Device::cuda);
  std::vector<float> host(16);
  try {
    ops::add_inplace(d.f32(), host.data(), 16, Device::cuda);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add_inplace on the emulated device: argument 2 = "),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("is not device memory (a host pointer handed to a device op)"),
              std::string::npos)
        << e.what();
  }
  ops::GemmParams p;
  p.m = p.n = p.k = 4, p.a = d.f32(), p.lda = 4, p.b = host.data(), p.ldb = 4, p.c = d.f32(), p.ldc = 4;
  try {
    ops::gemm(p, Device::cuda);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm on the emulated device: b = "), std::string::npos) << e.what();
  }
  EXPECT_THROW(EmulatedDevice(), Error);  // one emulation at a time
}

// Pinning host memory (an offloaded optimizer's state): counted while pinned; what the CUDA runtime refuses
// (device memory, a range pinned twice, unpinning what is not pinned) is one line here too.
TEST(EmulatedDevice, PinsHostMemoryAndRefusesWhatCudaWould) {
  EmulatedDevice emulation;
  const DeviceMemory& memory = device_memory(Device::cuda);
  std::vector<float> host(256);
  memory.pin_host(host.data(), host.size() * sizeof(float));
  EXPECT_EQ(EmulatedDevice::pinned_bytes(), 1024);
  testing::expect_error_containing([&] { memory.pin_host(host.data(), 1024); }, {"already pinned"});
  Tensor d = Tensor::zeros({16}, DType::f32, Device::cuda);
  testing::expect_error_containing([&] { memory.pin_host(d.raw(), 64); }, {"pin_host", "not a host range"});
  memory.unpin_host(host.data());
  EXPECT_EQ(EmulatedDevice::pinned_bytes(), 0);
  testing::expect_error_containing([&] { memory.unpin_host(host.data()); }, {"unpin_host", "not pinned"});
}

// Where the CUDA backend's limits are narrower than the CPU kernels' (FP8 GEMMs NT only, 16-byte aligned),
// the emulation applies them too (builds with the CUDA backend): what a GPU would refuse is refused here.
TEST(EmulatedDevice, CudaBackendLimitsApply) {
#ifndef FORGE_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  EmulatedDevice emulation;
  Tensor a = Tensor::zeros({32, 32}, DType::e4m3, Device::cuda),
         c = Tensor::zeros({32, 32}, DType::f32, Device::cuda);
  ops::Fp8GemmParams p;
  p.m = p.n = p.k = 32, p.a = a.data<uint8_t>(), p.lda = 32, p.b = a.data<uint8_t>(), p.ldb = 32;
  p.c = c.f32(), p.ldc = 32;  // NN: the CPU kernel takes it, FP8 tensor cores do not
  try {
    ops::fp8_gemm(p, Device::cuda);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_gemm: the NN orientation"), std::string::npos) << e.what();
  }
  p.trans_b = true;
  ops::fp8_gemm(p, Device::cuda);  // NT runs
#endif
}

// A dry run (Mode::check_only) checks every op and moves no data: results read as zeros, and device memory is
// never committed, so allocations far beyond this machine's memory succeed and only count toward peak_bytes.
TEST(EmulatedDevice, CheckOnlyRunsNothingAndCommitsNothing) {
  EmulatedDevice emulation(EmulatedDevice::Mode::check_only);
  EXPECT_TRUE(EmulatedDevice::check_only());
  const int64_t huge = int64_t{16} << 30;  // 64 GiB of floats, more than this machine has
  {
    Tensor big = Tensor::empty({huge}, DType::f32, Device::cuda);
    EXPECT_EQ(ops::sum_squares(big.f32(), huge, Device::cuda), 0.0);
    ops::scale_inplace(big.f32(), 2.0f, huge, Device::cuda);
    std::vector<float> host(4, 7.0f);
    device_memory(Device::cuda).copy(host.data(), Device::cpu, big.raw(), Device::cuda, 16);
    EXPECT_EQ(host, std::vector<float>(4, 0.0f));
    EXPECT_EQ(EmulatedDevice::peak_bytes(), huge * 4);
    std::vector<float> small(2);
    try {  // pointers are still checked
      ops::add_inplace(big.f32(), small.data(), 2, Device::cuda);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("add_inplace on the emulated device: argument 2"),
                std::string::npos);
    }
  }
  EXPECT_EQ(EmulatedDevice::ops_run(), 2);
  EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
}

// What a dry run's host needs to go on is the dry device's answer: the expert sort's offsets route as a
// perfectly balanced router would (10 tokens x top-2 over 3 experts: 7, 7, 6 rows; a capacity of 6 caps them;
// padded to it they all take 6), while its counts and every other read-back stay zeros; a write or a free
// ends the answer.
TEST(EmulatedDevice, CheckOnlyAnswersBalancedExpertOffsets) {
  EmulatedDevice emulation(EmulatedDevice::Mode::check_only);
  auto offsets_of = [](int64_t capacity, bool pad) {
    Tensor ids = Tensor::empty({20}, DType::i32, Device::cuda),
           row_of = Tensor::empty({20}, DType::i32, Device::cuda);
    Tensor offsets = Tensor::empty({4}, DType::i64, Device::cuda),
           counts = Tensor::empty({3}, DType::i64, Device::cuda);
    ops::MoeSortParams q;
    q.tokens = 10, q.top_k = 2, q.experts = 3, q.capacity = capacity, q.pad_to_capacity = pad;
    Tensor source = Tensor::empty({ops::moe_sorted_rows_bound(q)}, DType::i32, Device::cuda);
    q.expert_ids = ids.i32(), q.row_of = row_of.i32(), q.source = source.i32();
    q.offsets = offsets.data<int64_t>(), q.counts = counts.data<int64_t>();
    ops::moe_sort_by_expert(q, Device::cuda);
    const Tensor host = offsets.to(Device::cpu), host_counts = counts.to(Device::cpu);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(host_counts.data<int64_t>()[i], 0);
    std::vector<int64_t> out(host.data<int64_t>(), host.data<int64_t>() + 4);
    offsets.fill_zero();  // written: the answer is gone
    EXPECT_EQ(offsets.to(Device::cpu).data<int64_t>()[3], 0);
    return out;
  };
  EXPECT_EQ(offsets_of(0, false), (std::vector<int64_t>{0, 7, 14, 20}));
  EXPECT_EQ(offsets_of(6, false), (std::vector<int64_t>{0, 6, 12, 18}));
  EXPECT_EQ(offsets_of(8, true), (std::vector<int64_t>{0, 8, 16, 24}));
  EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
}

using EmulatedDeviceDeathTest = ::testing::Test;

// With count_rounded, peak_bytes counts the blocks the CUDA backend's caching allocator hands out (as a GPU's
// measured peak does): 512-byte multiples below 1 MiB, 2 MiB multiples from there.
TEST(EmulatedDevice, CountsTheCachingAllocatorsBlocksWhenAsked) {
  EmulatedDevice emulation(EmulatedDevice::Mode::check_only);
  EXPECT_FALSE(EmulatedDevice::count_rounded(true));
  {
    Tensor one = Tensor::empty({1}, DType::f32, Device::cuda);
    EXPECT_EQ(EmulatedDevice::peak_bytes(), 512);
    Tensor large = Tensor::empty({(int64_t{1} << 18) + 1}, DType::f32, Device::cuda);  // 1 MiB + 4 B
    EXPECT_EQ(EmulatedDevice::peak_bytes(), 512 + (int64_t{2} << 20));
    // Not while allocations counted one way are alive.
    EXPECT_THROW(EmulatedDevice::count_rounded(false), Error);
  }
  EXPECT_TRUE(EmulatedDevice::count_rounded(false));
  Tensor exact = Tensor::empty({3}, DType::f32, Device::cuda);
  device_memory(Device::cuda).reset_peak();
  EXPECT_EQ(EmulatedDevice::peak_bytes(), 12);
}

TEST_F(EmulatedDeviceDeathTest, HostReadOfDeviceMemoryDiesNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        EmulatedDevice emulation;
        Tensor d = Tensor::zeros({64}, DType::f32, Device::cuda);
        volatile float v = d.f32()[3];  // what a host read of a device loss would do
        (void)v;
      },
      "host code touched device memory at 0x[0-9a-f]+ \\(byte 12 of an allocation of 256 bytes");
}

// A freed allocation is unmapped: an op handed a stale pointer refuses it (a host read of it would fault).
TEST(EmulatedDevice, FreedMemoryIsNoDeviceMemory) {
  EmulatedDevice emulation;
  float* stale = nullptr;
  {
    Tensor d = Tensor::zeros({64}, DType::f32, Device::cuda);
    stale = d.f32();
  }
  try {
    ops::scale_inplace(stale, 2.0f, 64, Device::cuda);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scale_inplace on the emulated device: argument 1 = "),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace forge::emulated_device_test
