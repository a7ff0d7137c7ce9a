// attention_merge and strided_copy: the op tests (op_tests/context_ops.h) on the CPU and the device
// emulation.
#include "kernels/op_tests/context_ops.h"

#include "op_harness.h"

namespace forge::op_tests::context_ops {
FORGE_INSTANTIATE_OP_TEST(AttentionMergeOp, kMergeCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(StridedCopyOp, kCopyCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(ContextOpsFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
}  // namespace forge::op_tests::context_ops
