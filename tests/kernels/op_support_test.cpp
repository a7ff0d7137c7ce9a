// The support query (ops::supports_<op>, kernels/ops.h): for each backend built in, parameters it takes and
// parameters it refuses, the refusal's reason being exactly the line the op fails with when called anyway
// (the kernel checks its parameters through the same predicate). The CUDA backend's predicates need no GPU:
// they are asked of its table directly, and its ops fail with them before touching a device. Also the empty
// inputs of op_tests/empty_inputs.h on the CPU and the device emulation.
#include <gtest/gtest.h>

#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/tensor.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/profiler.h"
#include "kernels/op_tests/empty_inputs.h"
#include "op_harness.h"

namespace forge::op_tests::empty_inputs {
FORGE_INSTANTIATE_OP_TEST(EmptyInputs, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
}  // namespace forge::op_tests::empty_inputs

namespace forge::op_support_test {

namespace {

// query(reason) must refuse, with a one-line reason naming every fragment, and say so without a reason too;
// call() must then fail with that very line.
template <typename Query, typename Call>
void expect_refused(Query query, Call call, std::initializer_list<std::string_view> fragments) {
  std::string why;
  EXPECT_FALSE(query(&why));
  EXPECT_FALSE(query(nullptr));
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  for (std::string_view fragment : fragments)
    EXPECT_NE(why.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << why;
  try {
    call();
    ADD_FAILURE() << "the op ran parameters its query refuses: " << why;
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), why);
  }
}

// table.supports_<op>(args..., reason) and table.<op>(args...).
#define EXPECT_REFUSED(table, op, args, ...)                                                                 \
  expect_refused([&](std::string* reason_) { return (table).supports_##op FORGE_OP_APPEND(args, reason_); }, \
                 [&] { (table).op args; }, {__VA_ARGS__})
#define EXPECT_SUPPORTED(table, op, args)                                                \
  do {                                                                                   \
    std::string why_;                                                                    \
    EXPECT_TRUE((table).supports_##op FORGE_OP_APPEND(args, &why_)) << #op ": " << why_; \
  } while (0)

// Host arrays for the parameters (the queries judge parameters, not memory).
struct Memory {
  alignas(256) float f[1024] = {};
  alignas(256) uint8_t codes[1024] = {};
  alignas(256) uint16_t bf16[1024] = {};
};

ops::GemmParams gemm_params(Memory& m, DType ab, DType c) {
  ops::GemmParams p;
  p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.ab_dtype = ab, p.c_dtype = c;
  p.a = ab == DType::bf16 ? static_cast<const void*>(m.bf16) : m.f;
  p.b = p.a;
  p.c = c == DType::bf16 ? static_cast<void*>(m.bf16 + 512) : m.f + 512;
  return p;
}

// An FP8 GEMM 32x32x32, per-tensor scaling, both operands stored [32, 32]: NN unless told otherwise.
ops::Fp8GemmParams fp8_params(Memory& m) {
  ops::Fp8GemmParams p;
  p.m = p.n = p.k = 32, p.a = m.codes, p.lda = 32, p.b = m.codes, p.ldb = 32, p.c = m.f, p.ldc = 32;
  return p;
}

ops::AttentionParams attention_params(Memory& m, int64_t head_dim) {
  ops::AttentionParams p;
  p.batch = 1, p.seq = 1, p.heads = 1, p.kv_heads = 1, p.head_dim = head_dim;
  p.q = p.k = p.v = m.f, p.out = m.f + 512, p.lse = m.f + 1000;
  p.q_stride = p.k_stride = p.v_stride = p.out_stride = head_dim;
  return p;
}

// MLA's absorbed decode: two new tokens of one head against 10 cached positions of one kv head whose values
// are the first 512 columns of its key rows (v = k, same strides).
ops::AttentionParams absorbed_mla_decode_params(Memory& m, int64_t head_dim) {
  ops::AttentionParams p = attention_params(m, head_dim);
  p.seq = 2, p.kv_seq = 10, p.q_offset = 8, p.v_head_dim = 512, p.out_stride = 512;
  p.v = p.k, p.v_head_stride = head_dim;
  return p;
}

// LayerNorm, GELU and bias (the Vision Transformer's ops) refuse the same parameters with the same lines on
// every backend: bad shapes, a null pointer the op needs, a leading dimension below the row, an unknown kind.
// The optional pointers (LayerNorm's bias, mean and rstd in the forward, dbias) may be null.
void expect_vit_op_refusals(const ops::OpTable& table, Memory& m) {
  ops::LayerNormParams norm;
  norm.rows = 2, norm.dim = 0;
  EXPECT_REFUSED(table, layernorm_forward, (norm), "layernorm_forward: bad shape rows=2 dim=0");
  norm.rows = -1, norm.dim = 4;
  EXPECT_REFUSED(table, layernorm_backward_weight, (norm),
                 "layernorm_backward_weight: bad shape rows=-1 dim=4");
  norm.rows = 2, norm.x = m.f, norm.y = m.f + 8;
  EXPECT_REFUSED(table, layernorm_forward, (norm), "layernorm_forward: weight is null");
  norm.weight = m.f + 16;
  EXPECT_SUPPORTED(table, layernorm_forward, (norm));  // no bias, no statistics kept
  norm.dy = m.f + 24, norm.dx = m.f + 32, norm.rstd = m.f + 40;
  EXPECT_REFUSED(table, layernorm_backward_input, (norm), "layernorm_backward_input: mean is null");
  norm.mean = m.f + 48;
  EXPECT_SUPPORTED(table, layernorm_backward_input, (norm));
  EXPECT_REFUSED(table, layernorm_backward_weight, (norm), "layernorm_backward_weight: dweight is null");
  norm.dweight = m.f + 56;
  EXPECT_SUPPORTED(table, layernorm_backward_weight, (norm));  // dbias optional
  norm.x = nullptr;
  EXPECT_REFUSED(table, layernorm_backward_weight, (norm), "layernorm_backward_weight: x is null");

  ops::GeluParams gelu;
  gelu.n = -3;
  EXPECT_REFUSED(table, gelu_forward, (gelu), "gelu_forward: negative size -3");
  gelu.n = 4, gelu.x = m.f, gelu.out = m.f + 8;
  EXPECT_SUPPORTED(table, gelu_forward, (gelu));
  EXPECT_REFUSED(table, gelu_backward, (gelu), "gelu_backward: dy is null");
  gelu.dy = m.f + 16;
  EXPECT_REFUSED(table, gelu_backward, (gelu), "gelu_backward: dx is null");
  gelu.kind = static_cast<ops::GeluKind>(7);
  EXPECT_REFUSED(table, gelu_forward, (gelu), "gelu_forward: unknown kind 7");

  ops::BiasParams bias;
  bias.rows = -1, bias.n = 3;
  EXPECT_REFUSED(table, bias_add, (bias), "bias_add: bad shape rows=-1 n=3");
  bias.rows = 2, bias.n = -3;
  EXPECT_REFUSED(table, bias_backward, (bias), "bias_backward: bad shape rows=2 n=-3");
  bias.n = 3, bias.y = m.f, bias.y_ld = 2;
  EXPECT_REFUSED(table, bias_add, (bias), "bias_add: y_ld 2 is smaller than n 3");
  bias.y_ld = 5;
  EXPECT_REFUSED(table, bias_add, (bias), "bias_add: bias is null");
  bias.bias = m.f + 16;
  EXPECT_SUPPORTED(table, bias_add, (bias));
  bias.dy = m.f + 32, bias.dy_ld = 1;
  EXPECT_REFUSED(table, bias_backward, (bias), "bias_backward: dy_ld 1 is smaller than n 3");
  bias.dy_ld = 0;
  EXPECT_REFUSED(table, bias_backward, (bias), "bias_backward: dbias is null");
  bias.dbias = m.f + 48;
  EXPECT_SUPPORTED(table, bias_backward, (bias));
}

TEST(OpSupport, CpuBackend) {
  const ops::OpTable& cpu = ops::cpu_table();
  Memory m;
  EXPECT_SUPPORTED(cpu, gemm, (gemm_params(m, DType::f32, DType::f32)));
  EXPECT_SUPPORTED(cpu, gemm, (gemm_params(m, DType::bf16, DType::bf16)));
  EXPECT_REFUSED(cpu, gemm, (gemm_params(m, DType::f32, DType::bf16)),
                 "gemm: c_dtype bf16 needs bf16 operands");
  EXPECT_REFUSED(cpu, gemm, (gemm_params(m, DType::f16, DType::f32)), "gemm: operands must be fp32 or bf16",
                 "fp16");
  ops::GemmParams empty = gemm_params(m, DType::f32, DType::f32);
  empty.k = 0;
  EXPECT_REFUSED(cpu, gemm, (empty), "gemm: empty problem 4x4x0");
  // The CPU's FP8 GEMM takes every orientation and models limited-precision accumulation.
  ops::Fp8GemmParams fp8 = fp8_params(m);
  EXPECT_SUPPORTED(cpu, fp8_gemm, (fp8));
  fp8.accumulator_bits = 14;
  EXPECT_SUPPORTED(cpu, fp8_gemm, (fp8));
  fp8.accumulator_bits = 30;
  EXPECT_REFUSED(cpu, fp8_gemm, (fp8), "fp8_gemm: accumulator_bits must be 0 (exact fp32) or 1..23, got 30");
  fp8 = fp8_params(m), fp8.a_scale_inv = std::numeric_limits<float>::infinity();
  EXPECT_REFUSED(cpu, fp8_gemm, (fp8), "fp8_gemm: per-tensor scale_inv must be finite");
  EXPECT_SUPPORTED(cpu, attention_forward, (attention_params(m, 512)));  // no head_dim limit here
  ops::AttentionParams mla = absorbed_mla_decode_params(m, 576);
  EXPECT_SUPPORTED(cpu, attention_forward, (mla));
  mla.v_head_dim = mla.v_head_stride = mla.v_stride = mla.out_stride = 1024;  // wider than keys: fine here
  EXPECT_SUPPORTED(cpu, attention_forward, (mla));
  mla = absorbed_mla_decode_params(m, 576), mla.v_head_dim = -1;
  EXPECT_REFUSED(cpu, attention_forward, (mla), "attention: negative v_head_dim -1");
  mla = absorbed_mla_decode_params(m, 576), mla.out_stride = 500;
  EXPECT_REFUSED(cpu, attention_forward, (mla), "attention: q_stride 576 / out_stride 500 < 576 / 512");
  EXPECT_REFUSED(cpu, attention_backward, (attention_params(m, 64)),
                 "attention backward: dout, dq, dk and dv");
  ops::AttentionParams capped = attention_params(m, 64);
  capped.softcap = 50.0f;
  EXPECT_SUPPORTED(cpu, attention_forward, (capped));
  capped.softcap = -1.0f;
  EXPECT_REFUSED(cpu, attention_forward, (capped), "attention: softcap -1 must be finite and >= 0");
  EXPECT_REFUSED(cpu, softcap_inplace, (m.f, 0.0f, 4), "softcap_inplace: cap 0 must be positive");
  ops::SwigluParams glu;
  glu.rows = 2, glu.ffn = 4, glu.activation = ops::GluActivation::gelu_tanh;
  EXPECT_SUPPORTED(cpu, swiglu_forward, (glu));
  glu.activation = static_cast<ops::GluActivation>(5);
  EXPECT_REFUSED(cpu, swiglu_forward, (glu), "swiglu_forward: unknown activation 5");
  glu.activation = ops::GluActivation::silu, glu.dtype = DType::bf16;
  EXPECT_SUPPORTED(cpu, swiglu_forward, (glu));
  glu.dtype = DType::f16;
  EXPECT_REFUSED(cpu, swiglu_backward, (glu), "swiglu_backward: tensors must be fp32 or bf16, not fp16");
  ops::DropoutParams drop;
  drop.rows = 2, drop.cols = 4, drop.seq = 2, drop.rate = 0.1f;
  EXPECT_SUPPORTED(cpu, dropout, (drop));
  drop.rate = 1.0f;
  EXPECT_REFUSED(cpu, dropout, (drop), "dropout: rate 1 is not in [0, 1)");
  drop.rate = 0.1f, drop.first_sample = -1;
  EXPECT_REFUSED(cpu, dropout, (drop), "dropout: bad shape rows=2 cols=4 seq=2 row_begin=0 first_sample=-1");
  drop.first_sample = 0, drop.dtype = DType::f16;
  EXPECT_REFUSED(cpu, dropout, (drop), "dropout: tensors must be fp32 or bf16, not fp16");
  // The element-wise kernels take any size (a negative one does nothing).
  EXPECT_SUPPORTED(cpu, add_inplace, (nullptr, nullptr, -1));
  EXPECT_REFUSED(cpu, sum_squares_accumulate, (m.f, 4, nullptr), "sum_squares_accumulate: total is null");
  ops::RmsNormParams norm;
  norm.rows = 3, norm.dim = 0;
  EXPECT_REFUSED(cpu, rmsnorm_forward, (norm), "rmsnorm_forward: bad shape rows=3 dim=0");
  expect_vit_op_refusals(cpu, m);
  ops::Fp8CastParams cast;
  cast.rows = cast.cols = 2, cast.x = m.f, cast.q = m.codes;
  EXPECT_SUPPORTED(cpu, fp8_cast_transpose, (cast));
  EXPECT_REFUSED(cpu, fp8_quantize_1x128, (cast), "fp8_quantize_1x128: an output lacks its scales");
  // Context parallelism's data movement: empty problems need no pointers, others all of theirs.
  ops::AttentionMergeParams merge;
  merge.batch = 1, merge.seq = 0, merge.heads = 2, merge.v_dim = 4;
  EXPECT_SUPPORTED(cpu, attention_merge, (merge));
  merge.seq = 3;
  EXPECT_REFUSED(cpu, attention_merge, (merge), "attention_merge: out, lse, out_b and lse_b must be set");
  ops::StridedCopyParams copy;
  copy.shape[0] = 2, copy.src = m.f;
  EXPECT_REFUSED(cpu, strided_copy, (copy), "strided_copy: src and dst must be set");
}

// ops::supports_<op>(..., device) asks the device's table, an open profile's included.
TEST(OpSupport, WrappersAskTheDevicesTable) {
  Memory m;
  std::string why;
  EXPECT_TRUE(ops::supports_gemm(gemm_params(m, DType::f32, DType::f32)));
  EXPECT_FALSE(ops::supports_gemm(gemm_params(m, DType::f32, DType::bf16), Device::cpu, &why));
  EXPECT_NE(why.find("c_dtype bf16 needs bf16 operands"), std::string::npos) << why;
  ops::profile_begin(Device::cpu);
  std::string profiled_why;
  EXPECT_FALSE(ops::supports_gemm(gemm_params(m, DType::f32, DType::bf16), Device::cpu, &profiled_why));
  EXPECT_FALSE(ops::supports_rmsnorm_forward(ops::RmsNormParams{}, Device::cpu));  // dim 0
  const ops::OpProfile profile = ops::profile_end();
  EXPECT_EQ(profiled_why, why);
  EXPECT_TRUE(profile.rows.empty()) << "a query is no op call";
}

#ifdef FORGE_HAVE_CUDA
// The CUDA backend's limits, narrower than the CPU's in places. No GPU needed: parameters are checked first.
TEST(OpSupport, CudaBackend) {
  const ops::OpTable& gpu = ops::cuda_table();
  Memory m;
  EXPECT_SUPPORTED(gpu, gemm, (gemm_params(m, DType::f32, DType::f32)));
  EXPECT_SUPPORTED(gpu, gemm, (gemm_params(m, DType::bf16, DType::bf16)));
  // cuBLASLt has no fp32 x fp32 -> bf16 matmul.
  EXPECT_REFUSED(gpu, gemm, (gemm_params(m, DType::f32, DType::bf16)),
                 "gemm: c_dtype bf16 needs bf16 operands");
  ops::GemmParams misaligned = gemm_params(m, DType::bf16, DType::bf16);
  misaligned.c = reinterpret_cast<char*>(m.bf16 + 512) + 1;
  EXPECT_REFUSED(gpu, gemm, (misaligned), "gemm: c", "is not aligned to its 2-byte bf16 elements");
  ops::GemmParams wide = gemm_params(m, DType::f32, DType::f32);
  wide.ldc = 3;
  EXPECT_REFUSED(gpu, gemm, (wide), "gemm: ldc 3 is smaller than n 4");
  // FP8 tensor cores: NT only, 16-byte aligned operands; no limited-precision accumulation model.
  ops::Fp8GemmParams fp8 = fp8_params(m);
  EXPECT_REFUSED(gpu, fp8_gemm, (fp8), "fp8_gemm: the NN orientation");
  fp8.trans_b = true;
  EXPECT_SUPPORTED(gpu, fp8_gemm, (fp8));
  fp8.lda = 40;
  EXPECT_REFUSED(gpu, fp8_gemm, (fp8), "fp8_gemm: FP8 tensor cores need 16-byte aligned operands", "lda 40");
  fp8.lda = 32, fp8.accumulator_bits = 14;
  EXPECT_REFUSED(gpu, fp8_gemm, (fp8), "accumulator_bits = 14", "not implemented on CUDA");
  fp8.accumulator_bits = 0, fp8.a_dtype = fp8.b_dtype = DType::e5m2;
  EXPECT_REFUSED(gpu, fp8_gemm, (fp8), "e5m2 x e5m2");
  // Block scaling: forge's own kernel's limits.
  fp8 = fp8_params(m), fp8.trans_b = true, fp8.scaling = ops::Fp8Scaling::block;
  fp8.a_scales = fp8.b_scales = m.f + 768;
  EXPECT_SUPPORTED(gpu, fp8_gemm, (fp8));
  fp8.trans_a = true, fp8.trans_b = false;
  EXPECT_REFUSED(gpu, fp8_gemm, (fp8), "fp8_gemm (block scaling): the TN orientation");
  // The attention kernels' widest tiles.
  EXPECT_SUPPORTED(gpu, attention_forward, (attention_params(m, 256)));
  EXPECT_REFUSED(gpu, attention_forward, (attention_params(m, 512)), "attention: head_dim 512 > 256",
                 "not supported on the CUDA backend");
  // Values of another width: the tensor-core kernels run at the wider of the two (DeepSeek-V3's 192 / 128).
  ops::AttentionParams mla = attention_params(m, 192);
  mla.v_head_dim = 128, mla.v_stride = mla.out_stride = 128;
  EXPECT_SUPPORTED(gpu, attention_forward, (mla));
  mla.v_head_dim = 512, mla.v_stride = mla.out_stride = 512;
  EXPECT_REFUSED(gpu, attention_forward, (mla), "attention: v_head_dim 512 > 256",
                 "not supported on the CUDA backend");
  // The decode kernels take MLA's absorbed widths (576 / 512), but no wider, and only for a few queries.
  EXPECT_SUPPORTED(gpu, attention_forward, (absorbed_mla_decode_params(m, 576)));
  EXPECT_REFUSED(gpu, attention_forward, (absorbed_mla_decode_params(m, 640)),
                 "attention: head_dim 640 / v_head_dim 512 > 576", "decode kernels");
  mla = absorbed_mla_decode_params(m, 576), mla.seq = 17, mla.kv_seq = 20, mla.q_offset = 3;
  EXPECT_REFUSED(gpu, attention_forward, (mla), "attention: head_dim 576 > 256", "decode kernels");
  ops::LinearCrossEntropyParams loss;
  loss.rows = 2, loss.dim = 4, loss.vocab = 8;
  EXPECT_REFUSED(gpu, linear_cross_entropy_forward, (loss),
                 "linear_cross_entropy_forward: workspace is required");
  // Gemma's pieces run on CPUs only so far: logit soft-capping and the GeGLU gate are refused in one line.
  loss.workspace = m.f, loss.softcap = 30.0f;
  EXPECT_REFUSED(gpu, linear_cross_entropy_forward, (loss),
                 "linear_cross_entropy_forward: logit soft-capping", "run on the CPU");
  ops::AttentionParams capped = attention_params(m, 64);
  capped.softcap = 50.0f;
  EXPECT_REFUSED(gpu, attention_forward, (capped), "attention: logit soft-capping", "run on the CPU");
  ops::SwigluParams glu;
  glu.rows = 2, glu.ffn = 4, glu.activation = ops::GluActivation::gelu_tanh;
  EXPECT_REFUSED(gpu, swiglu_forward, (glu), "swiglu_forward: only the silu gate");
  ops::RmsNormParams offset;
  offset.rows = 2, offset.dim = 4, offset.weight_offset = 1.0f;
  EXPECT_REFUSED(gpu, rmsnorm_forward, (offset), "rmsnorm_forward: a weight offset", "run on the CPU");
  EXPECT_REFUSED(gpu, softcap_inplace, (m.f, 0.0f, 4), "softcap_inplace: cap 0", "must be positive");
  // The router's per-thread masks.
  ops::MoeRouterParams router;
  router.tokens = 4, router.experts = 2048, router.top_k = 8, router.logits = m.f,
  router.expert_ids = reinterpret_cast<int32_t*>(m.f + 256);
  router.weights = router.scores = m.f;
  EXPECT_REFUSED(gpu, moe_router_forward, (router), "moe_router_forward: experts=2048",
                 "beyond the CUDA router");
}

// Every parameter check of the element-wise, norm, rotary, SwiGLU, embedding and optimizer kernels names the
// op and the culprit, and is the query's reason.
TEST(OpSupport, CudaBackendBadParametersNameTheOp) {
  const ops::OpTable& gpu = ops::cuda_table();
  Memory m;
  EXPECT_SUPPORTED(gpu, add_inplace, (m.f, m.f, 4));
  EXPECT_REFUSED(gpu, add_inplace, (nullptr, nullptr, -1), "add_inplace: negative size -1");
  EXPECT_REFUSED(gpu, sum_squares, (nullptr, 5), "sum_squares: x is null");
  EXPECT_REFUSED(gpu, sum_squares_accumulate, (m.f, 4, nullptr), "sum_squares_accumulate: total is null");
  EXPECT_REFUSED(gpu, amax_to, (m.f, 4, nullptr), "amax_to: out is null");
  ops::RmsNormParams norm;
  norm.rows = 3, norm.dim = 0;
  EXPECT_REFUSED(gpu, rmsnorm_forward, (norm), "rmsnorm_forward: bad shape rows=3 dim=0");
  norm.dim = 4, norm.x = m.f, norm.weight = m.f, norm.y = m.f, norm.dy = m.f, norm.dx = m.f;
  EXPECT_SUPPORTED(gpu, rmsnorm_forward, (norm));
  EXPECT_REFUSED(gpu, rmsnorm_backward_input, (norm), "rmsnorm_backward_input: rstd is null");
  expect_vit_op_refusals(gpu, m);
  ops::LayerNormParams wide;
  wide.rows = 1, wide.dim = 65536 * 256, wide.x = wide.dy = m.f, wide.mean = wide.rstd = wide.dweight = m.f;
  EXPECT_REFUSED(gpu, layernorm_backward_weight, (wide),
                 "layernorm_backward_weight: shape rows=1 dim=16777216", "exceeds the kernel's grid");
  ops::BiasParams wide_bias;
  wide_bias.rows = 1, wide_bias.n = 65536 * 256, wide_bias.dy = m.f, wide_bias.dbias = m.f;
  EXPECT_REFUSED(gpu, bias_backward, (wide_bias), "bias_backward: shape rows=1 n=16777216",
                 "exceeds the kernel's grid");
  ops::RopeParams rope;
  rope.batch = 1, rope.seq = 1, rope.heads = 1, rope.head_dim = 7, rope.token_stride = 7;
  EXPECT_REFUSED(gpu, rope, (rope), "rope: head_dim must be even and positive, got 7");
  rope.head_dim = 8, rope.token_stride = 4;
  EXPECT_REFUSED(gpu, rope, (rope), "rope: token_stride 4");
  rope.token_stride = 8, rope.position_offset = -2;
  EXPECT_REFUSED(gpu, rope, (rope), "rope: negative position_offset -2");
  ops::SwigluParams swiglu;
  swiglu.rows = -1, swiglu.ffn = 3;
  EXPECT_REFUSED(gpu, swiglu_forward, (swiglu), "swiglu_forward: bad shape rows=-1");
  swiglu.rows = 2, swiglu.dtype = DType::e4m3;
  EXPECT_REFUSED(gpu, swiglu_forward, (swiglu), "swiglu_forward", "fp32 or bf16");
  ops::EmbeddingParams embedding;
  embedding.rows = 2, embedding.dim = 4, embedding.vocab = 0;
  EXPECT_REFUSED(gpu, embedding_forward, (embedding), "embedding_forward: bad shape", "vocab=0");
  ops::AdamWParams adamw;
  adamw.n = 4, adamw.step = 0;
  EXPECT_REFUSED(gpu, adamw, (adamw), "adamw: step is 1-based");
  adamw.step = 1;
  EXPECT_REFUSED(gpu, adamw, (adamw), "adamw: param is null");
  ops::Fp8CastParams cast;
  cast.rows = cast.cols = 2, cast.x = m.f, cast.q = m.codes, cast.fp8 = DType::bf16;
  EXPECT_REFUSED(gpu, fp8_cast_transpose, (cast), "fp8_cast_transpose: bf16 is not an FP8 dtype");
  ops::KvAppendParams kv;
  kv.batch = 1, kv.tokens = 1, kv.kv_heads = 0, kv.head_dim = 8;
  EXPECT_REFUSED(gpu, kv_append, (kv), "kv_append: bad shape", "kv_heads=0");
  ops::AttentionMergeParams merge;
  merge.batch = 1, merge.seq = 3, merge.heads = 2, merge.v_dim = 4;
  EXPECT_REFUSED(gpu, attention_merge, (merge), "attention_merge: out is null");
  ops::StridedCopyParams copy;
  copy.shape[2] = -1;
  EXPECT_REFUSED(gpu, strided_copy, (copy), "strided_copy: bad shape 1x1x-1");
}
#endif

// The emulated device answers, and refuses, as the GPU would (builds with the CUDA backend) and as the CPU
// kernel it runs would.
TEST(OpSupport, EmulatedDevice) {
  EmulatedDevice emulation;
  const ops::OpTable& emulated = ops::table(Device::cuda);
  Tensor codes = Tensor::zeros({32, 32}, DType::e4m3, Device::cuda);
  Tensor out = Tensor::zeros({32, 32}, DType::f32, Device::cuda);
  ops::Fp8GemmParams fp8;
  fp8.m = fp8.n = fp8.k = 32, fp8.a = codes.data<uint8_t>(), fp8.lda = 32, fp8.b = codes.data<uint8_t>();
  fp8.ldb = 32, fp8.c = out.f32(), fp8.ldc = 32;
#ifdef FORGE_HAVE_CUDA
  EXPECT_REFUSED(emulated, fp8_gemm, (fp8), "fp8_gemm: the NN orientation");
  EXPECT_REFUSED(emulated, add_inplace, (nullptr, nullptr, -1), "add_inplace: negative size -1");
#endif
  fp8.trans_b = true;
  EXPECT_SUPPORTED(emulated, fp8_gemm, (fp8));
  EXPECT_NO_THROW(ops::fp8_gemm(fp8, Device::cuda));
  fp8.accumulator_bits = 30;  // the CPU kernel's limit
  EXPECT_REFUSED(emulated, fp8_gemm, (fp8), "accumulator_bits");
  EXPECT_REFUSED(emulated, sum_squares_accumulate, (out.f32(), 4, nullptr),
                 "sum_squares_accumulate: total is null");
}

// Both backends take attention's tensors in fp32 or bf16, one dtype for all of them, and decode over a cache
// in fp32 only; mixtures are refused naming the dtypes.
TEST(OpSupport, AttentionDtypes) {
  std::vector<const ops::OpTable*> tables = {&ops::cpu_table()};
#ifdef FORGE_HAVE_CUDA
  tables.push_back(&ops::cuda_table());
#endif
  Memory m;
  for (const ops::OpTable* table : tables) {
    ops::AttentionParams p = attention_params(m, 64);
    p.seq = 2, p.q = p.k = p.v = m.bf16, p.out = m.bf16 + 512;
    EXPECT_SUPPORTED(*table, attention_forward, (p));
    p.out = m.f + 512;
    EXPECT_REFUSED(*table, attention_forward, (p),
                   "attention: q, k, v and out must hold one dtype (q bf16, k bf16, v bf16, out fp32)");
    p.out = m.bf16 + 512, p.dout = m.bf16, p.dq = p.dk = p.dv = m.bf16 + 256;
    p.dout_stride = p.dq_stride = p.dk_stride = p.dv_stride = 64;
    EXPECT_SUPPORTED(*table, attention_backward, (p));
    p.dk = m.f;
    EXPECT_REFUSED(*table, attention_backward, (p),
                   "attention backward: dout, dq, dk and dv must hold q's dtype bf16");
    ops::AttentionParams decode = attention_params(m, 64);
    decode.q = decode.k = decode.v = m.bf16, decode.out = m.bf16 + 512, decode.kv_seq = 4,
    decode.q_offset = 3;
    EXPECT_REFUSED(
        *table, attention_forward, (decode),
        "attention: decoding over a key/value cache takes fp32 queries, keys and values, not bf16");
  }
}

// Both backends refuse a router that cannot route: every shape rule names the setting.
TEST(OpSupport, MoeRouterShapeRules) {
  std::vector<const ops::OpTable*> tables = {&ops::cpu_table()};
#ifdef FORGE_HAVE_CUDA
  tables.push_back(&ops::cuda_table());
#endif
  for (const ops::OpTable* table : tables) {
    ops::MoeRouterParams p;
    p.tokens = 4, p.experts = 8, p.top_k = 2;
    EXPECT_REFUSED(*table, moe_router_forward, (p),
                   "moe_router_forward: logits, expert_ids, weights and scores");
    p.groups = 3;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "3 groups do not divide 8 experts");
    p.groups = 8;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "groups of 1 expert");
    p.groups = 4, p.topk_groups = 5;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "topk_groups 5 outside [1, groups = 4]");
    p.topk_groups = 1, p.top_k = 3;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "top_k 3 > the 2 experts of the 1 kept groups");
    p.top_k = 2, p.seq_len = 3;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "4 tokens are not whole sequences of seq_len 3");
    p.seq_len = 0, p.balance_scale = 1;
    EXPECT_REFUSED(*table, moe_router_backward, (p), "moe_router_backward: balance_scale without seq_len");
    // The micro-batch balance loss needs its buffers (checked only, never run: host pointers are fine).
    float f[32] = {};
    int32_t ids[8] = {};
    p.balance_scale = 0, p.aux_scale = 1, p.scores = f, p.expert_ids = ids, p.dweights = f, p.dlogits = f;
    EXPECT_REFUSED(*table, moe_router_backward, (p), "moe_router_backward: the micro-batch balance loss");
    p.logits = f, p.weights = f, p.aux_loss = f;
    EXPECT_REFUSED(*table, moe_router_forward, (p), "moe_router_forward: the micro-batch balance loss");
    EXPECT_REFUSED(*table, moe_bias_update, (nullptr, nullptr, 0, 1e-3f, false),
                   "moe_bias_update: bad experts=0");
  }
}

