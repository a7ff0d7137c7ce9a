// The output projection fused with chunked softmax cross-entropy (ops::linear_cross_entropy_forward /
// _backward), written once for every backend (op_harness.h): fp32 and bf16 GEMM operands, ragged rows, dim
// and vocabulary (vocabularies that chunks do not divide, chunks wider than the vocabulary, chunk widths that
// are and are not multiples of the CUDA kernels' float4 groups), ignored rows (targets -100 and -1), a
// vocabulary-parallel range with padding columns, grad_scale != 1 and dweight accumulated onto nonzero
// values. Outputs: lse, loss, target_logit, max_logit, dhidden, dweight; the workspace must not be written
// outside its advertised size (guard values after it, and before it when it starts off its allocation's
// alignment).
//
// On the CPU against the double-precision reference below (fp32: relative errors, and gradients by finite
// differences on the small cases; bf16: the scale-free dissimilarity against the reference on the unrounded
// fp32 operands). Elsewhere against the CPU kernel on the same inputs, within bounds from the arithmetic,
// per element, in double on the host, with u = 2^-24:
//   logits   both backends run fp32-accumulating GEMMs of length dim in different orders (bf16 products are
//            exact in fp32); as in op_tests/gemm.h each side errs by at most 2 (dim + 8) u of A = sum_k |h w|
//            (tensor cores may truncate), so the logits differ by E = 4 (dim + 8) u A.
//   max_logit  the max over the real columns: 1-Lipschitz (max norm), so within max E of the row; -inf
//            (bitwise) for a range of padding only. On the CPU against the exact max of the operands' logits,
//            within one side's GEMM bound; on every backend, with keep_logits, bitwise the largest of its own
//            kept logits.
//   lse      a 1-Lipschitz function of the logits (max norm), so the GEMMs contribute max E; each side's
//            online softmax adds at most R u (R real columns summed in some order), ~4u per exponential,
//            u |x| for each rounded argument x = logit - max (|x| <= 2 max|logit|) and the same again for
//            each chunk's rescaling, and the final log and addition: the bound below takes twice a generous
//            sum of these.
//   dlogits  d = (exp(l - lse) - onehot) s: both sides' exponentials lie within a factor e^delta of
//            p = exp(L - lse) (L the exact logit), delta = E + (lse difference) + argument roundings + 8u,
//            so they differ by at most 2 s p sinh(delta), plus a rounding of s and of the one-hot
//            subtraction. Under bf16 each side then rounds its d to bf16 (2^-9 relative each), so the two
//            can differ by a further 2^-8 |d|.
//   dhidden, dweight  the dlogits differences carried through |W| (|h|), plus each side's GEMM rounding,
//            2 (chain + 8) u of sum |d| |W| (|h|) with chain = vocab + chunks along the vocabulary (chunks
//            accumulate through beta = 1) and rows for dweight, where the initial dweight adds to the
//            magnitude.
// Where both sides are exact (ignored rows, out-of-range targets, padding, a range of padding only) the
// bound is 0 and the values must be bitwise equal (the comparison accepts bitwise-equal values first, so
// -inf matches -inf). Runs on every backend must be bitwise repeatable.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::linear_cross_entropy {

using testing::DeviceArray;
using testing::kU;

constexpr int64_t kGuard = 64;  // floats after (and, when offset, before) the workspace that must stay intact
constexpr float kGuardValue = -12345.0f;
constexpr float kUnwritten = 7.0f;  // initial value of outputs a failing call must leave alone

struct Case {
  const char* label;
  int64_t rows, dim, vocab, chunk;
  DType dtype;
  int64_t vocab_start = 0, global_vocab = 0;
  float grad_scale = 1.0f;
  bool optional_outputs = true;  // target_logit and max_logit asked for
  float spread = 1.0f;           // hidden and weight uniform in [-spread, spread]
  float softcap = 0.0f;          // > 0: logits capped to softcap * tanh(z / softcap) (Gemma 2)
  std::string name() const { return label; }
};

