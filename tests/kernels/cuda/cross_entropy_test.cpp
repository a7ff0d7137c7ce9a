// The CUDA output projection fused with chunked softmax cross-entropy (kernels/cuda/cross_entropy.cu) against
// the CPU kernel (ops::cpu_table()) on the same host data: fp32 and bf16 GEMM operands, ragged rows, dim and
// vocabulary (vocabularies that chunks do not divide, chunks wider than the vocabulary, chunk widths that are
// and are not multiples of the kernels' float4 groups), ignored rows, a vocabulary-parallel range with
// padding columns, grad_scale != 1 and dweight accumulated onto nonzero values. Outputs compared: lse, loss,
// target_logit, dhidden, dweight; the workspace must not be written past its advertised size.
//
// Tolerances come from the arithmetic (these tests were written on a machine without a GPU), per element, in
// double on the host, with u = 2^-24:
//   logits   both backends run fp32-accumulating GEMMs of length dim in different orders (bf16 products are
//            exact in fp32); as in gemm_test.cpp each side errs by at most 2 (dim + 8) u of A = sum_k |h w|
//            (tensor cores may truncate), so the logits differ by E = 4 (dim + 8) u A.
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
// -inf matches -inf). Runs on the GPU must be bitwise repeatable.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

using cuda::DeviceBuffer;

constexpr double kU = 1.0 / (1 << 24);
constexpr int64_t kGuard = 64;  // floats after (and, when offset, before) the workspace that must stay intact
constexpr float kGuardValue = -12345.0f;
constexpr float kUnwritten = 7.0f;  // initial value of outputs a failing call must leave alone

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buffer(std::max<size_t>(host.size(), 1) * sizeof(T));
  if (!host.empty()) buffer.upload(host.data(), host.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& buffer, size_t n) {
  std::vector<T> host(n);
  if (n > 0) buffer.download(host.data(), n * sizeof(T));
  return host;
}

std::string show(float x) {
  std::ostringstream out;
  out << std::setprecision(9) << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  return out.str();
}

bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// One EXPECT per array, naming the first offender: bitwise equal, or within tolerance[i] when one is given.
void expect_close(const std::vector<float>& cuda, const std::vector<float>& cpu,
                  const std::vector<double>* tolerance, const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cuda.size(); ++i) {
    const bool ok = same_bits(cuda[i], cpu[i]) ||
                    (tolerance && std::abs(double{cuda[i]} - double{cpu[i]}) <= (*tolerance)[i]);
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return;
  ADD_FAILURE() << what << ": " << bad << " of " << cuda.size() << " elements differ; first at " << first
                << ": cuda " << show(cuda[first]) << ", cpu " << show(cpu[first])
                << (tolerance ? ", tolerance " + std::to_string((*tolerance)[first])
                              : std::string(" (bitwise)"));
}

struct Case {
  const char* name;
  int64_t rows, dim, vocab, chunk;
  DType dtype;
  int64_t vocab_start = 0, global_vocab = 0;
  float grad_scale = 1.0f;
  bool target_logit = true;
};

struct Problem {
  Case c;
  std::vector<float> hidden, weight;  // the GEMM operands' exact values (bf16-rounded under bf16)
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

  // Sizes and scalars; the caller fills in the pointers.
  ops::LinearCrossEntropyParams params() const {
    ops::LinearCrossEntropyParams p;
    p.rows = c.rows, p.dim = c.dim, p.vocab = c.vocab, p.vocab_chunk = c.chunk, p.gemm_dtype = c.dtype;
    p.vocab_start = c.vocab_start, p.global_vocab = c.global_vocab, p.grad_scale = c.grad_scale;
    p.keep_logits = keep_logits;
    return p;
  }
};

Problem make_problem(const Case& c, uint32_t seed) {
  Problem pr;
  pr.c = c;
  // Logits of standard deviation sqrt(dim) / 3: a softmax neither flat nor one-hot.
  pr.hidden = testing::random_floats(c.rows * c.dim, seed, -1, 1);
  pr.weight = testing::random_floats(c.vocab * c.dim, seed + 1, -1, 1);
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
  return pr;
}

struct Outputs {
  std::vector<float> lse, loss, target_logit, dhidden, dweight;
};

