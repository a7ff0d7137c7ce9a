// The op profiler (kernels/profiler.h): while a profile is open the device's ops run through a timing table
// that forwards to the real one (same results), groups calls by op and shape, and counts the FLOPs and bytes
// the calls imply; outside a profile the table is the backend's own. Misuse is one clear error.
#include "forge/kernels/profiler.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/tensor.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::profiler_test {
namespace {

const ops::OpProfileRow* find_row(const ops::OpProfile& p, const std::string& op, const std::string& detail) {
  for (const ops::OpProfileRow& r : p.rows)
    if (r.op == op && r.detail == detail) return &r;
  return nullptr;
}

std::string error_of(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Closes a profile a failed assertion left open, so that later cases start clean.
struct ProfileGuard {
  ~ProfileGuard() {
    if (ops::profiling()) ops::profile_end();
  }
};

void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = a, p.lda = k, p.b = b, p.ldb = k, p.trans_b = true, p.c = c, p.ldc = n;
  ops::gemm(p);
}

TEST(Profiler, GroupsCallsByShapeAndForwardsToTheBackend) {
  ProfileGuard guard;
  EXPECT_EQ(&ops::table(Device::cpu), &ops::cpu_table());
  const auto a = testing::random_floats(64 * 48, 1), b = testing::random_floats(32 * 48, 2);
  std::vector<float> want(64 * 32), got(64 * 32);
  gemm_nt(64, 32, 48, a.data(), b.data(), want.data());
  const double want_sum = ops::sum_squares(a.data(), 100);

  ops::profile_begin(Device::cpu);
  EXPECT_TRUE(ops::profiling());
  EXPECT_NE(&ops::table(Device::cpu), &ops::cpu_table());
  gemm_nt(64, 32, 48, a.data(), b.data(), got.data());
  gemm_nt(64, 32, 48, a.data(), b.data(), got.data());
  std::vector<float> small(16 * 8);
  gemm_nt(16, 8, 48, a.data(), b.data(), small.data());
  const double got_sum = ops::sum_squares(a.data(), 100);
  const ops::OpProfile profile = ops::profile_end();

  EXPECT_FALSE(ops::profiling());
  EXPECT_EQ(&ops::table(Device::cpu), &ops::cpu_table());
  EXPECT_EQ(got, want);  // the profiled table runs the same kernel
  EXPECT_EQ(got_sum, want_sum);
  EXPECT_EQ(profile.device, Device::cpu);
  ASSERT_EQ(profile.rows.size(), 3u);
  const ops::OpProfileRow* big = find_row(profile, "gemm", "fp32 NT 64x32x48 -> fp32");
  const ops::OpProfileRow* little = find_row(profile, "gemm", "fp32 NT 16x8x48 -> fp32");
  const ops::OpProfileRow* squares = find_row(profile, "sum_squares", "n=100");
  ASSERT_TRUE(big && little && squares);
  EXPECT_EQ(big->calls, 2);
  EXPECT_EQ(big->flops, 2 * 2.0 * 64 * 32 * 48);
  EXPECT_EQ(big->bytes, 2 * 4.0 * (64 * 48 + 48 * 32 + 64 * 32));
  EXPECT_EQ(little->calls, 1);
  EXPECT_EQ(squares->flops, 0);
  EXPECT_EQ(squares->bytes, 400);
  double sum = 0;
  for (size_t i = 0; i < profile.rows.size(); ++i) {
    EXPECT_GE(profile.rows[i].seconds, 0);
    if (i > 0) {
      EXPECT_GE(profile.rows[i - 1].seconds, profile.rows[i].seconds) << "rows sorted by time";
    }
    sum += profile.rows[i].seconds;
  }
  EXPECT_DOUBLE_EQ(profile.op_seconds, sum);
  EXPECT_LE(profile.op_seconds, profile.wall_seconds);
}

TEST(Profiler, NamesAccumulatingAndBf16Gemms) {
  ProfileGuard guard;
  const auto a = testing::random_floats(8 * 16, 3);
  std::vector<uint16_t> a16(a.size()), b16(16 * 4);
  ops::convert_to_bf16(a.data(), a16.data(), static_cast<int64_t>(a.size()));
  ops::convert_to_bf16(a.data(), b16.data(), 16 * 4);
  std::vector<uint16_t> c16(8 * 4);
  ops::GemmParams p;
  p.m = 8, p.n = 4, p.k = 16, p.a = a16.data(), p.lda = 16, p.b = b16.data(), p.ldb = 4,
  p.ab_dtype = DType::bf16;
  p.c = c16.data(), p.ldc = 4, p.c_dtype = DType::bf16, p.beta = 1.0f;
  ops::profile_begin(Device::cpu);
  ops::gemm(p);
  const ops::OpProfile profile = ops::profile_end();
  const ops::OpProfileRow* row = find_row(profile, "gemm", "bf16 NN 8x4x16 -> bf16 (+=)");
  ASSERT_TRUE(row) << ops::format_profile(profile);
  // bf16 operands, and a bf16 C read (beta) and written.
  EXPECT_EQ(row->bytes, 2.0 * (8 * 16 + 16 * 4) + 2 * 2.0 * 8 * 4);
}

TEST(Profiler, AttentionFlopsCountTheVisiblePairs) {
  ProfileGuard guard;
  // Training's square causal attention: s(s+1)/2 pairs per head; forward 4 d FLOPs per pair, backward 2.5x.
  const int64_t b = 1, s = 8, h = 2, kv = 1, dim = 16;
  auto q = testing::random_floats(b * s * h * dim, 4), k = testing::random_floats(b * s * kv * dim, 5),
       v = testing::random_floats(b * s * kv * dim, 6);
  std::vector<float> out(q.size()), lse(b * h * s), dout = testing::random_floats(q.size(), 7), dq(q.size()),
                                                    dk(k.size()), dv(v.size());
  ops::AttentionParams p;
  p.batch = b, p.seq = s, p.heads = h, p.kv_heads = kv, p.head_dim = dim;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.q_stride = h * dim, p.k_stride = p.v_stride = kv * dim;
  p.out = out.data(), p.out_stride = h * dim, p.lse = lse.data(), p.scale = 0.25f;
  p.dout = dout.data(), p.dout_stride = h * dim, p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
  p.dq_stride = h * dim, p.dk_stride = p.dv_stride = kv * dim;
  ops::profile_begin(Device::cpu);
  ops::attention_forward(p);
  ops::attention_backward(p);
  // Two queries (positions 5 and 6) against a cache of 10 keys: 6 + 7 pairs.
  ops::AttentionParams decode = p;
  decode.seq = 2, decode.kv_seq = 10, decode.q_offset = 5, decode.lse = nullptr;
  std::vector<float> keys(10 * kv * dim), values(10 * kv * dim);
  decode.k = keys.data(), decode.v = values.data();
  ops::attention_forward(decode);
  // Values of 8 columns per head (v_head_dim, as MLA's): S counts head_dim, P V counts v_head_dim.
  ops::AttentionParams narrow = p;
  narrow.v_head_dim = 8, narrow.v_stride = kv * 8, narrow.out_stride = h * 8;
  ops::attention_forward(narrow);
  const ops::OpProfile profile = ops::profile_end();
  const ops::OpProfileRow* fwd = find_row(profile, "attention_forward", "b1 s8 h2/1 d16 causal");
  const ops::OpProfileRow* bwd = find_row(profile, "attention_backward", "b1 s8 h2/1 d16 causal");
  const ops::OpProfileRow* dec = find_row(profile, "attention_forward", "b1 s2 h2/1 d16 causal kv10");
  const ops::OpProfileRow* mla = find_row(profile, "attention_forward", "b1 s8 h2/1 d16 causal v8");
  ASSERT_TRUE(fwd && bwd && dec && mla) << ops::format_profile(profile);
  EXPECT_EQ(fwd->flops, 4.0 * dim * (s * (s + 1) / 2) * b * h);
  EXPECT_EQ(bwd->flops, 2.5 * fwd->flops);
  EXPECT_EQ(dec->flops, 4.0 * dim * (6 + 7) * b * h);
  EXPECT_EQ(mla->flops, 2.0 * (dim + 8) * (s * (s + 1) / 2) * b * h);
}

// Grouped GEMMs count 2 R n k FLOPs over the grouped rows (empty groups add nothing), each non-empty group's
// weight once; permutes count the rows they move.
TEST(Profiler, MoeRowsCountGroupedRowsAndMovedRows) {
  ProfileGuard guard;
  const std::vector<int64_t> offsets = {0, 5, 5, 12};  // 3 experts, the second empty
  const int64_t n = 6, k = 4, rows = 12;
  const auto x = testing::random_floats(rows * k, 1), w = testing::random_floats(3 * n * k, 2);
  std::vector<float> y(rows * n), dw(3 * n * k, 0.0f);
  ops::GroupedGemmParams p;
  p.groups = 3, p.offsets = offsets.data(), p.n = n, p.k = k, p.a = x.data(), p.lda = k, p.b = w.data();
  p.ldb = k, p.trans_b = true, p.b_group_stride = n * k, p.c = y.data(), p.ldc = n;
  ops::GroupedGemmParams q;
  q.groups = 3, q.offsets = offsets.data(), q.m = n, q.n = k, q.a = y.data(), q.lda = n, q.b = x.data();
  q.ldb = k, q.c = dw.data(), q.ldc = k, q.c_group_stride = n * k, q.beta = 1;
  const std::vector<int32_t> source = {0, 1, 2}, row_of = {0, 1, 2, -1};
  std::vector<float> permuted(3 * k);
  ops::MoePermuteParams permute;
  permute.tokens = 2, permute.top_k = 2, permute.hidden = k, permute.rows = 3, permute.source = source.data();
  permute.row_of = row_of.data(), permute.x = x.data(), permute.out = permuted.data();
  ops::profile_begin(Device::cpu);
  ops::m_grouped_gemm(p);
  ops::k_grouped_gemm(q);
  ops::moe_permute(permute);
  const ops::OpProfile profile = ops::profile_end();
  const ops::OpProfileRow* forward = find_row(profile, "m_grouped_gemm", "fp32 NT G3 R12 n6 k4 -> fp32");
  const ops::OpProfileRow* weight = find_row(profile, "k_grouped_gemm", "fp32 TN G3 R12 m6 n4 -> fp32 (+=)");
  const ops::OpProfileRow* moved = find_row(profile, "moe_permute", "t2 k2 h4 r3");
  ASSERT_TRUE(forward && weight && moved) << ops::format_profile(profile);
  EXPECT_EQ(forward->flops, 2.0 * rows * n * k);
  EXPECT_EQ(forward->bytes, 4.0 * (rows * k + 2 * n * k + rows * n));  // A, two experts' W, C
  EXPECT_EQ(weight->flops, 2.0 * rows * n * k);
  EXPECT_EQ(weight->bytes,
            4.0 * rows * (n + k) + 2 * 4.0 * 2 * n * k);  // A, B; two groups' C read and written
  EXPECT_EQ(moved->bytes, 8.0 * 3 * k + 4 * 3);           // three rows read and written, their indices
}

// The Vision Transformer's ops: LayerNorm, GELU (named by kind) and bias rows count the bytes each pass
// moves.
TEST(Profiler, CountsLayerNormGeluAndBias) {
  ProfileGuard guard;
  const int64_t rows = 3, dim = 8;
  const auto x = testing::random_floats(rows * dim, 9), w = testing::random_floats(dim, 10);
  std::vector<float> y(rows * dim), mean(rows), rstd(rows), dweight(dim), dbias(dim);
  ops::LayerNormParams norm;
  norm.rows = rows, norm.dim = dim, norm.x = x.data(), norm.weight = w.data(), norm.bias = w.data();
  norm.y = y.data(), norm.mean = mean.data(), norm.rstd = rstd.data(), norm.dy = x.data();
  norm.dweight = dweight.data(), norm.dbias = dbias.data();
  ops::GeluParams gelu;
  gelu.n = rows * dim, gelu.kind = ops::GeluKind::tanh, gelu.x = x.data(), gelu.out = y.data();
  ops::BiasParams bias;
  bias.rows = rows, bias.n = dim, bias.y = y.data(), bias.bias = w.data(), bias.dy = x.data();
  bias.dbias = dbias.data();
  ops::profile_begin(Device::cpu);
  ops::layernorm_forward(norm);
  ops::layernorm_backward_weight(norm);
  ops::gelu_forward(gelu);
  ops::bias_add(bias);
  ops::bias_backward(bias);
  const ops::OpProfile profile = ops::profile_end();
  const ops::OpProfileRow* forward = find_row(profile, "layernorm_forward", "3x8");
  const ops::OpProfileRow* weight = find_row(profile, "layernorm_backward_weight", "3x8 +bias");
  const ops::OpProfileRow* activation = find_row(profile, "gelu_forward", "n=24 gelu_pytorch_tanh");
  const ops::OpProfileRow* add = find_row(profile, "bias_add", "3x8");
  const ops::OpProfileRow* reduce = find_row(profile, "bias_backward", "3x8");
  ASSERT_TRUE(forward && weight && activation && add && reduce) << ops::format_profile(profile);
  EXPECT_EQ(forward->bytes, 8.0 * rows * dim);
  EXPECT_EQ(weight->bytes, 8.0 * rows * dim);
  EXPECT_EQ(activation->bytes, 8.0 * rows * dim);
  EXPECT_EQ(add->bytes, 8.0 * rows * dim);
  EXPECT_EQ(reduce->bytes, 4.0 * rows * dim);
}

TEST(Profiler, FormatsATableAndJson) {
  ProfileGuard guard;
  const auto x = testing::random_floats(1000, 8);
  ops::profile_begin(Device::cpu);
  for (int i = 0; i < 4; ++i) ops::amax(x.data(), 1000);
  const ops::OpProfile profile = ops::profile_end();
  const std::string table = ops::format_profile(profile, 2, 0.0);
  EXPECT_NE(table.find("op profile (cpu, 2 steps)"), std::string::npos) << table;
  EXPECT_NE(table.find("amax"), std::string::npos) << table;
  EXPECT_NE(table.find("n=1000"), std::string::npos) << table;
  EXPECT_NE(table.find("unattributed"), std::string::npos) << table;
  // A share threshold above every row folds them into one line.
  EXPECT_NE(ops::format_profile(profile, 1, 2.0).find("1 smaller rows"), std::string::npos);

  const nlohmann::json j = nlohmann::json::parse(ops::profile_json(profile, 2));
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["steps"], 2);
  ASSERT_EQ(j["rows"].size(), 1u);
  EXPECT_EQ(j["rows"][0]["op"], "amax");
  EXPECT_EQ(j["rows"][0]["calls"], 2);  // per step
  EXPECT_DOUBLE_EQ(j["rows"][0]["bytes"].get<double>(), 2 * 4000.0);
  EXPECT_DOUBLE_EQ(j["wall_seconds"].get<double>(), profile.wall_seconds / 2);
}

