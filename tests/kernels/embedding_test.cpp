// Embedding: the op tests (op_tests/embedding.h) on the CPU and the device emulation, and what only the CPU
// kernel promises (a scatter-add independent of the OpenMP thread count).
#include "kernels/op_tests/embedding.h"

#include <gtest/gtest.h>
#include <omp.h>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::embedding::embedding_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(EmbeddingOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

TEST(Embedding, BackwardWeightDoesNotDependOnThreadCount) {
  // Many rows hitting few ids, so different threads would race on the same rows without ownership.
  Problem one({500, 100, 6, 0.0}, 44), two({500, 100, 6, 0.0}, 44);
  for (Problem* pr : {&one, &two}) {
    for (int64_t r = 0; r < pr->c.rows; ++r) pr->ids[r] = static_cast<int32_t>((r * 7) % pr->c.vocab);
    pr->dweight.assign(pr->dweight.size(), 0.0f);
  }
  Buffers b1(Device::cpu, one, 6), b2(Device::cpu, two, 6);
  testing::with_threads(1, [&] { ops::embedding_backward_weight(b1.params(one, 6)); });
  testing::with_threads(2, [&] { ops::embedding_backward_weight(b2.params(two, 6)); });
  testing::expect_bitwise_equal(b1.dweight.download(), b2.dweight.download(), "dweight");
}

}  // namespace
}  // namespace forge::op_tests::embedding::embedding_test
