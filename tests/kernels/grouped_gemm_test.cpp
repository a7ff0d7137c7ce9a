// The grouped GEMMs: the op tests (op_tests/grouped_gemm.h) on the CPU and the device emulation.
#include "kernels/op_tests/grouped_gemm.h"

#include "op_harness.h"

namespace forge::op_tests::grouped_gemm {
namespace {

FORGE_INSTANTIATE_OP_TEST(GroupedGemmOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(GroupedGemmFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(GroupedGemmGradients, testing::kFixedCase, testing::Backend::cpu);

}  // namespace
}  // namespace forge::op_tests::grouped_gemm
