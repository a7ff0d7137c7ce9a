// The CUDA backend's attention (kernels/cuda/attention.cu) against the CPU backend: the same random inputs go
// through ops::cpu_table() on host vectors and ops::cuda_table() on device buffers. Shapes are ragged (never
// multiples of the 128-query / 64-key tiles), cover GQA groups of 1, 4 and 8, head dims 64, 128 and odd ones
// (40, 200: the padded generic path), causal and full attention, a fused qkv buffer and padded token strides,
// and the key/value-cache forward (prefill tiles and decode kernels) in both cache layouts.
//
// Tolerances come from the arithmetic, not from trial runs (written on a machine without a GPU). The
// tensor-core kernels round q (pre-scaled), k, v, dout, P and dS to bf16, unit roundoff u = 2^-9; everything
// else is fp32. So, for row i and key j with a_ij = scale sum_d |q_id k_jd|:
//   score error      |ds_ij| <= e_ij = (2u + (head_dim + 8) 2^-24) a_ij            (q and k rounded)
//   lse error        <= E_i = max_j e_ij                                           (lse moves by a P-average)
//   P relative error <= expm1(e_ij + E_i) + 2u (P rounded for the MMA; the sum uses unrounded P) + fp32 terms
//   out_id           <= sum_j P_ij (that + 2u) |v_jd|                              (v rounded)
// and in backward (both backends get the CPU forward's out and lse), dP_ij = <dout_i, v_j> errs by
// 2u sum_d |dout_id v_jd|, D_i = <dout_i, out_i> only by fp32 order, dS_ij = P_ij (dP_ij - D_i) by
// |dP - D| dP_err + P (dP_err + D_err), and dq, dk, dv sum those errors (plus 2u for the bf16 rounding of dS
// or P and of k, q or dout) against |k|, |q| and |dout|. These are worst-case bounds (every rounding
// aligned), with a safety factor of 1.5 for second-order terms, so they hold on any GPU; an indexing or
// masking bug moves values by O(|value|) and breaks them. A scale-free similarity 1 - 2<x,y>/(|x|^2+|y|^2) ~
// (relative RMS error)^2 / 2 checks the bulk: random roundings give a relative RMS of a few u (~0.01 at
// most), i.e. < 5e-5, so the forward must stay under 1e-4 and gradients (one more rounded product,
// cancellation in dP - D) under 4e-4. The decode kernels compute in fp32: there u is replaced by 2^-20 (16
// fp32 ulps for the CPU's SIMD exponential and the different summation orders) and the similarity bound is
// 1e-9.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

using cuda::DeviceBuffer;

constexpr double kBf16Unit = 1.0 / (1 << 9);     // bf16 unit roundoff
constexpr double kFp32Unit = 1.0 / (1 << 24);    // fp32 unit roundoff
constexpr double kDecodeUnit = 1.0 / (1 << 20);  // the decode kernels' stand-in for u (fp32, see above)
constexpr double kSafety = 1.5;
constexpr float kSentinel = -777.0f;

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buffer(host.size() * sizeof(T));
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

struct Case {
  int64_t batch, seq, heads, kv_heads, head_dim;
  bool causal = true;
  bool fused =
      false;        // q, k, v (and dq, dk, dv) inside one [batch, seq, heads + 2 kv_heads, head_dim] buffer
  int64_t pad = 0;  // extra elements per token in q, out, dout and k, v (padded token strides)
  int64_t kv_seq = 0;  // > 0: key/value cache of this many positions (forward only)
  int64_t q_offset = 0;
  bool head_major = false;    // cache [batch, kv_heads, capacity, head_dim] instead of [batch, capacity, ...]
  float scale_factor = 1.0f;  // scale = scale_factor / sqrt(head_dim)
};

std::string name(const Case& c) {
  std::ostringstream s;
  s << "b" << c.batch << " seq" << c.seq << " h" << c.heads << "/" << c.kv_heads << " d" << c.head_dim
    << (c.causal ? " causal" : " full") << (c.fused ? " fused" : "")
    << (c.pad ? " pad" + std::to_string(c.pad) : "");
  if (c.kv_seq)
    s << " kv" << c.kv_seq << "@" << c.q_offset << (c.head_major ? " head-major" : " token-major");
  if (c.scale_factor != 1.0f) s << " scale x" << c.scale_factor;
  return s.str();
}

