// attention_merge and strided_copy (the data movement of attention across a context-parallel group,
// ops::AttentionMergeParams, ops::StridedCopyParams), written once for every backend (op_harness.h).
// attention_merge on the CPU against the definition in double (the kernel weighs in double and rounds the two
// weights and the sum once each: within 4 ulp of the exact merge of the stored inputs); elsewhere against the
// CPU kernel within 2 ulp of the output's magnitude (exp and log may differ in their last double bits, which
// the float rounding almost always absorbs). Rows with no visible key (lse_b = -inf) stay untouched, rows
// not yet written (lse = -inf) take the block as it is. strided_copy copies or adds single values: bitwise.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::context_ops {

using testing::DeviceArray;

struct MergeCase {
  int64_t batch, seq, heads, v_dim;
  std::string name() const { return fmt::format("b{}_s{}_h{}_dv{}", batch, seq, heads, v_dim); }
  int64_t rows() const { return batch * heads * seq; }
  int64_t outs() const { return batch * seq * heads * v_dim; }
};

inline const std::vector<MergeCase> kMergeCases = {{1, 5, 1, 8}, {2, 33, 4, 16}, {3, 7, 2, 192}};

struct MergeProblem {
  MergeCase c;
  std::vector<float> out, lse, out_b, lse_b;
  MergeProblem(const MergeCase& c_, uint32_t seed) : c(c_) {
    out = testing::random_floats(c.outs(), seed, -2, 2);
    out_b = testing::random_floats(c.outs(), seed + 1, -2, 2);
    lse = testing::random_floats(c.rows(), seed + 2, -4, 8);
    lse_b = testing::random_floats(c.rows(), seed + 3, -4, 8);
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t r = 3; r < c.rows(); r += 11) lse_b[r] = lse[r] + 30;  // one side dominates
    for (int64_t r = 2; r < c.rows(); r += 7) lse[r] = -inf;            // the first block of the row
    for (int64_t r = 0; r < c.rows(); r += 5) lse_b[r] = -inf;          // keys all in the future
  }
  ops::AttentionMergeParams params() const {
    ops::AttentionMergeParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.v_dim = c.v_dim;
    return p;
  }
  // The merge in double from the definition in ops.h.
  void reference(std::vector<double>& o, std::vector<double>& l) const {
    o.assign(out.begin(), out.end()), l.assign(lse.begin(), lse.end());
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.heads; ++h)
        for (int64_t t = 0; t < c.seq; ++t) {
          const int64_t r = (b * c.heads + h) * c.seq + t;
          if (std::isinf(lse_b[r])) continue;
          const double total = std::isinf(lse[r])
                                   ? double{lse_b[r]}
                                   : std::max(double{lse[r]}, double{lse_b[r]}) +
                                         std::log1p(std::exp(-std::abs(double{lse[r]} - lse_b[r])));
          const double w_old = std::exp(double{lse[r]} - total), w_new = std::exp(double{lse_b[r]} - total);
          for (int64_t i = 0; i < c.v_dim; ++i) {
            const int64_t at = ((b * c.seq + t) * c.heads + h) * c.v_dim + i;
            o[at] = w_old * out[at] + w_new * out_b[at];
          }
          l[r] = total;
        }
  }
};

class AttentionMergeOp : public testing::OpTest<MergeCase> {
 protected:
  static void merge(Device on, const MergeProblem& pr, std::vector<float>& out, std::vector<float>& lse) {
    DeviceArray<float> o(on, pr.out), l(on, pr.lse), ob(on, pr.out_b), lb(on, pr.lse_b);
    ops::AttentionMergeParams p = pr.params();
    p.out = o.data(), p.lse = l.data(), p.out_b = ob.data(), p.lse_b = lb.data();
    FORGE_TEST_OP(attention_merge, on, p);
    out = o.download(), lse = l.download();
  }
};

