// The op profiler on a GPU: ops are bracketed by events on the compute stream, so a profile adds no
// synchronisation; the rows carry the device's time of each op, their sum fits inside the wall time, and the
// profiled ops compute what the unprofiled ones do.
#include "forge/kernels/profiler.h"

#include <gtest/gtest.h>

#include <vector>

#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::profiler_test {
namespace {

using cuda::DeviceBuffer;

TEST(CudaProfiler, TimesDeviceOpsOnTheStream) {
  if (!cuda::available()) GTEST_SKIP() << "no usable GPU";
  constexpr int64_t m = 512, n = 256, k = 1024;
  const auto a = testing::random_floats(m * k, 11), b = testing::random_floats(n * k, 12);
  DeviceBuffer da(a.size() * 4), db(b.size() * 4), dc(m * n * 4), dc2(m * n * 4);
  da.upload(a.data(), a.size() * 4);
  db.upload(b.data(), b.size() * 4);
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = da.data(), p.lda = k, p.b = db.data(), p.ldb = k, p.trans_b = true;
  p.c = dc.data(), p.ldc = n;
  ops::gemm(p, Device::cuda);
  std::vector<float> want(m * n), got(m * n);
  dc.download(want.data(), want.size() * 4);

  ops::profile_begin(Device::cuda);
  p.c = dc2.data();
  for (int i = 0; i < 3; ++i) ops::gemm(p, Device::cuda);
  ops::scale_inplace(dc.as<float>(), 0.5f, m * n, Device::cuda);
  const ops::OpProfile profile = ops::profile_end();

  dc2.download(got.data(), got.size() * 4);
  EXPECT_EQ(got, want);
  ASSERT_EQ(profile.rows.size(), 2u) << ops::format_profile(profile);
  const ops::OpProfileRow& gemm = profile.rows[0].op == "gemm" ? profile.rows[0] : profile.rows[1];
  EXPECT_EQ(gemm.op, "gemm");
  EXPECT_EQ(gemm.detail, "fp32 NT 512x256x1024 -> fp32");
  EXPECT_EQ(gemm.calls, 3);
  EXPECT_GT(gemm.seconds, 0);
  EXPECT_LE(profile.op_seconds, profile.wall_seconds);
  EXPECT_EQ(profile.device, Device::cuda);
  std::printf("%s", ops::format_profile(profile, 1, 0).c_str());
}

}  // namespace
}  // namespace forge::profiler_test