inline const std::vector<Case> kCases = {
    // label, rows, dim, vocab, chunk, dtype, vocab_start, global_vocab, grad_scale, optional_outputs, spread
    // Small shapes (every one also checked by finite differences on the CPU): chunk widths not dividing the
    // vocabulary, exactly the vocabulary, and wider than it.
    {"f32_small_chunk8", 9, 16, 37, 8, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_small_chunk37", 9, 16, 37, 37, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_small_chunk64", 9, 16, 37, 64, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_tiny_chunk8", 5, 6, 37, 8, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_tiny_chunk37", 5, 6, 37, 37, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_tiny_chunk64", 5, 6, 37, 64, DType::f32, 0, 0, 0.25f, true, 1.5f},
    // bf16 operands (and bf16 dlogits in backward).
    {"bf16_square", 64, 64, 300, 128, DType::bf16, 0, 0, 0.25f, true, 1.5f},
    // Chunks that do not divide the vocabulary and one whole-vocabulary chunk (with keep_logits too).
    {"f32_chunk37", 64, 48, 300, 37, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"f32_chunk300", 64, 48, 300, 300, DType::f32, 0, 0, 0.25f, true, 1.5f},
    {"bf16_chunk37", 64, 48, 300, 37, DType::bf16, 0, 0, 0.25f, true, 1.5f},
    {"bf16_chunk300", 64, 48, 300, 300, DType::bf16, 0, 0, 0.25f, true, 1.5f},
    // Chunks of 128, 128, 45: vector loads, then a ragged width on the scalar path. No target_logit or
    // max_logit output.
    {"f32_ragged", 37, 72, 301, 128, DType::f32, 0, 0, 0.37f, false},
    {"bf16_ragged", 37, 72, 301, 128, DType::bf16, 0, 0, 0.37f},
    // One chunk, odd width and odd dim.
    {"f32_chunk_wider_than_vocab", 19, 37, 333, 512, DType::f32, 0, 0, 1.0f},
    // Odd chunk widths (37) then a last chunk of 4 columns whose bf16 rows are not 8-byte aligned.
    {"bf16_odd_chunk", 21, 50, 300, 37, DType::bf16, 0, 0, 2.0f},
    // Widths that are multiples of 4 throughout (256, 256, 256, 232): float4 loads and stores, bf16 in uint2.
    {"f32_vector_width", 45, 96, 1000, 256, DType::f32, 0, 0, 0.5f},
    {"bf16_vector_width", 45, 96, 1000, 256, DType::bf16, 0, 0, 0.5f},
    // 8192-wide chunks (256 threads per row, several unrolled passes), then 808.
    {"f32_wide_chunk", 6, 32, 9000, 8192, DType::f32, 0, 0, 1.0f},
    // 40000 columns in one chunk: 1024 threads per row; odd width on the scalar path.
    {"f32_thousand_threads", 4, 24, 40000, 65536, DType::f32, 0, 0, 1.0f},
    {"bf16_thousand_threads_odd", 4, 24, 40003, 65536, DType::bf16, 0, 0, 1.0f},
    // Range [300, 800) of a 650-token vocabulary: chunks of 128, 128, then 128 with 94 real columns; the
    // last chunk is all padding and skipped. Targets inside and outside the range.
    {"f32_vocab_range", 33, 64, 500, 128, DType::f32, 300, 650, 0.5f},
    {"bf16_vocab_range", 33, 64, 500, 128, DType::bf16, 300, 650, 1.5f},
    // A range of padding only: lse -inf, no gradient, dhidden zero.
    {"f32_range_all_padding", 9, 16, 40, 16, DType::f32, 700, 650, 1.0f},
};

// Logit soft-capping (CPU only: the CUDA kernel refuses it). Caps that bend most logits (they reach about
// +-10 at spread 1.5 and dim 16..72): small shapes for finite differences, bf16, a vocabulary range.
inline const std::vector<Case> kSoftcapCases = {
    {"f32_small_cap2", 9, 16, 37, 8, DType::f32, 0, 0, 0.25f, true, 1.5f, 2.0f},
    {"f32_tiny_cap5", 5, 6, 37, 64, DType::f32, 0, 0, 0.25f, true, 1.5f, 5.0f},
    {"f32_chunk37_cap3", 64, 48, 300, 37, DType::f32, 0, 0, 0.25f, true, 1.5f, 3.0f},
    {"bf16_chunk37_cap30", 64, 48, 300, 37, DType::bf16, 0, 0, 0.25f, true, 1.5f, 30.0f},
    {"f32_vocab_range_cap4", 33, 64, 500, 128, DType::f32, 300, 650, 0.5f, true, 1.0f, 4.0f},
};

// The all-vector-width shapes, with a workspace one float past 16-byte alignment: the CUDA row kernels take
// their scalar paths (same groups, same order) and must still agree with the CPU.
inline const std::vector<Case> kMisalignedWorkspaceCases = {
    {"f32_vector_width", 45, 96, 1000, 256, DType::f32, 0, 0, 0.5f},
    {"bf16_vector_width", 45, 96, 1000, 256, DType::bf16, 0, 0, 0.5f},
};

struct Problem {
  Case c;
  std::vector<float> hidden, weight;          // the GEMM operands' exact values (bf16-rounded under bf16)
  std::vector<float> hidden_f32, weight_f32;  // before any rounding
  std::vector<uint16_t> hidden16, weight16;
  std::vector<int32_t> targets;  // global ids; negative = ignored
  std::vector<float> dweight0;   // backward accumulates onto this
  bool keep_logits = false;      // forward's logits kept for backward (LinearCrossEntropyParams::keep_logits)

  int64_t global_vocab() const { return c.global_vocab > 0 ? c.global_vocab : c.vocab_start + c.vocab; }
  int64_t chunk_width() const { return std::min(c.chunk, c.vocab); }
  // Local columns [0, real_columns()) are real tokens; the rest of the range is padding.
  int64_t real_columns() const { return std::clamp<int64_t>(global_vocab() - c.vocab_start, 0, c.vocab); }
  int64_t chunks() const { return (real_columns() + chunk_width() - 1) / chunk_width(); }
  bool bf16() const { return c.dtype == DType::bf16; }
  bool vocabulary_parallel() const { return c.vocab_start > 0 || c.global_vocab > 0; }

  // Sizes and scalars; the caller fills in the pointers.
  ops::LinearCrossEntropyParams params() const {
    ops::LinearCrossEntropyParams p;
    p.rows = c.rows, p.dim = c.dim, p.vocab = c.vocab, p.vocab_chunk = c.chunk, p.gemm_dtype = c.dtype;
    p.vocab_start = c.vocab_start, p.global_vocab = c.global_vocab, p.grad_scale = c.grad_scale;
    p.keep_logits = keep_logits;
    p.softcap = c.softcap;
    return p;
  }
};

inline Problem make_problem(const Case& c, uint32_t seed) {
  Problem pr;
  pr.c = c;
  // Logits of standard deviation spread sqrt(dim) / 3: a softmax neither flat nor one-hot.
  pr.hidden = testing::random_floats(c.rows * c.dim, seed, -c.spread, c.spread);
  pr.weight = testing::random_floats(c.vocab * c.dim, seed + 1, -c.spread, c.spread);
  pr.hidden_f32 = pr.hidden, pr.weight_f32 = pr.weight;
  if (pr.bf16()) {
    pr.hidden16.resize(pr.hidden.size()), pr.weight16.resize(pr.weight.size());
    for (size_t i = 0; i < pr.hidden.size(); ++i)
      pr.hidden16[i] = f32_to_bf16_bits(pr.hidden[i]), pr.hidden[i] = bf16_bits_to_f32(pr.hidden16[i]);
    for (size_t i = 0; i < pr.weight.size(); ++i)
      pr.weight16[i] = f32_to_bf16_bits(pr.weight[i]), pr.weight[i] = bf16_bits_to_f32(pr.weight16[i]);
  }
  pr.dweight0 = testing::random_floats(c.vocab * c.dim, seed + 2, -0.5f, 0.5f);
  const int64_t global_vocab = pr.global_vocab(), real = pr.real_columns();
  pr.targets.resize(c.rows);
  for (int64_t r = 0; r < c.rows; ++r)
    pr.targets[r] = r % 7 == 3 ? -100 : r % 11 == 5 ? -1 : static_cast<int32_t>((r * 37 + 11) % global_vocab);
  if (real > 0) {
    pr.targets[0] = static_cast<int32_t>(c.vocab_start);                      // first column of the range
    pr.targets[c.rows - 1] = static_cast<int32_t>(c.vocab_start + real - 1);  // last real column
  }
  if (c.rows > 3 && c.rows < 7) pr.targets[1] = -100, pr.targets[3] = -1;  // both kinds of ignored row
  return pr;
}

struct Outputs {
  std::vector<float> lse, loss, target_logit, max_logit, dhidden, dweight;
  std::vector<float> kept_logits;  // with keep_logits: the workspace's logits area after forward
};

// Forward, then backward, on `on`. Backward reads backward_lse when given (a vocabulary-parallel caller
// passes the global lse), else the forward's own lse. The workspace starts `workspace_offset` floats into its
// allocation, between guard values, which must come back intact; dhidden starts as NaN (backward must
// overwrite it).
inline Outputs run(Device on, const Problem& pr, const std::vector<float>* backward_lse,
                   int64_t workspace_offset = 0) {
  const Case& c = pr.c;
  ops::LinearCrossEntropyParams p = pr.params();
  const int64_t workspace_floats = ops::linear_cross_entropy_workspace_floats(p);
  DeviceArray<float> hidden(on, pr.bf16() ? std::vector<float>{} : pr.hidden),
      weight(on, pr.bf16() ? std::vector<float>{} : pr.weight);
  DeviceArray<uint16_t> hidden16(on, pr.hidden16), weight16(on, pr.weight16);
  DeviceArray<int32_t> targets(on, pr.targets);
  DeviceArray<float> lse(on, std::vector<float>(c.rows, kUnwritten)),
      loss(on, std::vector<float>(c.rows, kUnwritten)),
      target_logit(on, std::vector<float>(c.rows, kUnwritten)),
      max_logit(on, std::vector<float>(c.rows, kUnwritten)),
      dhidden(on, std::vector<float>(c.rows * c.dim, std::numeric_limits<float>::quiet_NaN())),
      dweight(on, pr.dweight0),
      workspace(on, std::vector<float>(workspace_offset + workspace_floats + kGuard, kGuardValue));
  p.hidden_gemm = pr.bf16() ? static_cast<const void*>(hidden16.data()) : hidden.data();
  p.weight_gemm = pr.bf16() ? static_cast<const void*>(weight16.data()) : weight.data();
  p.targets = targets.data(), p.lse = lse.data(), p.loss = loss.data();
  p.target_logit = c.optional_outputs ? target_logit.data() : nullptr;
  p.max_logit = c.optional_outputs ? max_logit.data() : nullptr;
  p.dhidden = dhidden.data(), p.dweight = dweight.data(), p.workspace = workspace.data() + workspace_offset;
  FORGE_TEST_OP(linear_cross_entropy_forward, on, p);
  Outputs out;
  out.lse = lse.download();
  if (pr.keep_logits) {
    const std::vector<float> all = workspace.download();
    const auto begin = all.begin() + workspace_offset;
    out.kept_logits.assign(begin, begin + ops::linear_cross_entropy_logits_floats(p));
  }
  DeviceArray<float> lse_in(on, backward_lse ? *backward_lse : std::vector<float>{});
  if (backward_lse) p.lse = lse_in.data();
  FORGE_TEST_OP(linear_cross_entropy_backward, on, p);
  out.loss = loss.download(), out.target_logit = target_logit.download();
  out.max_logit = max_logit.download();
  out.dhidden = dhidden.download(), out.dweight = dweight.download();
  const std::vector<float> all = workspace.download();
  size_t bad = 0;
  for (int64_t i = 0; i < workspace_offset; ++i)
    bad += std::bit_cast<uint32_t>(all[i]) != std::bit_cast<uint32_t>(kGuardValue);
  for (size_t i = workspace_offset + workspace_floats; i < all.size(); ++i)
    bad += std::bit_cast<uint32_t>(all[i]) != std::bit_cast<uint32_t>(kGuardValue);
  EXPECT_EQ(bad, 0u) << c.label << ": the kernels wrote outside the workspace";
  return out;
}

// A vocabulary-parallel caller's global lse: this range's lse plus the other ranges' mass (here a made-up
// log(1 + e^0.75)-ish shift); a range of padding only has none of its own.
inline std::vector<float> global_lse(const Outputs& forward) {
  std::vector<float> lse(forward.lse.size());
  for (size_t r = 0; r < lse.size(); ++r)
    lse[r] = std::isfinite(forward.lse[r]) ? forward.lse[r] + 0.75f : 3.5f;
  return lse;
}

// ---------------------------------------------------------------------------------------------------------------
// The double-precision reference

struct Reference {
  std::vector<double> lse, loss, target_logit, dhidden, dweight;  // dweight: the increment
};

// Logits = h @ W^T over the range's real columns, softmax cross-entropy and its gradients, in double, as
// ops.h defines them: lse over the real columns (-inf for none), target logit 0 where the target lies outside
// the range, dlogits (softmax against backward_lse, else the own lse, minus the one-hot) * grad_scale.
inline Reference reference(const Problem& pr, const std::vector<double>& h, const std::vector<double>& w,
                           const std::vector<float>* backward_lse) {
  const Case& c = pr.c;
  const int64_t rows = c.rows, dim = c.dim, real = pr.real_columns();
  const double s = c.grad_scale;
  Reference ref;
  ref.lse.assign(rows, 0), ref.loss.assign(rows, 0), ref.target_logit.assign(rows, 0);
  ref.dhidden.assign(rows * dim, 0), ref.dweight.assign(c.vocab * dim, 0);
  std::vector<double> logits(real);
  for (int64_t r = 0; r < rows; ++r) {
    double max = -INFINITY;
    for (int64_t v = 0; v < real; ++v) {
      double sum = 0;
      for (int64_t k = 0; k < dim; ++k) sum += h[r * dim + k] * w[v * dim + k];
      if (c.softcap > 0) sum = c.softcap * std::tanh(sum / c.softcap);
      logits[v] = sum, max = std::max(max, sum);
    }
    double sum = 0;
    for (int64_t v = 0; v < real; ++v) sum += std::exp(logits[v] - max);
    ref.lse[r] = real > 0 ? max + std::log(sum) : -INFINITY;
    const int64_t target = pr.targets[r], column = target - c.vocab_start;
    const bool in_range = target >= 0 && column >= 0 && column < real;
    if (in_range) ref.target_logit[r] = logits[column];
    if (target < 0) continue;
    ref.loss[r] = ref.lse[r] - ref.target_logit[r];
    const double lse_in = backward_lse ? double{(*backward_lse)[r]} : ref.lse[r];
    for (int64_t v = 0; v < real; ++v) {
      double d = (std::exp(logits[v] - lse_in) - (in_range && v == column ? 1.0 : 0.0)) * s;
      if (c.softcap > 0) d *= 1 - (logits[v] / c.softcap) * (logits[v] / c.softcap);
      for (int64_t k = 0; k < dim; ++k) {
        ref.dhidden[r * dim + k] += d * w[v * dim + k];
        ref.dweight[v * dim + k] += d * h[r * dim + k];
      }
    }
  }
  return ref;
}

inline double total_loss(const Reference& ref, double grad_scale) {
  double s = 0;
  for (double l : ref.loss) s += l;
  return s * grad_scale;
}

// max |got - want| / max |want| over the elements whose reference is finite; where it is not, got must be it.
inline double relative_error_of_finite(const std::vector<float>& got, const std::vector<double>& want,
                                       const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  std::vector<float> g;
  std::vector<double> w;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isfinite(want[i])) {
      g.push_back(got[i]), w.push_back(want[i]);
    } else {
      EXPECT_EQ(double{got[i]}, want[i]) << what << " [" << i << "]";
    }
  }
  return g.empty() ? 0.0 : testing::relative_error(g, w);
}