// One problem: q, k, v live in one `inputs` array at offsets with their strides (so a fused qkv buffer and
// separate tensors are the same code), gradients in `grads` at the same places. Padding and gaps hold random
// values in inputs and kSentinel in the outputs (which must stay untouched).
struct Problem {
  Case c;
  int64_t kv_seq, q_stride, out_stride, k_stride, head_stride, batch_stride, k_offset, v_offset, capacity;
  std::vector<float> inputs, dout, out, lse, grads;

  Problem(const Case& cc, uint32_t seed) : c(cc) {
    const int64_t d = c.head_dim, q_width = c.heads * d, kv_width = c.kv_heads * d;
    kv_seq = c.kv_seq ? c.kv_seq : c.seq;
    out_stride = q_width + c.pad;
    size_t total;
    if (c.fused) {
      q_stride = k_stride = q_width + 2 * kv_width + c.pad;
      head_stride = d, batch_stride = c.seq * q_stride, capacity = c.seq;
      k_offset = q_width, v_offset = q_width + kv_width;
      total = c.batch * c.seq * q_stride;
    } else {
      q_stride = q_width + c.pad;
      capacity = c.kv_seq ? kv_seq + 5 : kv_seq;  // a cache holds more positions than are filled
      k_stride = c.head_major ? d : kv_width + c.pad;
      head_stride = c.head_major ? capacity * d + 4 : d;
      batch_stride = (c.head_major ? c.kv_heads * head_stride : capacity * k_stride) + (c.kv_seq ? 8 : 0);
      k_offset = c.batch * c.seq * q_stride;
      v_offset = k_offset + c.batch * batch_stride;
      total = v_offset + c.batch * batch_stride;
    }
    inputs = testing::random_floats(total, seed, -2.0f, 2.0f);
    // v in [-1, 1]: rescale its region (fused: every v element) so outputs are O(1)
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < kv_seq; ++j)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          for (int64_t e = 0; e < d; ++e) inputs[v_at(b, j, g) + e] *= 0.5f;
    dout = testing::random_floats(c.batch * c.seq * out_stride, seed + 1);
    out.assign(c.batch * c.seq * out_stride, kSentinel);
    lse.assign(c.batch * c.heads * c.seq, kSentinel);
    grads.assign(total, kSentinel);
  }
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * c.seq + t) * q_stride + h * c.head_dim; }
  int64_t o_at(int64_t b, int64_t t, int64_t h) const {
    return (b * c.seq + t) * out_stride + h * c.head_dim;
  }
  int64_t k_at(int64_t b, int64_t j, int64_t g) const {
    return k_offset + b * batch_stride + g * head_stride + j * k_stride;
  }
  int64_t v_at(int64_t b, int64_t j, int64_t g) const {
    return v_offset + b * batch_stride + g * head_stride + j * k_stride;
  }
  bool decode() const { return c.seq <= 16 && (kv_seq != c.seq || c.q_offset != 0); }

  // Parameters over base pointers to (a copy of) inputs, dout, out, lse, grads.
  ops::AttentionParams params(const float* in, const float* dout_base, float* out_base, float* lse_base,
                              float* grads_base) const {
    ops::AttentionParams p;
    p.batch = c.batch, p.seq = c.seq, p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.q = in, p.k = in + k_offset, p.v = in + v_offset;
    p.q_stride = q_stride, p.k_stride = p.v_stride = k_stride;
    p.out = out_base, p.out_stride = out_stride, p.lse = lse_base;
    p.scale = c.scale_factor / std::sqrt(static_cast<float>(c.head_dim));
    p.causal = c.causal;
    if (c.kv_seq) {
      p.kv_seq = kv_seq, p.q_offset = c.q_offset;
      p.k_head_stride = p.v_head_stride = c.head_major ? head_stride : 0;
      p.k_batch_stride = p.v_batch_stride = batch_stride;
    }
    p.dout = dout_base, p.dout_stride = out_stride;
    p.dq = grads_base, p.dk = grads_base + k_offset, p.dv = grads_base + v_offset;
    p.dq_stride = q_stride, p.dk_stride = p.dv_stride = k_stride;
    return p;
  }
  ops::AttentionParams host_params() {
    return params(inputs.data(), dout.data(), out.data(), lse.data(), grads.data());
  }
};

struct Device {
  DeviceBuffer inputs, dout, out, lse, grads;
  explicit Device(const Problem& pr)
      : inputs(to_device(pr.inputs)),
        dout(to_device(pr.dout)),
        out(to_device(pr.out)),
        lse(to_device(pr.lse)),
        grads(to_device(pr.grads)) {}
  ops::AttentionParams params(const Problem& pr) const {
    return pr.params(inputs.as<float>(), dout.as<float>(), out.as<float>(), lse.as<float>(),
                     grads.as<float>());
  }
};