// Forward, then backward. Backward reads backward_lse when given (a vocabulary-parallel caller passes the
// global lse), else the forward's own lse.
Outputs run_cpu(const Problem& pr, const std::vector<float>* backward_lse) {
  const Case& c = pr.c;
  Outputs out;
  out.lse.assign(c.rows, kUnwritten), out.loss.assign(c.rows, kUnwritten);
  out.target_logit.assign(c.rows, kUnwritten);
  out.dhidden.assign(c.rows * c.dim, kUnwritten), out.dweight = pr.dweight0;
  ops::LinearCrossEntropyParams p = pr.params();
  std::vector<float> workspace(ops::linear_cross_entropy_workspace_floats(p));
  p.hidden_gemm = pr.bf16() ? static_cast<const void*>(pr.hidden16.data()) : pr.hidden.data();
  p.weight_gemm = pr.bf16() ? static_cast<const void*>(pr.weight16.data()) : pr.weight.data();
  p.targets = pr.targets.data(), p.lse = out.lse.data(), p.loss = out.loss.data();
  p.target_logit = c.target_logit ? out.target_logit.data() : nullptr;
  p.dhidden = out.dhidden.data(), p.dweight = out.dweight.data(), p.workspace = workspace.data();
  ops::cpu_table().linear_cross_entropy_forward(p);
  std::vector<float> lse_in = backward_lse ? *backward_lse : out.lse;
  p.lse = lse_in.data();
  ops::cpu_table().linear_cross_entropy_backward(p);
  return out;
}

// The problem's device copies and outputs. The workspace starts `offset` floats into its buffer, between
// guard values; dhidden starts as NaN (backward must overwrite it).
struct DeviceProblem {
  const Problem& pr;
  int64_t workspace_floats, offset;
  DeviceBuffer hidden, weight, targets, lse, loss, target_logit, dhidden, dweight, workspace;

  DeviceProblem(const Problem& problem, int64_t workspace_offset = 0)
      : pr(problem),
        workspace_floats(ops::linear_cross_entropy_workspace_floats(problem.params())),
        offset(workspace_offset),
        hidden(problem.bf16() ? to_device(problem.hidden16) : to_device(problem.hidden)),
        weight(problem.bf16() ? to_device(problem.weight16) : to_device(problem.weight)),
        targets(to_device(problem.targets)),
        lse(to_device(std::vector<float>(problem.c.rows, kUnwritten))),
        loss(to_device(std::vector<float>(problem.c.rows, kUnwritten))),
        target_logit(to_device(std::vector<float>(problem.c.rows, kUnwritten))),
        dhidden(to_device(
            std::vector<float>(problem.c.rows * problem.c.dim, std::numeric_limits<float>::quiet_NaN()))),
        dweight(to_device(problem.dweight0)),
        workspace(to_device(std::vector<float>(offset + workspace_floats + kGuard, kGuardValue))) {}

  ops::LinearCrossEntropyParams params() const {
    ops::LinearCrossEntropyParams p = pr.params();
    p.hidden_gemm = hidden.data(), p.weight_gemm = weight.data(), p.targets = targets.as<int32_t>();
    p.lse = lse.as<float>(), p.loss = loss.as<float>();
    p.target_logit = pr.c.target_logit ? target_logit.as<float>() : nullptr;
    p.dhidden = dhidden.as<float>(), p.dweight = dweight.as<float>(),
    p.workspace = workspace.as<float>() + offset;
    return p;
  }

  void expect_guards_intact() const {
    const auto all = to_host<float>(workspace, offset + workspace_floats + kGuard);
    size_t bad = 0;
    for (int64_t i = 0; i < offset; ++i) bad += !same_bits(all[i], kGuardValue);
    for (int64_t i = offset + workspace_floats; i < static_cast<int64_t>(all.size()); ++i)
      bad += !same_bits(all[i], kGuardValue);
    EXPECT_EQ(bad, 0u) << pr.c.name << ": the kernels wrote outside the workspace";
  }
};