inline std::vector<float> increment(const std::vector<float>& after, const std::vector<float>& before) {
  std::vector<float> delta(after.size());
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = after[i] - before[i];
  return delta;
}

// max_logit against the exact max of the real columns' logits of the GEMM operands (bf16-rounded under bf16,
// whose products fp32 holds exactly), within one side's GEMM bound 2 (dim + 8) u sum_k |h w| of the row's
// largest such sum; -inf (bitwise) for a range of padding only.
inline void expect_max_logit_exact(const Problem& pr, const std::vector<float>& got,
                                   const std::string& what) {
  const Case& c = pr.c;
  const int64_t real = pr.real_columns();
  std::vector<double> want(c.rows, -INFINITY), bound(c.rows, 0);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t v = 0; v < real; ++v) {
      double sum = 0, magnitude = 0;
      for (int64_t k = 0; k < c.dim; ++k) {
        const double product = double{pr.hidden[r * c.dim + k]} * pr.weight[v * c.dim + k];
        sum += product, magnitude += std::abs(product);
      }
      // Capping is monotone and 1-Lipschitz: the capped max within the same bound, plus tanh's roundings.
      if (c.softcap > 0) sum = c.softcap * std::tanh(sum / c.softcap), magnitude += 4 * c.softcap;
      want[r] = std::max(want[r], sum), bound[r] = std::max(bound[r], 2 * (c.dim + 8) * kU * magnitude);
    }
  const std::vector<float> want_f32(want.begin(), want.end());
  testing::expect_all(got, want_f32, what + " max_logit vs the exact max", [&](size_t r) {
    return double{got[r]} == want[r] || std::abs(double{got[r]} - want[r]) <= bound[r];
  });
}