// Error bounds (see the top of the file) for out, lse and the gradients, laid out like the arrays they bound;
// -1 marks elements no output may touch. `forward_out` is the out the backward runs on (the CPU's).
struct Bounds {
  std::vector<double> out, lse, grads;
};

Bounds error_bounds(const Problem& pr, bool backward, const std::vector<float>& forward_out) {
  const Case& c = pr.c;
  const int64_t d = c.head_dim, group = c.heads / c.kv_heads;
  const double u = pr.decode() ? kDecodeUnit : kBf16Unit;
  const double fp32 = (pr.kv_seq + d + 32) * kFp32Unit;  // fp32 accumulation and roundings, either backend
  const double dot_unit = 2 * u + (d + 8) * kFp32Unit;
  const double scale = c.scale_factor / std::sqrt(static_cast<float>(c.head_dim));
  Bounds bd;
  bd.out.assign(pr.out.size(), -1.0);
  bd.lse.assign(pr.lse.size(), -1.0);
  bd.grads.assign(pr.grads.size(), -1.0);
  std::vector<double> s(pr.kv_seq), e(pr.kv_seq), prob(pr.kv_seq);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t t = 0; t < c.seq; ++t) {
        const int64_t g = h / group, keys = c.causal ? c.q_offset + t + 1 : pr.kv_seq;
        const float* q = &pr.inputs[pr.q_at(b, t, h)];
        double m = -std::numeric_limits<double>::infinity(), worst = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const float* k = &pr.inputs[pr.k_at(b, j, g)];
          double x = 0, a = 0;
          for (int64_t i = 0; i < d; ++i) x += double{q[i]} * k[i], a += std::abs(double{q[i]} * k[i]);
          s[j] = scale * x, e[j] = dot_unit * scale * a;
          m = std::max(m, s[j]), worst = std::max(worst, e[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < keys; ++j) l += std::exp(s[j] - m);
        for (int64_t j = 0; j < keys; ++j) prob[j] = std::exp(s[j] - m) / l;
        const double lse = m + std::log(l);
        bd.lse[(b * c.heads + h) * c.seq + t] = kSafety * (worst + 64 * kFp32Unit * (std::abs(lse) + 1));
        double* out_bound = &bd.out[pr.o_at(b, t, h)];
        for (int64_t i = 0; i < d; ++i) out_bound[i] = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const double rel = std::expm1(e[j] + worst) + 4 * u + fp32;
          const float* v = &pr.inputs[pr.v_at(b, j, g)];
          for (int64_t i = 0; i < d; ++i) out_bound[i] += kSafety * prob[j] * rel * std::abs(v[i]);
        }
        if (!backward) continue;
        const float* dout = &pr.dout[pr.o_at(b, t, h)];
        const float* out = &forward_out[pr.o_at(b, t, h)];
        double delta = 0, delta_abs = 0;
        for (int64_t i = 0; i < d; ++i)
          delta += double{dout[i]} * out[i], delta_abs += std::abs(double{dout[i]} * out[i]);
        const double delta_error = (d + 8) * kFp32Unit * delta_abs;
        double* dq = &bd.grads[pr.q_at(b, t, h)];
        for (int64_t i = 0; i < d; ++i)
          if (dq[i] < 0) dq[i] = 0;
        for (int64_t j = 0; j < keys; ++j) {
          const float* k = &pr.inputs[pr.k_at(b, j, g)];
          const float* v = &pr.inputs[pr.v_at(b, j, g)];
          double dp = 0, dp_abs = 0;
          for (int64_t i = 0; i < d; ++i)
            dp += double{dout[i]} * v[i], dp_abs += std::abs(double{dout[i]} * v[i]);
          const double p_error = prob[j] * (std::expm1(e[j]) + fp32);  // same lse on both backends
          const double dp_error = dot_unit * dp_abs;
          const double ds = prob[j] * (dp - delta);
          const double ds_error = p_error * std::abs(dp - delta) +
                                  (prob[j] + p_error) * (dp_error + delta_error) +
                                  (2 * u + fp32) * std::abs(ds);
          double* dk = &bd.grads[pr.k_at(b, j, g)];
          double* dv = &bd.grads[pr.v_at(b, j, g)];
          for (int64_t i = 0; i < d; ++i) {
            if (dk[i] < 0) dk[i] = 0;
            if (dv[i] < 0) dv[i] = 0;
            dq[i] += kSafety * scale * ds_error * std::abs(k[i]);
            dk[i] += kSafety * scale * ds_error * std::abs(q[i]);
            dv[i] += kSafety * (p_error + (2 * u + fp32) * prob[j]) * std::abs(dout[i]);
          }
        }
      }
  if (backward)  // keys no query sees (none in square attention, but keep every gradient element bounded)
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < c.seq; ++j)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          for (int64_t i = 0; i < d; ++i) {
            bd.grads[pr.k_at(b, j, g) + i] = std::max(bd.grads[pr.k_at(b, j, g) + i], 0.0);
            bd.grads[pr.v_at(b, j, g) + i] = std::max(bd.grads[pr.v_at(b, j, g) + i], 0.0);
          }
  return bd;
}

