// The op tests of tests/kernels/op_tests/ (written once for every backend) on the GPU: the CUDA backend's
// element-wise, norm (RMSNorm, LayerNorm), GELU, bias, rotary, SwiGLU, embedding, optimizer, kv-cache append
// and mixture-of-experts (sort, permutes, grouped GEMMs) ops against the CPU backend on the same inputs
// (awkward sizes, never multiples of the block sizes), within bounds that come from the arithmetic. Each case
// skips where no GPU is usable; test_kernels runs the same tests on the CPU and on the device emulation.
// GEMMs: gemm_test.cpp; attention: attention_test.cpp; the support queries and parameter checks, which need
// no GPU: kernels/op_support_test.cpp.
#include "kernels/op_tests/adamw.h"
#include "kernels/op_tests/bias.h"
#include "kernels/op_tests/context_ops.h"
#include "kernels/op_tests/dropout.h"
#include "kernels/op_tests/elementwise.h"
#include "kernels/op_tests/embedding.h"
#include "kernels/op_tests/empty_inputs.h"
#include "kernels/op_tests/gelu.h"
#include "kernels/op_tests/grouped_gemm.h"
#include "kernels/op_tests/kv_append.h"
#include "kernels/op_tests/layernorm.h"
#include "kernels/op_tests/moe_permute.h"
#include "kernels/op_tests/rmsnorm.h"
#include "kernels/op_tests/rope.h"
#include "kernels/op_tests/swiglu.h"
#include "op_harness.h"

namespace forge::op_tests {

namespace adamw {
FORGE_INSTANTIATE_OP_TEST(AdamWOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(AdamWFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace adamw

namespace bias {
FORGE_INSTANTIATE_OP_TEST(BiasOp, kCases, testing::Backend::gpu);
}  // namespace bias

namespace elementwise {
FORGE_INSTANTIATE_OP_TEST(ElementwiseOp, kCases, testing::Backend::gpu);
}  // namespace elementwise

namespace embedding {
FORGE_INSTANTIATE_OP_TEST(EmbeddingOp, kCases, testing::Backend::gpu);
}  // namespace embedding

namespace empty_inputs {
FORGE_INSTANTIATE_OP_TEST(EmptyInputs, testing::kFixedCase, testing::Backend::gpu);
}  // namespace empty_inputs

namespace gelu {
FORGE_INSTANTIATE_OP_TEST(GeluOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(GeluSaturation, testing::kFixedCase, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(GeluKnownValues, testing::kFixedCase, testing::Backend::gpu);
}  // namespace gelu

namespace grouped_gemm {
FORGE_INSTANTIATE_OP_TEST(GroupedGemmOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(GroupedGemmFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace grouped_gemm

namespace context_ops {
FORGE_INSTANTIATE_OP_TEST(AttentionMergeOp, kMergeCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(StridedCopyOp, kCopyCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(ContextOpsFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace context_ops

namespace kv_append {
FORGE_INSTANTIATE_OP_TEST(KvAppendOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(KvAppendFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace kv_append

namespace layernorm {
FORGE_INSTANTIATE_OP_TEST(LayerNormOp, kCases, testing::Backend::gpu);
}  // namespace layernorm

namespace moe_permute {
FORGE_INSTANTIATE_OP_TEST(MoeSortOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(MoePermuteOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(MoeSortFixed, testing::kFixedCase, testing::Backend::gpu);
}  // namespace moe_permute

namespace rmsnorm {
FORGE_INSTANTIATE_OP_TEST(RmsNormOp, kCases, testing::Backend::gpu);
}  // namespace rmsnorm

namespace rope {
FORGE_INSTANTIATE_OP_TEST(RopeOp, kCases, testing::Backend::gpu);
}  // namespace rope

namespace swiglu {
FORGE_INSTANTIATE_OP_TEST(SwigluOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(SwigluSaturation, testing::kFixedCase, testing::Backend::gpu);
}  // namespace swiglu

namespace dropout {
FORGE_INSTANTIATE_OP_TEST(DropoutOp, kCases, testing::Backend::gpu);
FORGE_INSTANTIATE_OP_TEST(DropoutRate, testing::kFixedCase, testing::Backend::gpu);
}  // namespace dropout

}  // namespace forge::op_tests