// With keep_logits every real chunk's logits stay in the workspace after forward: max_logit is bitwise the
// largest of the row's real columns there, on every backend.
inline void expect_max_logit_is_the_kept_max(const Problem& pr, const Outputs& out, const std::string& what) {
  const Case& c = pr.c;
  const ops::LinearCrossEntropyParams p = pr.params();
  const int64_t real = pr.real_columns(), chunk = pr.chunk_width();
  std::vector<float> want(c.rows, -std::numeric_limits<float>::infinity());
  for (int64_t first = 0; first < real; first += chunk) {
    const int64_t width = std::min(chunk, c.vocab - first), columns = std::min(width, real - first);
    const float* block = out.kept_logits.data() + ops::linear_cross_entropy_chunk_offset(p, first);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < columns; ++j) want[r] = std::max(want[r], block[r * width + j]);
  }
  testing::expect_bitwise_equal(out.max_logit, want, what + " max_logit vs the kept logits' max");
}

// The CPU kernel's outputs against the reference. fp32: lse to 1e-6, loss, target_logit, dhidden and
// dweight's increment to 1e-5 (relative to each array's largest). bf16 against the reference on the unrounded
// fp32 operands, by the scale-free dissimilarity (bf16 keeps 8 significant bits; measured on the 64 x 64 x
// 300 case: loss 4.7e-7, dhidden 6.5e-6, dweight 6.9e-6, the thresholds leaving ~10x headroom), and the
// operands really were rounded: fp32 GEMMs land near 1e-14.
inline void expect_matches_reference(const Problem& pr, const Outputs& got,
                                     const std::vector<float>* backward_lse) {
  const Case& c = pr.c;
  if (c.optional_outputs) expect_max_logit_exact(pr, got.max_logit, c.name());
  const std::vector<float> delta = increment(got.dweight, pr.dweight0);
  if (!pr.bf16()) {
    const Reference ref =
        reference(pr, testing::to_double(pr.hidden), testing::to_double(pr.weight), backward_lse);
    EXPECT_LT(relative_error_of_finite(got.lse, ref.lse, c.name() + " lse"), 1e-6) << c.label;
    EXPECT_LT(relative_error_of_finite(got.loss, ref.loss, c.name() + " loss"), 1e-5) << c.label;
    if (c.optional_outputs) {
      EXPECT_LT(testing::relative_error(got.target_logit, ref.target_logit), 1e-5) << c.label;
    }
    EXPECT_LT(testing::relative_error(got.dhidden, ref.dhidden), 1e-5) << c.label;
    EXPECT_LT(testing::relative_error(delta, ref.dweight), 1e-5) << c.label;
    return;
  }
  const Reference ref =
      reference(pr, testing::to_double(pr.hidden_f32), testing::to_double(pr.weight_f32), backward_lse);
  const double loss = testing::dissimilarity(got.loss.data(), ref.loss.data(), got.loss.size());
  EXPECT_LT(loss, 5e-6) << c.label;
  EXPECT_LT(testing::dissimilarity(got.dhidden.data(), ref.dhidden.data(), got.dhidden.size()), 5e-5)
      << c.label;
  EXPECT_LT(testing::dissimilarity(delta.data(), ref.dweight.data(), delta.size()), 5e-5) << c.label;
  EXPECT_GT(loss, 1e-10) << c.label;
}