// One EXPECT per array naming the first offender: bounded elements within their bound (and finite), the rest
// bitwise equal (both untouched); then the similarity over the bounded elements.
void expect_within(const std::vector<float>& cuda, const std::vector<float>& cpu,
                   const std::vector<double>& bound, double max_dissimilarity, const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < cuda.size(); ++i) {
    bool ok;
    if (bound[i] < 0) {
      ok = std::bit_cast<uint32_t>(cuda[i]) == std::bit_cast<uint32_t>(cpu[i]);
    } else {
      ok = std::isfinite(cuda[i]) && std::abs(double{cuda[i]} - double{cpu[i]}) <= bound[i];
      xy += double{cuda[i]} * cpu[i], xx += double{cuda[i]} * cuda[i], yy += double{cpu[i]} * cpu[i];
    }
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << cuda.size() << " elements off; first at " << first
                     << ": cuda " << show(cuda[first]) << ", cpu " << show(cpu[first]) << ", bound "
                     << (bound[first] < 0 ? std::string("untouched") : std::to_string(bound[first]));
  const double dissimilarity = 1.0 - 2.0 * xy / (xx + yy + 1e-300);
  EXPECT_LE(dissimilarity, max_dissimilarity) << what;
}

double forward_dissimilarity(const Problem& pr) { return pr.decode() ? 1e-9 : 1e-4; }

// Forward on both backends: out and lse within their bounds, untouched elements untouched.
void check_forward(Problem& pr, const std::string& what) {
  Device dev(pr);
  ops::cuda_table().attention_forward(dev.params(pr));
  const auto out = to_host<float>(dev.out, pr.out.size());
  const auto lse = to_host<float>(dev.lse, pr.lse.size());
  ops::cpu_table().attention_forward(pr.host_params());
  const Bounds bd = error_bounds(pr, false, pr.out);
  expect_within(out, pr.out, bd.out, forward_dissimilarity(pr), what + " out");
  expect_within(lse, pr.lse, bd.lse, 1.0, what + " lse");
}

void check_backward(Problem& pr, const std::string& what) {
  ops::cpu_table().attention_forward(pr.host_params());  // out and lse for both backwards
  Device dev(pr);
  ops::cuda_table().attention_backward(dev.params(pr));
  const auto grads = to_host<float>(dev.grads, pr.grads.size());
  ops::cpu_table().attention_backward(pr.host_params());
  const Bounds bd = error_bounds(pr, true, pr.out);
  expect_within(grads, pr.grads, bd.grads, 4e-4, what + " dq, dk, dv");
}

// Training's square attention: ragged lengths, GQA 1/4/8, head dims 64, 128 and padded ones.
const std::vector<Case> kTrainingCases = {
    {1, 37, 2, 1, 64, true},                                 // one tile, GQA 2
    {2, 150, 4, 1, 64, true},                                // GQA 4, two key blocks, batch 2
    {1, 200, 2, 2, 128, false},                              // MHA, full attention
    {1, 300, 8, 1, 128, true},                               // GQA 8, three query blocks
    {1, 130, 4, 1, 40, true, true},                          // odd head_dim in a fused qkv buffer
    {1, 70, 4, 2, 128, true, false, 5},                      // padded token strides
    {1, 64, 4, 2, 128, true},                                // exact tile multiples
    {1, 129, 2, 1, 200, true},                               // head_dim 200: the 256-wide kernels
    {1, 50, 2, 2, 256, false},                               // head_dim 256, full
    {2, 100, 4, 4, 64, false, false, 0, 0, 0, false, 4.0f},  // sharp softmax (scale x4)
    {1, 96, 8, 8, 72, true, true, 3},                        // fused and padded, head_dim 72
};

