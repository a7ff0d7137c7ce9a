// kv_append: the op tests (op_tests/kv_append.h) on the CPU and the device emulation.
#include "kernels/op_tests/kv_append.h"

#include "op_harness.h"

namespace forge::op_tests::kv_append {
FORGE_INSTANTIATE_OP_TEST(KvAppendOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(KvAppendFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
}  // namespace forge::op_tests::kv_append