// ---------------------------------------------------------------------------------------------------------------
// Another backend against the CPU

struct Tolerances {
  std::vector<double> lse, loss, target_logit, max_logit, dhidden, dweight;
};

// The bounds of the header comment, per element. cpu holds the CPU's outputs; backward_lse is what both
// backends' backward read when shared (else each read its own forward lse, which differ by up to the lse
// tolerance).
inline Tolerances tolerances(const Problem& pr, const Outputs& cpu, const std::vector<float>* backward_lse) {
  const Case& c = pr.c;
  const int64_t rows = c.rows, dim = c.dim, real = pr.real_columns(), chunks = pr.chunks();
  const double s = std::abs(double{c.grad_scale});
  Tolerances t;
  t.lse.assign(rows, 0), t.loss.assign(rows, 0), t.target_logit.assign(rows, 0), t.max_logit.assign(rows, 0);
  t.dhidden.assign(rows * dim, 0), t.dweight.assign(c.vocab * dim, 0);
  // Exact logits of the real columns and their bound E.
  std::vector<double> logit(rows * real), logit_error(rows * real);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = 0; v < real; ++v) {
      double sum = 0, magnitude = 0;
      for (int64_t k = 0; k < dim; ++k) {
        const double product = double{pr.hidden[r * dim + k]} * pr.weight[v * dim + k];
        sum += product, magnitude += std::abs(product);
      }
      logit[r * real + v] = sum, logit_error[r * real + v] = 4 * (dim + 8) * kU * magnitude;
    }
  auto target_column = [&](int64_t r) {
    const int64_t column = int64_t{pr.targets[r]} - c.vocab_start;
    return pr.targets[r] >= 0 && column >= 0 && column < real ? column : int64_t{-1};
  };
  for (int64_t r = 0; r < rows && real > 0; ++r) {
    double max_error = 0, max_logit = 0;
    for (int64_t v = 0; v < real; ++v)
      max_error = std::max(max_error, logit_error[r * real + v]),
      max_logit = std::max(max_logit, std::abs(logit[r * real + v]));
    t.lse[r] =
        max_error + 2 * kU * (real + 8 * (chunks + 1) * (2 + 2 * max_logit)) + 4 * kU * std::abs(cpu.lse[r]);
    t.max_logit[r] = max_error;
    const int64_t column = target_column(r);
    t.target_logit[r] = column >= 0 ? logit_error[r * real + column] : 0.0;
    if (pr.targets[r] >= 0)
      t.loss[r] = t.lse[r] + t.target_logit[r] + 4 * kU * (std::abs(cpu.loss[r]) + std::abs(cpu.lse[r]));
  }
  // dlogits: the bound on the two sides' difference and on their magnitude.
  std::vector<double> d_error(rows * real, 0), d_magnitude(rows * real, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (pr.targets[r] < 0) continue;
    const double lse_in = backward_lse ? (*backward_lse)[r] : cpu.lse[r];
    const double lse_difference = backward_lse ? 0.0 : t.lse[r];
    const int64_t column = target_column(r);
    for (int64_t v = 0; v < real; ++v) {
      const double l = logit[r * real + v], p = std::exp(l - lse_in), onehot = v == column ? 1.0 : 0.0;
      const double delta =
          logit_error[r * real + v] + lse_difference + 4 * kU * (std::abs(l) + std::abs(lse_in) + 1) + 8 * kU;
      const double magnitude = s * (p * std::exp(delta) + onehot);
      double error = 1.01 * 2 * s * p * std::sinh(delta) + 2 * kU * magnitude +
                     2 * double{std::numeric_limits<float>::min()} * std::max(1.0, s);
      double bound_magnitude = magnitude + error;
      // bf16 dlogits: each side rounds to 8 significant bits (unit roundoff 2^-8), and where the two fp32
      // values straddle a rounding boundary they land one bf16 ulp apart: up to 2^-7 of the magnitude (an
      // H200 against the CPU came within 1% of that, past the 2^-8 this bound allowed before).
      if (pr.bf16()) error += std::ldexp(bound_magnitude, -7), bound_magnitude *= 1 + std::ldexp(1.0, -8);
      d_error[r * real + v] = error, d_magnitude[r * real + v] = bound_magnitude;
    }
  }
  const double dhidden_gamma = 4 * (c.vocab + chunks + 8) * kU, dweight_gamma = 4 * (rows + 8) * kU;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < dim; ++k) {
      double error = 0, magnitude = 0;
      for (int64_t v = 0; v < real; ++v) {
        const double w = std::abs(double{pr.weight[v * dim + k]});
        error += d_error[r * real + v] * w, magnitude += d_magnitude[r * real + v] * w;
      }
      t.dhidden[r * dim + k] = error + dhidden_gamma * magnitude;
    }
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t k = 0; k < dim; ++k) {
      double error = 0, magnitude = std::abs(double{pr.dweight0[v * dim + k]});
      for (int64_t r = 0; r < rows && v < real; ++r) {
        const double h = std::abs(double{pr.hidden[r * dim + k]});
        error += d_error[r * real + v] * h, magnitude += d_magnitude[r * real + v] * h;
      }
      t.dweight[v * dim + k] = error + dweight_gamma * magnitude;
    }
  return t;
}