// Mixture of experts: the sort, the permutes and the grouped GEMMs refuse the same parameters on both
// backends (the CUDA sort also caps the experts at its per-block counters).
ops::GroupedGemmParams grouped_params(Memory& m, const int64_t* offsets) {
  ops::GroupedGemmParams p;
  p.groups = 2, p.offsets = offsets, p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.a = m.f, p.b = m.f + 256, p.c = m.f + 512, p.c_group_stride = 16;
  return p;
}

void expect_moe_refusals(const ops::OpTable& table, Memory& m) {
  ops::MoeSortParams sort;
  sort.tokens = 4, sort.top_k = 2, sort.experts = 0;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort),
                 "moe_sort_by_expert: bad shape tokens=4 top_k=2 experts=0");
  sort.experts = 3, sort.capacity = -1;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "moe_sort_by_expert: negative capacity -1");
  sort.capacity = 0;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "moe_sort_by_expert: offsets is null");
  sort.tokens = int64_t{1} << 30, sort.top_k = 4;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "does not fit the int32 rows");
  sort.tokens = 4, sort.top_k = 2, sort.align = 0;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "moe_sort_by_expert: align must be >= 1, got 0");
  sort.align = -16;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "moe_sort_by_expert: align must be >= 1, got -16");
  // The padded bound 2^30 + 3 * (2^29 - 1) passes int32 (tokens * top_k alone fits).
  sort.offsets = reinterpret_cast<int64_t*>(m.f), sort.expert_ids = reinterpret_cast<int32_t*>(m.f + 64);
  sort.row_of = sort.source = reinterpret_cast<int32_t*>(m.f + 128);
  sort.tokens = int64_t{1} << 28, sort.top_k = 4, sort.align = int64_t{1} << 29;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort),
                 "moe_sort_by_expert: tokens * top_k + experts * (align - 1)",
                 "268435456 * 4 + 3 * 536870911 does not fit the int32 rows");
  sort.align = int64_t{1} << 28;  // 2^30 + 3 * (2^28 - 1) fits
  EXPECT_SUPPORTED(table, moe_sort_by_expert, (sort));
  sort.align = std::numeric_limits<int64_t>::max();
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "does not fit the int32 rows");
  // Without tokens source still holds experts * (align - 1) entries, all -1.
  sort.tokens = 0, sort.align = 16, sort.source = nullptr;
  EXPECT_REFUSED(table, moe_sort_by_expert, (sort), "moe_sort_by_expert: source is null (its 45 entries");
  sort.align = 1;
  EXPECT_SUPPORTED(table, moe_sort_by_expert, (sort));
  ops::MoePermuteParams permute;
  // Padding may take rows past tokens * top_k; row_of must still index them as int32.
  permute.tokens = 2, permute.top_k = 2, permute.hidden = 8, permute.rows = int64_t{1} << 31;
  EXPECT_REFUSED(table, moe_permute, (permute),
                 "moe_permute: rows 2147483648 does not fit the int32 row indices");
  permute.rows = 4, permute.x_stride = 6;
  EXPECT_REFUSED(table, moe_permute, (permute), "moe_permute: x_stride 6 is smaller than hidden 8");
  permute.x_stride = 0;
  EXPECT_REFUSED(table, moe_permute, (permute), "moe_permute: source is null");
  EXPECT_REFUSED(table, moe_permute_backward, (permute), "moe_permute_backward: row_of is null");
  ops::MoeUnpermuteParams unpermute;
  unpermute.tokens = 2, unpermute.top_k = 2, unpermute.hidden = 0;
  EXPECT_REFUSED(table, moe_unpermute, (unpermute), "moe_unpermute: bad shape", "hidden=0");
  unpermute.hidden = 8, unpermute.rows = 3, unpermute.dy = m.f;
  EXPECT_REFUSED(table, moe_unpermute_backward, (unpermute), "moe_unpermute_backward: source is null");
  const int64_t offsets[3] = {0, 2, 4};
  EXPECT_SUPPORTED(table, m_grouped_gemm, (grouped_params(m, offsets)));
  EXPECT_SUPPORTED(table, k_grouped_gemm, (grouped_params(m, offsets)));
  ops::GroupedGemmParams grouped = grouped_params(m, offsets);
  grouped.c_dtype = DType::bf16;
  EXPECT_REFUSED(table, m_grouped_gemm, (grouped), "m_grouped_gemm: c_dtype bf16 needs bf16 operands");
  grouped = grouped_params(m, offsets), grouped.ab_dtype = DType::f16;
  EXPECT_REFUSED(table, k_grouped_gemm, (grouped), "k_grouped_gemm: operands must be fp32 or bf16", "fp16");
  grouped = grouped_params(m, offsets), grouped.offsets = nullptr;
  EXPECT_REFUSED(table, m_grouped_gemm, (grouped), "m_grouped_gemm: offsets (host memory");
  grouped = grouped_params(m, offsets), grouped.groups = 0;
  EXPECT_REFUSED(table, m_grouped_gemm, (grouped), "m_grouped_gemm: groups must be positive, got 0");
  grouped = grouped_params(m, offsets), grouped.k = 0;
  EXPECT_REFUSED(table, m_grouped_gemm, (grouped), "m_grouped_gemm: empty problem n=4 k=0");
  grouped = grouped_params(m, offsets), grouped.trans_b = true, grouped.ldb = 3;
  EXPECT_REFUSED(table, m_grouped_gemm, (grouped),
                 "m_grouped_gemm: ldb 3 is smaller than B's 4 stored columns");
  grouped = grouped_params(m, offsets), grouped.lda = 3;
  EXPECT_REFUSED(table, k_grouped_gemm, (grouped), "k_grouped_gemm: lda 3 is smaller than m 4");
  grouped = grouped_params(m, offsets), grouped.c_group_stride = 15;
  EXPECT_REFUSED(table, k_grouped_gemm, (grouped),
                 "k_grouped_gemm: c_group_stride 15 is smaller than one group's C");
}