Outputs run_cuda(const Problem& pr, const std::vector<float>* backward_lse, int64_t workspace_offset = 0) {
  const Case& c = pr.c;
  DeviceProblem d(pr, workspace_offset);
  ops::LinearCrossEntropyParams p = d.params();
  ops::cuda_table().linear_cross_entropy_forward(p);
  Outputs out;
  out.lse = to_host<float>(d.lse, c.rows);
  DeviceBuffer lse_in = to_device(backward_lse ? *backward_lse : out.lse);
  if (backward_lse) p.lse = lse_in.as<float>();
  ops::cuda_table().linear_cross_entropy_backward(p);
  out.loss = to_host<float>(d.loss, c.rows);
  out.target_logit =
      c.target_logit ? to_host<float>(d.target_logit, c.rows) : std::vector<float>(c.rows, kUnwritten);
  out.dhidden = to_host<float>(d.dhidden, c.rows * c.dim);
  out.dweight = to_host<float>(d.dweight, c.vocab * c.dim);
  d.expect_guards_intact();
  return out;
}

struct Tolerances {
  std::vector<double> lse, loss, target_logit, dhidden, dweight;
};

// The bounds of the header comment, per element. cpu holds the CPU's outputs; backward_lse is what both
// backends' backward read when shared (else each read its own forward lse, which differ by up to the lse
// tolerance).
Tolerances tolerances(const Problem& pr, const Outputs& cpu, const std::vector<float>* backward_lse) {
  const Case& c = pr.c;
  const int64_t rows = c.rows, dim = c.dim, real = pr.real_columns(), chunks = pr.chunks();
  const double s = std::abs(double{c.grad_scale});
  Tolerances t;
  t.lse.assign(rows, 0), t.loss.assign(rows, 0), t.target_logit.assign(rows, 0);
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
      if (pr.bf16()) error += std::ldexp(bound_magnitude, -8), bound_magnitude *= 1 + std::ldexp(1.0, -8);
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

void expect_match(const Outputs& cuda, const Outputs& cpu, const Tolerances& t, const std::string& what) {
  expect_close(cuda.lse, cpu.lse, &t.lse, what + " lse");
  expect_close(cuda.loss, cpu.loss, &t.loss, what + " loss");
  expect_close(cuda.target_logit, cpu.target_logit, &t.target_logit, what + " target_logit");
  expect_close(cuda.dhidden, cpu.dhidden, &t.dhidden, what + " dhidden");
  expect_close(cuda.dweight, cpu.dweight, &t.dweight, what + " dweight");
}

void expect_bitwise_equal(const Outputs& a, const Outputs& b, const std::string& what) {
  expect_close(a.lse, b.lse, nullptr, what + " lse");
  expect_close(a.loss, b.loss, nullptr, what + " loss");
  expect_close(a.target_logit, b.target_logit, nullptr, what + " target_logit");
  expect_close(a.dhidden, b.dhidden, nullptr, what + " dhidden");
  expect_close(a.dweight, b.dweight, nullptr, what + " dweight");
}

// A vocabulary-parallel caller's global lse: this range's lse plus the other ranges' mass (here a made-up
// log(1 + e^0.75)-ish shift); a range of padding only has none of its own.
std::vector<float> global_lse(const Outputs& cpu) {
  std::vector<float> lse(cpu.lse.size());
  for (size_t r = 0; r < lse.size(); ++r) lse[r] = std::isfinite(cpu.lse[r]) ? cpu.lse[r] + 0.75f : 3.5f;
  return lse;
}

bool vocabulary_parallel(const Case& c) { return c.vocab_start > 0 || c.global_vocab > 0; }

const std::vector<Case> kCases = {
    // name, rows, dim, vocab, chunk, dtype, vocab_start, global_vocab, grad_scale, target_logit
    // Chunks of 128, 128, 45: vector loads, then a ragged width on the scalar path. No target_logit output.
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

class CudaLinearCrossEntropy : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLinearCrossEntropy, MatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Case& c = GetParam();
  const Problem pr = make_problem(c, 17);
  const Outputs cpu_forward_only = vocabulary_parallel(c) ? run_cpu(pr, nullptr) : Outputs{};
  const std::vector<float> lse_in =
      vocabulary_parallel(c) ? global_lse(cpu_forward_only) : std::vector<float>{};
  const std::vector<float>* backward_lse = vocabulary_parallel(c) ? &lse_in : nullptr;
  const Outputs cpu = run_cpu(pr, backward_lse);
  const Outputs cuda = run_cuda(pr, backward_lse);
  expect_match(cuda, cpu, tolerances(pr, cpu, backward_lse), c.name);
  // Ignored rows have no loss (also bitwise in the comparison above; this names the row).
  for (int64_t r = 0; r < c.rows; ++r)
    if (pr.targets[r] < 0) {
      EXPECT_EQ(cuda.loss[r], 0.0f) << c.name << " row " << r;
    }
}

TEST_P(CudaLinearCrossEntropy, IsBitwiseRepeatable) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Case& c = GetParam();
  const Problem pr = make_problem(c, 23);
  const std::vector<float> lse_in(c.rows, 4.0f);  // any lse will do for repeatability
  const std::vector<float>* backward_lse = vocabulary_parallel(c) ? &lse_in : nullptr;
  const Outputs first = run_cuda(pr, backward_lse), second = run_cuda(pr, backward_lse);
  expect_bitwise_equal(second, first, std::string(c.name) + " second run");
}

