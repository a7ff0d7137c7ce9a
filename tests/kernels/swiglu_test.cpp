// SwiGLU: the op tests (op_tests/swiglu.h) on the CPU and the device emulation.
#include "kernels/op_tests/swiglu.h"

#include "op_harness.h"

namespace forge::op_tests::swiglu {
namespace {

FORGE_INSTANTIATE_OP_TEST(SwigluOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(SwigluSaturation, testing::kFixedCase, testing::Backend::cpu, testing::Backend::emulated);

}  // namespace
}  // namespace forge::op_tests::swiglu