TEST(Profiler, AnOpThatFailsIsCountedAndTheProfileStaysUsable) {
  ProfileGuard guard;
  ops::profile_begin(Device::cpu);
  ops::GemmParams bad;
  bad.m = bad.n = bad.k = 1;
  bad.c_dtype = DType::bf16;  // bf16 output with fp32 operands: refused
  EXPECT_THROW(ops::gemm(bad), Error);
  const auto x = testing::random_floats(10, 9);
  EXPECT_EQ(ops::amax(x.data(), 0), 0.0f);
  const ops::OpProfile profile = ops::profile_end();
  const ops::OpProfileRow* row = find_row(profile, "gemm", "fp32 NN 1x1x1 -> bf16");
  ASSERT_TRUE(row) << ops::format_profile(profile);
  EXPECT_EQ(row->calls, 1);
  EXPECT_TRUE(find_row(profile, "amax", "n=0"));
}

// On a device, memsets and copies through its memory interface are rows too (here the device emulation's,
// which the profile wraps and then puts back).
TEST(Profiler, DeviceMemsetsAndCopiesAreRows) {
  ProfileGuard guard;
  EmulatedDevice emulation;
  const DeviceMemory* before = &device_memory(Device::cuda);
  std::vector<float> host(256, 1.0f);
  ops::profile_begin(Device::cuda);
  {
    Tensor d = Tensor::zeros({256}, DType::f32, Device::cuda);
    device_memory(Device::cuda).copy(d.raw(), Device::cuda, host.data(), Device::cpu, 1024);
    device_memory(Device::cuda).copy(host.data(), Device::cpu, d.raw(), Device::cuda, 1024);
    ops::scale_inplace(d.f32(), 2.0f, 256, Device::cuda);
  }
  const ops::OpProfile profile = ops::profile_end();
  EXPECT_EQ(&device_memory(Device::cuda), before);
  const ops::OpProfileRow* memset = find_row(profile, "memset", "device");
  const ops::OpProfileRow* up = find_row(profile, "copy", "host -> device");
  const ops::OpProfileRow* down = find_row(profile, "copy", "device -> host");
  ASSERT_TRUE(memset && up && down && find_row(profile, "scale_inplace", "n=256"))
      << ops::format_profile(profile);
  EXPECT_EQ(memset->bytes, 1024);
  EXPECT_EQ(up->calls, 1);
  EXPECT_EQ(down->bytes, 1024);
}

TEST(Profiler, MisuseIsOneLine) {
  ProfileGuard guard;
  EXPECT_EQ(error_of([] { ops::profile_end(); }), "op profile: profile_end without profile_begin");
  ops::profile_begin(Device::cpu);
  EXPECT_EQ(error_of([] { ops::profile_begin(Device::cpu); }),
            "op profile: one is already open (profile_end closes it)");
  const ops::OpProfile profile = ops::profile_end();
  EXPECT_TRUE(profile.rows.empty());
  EXPECT_EQ(error_of([] { ops::format_profile(ops::OpProfile{}, 0); }),
            "format_profile: steps must be positive, got 0");
}

}  // namespace
}  // namespace forge::profiler_test