// Logits kept from forward for backward are the very values a recompute would produce (each chunk's block is
// as aligned as the workspace, so its GEMM is the same cuBLASLt plan): every output is bitwise the recomputing
// run's, the CPU agrees as before, and the larger workspace is not overrun (run_cuda checks its guards).
TEST_P(CudaLinearCrossEntropy, KeptLogitsGiveTheRecomputedResultsBitwise) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Case& c = GetParam();
  Problem pr = make_problem(c, 31);
  const std::vector<float> lse_in(c.rows, 4.0f);  // any lse will do: both runs read the same
  const std::vector<float>* backward_lse = vocabulary_parallel(c) ? &lse_in : nullptr;
  const Outputs recompute = run_cuda(pr, backward_lse);
  pr.keep_logits = true;
  const Outputs keep = run_cuda(pr, backward_lse);
  expect_bitwise_equal(keep, recompute, std::string(c.name) + " keep_logits");
  if (!vocabulary_parallel(c)) {
    const Outputs cpu = run_cpu(pr, nullptr);
    expect_match(keep, cpu, tolerances(pr, cpu, nullptr), std::string(c.name) + " keep_logits vs cpu");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLinearCrossEntropy, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// A workspace one float past 16-byte alignment: the row kernels take their scalar paths (same groups, same
// order) and must still agree with the CPU.
TEST(CudaLinearCrossEntropyWorkspace, MisalignedWorkspaceMatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  for (const Case& c : {kCases[4], kCases[5]}) {  // the all-vector-width shapes
    const Problem pr = make_problem(c, 29);
    const Outputs cpu = run_cpu(pr, nullptr);
    const Outputs cuda = run_cuda(pr, nullptr, /*workspace_offset=*/1);
    expect_match(cuda, cpu, tolerances(pr, cpu, nullptr), std::string(c.name) + " misaligned workspace");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Errors

// Targets at or past the global vocabulary fail like on the CPU, naming the first bad row, before anything
// is written.
TEST(CudaLinearCrossEntropyErrors, RejectsTargetsOutsideTheVocabulary) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
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
  };
  for (const BadCase& b : cases) {
    Problem pr = make_problem(b.c, 31);
    pr.targets[b.row] = b.target, pr.targets[b.later_row] = b.later_target;
    const DeviceProblem d(pr);
    const ops::LinearCrossEntropyParams p = d.params();
    const std::string at = "target " + std::to_string(b.target) + " at row " + std::to_string(b.row);
    const std::string range = "[0, " + std::to_string(pr.global_vocab()) + ")";
    testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                     {"linear_cross_entropy_forward", at, range});
    testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_backward(p); },
                                     {"linear_cross_entropy_backward", at, range});
    const std::vector<float> unwritten(b.c.rows, kUnwritten);
    expect_close(to_host<float>(d.lse, b.c.rows), unwritten, nullptr,
                 std::string(b.c.name) + " lse after the failure");
    expect_close(to_host<float>(d.loss, b.c.rows), unwritten, nullptr,
                 std::string(b.c.name) + " loss after the failure");
    expect_close(to_host<float>(d.dweight, pr.dweight0.size()), pr.dweight0, nullptr,
                 std::string(b.c.name) + " dweight after the failure");
    const auto dhidden = to_host<float>(d.dhidden, b.c.rows * b.c.dim);
    EXPECT_TRUE(std::all_of(dhidden.begin(), dhidden.end(), [](float x) { return std::isnan(x); }))
        << b.c.name << ": dhidden written before the failure";
  }
}