TEST_P(AttentionMergeOp, WeighsBothPartsByTheirLogSumExp) {
  const MergeCase& c = test_case();
  const MergeProblem pr(c, 3);
  std::vector<float> out, lse;
  merge(device(), pr, out, lse);
  if (on_cpu()) {
    std::vector<double> want_out, want_lse;
    pr.reference(want_out, want_lse);
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(out[i], want_out[i], 4 * testing::kU * (std::abs(want_out[i]) + 2)) << "out " << i;
    for (size_t r = 0; r < lse.size(); ++r) {
      if (std::isinf(want_lse[r])) {
        EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << "lse " << r;
        continue;
      }
      ASSERT_NEAR(lse[r], want_lse[r], 2 * testing::kU * (std::abs(want_lse[r]) + 1)) << "lse " << r;
    }
    // Untouched where the block saw nothing: bitwise the input.
    for (int64_t r = 0; r < c.rows(); r += 5) EXPECT_EQ(lse[r], pr.lse[r]) << "lse " << r;
    return;
  }
  std::vector<float> cpu_out, cpu_lse;
  merge(Device::cpu, pr, cpu_out, cpu_lse);
  testing::expect_close(out, cpu_out, "attention_merge " + c.name() + ": out",
                        [&](size_t i) { return 2 * testing::kU * (std::abs(cpu_out[i]) + 2); });
  testing::expect_all(lse, cpu_lse, "attention_merge " + c.name() + ": lse", [&](size_t i) {
    return lse[i] == cpu_lse[i] ||
           std::abs(double{lse[i]} - cpu_lse[i]) <= 2 * testing::kU * (std::abs(cpu_lse[i]) + 1);
  });
}

struct CopyCase {
  std::string label;
  int64_t shape[3];
  int64_t src_stride[3], dst_stride[3];
  int64_t src_size, dst_size;
  bool accumulate;
  std::string name() const { return label; }
};

inline const std::vector<CopyCase> kCopyCases = {
    // The second half of each of 3 sequences of 10 tokens (rows of 24 floats, 40 apart) packed dense.
    {"pack_half", {3, 5, 24}, {400, 40, 1}, {120, 24, 1}, 1200, 360, false},
    // ... and added back into rows of another layout.
    {"unpack_add", {3, 5, 24}, {120, 24, 1}, {300, 30, 1}, 360, 900, true},
    // [2, 7, 6] -> [2, 6, 7]: a log-sum-exp's heads and tokens transposed.
    {"transpose", {2, 7, 6}, {42, 6, 1}, {42, 1, 7}, 84, 84, false},
    // A long inner run, for the CPU's threads.
    {"long_rows", {2, 3, 5000}, {15000, 5000, 1}, {15010, 5003, 1}, 30000, 30020, false},
};

class StridedCopyOp : public testing::OpTest<CopyCase> {
 protected:
  static std::vector<float> copy(Device on, const CopyCase& c, const std::vector<float>& src,
                                 const std::vector<float>& dst) {
    DeviceArray<float> s(on, src), d(on, dst);
    ops::StridedCopyParams p;
    for (int a = 0; a < 3; ++a)
      p.shape[a] = c.shape[a], p.src_stride[a] = c.src_stride[a], p.dst_stride[a] = c.dst_stride[a];
    p.src = s.data(), p.dst = d.data(), p.accumulate = c.accumulate;
    FORGE_TEST_OP(strided_copy, on, p);
    return d.download();
  }
};

TEST_P(StridedCopyOp, MovesEveryElementAndNothingElse) {
  const CopyCase& c = test_case();
  const std::vector<float> src = testing::random_floats(c.src_size, 5),
                           dst = testing::random_floats(c.dst_size, 6);
  std::vector<float> want = dst;
  if (on_cpu()) {
    for (int64_t i = 0; i < c.shape[0]; ++i)
      for (int64_t j = 0; j < c.shape[1]; ++j)
        for (int64_t k = 0; k < c.shape[2]; ++k) {
          const float x = src[i * c.src_stride[0] + j * c.src_stride[1] + k * c.src_stride[2]];
          float& y = want[i * c.dst_stride[0] + j * c.dst_stride[1] + k * c.dst_stride[2]];
          y = c.accumulate ? y + x : x;
        }
  } else {
    want = copy(Device::cpu, c, src, dst);
  }
  testing::expect_bitwise_equal(copy(device(), c, src, dst), want, "strided_copy " + c.name());
}

class ContextOpsFixed : public testing::OpTest<testing::FixedCase> {};

// Bad shapes are refused on every backend with one line naming the op and the culprit.
TEST_P(ContextOpsFixed, BadShapesAreOneLineNamingTheOp) {
  ops::AttentionMergeParams m;
  m.batch = 1, m.seq = -2, m.heads = 1, m.v_dim = 4;
  testing::expect_error_containing([&] { ops::attention_merge(m, device()); }, {"attention_merge", "seq=-2"});
  ops::StridedCopyParams s;
  s.shape[1] = -3;
  testing::expect_error_containing([&] { ops::strided_copy(s, device()); }, {"strided_copy", "-3"});
}

}  // namespace forge::op_tests::context_ops