TEST(CudaAttention, ForwardMatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  uint32_t seed = 100;
  for (const Case& c : kTrainingCases) {
    Problem pr(c, seed++);
    check_forward(pr, "attention_forward " + name(c));
  }
}

TEST(CudaAttention, BackwardMatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  uint32_t seed = 200;
  for (const Case& c : kTrainingCases) {
    Problem pr(c, seed++);
    check_backward(pr, "attention_backward " + name(c));
  }
}

// The key/value-cache forward: queries at q_offset.. against a cache holding more positions than kv_seq, in
// both layouts. Up to 16 queries with an offset run the fp32 decode kernels, more the tensor-core tiles.
const std::vector<Case> kCacheCases = {
    {2, 40, 4, 2, 64, true, false, 3, 100, 60},          // prefill tiles, token-major
    {1, 70, 2, 1, 128, true, false, 0, 300, 230, true},  // prefill tiles, head-major
    {1, 33, 2, 2, 40, false, false, 0, 90, 10, true},    // full attention over a cache
    {2, 1, 4, 1, 64, true, false, 0, 300, 299},          // one decode step, several chunks
    {1, 5, 8, 2, 128, true, false, 2, 200, 150, true},   // short chunk, GQA 4, head-major
    {1, 16, 2, 1, 72, false, false, 0, 129, 7},          // 16 queries, full
    {1, 3, 2, 2, 256, true, false, 0, 17, 14, true},     // head_dim 256 decode
    {1, 4, 8, 1, 128, true, false, 0, 1000, 996},        // GQA 8, eight chunks
};

TEST(CudaAttention, CacheForwardMatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  uint32_t seed = 300;
  for (const Case& c : kCacheCases) {
    Problem pr(c, seed++);
    check_forward(pr, "attention_forward " + name(c));
  }
}

// Determinism: no atomics, fixed reduction orders; two identical runs agree bitwise.
TEST(CudaAttention, BitwiseRepeatable) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  for (const Case& c : {Case{2, 300, 8, 2, 128, true}, Case{1, 3, 4, 1, 64, true, false, 0, 600, 500}}) {
    Problem pr(c, 400);
    ops::cpu_table().attention_forward(pr.host_params());
    Device dev(pr);
    std::vector<std::vector<float>> runs;
    for (int run = 0; run < 2; ++run) {
      auto p = dev.params(pr);
      ops::cuda_table().attention_forward(p);
      runs.push_back(to_host<float>(dev.out, pr.out.size()));
      runs.push_back(to_host<float>(dev.lse, pr.lse.size()));
      if (pr.decode()) continue;
      dev.lse.upload(pr.lse.data(), pr.lse.size() * sizeof(float));  // backward on the CPU's lse and out
      dev.out.upload(pr.out.data(), pr.out.size() * sizeof(float));
      ops::cuda_table().attention_backward(p);
      runs.push_back(to_host<float>(dev.grads, pr.grads.size()));
    }
    const size_t per_run = runs.size() / 2;
    for (size_t i = 0; i < per_run; ++i)
      EXPECT_EQ(0, std::memcmp(runs[i].data(), runs[per_run + i].data(), runs[i].size() * sizeof(float)))
          << name(c) << " array " << i;
  }
}

// lse may be null in the forward; out must not change.
TEST(CudaAttention, LseIsOptional) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  for (const Case& c : {Case{1, 70, 4, 2, 64, true}, Case{1, 2, 4, 2, 64, true, false, 0, 50, 40}}) {
    Problem pr(c, 500);
    Device dev(pr);
    ops::cuda_table().attention_forward(dev.params(pr));
    const auto with = to_host<float>(dev.out, pr.out.size());
    dev.out.upload(pr.out.data(), pr.out.size() * sizeof(float));
    auto p = dev.params(pr);
    p.lse = nullptr;
    ops::cuda_table().attention_forward(p);
    const auto without = to_host<float>(dev.out, pr.out.size());
    EXPECT_EQ(0, std::memcmp(with.data(), without.data(), with.size() * sizeof(float))) << name(c);
  }
}