// Bitwise equal, or within tolerance[i] when one is given (bitwise-equal values pass first: -inf matches
// -inf).
inline void expect_close(const std::vector<float>& got, const std::vector<float>& cpu,
                         const std::vector<double>* tolerance, const std::string& what) {
  const auto ok = [&](size_t i) {
    return std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(cpu[i]) ||
           (tolerance && std::abs(double{got[i]} - double{cpu[i]}) <= (*tolerance)[i]);
  };
  testing::expect_all(got, cpu, what + (tolerance ? "" : " (bitwise)"), ok);
  if (!tolerance || got.size() != cpu.size()) return;
  // How far past its bound the worst element is: a few percent says the bound is tight, orders of magnitude
  // a wrong result.
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!ok(i)) {
      const double excess = std::abs(double{got[i]} - double{cpu[i]}) / (*tolerance)[i];
      if (!(excess <= worst)) worst = excess, at = i;
    }
  if (worst > 0)
    ADD_FAILURE() << what << ": worst element " << at << " is " << worst << "x its bound " << (*tolerance)[at]
                  << " (got " << got[at] << ", cpu " << cpu[at] << ")";
}

inline void expect_match(const Outputs& got, const Outputs& cpu, const Tolerances& t,
                         const std::string& what) {
  expect_close(got.lse, cpu.lse, &t.lse, what + " lse");
  expect_close(got.loss, cpu.loss, &t.loss, what + " loss");
  expect_close(got.target_logit, cpu.target_logit, &t.target_logit, what + " target_logit");
  expect_close(got.max_logit, cpu.max_logit, &t.max_logit, what + " max_logit");
  expect_close(got.dhidden, cpu.dhidden, &t.dhidden, what + " dhidden");
  expect_close(got.dweight, cpu.dweight, &t.dweight, what + " dweight");
}

