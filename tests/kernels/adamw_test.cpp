// AdamW: the op tests (op_tests/adamw.h) on the CPU and the device emulation.
#include "kernels/op_tests/adamw.h"

#include "op_harness.h"

namespace forge::op_tests::adamw::adamw_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(AdamWOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(AdamWFixed, testing::kFixedCase, testing::Backend::cpu, testing::Backend::emulated);

}  // namespace
}  // namespace forge::op_tests::adamw::adamw_test
