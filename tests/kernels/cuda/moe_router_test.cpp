// The MoE router and bias update (op_tests/moe_router.h) on the GPU, against the CPU kernel.
#include "kernels/op_tests/moe_router.h"

#include "op_harness.h"

namespace forge::op_tests::moe_router::moe_router_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(MoeRouterOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(MoeRouterHandMade, testing::kFixedCase, testing::Backend::gpu);

}  // namespace
}  // namespace forge::op_tests::moe_router::moe_router_test