inline void expect_bitwise_equal(const Outputs& a, const Outputs& b, const std::string& what) {
  expect_close(a.lse, b.lse, nullptr, what + " lse");
  expect_close(a.loss, b.loss, nullptr, what + " loss");
  expect_close(a.target_logit, b.target_logit, nullptr, what + " target_logit");
  expect_close(a.max_logit, b.max_logit, nullptr, what + " max_logit");
  expect_close(a.dhidden, b.dhidden, nullptr, what + " dhidden");
  expect_close(a.dweight, b.dweight, nullptr, what + " dweight");
}

// ---------------------------------------------------------------------------------------------------------------
// The tests

class LinearCrossEntropyOp : public testing::OpTest<Case> {
 protected:
  // The case on this backend (the workspace `workspace_offset` floats off alignment): on the CPU against the
  // reference, elsewhere against the CPU; ignored rows have no loss and no gradient.
  void check(const Problem& pr, int64_t workspace_offset) {
    const Case& c = pr.c;
    const std::vector<float> lse_in =
        pr.vocabulary_parallel() ? global_lse(run(Device::cpu, pr, nullptr)) : std::vector<float>{};
    const std::vector<float>* backward_lse = pr.vocabulary_parallel() ? &lse_in : nullptr;
    const Outputs got = run(device(), pr, backward_lse, workspace_offset);
    if (on_cpu()) {
      expect_matches_reference(pr, got, backward_lse);
    } else {
      const Outputs cpu = run(Device::cpu, pr, backward_lse);
      expect_match(got, cpu, tolerances(pr, cpu, backward_lse),
                   c.name() + (workspace_offset ? " misaligned workspace" : ""));
    }
    // Ignored rows have no loss (also bitwise in the comparison above; this names the row) and no gradient.
    for (int64_t r = 0; r < c.rows; ++r)
      if (pr.targets[r] < 0) {
        EXPECT_EQ(got.loss[r], 0.0f) << c.label << " row " << r;
        for (int64_t k = 0; k < c.dim; ++k)
          EXPECT_EQ(got.dhidden[r * c.dim + k], 0.0f) << c.label << " row " << r;
      }
  }
};

TEST_P(LinearCrossEntropyOp, MatchesTheReference) {
  const Case& c = test_case();
  const Problem pr = make_problem(c, 17);
  check(pr, 0);
  if (!on_cpu() || pr.bf16() || pr.vocabulary_parallel() || (c.rows + c.vocab) * c.dim > 2000) return;
  // The gradients of the total loss grad_scale * sum loss by central differences on the double reference.
  const Outputs got = run(Device::cpu, pr, nullptr);
  const auto h = testing::to_double(pr.hidden), w = testing::to_double(pr.weight);
  const double scale = c.grad_scale;
  const auto dh_fd = testing::finite_difference(
      [&](const std::vector<double>& x) { return total_loss(reference(pr, x, w, nullptr), scale); }, h);
  const auto dw_fd = testing::finite_difference(
      [&](const std::vector<double>& x) { return total_loss(reference(pr, h, x, nullptr), scale); }, w);
  EXPECT_LT(testing::relative_error(got.dhidden, dh_fd), 1e-5);
  EXPECT_LT(testing::relative_error(increment(got.dweight, pr.dweight0), dw_fd), 1e-5);
}

TEST_P(LinearCrossEntropyOp, IsBitwiseRepeatable) {
  const Case& c = test_case();
  const Problem pr = make_problem(c, 23);
  const std::vector<float> lse_in(c.rows, 4.0f);  // any lse will do for repeatability
  const std::vector<float>* backward_lse = pr.vocabulary_parallel() ? &lse_in : nullptr;
  const Outputs first = run(device(), pr, backward_lse), second = run(device(), pr, backward_lse);
  expect_bitwise_equal(second, first, c.name() + " second run");
}

// Logits kept from forward for backward are the very values a recompute would produce (each chunk's block is
// as aligned as the workspace, so its GEMM is the same one, on the GPU the same cuBLASLt plan): every output
// is bitwise the recomputing run's, another backend agrees with the CPU as before, and the larger workspace
// is not overrun (run checks its guards).
TEST_P(LinearCrossEntropyOp, KeptLogitsGiveTheRecomputedResultsBitwise) {
  const Case& c = test_case();
  Problem pr = make_problem(c, 31);
  const std::vector<float> lse_in(c.rows, 4.0f);  // any lse will do: both runs read the same
  const std::vector<float>* backward_lse = pr.vocabulary_parallel() ? &lse_in : nullptr;
  const Outputs recompute = run(device(), pr, backward_lse);
  pr.keep_logits = true;
  const Outputs keep = run(device(), pr, backward_lse);
  expect_bitwise_equal(keep, recompute, c.name() + " keep_logits");
  if (c.optional_outputs) {
    expect_max_logit_is_the_kept_max(pr, keep, c.name() + " keep_logits");
    if (on_cpu()) expect_max_logit_exact(pr, keep.max_logit, c.name() + " keep_logits");
  }
  if (!on_cpu() && !pr.vocabulary_parallel()) {
    const Outputs cpu = run(Device::cpu, pr, nullptr);
    expect_match(keep, cpu, tolerances(pr, cpu, nullptr), c.name() + " keep_logits vs cpu");
  }
}

