// Flash attention (forward and backward): the op tests (op_tests/attention.h) on the CPU and the device
// emulation, and what only the CPU kernels have: the staging window of very wide heads, bitwise thread-count
// invariance, and their shape checks.
#include "kernels/op_tests/attention.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::attention {
FORGE_INSTANTIATE_OP_TEST(AttentionOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(AttentionCacheOp, kCacheCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(AttentionFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
class AttentionWindowOp : public AttentionOp {};
TEST_P(AttentionWindowOp, Forward) {
  Problem pr(test_case(), 31);
  expect_matches_reference(pr, false, "attention_forward " + test_case().name());
}
TEST_P(AttentionWindowOp, Backward) {
  const Case& c = test_case();
  Problem pr(c, 37);
  expect_matches_reference(pr, true, "attention_backward " + c.name());
  expect_gradients_match_finite_differences(pr);
}
FORGE_INSTANTIATE_OP_TEST(AttentionWindowOp, kWindowCases, testing::Backend::cpu);
class AttentionWindowCacheOp : public AttentionOp {};  // the cache forward: no backward
TEST_P(AttentionWindowCacheOp, Forward) {
  Problem pr(test_case(), 31);
  expect_matches_reference(pr, false, "attention_forward " + test_case().name());
}
FORGE_INSTANTIATE_OP_TEST(AttentionWindowCacheOp, kWindowCacheCases, testing::Backend::cpu);
// Soft-capping reuses the window tests: against the double reference, gradients by finite differences.
FORGE_INSTANTIATE_OP_TEST_NAMED(Softcap, AttentionWindowOp, kSoftcapCases, testing::Backend::cpu);
FORGE_INSTANTIATE_OP_TEST_NAMED(Softcap, AttentionWindowCacheOp, kSoftcapCacheCases, testing::Backend::cpu);
}  // namespace forge::op_tests::attention

namespace forge::attention_test {

namespace {

using op_tests::attention::Case;
using op_tests::attention::Problem;

// head_dim 8192: each thread stages at most 4 MiB of k/v (or q/dout) rows, so 64 of the 80 rows fit and
// the staging window has to slide. One (batch, kv head) pair: 1 thread runs the fused backward, 2 threads
// the two-pass one.
// The same with values wider than keys (6144 / 8192: 73 rows of both fit), so that the two staged sources
// of each pair differ in width.
TEST(AttentionStaging, SlidingWindowMatchesReference) {
  // Dot products of length 8192 in fp32: a modest scale keeps the logits' rounding error ~1e-6.
  for (const Case& c : {Case{1, 80, 1, 1, 8192, true, true, 3, 0, 0, false, 2.0f},
                        Case{1, 80, 1, 1, 6144, true, true, 3, 0, 0, false, 2.0f, 8192}})
    for (int threads : {1, 2})
      testing::with_threads(threads, [&] {
        Problem pr(c, 41);
        // q and k in [-1, 1] (as v): with the op tests' [-2, 2] the logits' rounding error doubles.
        for (size_t i : pr.q_elements()) pr.inputs[i] *= 0.5f;
        for (size_t i : pr.k_elements()) pr.inputs[i] *= 0.5f;
        op_tests::attention::expect_matches_reference(pr, true,
                                                      c.name() + ", " + std::to_string(threads) + " threads");
      });
}

// Work is split over threads by items that never share an output element, so the result must not depend
// on the thread count. With 4 (batch, kv head) pairs, 1 and 2 threads run the fused backward and 3 threads
// the two-pass one, so this also checks that the two schemes agree bitwise (also with values of another
// width than keys).
TEST(AttentionThreads, BitwiseIndependentOfThreadCount) {
  for (const auto& [causal, v_head_dim] : {std::pair{true, 0}, std::pair{false, 0}, std::pair{true, 40}}) {
    const Case c{2, 150, 4, 2, 64, causal, true, 3, 0, 0, false, 1.0f, v_head_dim};
    std::vector<Problem> runs;
    for (int threads : {1, 2, 3})
      testing::with_threads(threads, [&] {
        runs.emplace_back(c, 5);
        ops::attention_forward(runs.back().host_params());
        ops::attention_backward(runs.back().host_params());
      });
    for (size_t r = 1; r < runs.size(); ++r) {
      EXPECT_EQ(0, std::memcmp(runs[0].out.data(), runs[r].out.data(), runs[0].out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(runs[0].lse.data(), runs[r].lse.data(), runs[0].lse.size() * sizeof(float)));
      EXPECT_EQ(0,
                std::memcmp(runs[0].grads.data(), runs[r].grads.data(), runs[0].grads.size() * sizeof(float)))
          << c.name() << ", threads " << r + 1;
    }
  }
}

// A window hides exactly the keys it should: the windowed kernel equals the same problem with the keys
// outside every query's window replaced by garbage (bitwise), and a window as long as the sequence equals no
// window (bitwise).
TEST(AttentionWindow, HiddenKeysTakeNoPartAndLongWindowsChangeNothing) {
  const Case c{1, 150, 4, 2, 16, true, true, 3, 0, 0, false, 1.0f, 0, false, 150};
  Problem full(c, 9), none(c, 9);
  auto p = none.host_params();
  p.window = 0;
  ops::attention_forward(full.host_params()), ops::attention_backward(full.host_params());
  ops::attention_forward(p), ops::attention_backward(p);
  EXPECT_EQ(0, std::memcmp(full.out.data(), none.out.data(), full.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(full.grads.data(), none.grads.data(), full.grads.size() * sizeof(float)));
  // Window 10: query 140 sees keys 131..140; poison keys 0..130 for the rows from 140 on.
  const Case w{1, 150, 4, 2, 16, true, true, 3, 0, 0, false, 1.0f, 0, false, 10};
  Problem a(w, 3), b(w, 3);
  for (int64_t j = 0; j <= 130; ++j)
    for (int64_t g = 0; g < w.kv_heads; ++g)
      for (int64_t i = 0; i < w.head_dim; ++i)
        b.inputs[b.k_at(0, j, g) + i] = 1e3f, b.inputs[b.v_at(0, j, g) + i] = 7.0f;
  ops::attention_forward(a.host_params()), ops::attention_forward(b.host_params());
  for (int64_t t = 140; t < w.seq; ++t)
    EXPECT_EQ(0, std::memcmp(&a.out[a.o_at(0, t, 0)], &b.out[b.o_at(0, t, 0)],
                             w.heads * w.head_dim * sizeof(float)))
        << "row " << t;
}

#ifdef FORGE_HAVE_CUDA
// The CUDA kernels mask causally only: a window that hides keys is refused in one line rather than computed
// over every key; one as long as the sequence hides none and is taken. No GPU needed: parameters first.
TEST(AttentionWindow, CudaRefusesAWindowThatHidesKeys) {
  Problem pr(Case{1, 12, 4, 2, 8, true, true, 3, 0, 0, false, 1.0f, 0, false, 5}, 1);
  for (bool backward : {false, true}) {
    std::string why;
    const ops::OpTable& gpu = ops::cuda_table();
    EXPECT_FALSE(backward ? gpu.supports_attention_backward(pr.host_params(), &why)
                          : gpu.supports_attention_forward(pr.host_params(), &why));
    EXPECT_NE(why.find("a sliding window (window 5) is not implemented by the CUDA attention kernels"),
              std::string::npos)
        << why;
    auto whole = pr.host_params();
    whole.window = 12;
    EXPECT_TRUE(backward ? gpu.supports_attention_backward(whole, &why)
                         : gpu.supports_attention_forward(whole, &why))
        << why;
  }
}
#endif

TEST(AttentionErrors, RejectsBadShapes) {
  Problem prob({1, 4, 3, 2, 16, true, true, 3}, 1);  // 3 heads do not split into 2 kv heads
  EXPECT_THROW(ops::attention_forward(prob.host_params()), Error);
  Problem ok({1, 4, 2, 1, 16, true, true, 3}, 1);
  auto p = ok.host_params();
  p.q_stride = 8;  // narrower than heads * head_dim
  EXPECT_THROW(ops::attention_forward(p), Error);
  p = ok.host_params();
  p.dk = nullptr;
  EXPECT_THROW(ops::attention_backward(p), Error);
  p = ok.host_params();
  p.window = -1;
  EXPECT_THROW(ops::attention_forward(p), Error);
  p = ok.host_params();
  p.q_offset = 2;  // backward: an offset only without the causal mask
  EXPECT_THROW(ops::attention_backward(p), Error);
}

}  // namespace
}  // namespace forge::attention_test
