// The mixture-of-experts token shuffling: the op tests (op_tests/moe_permute.h) on the CPU and the device
// emulation, and what only the CPU kernels promise (results independent of the OpenMP thread count).
#include "kernels/op_tests/moe_permute.h"

#include <gtest/gtest.h>

#include "op_harness.h"

namespace forge::op_tests::moe_permute::moe_permute_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(MoeSortOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(MoePermuteOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(MoeSortFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

TEST(MoePermute, ResultsDoNotDependOnThreadCount) {
  for (int64_t align : {1, 16}) {
    const Problem pr({4099, 8, 64, 31, 0, 60, 2, align}, 9);
    Results one, two;
    testing::with_threads(1, [&] { one = run_ops(Device::cpu, pr); });
    testing::with_threads(2, [&] { two = run_ops(Device::cpu, pr); });
    testing::expect_bitwise_equal(two.permuted, one.permuted, pr.what("permuted"));
    testing::expect_bitwise_equal(two.dx, one.dx, pr.what("dx"));
    testing::expect_bitwise_equal(two.combined, one.combined, pr.what("combined"));
    testing::expect_bitwise_equal(two.dy, one.dy, pr.what("dy"));
    testing::expect_bitwise_equal(two.dweights, one.dweights, pr.what("dweights"));
  }
}

// Bad indices (data) fail on the CPU with one line before any parallel work.
TEST(MoePermute, IndicesOutOfRangeAreOneLine) {
  const std::vector<int32_t> row_of = {0, 5, 1, -1}, source = {0, 7};
  std::vector<float> x(8, 1.0f), out(8);
  ops::MoePermuteParams p;
  p.tokens = 2, p.top_k = 2, p.hidden = 2, p.rows = 2, p.row_of = row_of.data(), p.source = source.data();
  p.x = x.data(), p.out = out.data(), p.dout = x.data(), p.dx = out.data();
  testing::expect_error_containing([&] { ops::moe_permute(p); },
                                   {"moe_permute", "source[1] = 7", "outside the assignments [0, 4)"});
  testing::expect_error_containing(
      [&] { ops::moe_permute_backward(p); },
      {"moe_permute_backward", "row_of[1] = 5", "outside the sorted rows [0, 2)"});
}

// source -1 is a padding row (zeros out, zero dy); anything else below 0 is still an error.
TEST(MoePermute, SourceMinusOneIsPaddingBelowIsOneLine) {
  std::vector<int32_t> source = {1, -1};
  const std::vector<int32_t> row_of = {-1, 0};
  const std::vector<float> x = {1, 2, 3, 4}, weights = {0.5f, 2.0f}, dout = {1, -1, 3, 5};
  std::vector<float> out(4, 9.0f), dy(4, 9.0f);
  ops::MoePermuteParams p;
  p.tokens = 1, p.top_k = 2, p.hidden = 2, p.rows = 2, p.row_of = row_of.data(), p.source = source.data();
  p.x = x.data(), p.x_stride = 4, p.out = out.data();
  ops::moe_permute(p);
  EXPECT_EQ(out, (std::vector<float>{1, 2, 0, 0}));
  ops::MoeUnpermuteParams u;
  u.tokens = 1, u.top_k = 2, u.hidden = 2, u.rows = 2, u.row_of = row_of.data(), u.source = source.data();
  u.weights = weights.data(), u.dout = dout.data(), u.dy = dy.data();
  ops::moe_unpermute_backward(u);
  EXPECT_EQ(dy, (std::vector<float>{2, -2, 0, 0}));
  source[1] = -2;
  testing::expect_error_containing([&] { ops::moe_permute(p); },
                                   {"moe_permute", "source[1] = -2", "[0, 2) (or -1, padding)"});
  testing::expect_error_containing([&] { ops::moe_unpermute_backward(u); },
                                   {"moe_unpermute_backward", "source[1] = -2", "(or -1, padding)"});
}

}  // namespace
}  // namespace forge::op_tests::moe_permute::moe_permute_test