// Asking for target_logit and max_logit changes no other output's bits, with and without keep_logits.
TEST_P(LinearCrossEntropyOp, OptionalOutputsLeaveTheOthersBitwise) {
  const Case& c = test_case();
  if (!c.optional_outputs) GTEST_SKIP() << "the case asks for no optional output";
  Problem with = make_problem(c, 37);
  const std::vector<float> lse_in(c.rows, 4.0f);
  const std::vector<float>* backward_lse = with.vocabulary_parallel() ? &lse_in : nullptr;
  for (const bool keep : {false, true}) {
    with.keep_logits = keep;
    Problem without = with;
    without.c.optional_outputs = false;
    const Outputs a = run(device(), with, backward_lse), b = run(device(), without, backward_lse);
    const std::string what = c.name() + (keep ? " keep_logits" : "") + " without optional outputs";
    expect_close(b.lse, a.lse, nullptr, what + " lse");
    expect_close(b.loss, a.loss, nullptr, what + " loss");
    expect_close(b.dhidden, a.dhidden, nullptr, what + " dhidden");
    expect_close(b.dweight, a.dweight, nullptr, what + " dweight");
    expect_close(b.max_logit, std::vector<float>(c.rows, kUnwritten), nullptr, what + " max_logit untouched");
  }
}

class LinearCrossEntropyMisalignedWorkspace : public LinearCrossEntropyOp {};

TEST_P(LinearCrossEntropyMisalignedWorkspace, MatchesTheReference) {
  check(make_problem(test_case(), 29), 1);
}

class LinearCrossEntropyFixed : public testing::OpTest<testing::FixedCase> {};

// Targets at or past the global vocabulary fail on every backend, naming the op, the first bad row and the
// vocabulary, before anything is written.
TEST_P(LinearCrossEntropyFixed, RejectsTargetsOutsideTheVocabulary) {
  struct BadCase {
    Case c;
    int64_t row;
    int32_t target;
    int64_t later_row;
    int32_t later_target;
  };
  const std::vector<BadCase> cases = {
      {{"whole", 37, 24, 100, 32, DType::f32}, 5, 100, 20, 1 << 30},
      // In this rank's range [50, 150) but past the global vocabulary of 120.
      {{"range", 37, 24, 100, 32, DType::bf16, 50, 120}, 12, 120, 30, 125},
      {{"last_row", 37, 24, 100, 32, DType::f32}, 36, INT32_MAX, 36, INT32_MAX},
      {{"small", 4, 8, 20, 8, DType::f32}, 2, 20, 2, 20},
  };
  for (const BadCase& b : cases) {
    Problem pr = make_problem(b.c, 31);
    pr.targets[b.row] = b.target, pr.targets[b.later_row] = b.later_target;
    ops::LinearCrossEntropyParams p = pr.params();
    DeviceArray<float> hidden(device(), pr.bf16() ? std::vector<float>{} : pr.hidden),
        weight(device(), pr.bf16() ? std::vector<float>{} : pr.weight);
    DeviceArray<uint16_t> hidden16(device(), pr.hidden16), weight16(device(), pr.weight16);
    DeviceArray<int32_t> targets(device(), pr.targets);
    const std::vector<float> unwritten(b.c.rows, kUnwritten);
    DeviceArray<float> lse(device(), unwritten), loss(device(), unwritten),
        dhidden(device(), std::vector<float>(b.c.rows * b.c.dim, std::numeric_limits<float>::quiet_NaN())),
        dweight(device(), pr.dweight0),
        workspace(device(), std::vector<float>(ops::linear_cross_entropy_workspace_floats(p), kGuardValue));
    p.hidden_gemm = pr.bf16() ? static_cast<const void*>(hidden16.data()) : hidden.data();
    p.weight_gemm = pr.bf16() ? static_cast<const void*>(weight16.data()) : weight.data();
    p.targets = targets.data(), p.lse = lse.data(), p.loss = loss.data();
    p.dhidden = dhidden.data(), p.dweight = dweight.data(), p.workspace = workspace.data();
    const std::string at = "target " + std::to_string(b.target) + " at row " + std::to_string(b.row);
    const std::string range = "[0, " + std::to_string(pr.global_vocab()) + ")";
    testing::expect_error_containing([&] { ops::linear_cross_entropy_forward(p, device()); },
                                     {"linear_cross_entropy_forward", at, range});
    testing::expect_error_containing([&] { ops::linear_cross_entropy_backward(p, device()); },
                                     {"linear_cross_entropy_backward", at, range});
    expect_close(lse.download(), unwritten, nullptr, std::string(b.c.label) + " lse after the failure");
    expect_close(loss.download(), unwritten, nullptr, std::string(b.c.label) + " loss after the failure");
    expect_close(dweight.download(), pr.dweight0, nullptr,
                 std::string(b.c.label) + " dweight after the failure");
    const auto dh = dhidden.download();
    EXPECT_TRUE(std::all_of(dh.begin(), dh.end(), [](float x) { return std::isnan(x); }))
        << b.c.label << ": dhidden written before the failure";
  }
}

}  // namespace forge::op_tests::linear_cross_entropy
