// Mixture-of-experts GEMMs: the grouped GEMMs (ops::m_grouped_gemm, k_grouped_gemm) an MoE layer runs over
// its expert-sorted tokens, beside ONE dense GEMM of the same FLOPs in the same run (the peer: the grouped
// GEMM cannot beat the dense one; the ratio says what splitting the rows into experts costs). Shapes: 2048
// tokens, top-k 4 of E experts, hidden 512, expert width 256 (a ~50M-parameter DeepSeek-V3-shaped layer's
// proportions), routed evenly (every expert the same rows) or skewed (expert e gets weight ~1/(e+1), several
// near-empty). Reported as GFLOP/s over wall time (oneDNN is multi-threaded).
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"

namespace forge {
namespace {

constexpr int64_t kTokens = 2048, kTopK = 4, kHidden = 512, kFfn = 256;

enum Pass : int64_t { forward_gate_up, input_grad_down, weight_grad_gate_up };

// Row offsets of R = tokens * top_k sorted rows over `experts` groups, even or skewed (harmonic weights).
std::vector<int64_t> offsets_for(int64_t experts, bool skewed) {
  const int64_t rows = kTokens * kTopK;
  std::vector<double> share(experts, 1.0);
  if (skewed)
    for (int64_t e = 0; e < experts; ++e) share[e] = 1.0 / static_cast<double>(e + 1);
  double total = 0;
  for (double s : share) total += s;
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e)
    offsets[e + 1] =
        e + 1 == experts ? rows : offsets[e] + static_cast<int64_t>(std::floor(rows * share[e] / total));
  return offsets;
}

struct Problem {
  int64_t m, n, k;  // the dense GEMM of the same FLOPs: [m, k] x [k, n]
};

// Arguments: experts, pass, skewed (0/1), bf16 (0/1), grouped (0 = the dense peer, 1 = grouped).
void BM_MoeGemm(benchmark::State& state) {
  const int64_t experts = state.range(0);
  const auto pass = static_cast<Pass>(state.range(1));
  const bool skewed = state.range(2) != 0, grouped = state.range(4) != 0;
  const DType dtype = state.range(3) ? DType::bf16 : DType::f32;
  const std::vector<int64_t> offsets = offsets_for(experts, skewed);
  const int64_t rows = offsets.back();
  // Per pass: what the GEMM multiplies (C = A op(B)), and the per-expert weight it reads or writes.
  const Problem dense = pass == forward_gate_up   ? Problem{rows, 2 * kFfn, kHidden}
                        : pass == input_grad_down ? Problem{rows, kFfn, kHidden}
                                                  : Problem{2 * kFfn, kHidden, rows};
  const size_t weight = static_cast<size_t>(experts) * 2 * kFfn * kHidden;
  std::vector<float> a(rows * 2 * kFfn + rows * kHidden, 0.5f), b(weight + rows * kHidden, 0.25f);
  std::vector<float> c(std::max<size_t>(weight, static_cast<size_t>(rows) * 2 * kFfn), 0.0f);
  std::vector<uint16_t> a16(a.size(), f32_to_bf16_bits(0.5f)), b16(b.size(), f32_to_bf16_bits(0.25f));
  const void* pa = dtype == DType::bf16 ? static_cast<const void*>(a16.data()) : a.data();
  const void* pb = dtype == DType::bf16 ? static_cast<const void*>(b16.data()) : b.data();

  ops::GemmParams g;  // the dense peer
  ops::GroupedGemmParams p;
  p.groups = experts, p.offsets = offsets.data(), p.ab_dtype = dtype, p.a = pa, p.b = pb, p.c = c.data();
  g.ab_dtype = dtype, g.a = pa, g.b = pb, g.c = c.data(), g.m = dense.m, g.n = dense.n, g.k = dense.k;
  if (pass == forward_gate_up) {  // y = x W_g^T: W_g [2 ffn, hidden]
    p.n = 2 * kFfn, p.k = kHidden, p.lda = kHidden, p.ldb = kHidden, p.trans_b = true;
    p.b_group_stride = 2 * kFfn * kHidden, p.ldc = 2 * kFfn;
    g.lda = kHidden, g.ldb = kHidden, g.trans_b = true, g.ldc = 2 * kFfn;
  } else if (pass ==
             input_grad_down) {  // dact = dy W_down_g: W_g [hidden, ffn] read as [k = hidden, n = ffn]
    p.n = kFfn, p.k = kHidden, p.lda = kHidden, p.ldb = kFfn, p.b_group_stride = kHidden * kFfn, p.ldc = kFfn;
    g.lda = kHidden, g.ldb = kFfn, g.ldc = kFfn;
  } else {  // dW_g [2 ffn, hidden] += dy_g^T x_g
    p.m = 2 * kFfn, p.n = kHidden, p.lda = 2 * kFfn, p.ldb = kHidden, p.ldc = kHidden;
    p.c_group_stride = 2 * kFfn * kHidden, p.beta = 1.0f;
    g.lda = 2 * kFfn, g.trans_a = true, g.ldb = kHidden, g.ldc = kHidden, g.beta = 1.0f;
  }
  auto run = [&] {
    if (!grouped)
      ops::gemm(g);
    else if (pass == weight_grad_gate_up)
      ops::k_grouped_gemm(p);
    else
      ops::m_grouped_gemm(p);
  };
  run();  // oneDNN primitives are created once per shape: keep that out of the timing
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  const double flops =
      2.0 * static_cast<double>(dense.m) * static_cast<double>(dense.n) * static_cast<double>(dense.k);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  static const char* kPassNames[] = {"fwd gate_up (nt)", "dgrad down (nn)", "wgrad gate_up (tn)"};
  state.SetLabel(std::string(grouped ? "grouped " : "dense   ") + kPassNames[pass] +
                 (skewed ? " skewed" : " even") + (dtype == DType::bf16 ? " bf16" : " fp32"));
}

void moe_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"E", "pass", "skewed", "bf16", "grouped"});
  for (int64_t bf16 : {0, 1})
    for (int64_t experts : {16, 64})
      for (int64_t pass : {forward_gate_up, input_grad_down, weight_grad_gate_up})
        for (int64_t skewed : {0, 1})
          for (int64_t grouped : {0, 1}) {
            if (!grouped && skewed) continue;  // the dense peer does not depend on the routing
            b->Args({experts, pass, skewed, bf16, grouped});
          }
}

BENCHMARK(BM_MoeGemm)->Apply(moe_shapes)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace forge