TEST(CudaLinearCrossEntropyErrors, RejectsHostPointers) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Problem pr = make_problem({"host", 8, 16, 40, 16, DType::f32}, 37);
  const DeviceProblem d(pr);
  ops::LinearCrossEntropyParams p = d.params();
  p.targets = pr.targets.data();
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "targets", "not device memory"});
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_backward(p); },
                                   {"linear_cross_entropy_backward", "targets", "not device memory"});
}

// The checks below fail before any CUDA call: they run on machines without a GPU too. The pointers are host
// addresses that are never dereferenced.
ops::LinearCrossEntropyParams host_params(std::vector<float>& storage, std::vector<int32_t>& targets) {
  ops::LinearCrossEntropyParams p;
  p.rows = 3, p.dim = 4, p.vocab = 10, p.vocab_chunk = 4;
  p.hidden_gemm = storage.data(), p.weight_gemm = storage.data(), p.targets = targets.data();
  p.lse = storage.data(), p.loss = storage.data(), p.dhidden = storage.data(), p.dweight = storage.data();
  p.workspace = storage.data();
  return p;
}

TEST(CudaLinearCrossEntropyErrors, BadParametersFailBeforeTouchingTheDevice) {
  std::vector<float> storage(64);
  std::vector<int32_t> targets(3);
  const ops::OpTable& gpu = ops::cuda_table();
  for (auto run : {gpu.linear_cross_entropy_forward, gpu.linear_cross_entropy_backward}) {
    const std::string op = run == gpu.linear_cross_entropy_forward ? "linear_cross_entropy_forward"
                                                                   : "linear_cross_entropy_backward";
    auto p = host_params(storage, targets);
    p.dim = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "dim=0"});
    p = host_params(storage, targets), p.rows = -1;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "rows=-1"});
    p = host_params(storage, targets), p.vocab_chunk = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "vocab_chunk=0"});
    p = host_params(storage, targets), p.vocab = 0;
    testing::expect_error_containing([&] { run(p); }, {op, "bad shape", "vocab=0"});
    p = host_params(storage, targets), p.gemm_dtype = DType::f16;
    testing::expect_error_containing([&] { run(p); },
                                     {op, "gemm_dtype must be fp32 or bf16", dtype_name(DType::f16)});
    p = host_params(storage, targets), p.workspace = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "workspace is required"});
    p = host_params(storage, targets), p.vocab_start = -3;
    testing::expect_error_containing([&] { run(p); }, {op, "negative vocabulary start -3"});
    p = host_params(storage, targets), p.rows = int64_t{1} << 31;
    testing::expect_error_containing([&] { run(p); }, {op, "rows=2147483648", "grid"});
    p = host_params(storage, targets), p.hidden_gemm = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "hidden_gemm is null"});
    p = host_params(storage, targets), p.weight_gemm = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "weight_gemm is null"});
    p = host_params(storage, targets), p.targets = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "targets is null"});
    p = host_params(storage, targets), p.lse = nullptr;
    testing::expect_error_containing([&] { run(p); }, {op, "lse is null"});
  }
  auto p = host_params(storage, targets);
  p.loss = nullptr;
  testing::expect_error_containing([&] { gpu.linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "loss is null"});
  p = host_params(storage, targets), p.dhidden = nullptr;
  testing::expect_error_containing([&] { gpu.linear_cross_entropy_backward(p); },
                                   {"linear_cross_entropy_backward", "dhidden is null"});
  p = host_params(storage, targets), p.dweight = nullptr;
  testing::expect_error_containing([&] { gpu.linear_cross_entropy_backward(p); },
                                   {"linear_cross_entropy_backward", "dweight is null"});
}

// No rows: nothing to do and nothing touched (the CPU kernel's behaviour), without a GPU too. The workspace
// is still required, as on the CPU.
TEST(CudaLinearCrossEntropyErrors, NoRowsIsANoOp) {
  std::vector<float> storage(4);
  ops::LinearCrossEntropyParams p;
  p.rows = 0, p.dim = 8, p.vocab = 10, p.vocab_chunk = 4, p.workspace = storage.data();
  ops::cuda_table().linear_cross_entropy_forward(p);
  ops::cuda_table().linear_cross_entropy_backward(p);
  p.workspace = nullptr;
  testing::expect_error_containing([&] { ops::cuda_table().linear_cross_entropy_forward(p); },
                                   {"linear_cross_entropy_forward", "workspace is required"});
}

}  // namespace
}  // namespace forge
