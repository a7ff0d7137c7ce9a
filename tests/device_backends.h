// GPU tests that run twice: on the GPU (skipped where none is usable) and on the host under the device emulation
// of kernels/emulated_device.h (with its communicators, train/device_emulation.h), where Device::cuda runs the CPU kernels but device memory faults on any host
// access outside an op or copy, and device ops refuse host pointers. The emulated instance checks the host side
// of every GPU code path (staging copies, device scalars and scales, checkpoints, the KV cache) in CI, where no
// GPU is lent; what it cannot check (the CUDA kernels, streams, NCCL) stays with the GPU instance.
//
//   class MyTest : public DeviceBackendTest {};
//   TEST_P(MyTest, Case) { ... Device::cuda ... }
//   FORGE_INSTANTIATE_DEVICE_BACKENDS(MyTest);
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/emulated_device.h"
#include "forge/train/device_emulation.h"

namespace forge {
using namespace forge::train;

enum class DeviceBackend { gpu, emulated };

class DeviceBackendTest : public ::testing::TestWithParam<DeviceBackend> {
 protected:
  void SetUp() override {
    if (!emulated()) {
      if (!cuda::available()) GTEST_SKIP() << "no usable GPU";
      return;
    }
    emulation_.emplace();
  }
  void TearDown() override {
    if (emulation_) {
      EXPECT_EQ(EmulatedDevice::live_allocations(), 0) << "device memory outlived the test";
    }
    emulation_.reset();
  }
  bool emulated() const { return GetParam() == DeviceBackend::emulated; }

 private:
  std::optional<DeviceEmulation> emulation_;
};

inline std::string device_backend_name(const ::testing::TestParamInfo<DeviceBackend>& info) {
  return info.param == DeviceBackend::gpu ? "Gpu" : "Emulated";
}

}  // namespace forge

#define FORGE_INSTANTIATE_DEVICE_BACKENDS(suite)                                                                \
  INSTANTIATE_TEST_SUITE_P(Backends, suite,                                                                     \
                           ::testing::Values(::forge::DeviceBackend::gpu, ::forge::DeviceBackend::emulated),   \
                           ::forge::device_backend_name)
