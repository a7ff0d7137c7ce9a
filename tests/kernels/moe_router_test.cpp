// The MoE router and bias update: the op tests (op_tests/moe_router.h) on the CPU and the device emulation.
#include "kernels/op_tests/moe_router.h"

#include "op_harness.h"

namespace forge::op_tests::moe_router::moe_router_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(MoeRouterOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(MoeRouterHandMade, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

}  // namespace
}  // namespace forge::op_tests::moe_router::moe_router_test