// Under the causal mask, changing the tokens after position t leaves rows up to t bitwise unchanged (masked
// probabilities are exact zeros), forward and backward's dq.
TEST(CudaAttention, LaterTokensDoNotLeak) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Case c{1, 150, 4, 2, 64, true};
  const int64_t cut = 77;  // rows 0..77 must not see tokens 78..
  Problem a(c, 600), b(c, 600);
  for (int64_t t = cut + 1; t < c.seq; ++t)
    for (int64_t i = 0; i < b.q_stride; ++i) b.inputs[t * b.q_stride + i] += 1.0f;
  for (int64_t j = cut + 1; j < c.seq; ++j)
    for (int64_t g = 0; g < c.kv_heads; ++g)
      for (int64_t i = 0; i < c.head_dim; ++i)
        b.inputs[b.k_at(0, j, g) + i] *= -1.0f, b.inputs[b.v_at(0, j, g) + i] += 0.5f;
  std::vector<std::vector<float>> dq;
  std::vector<std::vector<float>> out;
  for (Problem* pr : {&a, &b}) {
    ops::cpu_table().attention_forward(pr->host_params());  // same lse for rows <= cut on both
    Device dev(*pr);
    ops::cuda_table().attention_forward(dev.params(*pr));
    out.push_back(to_host<float>(dev.out, pr->out.size()));
    dev.out.upload(pr->out.data(), pr->out.size() * sizeof(float));
    dev.lse.upload(pr->lse.data(), pr->lse.size() * sizeof(float));
    ops::cuda_table().attention_backward(dev.params(*pr));
    dq.push_back(to_host<float>(dev.grads, static_cast<size_t>((cut + 1) * a.q_stride)));
  }
  EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), (cut + 1) * a.out_stride * sizeof(float)));
  // dq rows <= cut depend on later tokens only through dout and out of later rows: none.
  for (int64_t t = 0; t <= cut; ++t)
    EXPECT_EQ(0, std::memcmp(dq[0].data() + t * a.q_stride, dq[1].data() + t * a.q_stride,
                             c.heads * c.head_dim * sizeof(float)))
        << "dq row " << t;
}

// Cache positions past kv_seq (stale or never written) take no part, in both kernels and both layouts.
TEST(CudaAttention, IgnoresCachePositionsPastKvSeq) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  for (const Case& c :
       {Case{1, 1, 2, 2, 64, true, false, 0, 41, 40}, Case{1, 1, 2, 2, 64, true, false, 0, 41, 40, true},
        Case{1, 30, 2, 1, 64, true, false, 0, 41, 11}, Case{1, 30, 2, 1, 64, true, false, 0, 41, 11, true}}) {
    Problem a(c, 700), b(c, 700);
    for (int64_t j = c.kv_seq; j < b.capacity; ++j)
      for (int64_t g = 0; g < c.kv_heads; ++g)
        for (int64_t i = 0; i < c.head_dim; ++i)
          b.inputs[b.k_at(0, j, g) + i] = std::numeric_limits<float>::quiet_NaN(),
                                     b.inputs[b.v_at(0, j, g) + i] = 1e30f;
    std::vector<std::vector<float>> out;
    for (Problem* pr : {&a, &b}) {
      Device dev(*pr);
      ops::cuda_table().attention_forward(dev.params(*pr));
      out.push_back(to_host<float>(dev.out, pr->out.size()));
    }
    EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float))) << name(c);
  }
}

// Parameter errors are raised on the host before any CUDA call: these run without a GPU.
TEST(CudaAttentionErrors, RejectsBadParametersBeforeTouchingTheDevice) {
  Problem pr({1, 4, 2, 1, 16, true}, 1);
  const auto good = pr.host_params();  // host pointers: never dereferenced, every call below fails first
  const ops::OpTable& cuda = ops::cuda_table();
  auto p = good;
  p.kv_heads = 3;  // 2 heads do not split into 3 kv heads
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"heads 2", "kv_heads 3"});
  p = good;
  p.q_stride = 8;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"q_stride 8"});
  p = good;
  p.kv_seq = 4, p.q_offset = 1;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"positions 1..4", "kv_seq is 4"});
  p = good;
  p.head_dim = 300, p.q_stride = p.out_stride = 600, p.k_stride = p.v_stride = 300;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"head_dim 300", "CUDA"});
  p = good;
  p.k = nullptr;
  testing::expect_error_containing([&] { cuda.attention_forward(p); }, {"q, k, v and out"});
  p = good;
  p.kv_seq = 6;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"only square attention"});
  p = good;
  p.dk = nullptr;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"dout, dq, dk and dv"});
  p = good;
  p.lse = nullptr;
  testing::expect_error_containing([&] { cuda.attention_backward(p); }, {"lse must be set"});
}

}  // namespace
}  // namespace forge
