// Dropout: the op tests (op_tests/dropout.h) on the CPU and the device emulation.
#include "kernels/op_tests/dropout.h"

#include "op_harness.h"

namespace forge::op_tests::dropout::dropout_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(DropoutOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(DropoutRate, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

}  // namespace
}  // namespace forge::op_tests::dropout::dropout_test
