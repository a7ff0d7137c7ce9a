// FP8 casts: the op tests (op_tests/fp8_cast.h) on the CPU and the device emulation: every code, scale_inv
// and returned amax through device-style buffers (guard bytes, unaligned pointers) bitwise the CPU table's on
// plain host arrays.
#include "kernels/op_tests/fp8_cast.h"

#include "op_harness.h"

namespace forge::op_tests::fp8_cast {
FORGE_INSTANTIATE_OP_TEST(Fp8CastOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(Fp8CastFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
}  // namespace forge::op_tests::fp8_cast