TEST(OpSupport, MoeCpuBackend) {
  Memory m;
  expect_moe_refusals(ops::cpu_table(), m);
}

#ifdef FORGE_HAVE_CUDA
TEST(OpSupport, MoeCudaBackend) {
  const ops::OpTable& gpu = ops::cuda_table();
  Memory m;
  expect_moe_refusals(gpu, m);
  ops::MoeSortParams sort;
  sort.tokens = 4, sort.top_k = 2, sort.experts = 10000, sort.offsets = reinterpret_cast<int64_t*>(m.f);
  EXPECT_REFUSED(gpu, moe_sort_by_expert, (sort), "moe_sort_by_expert: experts 10000 > 8192");
  const int64_t offsets[3] = {0, 2, 4};
  ops::GroupedGemmParams grouped = grouped_params(m, offsets);
  grouped.ab_dtype = grouped.c_dtype = DType::bf16, grouped.c = reinterpret_cast<char*>(m.bf16) + 1;
  EXPECT_REFUSED(gpu, m_grouped_gemm, (grouped), "m_grouped_gemm: c is not aligned to its 2-byte elements");
}
#endif

// The emulated device: the grouped GEMMs' offsets must be host memory (a GPU's loop over the groups reads
// them on the host).
TEST(OpSupport, MoeEmulatedDeviceTakesHostOffsets) {
  EmulatedDevice emulation;
  Tensor operands = Tensor::zeros({3, 16}, DType::f32, Device::cuda);
  Tensor device_offsets = Tensor::zeros({3}, DType::i64, Device::cuda);
  ops::GroupedGemmParams p;
  const int64_t offsets[3] = {0, 2, 4};
  p.groups = 2, p.offsets = offsets, p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.a = operands.f32(), p.b = operands.f32() + 16, p.c = operands.f32() + 32;
  EXPECT_NO_THROW(ops::m_grouped_gemm(p, Device::cuda));
  p.offsets = device_offsets.data<int64_t>();
  testing::expect_error_containing([&] { ops::m_grouped_gemm(p, Device::cuda); },
                                   {"m_grouped_gemm on the emulated device", "offsets", "is device memory"});
}

}  // namespace
}  // namespace forge::op_support_test
