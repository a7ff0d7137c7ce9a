// The mixture-of-experts token shuffling (ops::moe_sort_by_expert, moe_permute*, moe_unpermute*), written
// once for every backend (op_harness.h).
//
// Sort: against a reference built another way (a std::stable_sort of (expert, assignment) pairs, then each
// expert's first `capacity`, each segment padded to a multiple of `align`), exactly, on every backend: it is
// integer work with one right answer.
// Permutes: on the CPU against double-precision references and finite differences of the forward passes (the
// backward ops are their exact adjoints); elsewhere against the CPU kernel. moe_permute and
// moe_permute_backward are copies and in-order sums of the same values, and dy is one product: bitwise.
// moe_unpermute sums top_k products (a backend may fuse them, FMA or not): top_k + 1 roundings of the
// magnitude sum |w y|. dweights is a dot product over hidden in each backend's fixed order:
// reduction_tolerance(hidden) of sum |dout y|. Padding rows (align > 1) are zeros in permute's out and
// unpermute_backward's dy, never read elsewhere, and change no other output's bits.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::moe_permute {

using testing::DeviceArray;

struct Case {
  int64_t tokens, top_k, experts, hidden, capacity;
  int64_t used_experts;  // ids drawn from [0, used_experts): the rest stay empty
  int64_t pad;           // token-side row strides are hidden + pad
  int64_t align = 1;     // each expert's segment of sorted rows padded to a multiple of it
  bool fill = false;     // pad_to_capacity: every segment the capacity's rows (rounded up to align)
  std::string name() const {
    return fmt::format("t{}_k{}_e{}_h{}{}{}{}{}{}", tokens, top_k, experts, hidden,
                       capacity ? fmt::format("_cap{}", capacity) : "",
                       used_experts < experts ? fmt::format("_used{}", used_experts) : "",
                       pad ? fmt::format("_pad{}", pad) : "", align > 1 ? fmt::format("_align{}", align) : "",
                       fill ? "_fill" : "");
  }
  bool finite_differences() const { return tokens * hidden <= 400; }
};

// Small ones for finite differences (one with drops, one with a single expert, one token), a capacity that
// drops most rows, empty experts, odd hidden sizes, and one of a training step's shape (many chunks of the
// GPU sort, 64 experts). Then padded segments (align 4 and 16, FP8's 16), dropless and under a capacity, with
// empty experts, a capacity that is not a multiple of the align, and more padding rows than assignments.
// Then every segment filled to the capacity (pad_to_capacity): small for finite differences, with empty
// experts, aligned, and a capacity above most experts' loads.
inline const std::vector<Case> kCases = {
    {7, 2, 4, 13, 0, 4, 3},
    {9, 3, 5, 11, 2, 5, 0},
    {6, 1, 1, 17, 0, 1, 1},
    {1, 4, 8, 9, 0, 8, 0},
    {50, 2, 16, 33, 0, 10, 5},
    {200, 4, 8, 65, 30, 8, 0},
    {301, 6, 64, 129, 0, 64, 0},
    {4099, 8, 64, 31, 0, 60, 2},
    {3000, 2, 256, 20, 7, 256, 0},
    {7, 2, 4, 13, 0, 4, 3, 4},
    {9, 3, 5, 11, 2, 5, 0, 4},
    {6, 1, 1, 17, 0, 1, 1, 16},
    {1, 4, 8, 9, 0, 8, 0, 16},
    {50, 2, 16, 33, 0, 10, 5, 16},
    {200, 4, 8, 65, 30, 8, 0, 16},
    {4099, 8, 64, 31, 0, 60, 2, 16},
    {3000, 2, 256, 20, 7, 256, 0, 4},
    {7, 2, 4, 13, 3, 4, 3, 1, true},
    {9, 3, 5, 11, 2, 5, 0, 4, true},
    {50, 2, 16, 33, 4, 10, 5, 1, true},
    {200, 4, 8, 65, 30, 8, 0, 16, true},
    {3000, 2, 256, 20, 7, 256, 0, 4, true},
};

static_assert(ops::moe_sorted_rows_bound(4, 2, 3, 16) == 8 + 3 * 15);

// The sort's outputs.
struct Sorted {
  std::vector<int32_t> row_of, source;
  std::vector<int64_t> offsets, counts;
  int64_t rows() const { return offsets.back(); }
};

// The kept assignments of an expert with `count` of them, and its segment: kept rounded up to `align`.
inline int64_t kept_rows(int64_t count, int64_t capacity) {
  return capacity > 0 ? std::min(count, capacity) : count;
}
inline int64_t segment_rows(int64_t kept, int64_t align) {
  return kept == 0 ? 0 : ((kept - 1) / align + 1) * align;
}

// Stable sort by expert, then each expert's first `capacity` kept, each segment padded to a multiple of
// `align` (fill: to the capacity, rounded up to `align`) with rows of source -1; source has tokens * top_k +
// experts * (align - 1) entries (fill: exactly the rows).
inline Sorted reference_sort(const std::vector<int32_t>& ids, int64_t experts, int64_t capacity,
                             int64_t align = 1, bool fill = false) {
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for (int64_t a = 0; a < n; ++a) pairs.push_back({ids[a], static_cast<int32_t>(a)});
  std::stable_sort(pairs.begin(), pairs.end(), [](auto x, auto y) { return x.first < y.first; });
  Sorted s;
  const int64_t filled = fill ? segment_rows(capacity, align) : 0;
  s.row_of.assign(n, -1), s.source.assign(fill ? experts * filled : n + experts * (align - 1), -1),
      s.counts.assign(experts, 0), s.offsets.assign(experts + 1, 0);
  for (auto [e, a] : pairs) ++s.counts[e];
  for (int64_t e = 0; e < experts; ++e)
    s.offsets[e + 1] = s.offsets[e] + (fill ? filled : segment_rows(kept_rows(s.counts[e], capacity), align));
  std::vector<int64_t> kept(experts, 0);
  for (auto [e, a] : pairs) {
    if (capacity > 0 && kept[e] >= capacity) continue;
    const int64_t row = s.offsets[e] + kept[e]++;
    s.row_of[a] = static_cast<int32_t>(row), s.source[row] = a;
  }
  return s;
}

// The padding's promises, checked apart from the reference: every segment starts at a multiple of align and
// holds its expert's kept rows, then only padding (source -1, named by no row_of); source is -1 past R too.
inline void expect_aligned_segments(const Sorted& s, const std::vector<int32_t>& ids, int64_t capacity,
                                    int64_t align, const std::string& what, bool fill = false) {
  const int64_t experts = static_cast<int64_t>(s.counts.size()), n = static_cast<int64_t>(ids.size());
  ASSERT_EQ(static_cast<int64_t>(s.source.size()),
            fill ? experts * segment_rows(capacity, align) : n + experts * (align - 1))
      << what;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = s.offsets[e], kept = kept_rows(s.counts[e], capacity);
    EXPECT_EQ(begin % align, 0) << what << ": expert " << e << " starts at " << begin;
    EXPECT_EQ(s.offsets[e + 1] - begin, segment_rows(fill ? capacity : kept, align))
        << what << ": expert " << e;
    for (int64_t r = begin; r < s.offsets[e + 1]; ++r) {
      if (r < begin + kept) {
        ASSERT_TRUE(s.source[r] >= 0 && s.source[r] < n) << what << ": row " << r;
        EXPECT_EQ(ids[s.source[r]], e) << what << ": row " << r;
        EXPECT_EQ(s.row_of[s.source[r]], r) << what << ": row " << r;
      } else {
        EXPECT_EQ(s.source[r], -1) << what << ": padding row " << r << " of expert " << e;
      }
    }
  }
  for (size_t r = static_cast<size_t>(s.rows()); r < s.source.size(); ++r)
    EXPECT_EQ(s.source[r], -1) << what << ": source[" << r << "] past the " << s.rows() << " rows";
}

inline std::vector<int32_t> random_ids(const Case& c, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(c.used_experts) - 1);
  std::vector<int32_t> ids(c.tokens * c.top_k);
  for (auto& v : ids) v = id(gen);  // a token may pick one expert twice
  // Used experts spread over the range (every other one empty when half are used), not just the first ones.
  if (c.used_experts < c.experts)
    for (auto& v : ids) v = static_cast<int32_t>(v * c.experts / c.used_experts);
  return ids;
}

// The sort on `on`, source sized by ops::moe_sorted_rows_bound.
inline Sorted run_sort(Device on, const std::vector<int32_t>& ids, int64_t tokens, int64_t top_k,
                       int64_t experts, int64_t capacity, int64_t align = 1, bool fill = false) {
  ops::MoeSortParams p;
  p.tokens = tokens, p.top_k = top_k, p.experts = experts, p.capacity = capacity, p.align = align;
  p.pad_to_capacity = fill;
  const int64_t n = tokens * top_k, bound = ops::moe_sorted_rows_bound(p);
  DeviceArray<int32_t> d_ids(on, ids), row_of(on, std::vector<int32_t>(n, 12345)),
      source(on, std::vector<int32_t>(bound, 12345));
  DeviceArray<int64_t> offsets(on, std::vector<int64_t>(experts + 1, 777)), counts(on, experts);
  p.expert_ids = d_ids.data(), p.row_of = row_of.data(), p.source = source.data();
  p.offsets = offsets.data(), p.counts = counts.data();
  FORGE_TEST_OP(moe_sort_by_expert, on, p);
  return {row_of.download(), source.download(), offsets.download(), counts.download()};
}

inline void expect_sorted_equal(const Sorted& got, const Sorted& want, const std::string& what) {
  EXPECT_EQ(got.offsets, want.offsets) << what << ": offsets";
  EXPECT_EQ(got.counts, want.counts) << what << ": counts";
  EXPECT_EQ(got.row_of, want.row_of) << what << ": row_of";
  EXPECT_EQ(got.source, want.source) << what << ": source";
}

// A case's inputs and its (CPU) sort.
struct Problem {
  Case c;
  std::vector<int32_t> ids;
  Sorted sorted;
  int64_t rows, x_stride;
  std::vector<float> x, weights, dsorted, y, dout;
  Problem(const Case& c_, uint32_t seed) : c(c_) {
    ids = random_ids(c, seed);
    sorted = reference_sort(ids, c.experts, c.capacity, c.align, c.fill);
    rows = sorted.rows(), x_stride = c.hidden + c.pad;
    x = testing::random_floats(c.tokens * x_stride, seed + 1);
    weights = testing::random_floats(c.tokens * c.top_k, seed + 2, 0.0f, 1.0f);
    dsorted = testing::random_floats(rows * c.hidden, seed + 3);  // dout of permute
    y = testing::random_floats(rows * c.hidden, seed + 4);
    dout = testing::random_floats(c.tokens * x_stride, seed + 5);  // dout of unpermute
  }
  std::string what(const char* op) const { return std::string(op) + " " + c.name(); }
};

// moe_permute in double: out[r] = x[source[r] / top_k] (x with the case's stride), zeros for padding.
inline std::vector<double> reference_permute(const Problem& pr, const std::vector<double>& x) {
  std::vector<double> out(pr.rows * pr.c.hidden, 0.0);
  for (int64_t r = 0; r < pr.rows; ++r)
    if (pr.sorted.source[r] >= 0)
      for (int64_t i = 0; i < pr.c.hidden; ++i)
        out[r * pr.c.hidden + i] = x[(pr.sorted.source[r] / pr.c.top_k) * pr.x_stride + i];
  return out;
}

// moe_unpermute in double: out[t] = sum_j w[a] y[row_of[a]] (out with the case's stride, padding 0).
inline std::vector<double> reference_unpermute(const Problem& pr, const std::vector<double>& y,
                                               const std::vector<double>& w) {
  std::vector<double> out(pr.c.tokens * pr.x_stride, 0.0);
  for (int64_t t = 0; t < pr.c.tokens; ++t)
    for (int64_t j = 0; j < pr.c.top_k; ++j) {
      const int64_t a = t * pr.c.top_k + j, row = pr.sorted.row_of[a];
      if (row < 0) continue;
      for (int64_t i = 0; i < pr.c.hidden; ++i) out[t * pr.x_stride + i] += w[a] * y[row * pr.c.hidden + i];
    }
  return out;
}

// The token-side entries of a strided [tokens, hidden] array (the padding is never written).
inline std::vector<float> token_rows(const std::vector<float>& v, const Problem& pr) {
  std::vector<float> out;
  for (int64_t t = 0; t < pr.c.tokens; ++t)
    out.insert(out.end(), v.begin() + t * pr.x_stride, v.begin() + t * pr.x_stride + pr.c.hidden);
  return out;
}
inline std::vector<double> token_rows(const std::vector<double>& v, const Problem& pr) {
  std::vector<double> out;
  for (int64_t t = 0; t < pr.c.tokens; ++t)
    out.insert(out.end(), v.begin() + t * pr.x_stride, v.begin() + t * pr.x_stride + pr.c.hidden);
  return out;
}

// Every op's outputs on one device, from the problem's inputs (outputs start as NaN: overwritten, never
// read).
struct Results {
  std::vector<float> permuted, dx, combined, dy, dweights;
};

// The four ops on `on` over the problem's indices and these arrays (fp32 or bf16 rows).
struct OpArrays {
  ConstElements x, dsorted, y, dout;
  const float* weights;
  Elements permuted, dx, combined, dy;
  float* dweights;
};
inline void launch_ops(Device on, const Problem& pr, const OpArrays& a) {
  DeviceArray<int32_t> row_of(on, pr.sorted.row_of), source(on, pr.sorted.source);
  ops::MoePermuteParams p;
  p.tokens = pr.c.tokens, p.top_k = pr.c.top_k, p.hidden = pr.c.hidden, p.rows = pr.rows;
  p.row_of = row_of.data(), p.source = source.data();
  p.x = a.x, p.x_stride = pr.x_stride, p.out = a.permuted;
  p.dout = a.dsorted, p.dx = a.dx, p.dx_stride = pr.x_stride;
  FORGE_TEST_OP(moe_permute, on, p);
  FORGE_TEST_OP(moe_permute_backward, on, p);
  ops::MoeUnpermuteParams u;
  u.tokens = pr.c.tokens, u.top_k = pr.c.top_k, u.hidden = pr.c.hidden, u.rows = pr.rows;
  u.row_of = row_of.data(), u.source = source.data(), u.weights = a.weights, u.y = a.y;
  u.out = a.combined, u.out_stride = pr.x_stride;
  u.dout = a.dout, u.dout_stride = pr.x_stride, u.dy = a.dy, u.dweights = a.dweights;
  FORGE_TEST_OP(moe_unpermute, on, u);
  FORGE_TEST_OP(moe_unpermute_backward, on, u);
}

inline Results run_ops(Device on, const Problem& pr) {
  const int64_t tokens = pr.c.tokens, hidden = pr.c.hidden, n = tokens * pr.c.top_k;
  const float nan = std::nanf("");
  DeviceArray<float> x(on, pr.x), dsorted(on, pr.dsorted), weights(on, pr.weights), y(on, pr.y),
      dout(on, pr.dout);
  DeviceArray<float> permuted(on, std::vector<float>(pr.rows * hidden, nan));
  DeviceArray<float> dx(on, std::vector<float>(tokens * pr.x_stride, nan));
  DeviceArray<float> combined(on, std::vector<float>(tokens * pr.x_stride, nan));
  DeviceArray<float> dy(on, std::vector<float>(pr.rows * hidden, nan)),
      dweights(on, std::vector<float>(n, nan));
  launch_ops(on, pr,
             {x.data(), dsorted.data(), y.data(), dout.data(), weights.data(), permuted.data(), dx.data(),
              combined.data(), dy.data(), dweights.data()});
  return {permuted.download(), token_rows(dx.download(), pr), token_rows(combined.download(), pr),
          dy.download(), dweights.download()};
}

// The same ops over bf16 rows (every row tensor bf16; the weights and dweights fp32): the inputs are rounded
// to bf16 first, and each bf16 output must be the fp32 op's output on those inputs, on the same backend,
// rounded once (permute: a copy; the sums are taken in fp32); dweights, fp32 either way, within the dot
// products' reduction tolerance.
inline void expect_bf16_rows_round_the_fp32_results(Device on, Problem pr) {
  for (std::vector<float>* v : {&pr.x, &pr.dsorted, &pr.y, &pr.dout})
    for (float& f : *v) f = bf16_to_float(float_to_bf16(f));
  const Results want = run_ops(on, pr);
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
    return b;
  };
  const int64_t tokens = pr.c.tokens, hidden = pr.c.hidden;
  DeviceArray<uint16_t> x(on, bits(pr.x)), dsorted(on, bits(pr.dsorted)), y(on, bits(pr.y)),
      dout(on, bits(pr.dout));
  DeviceArray<float> weights(on, pr.weights), dweights(on, tokens * pr.c.top_k);
  DeviceArray<uint16_t> permuted(on, pr.rows * hidden), dx(on, tokens * pr.x_stride),
      combined(on, tokens * pr.x_stride), dy(on, pr.rows * hidden);
  launch_ops(on, pr,
             {x.data(), dsorted.data(), y.data(), dout.data(), weights.data(), permuted.data(), dx.data(),
              combined.data(), dy.data(), dweights.data()});
  auto widen = [](const std::vector<uint16_t>& b) {
    std::vector<float> v(b.size());
    for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
    return v;
  };
  auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = bf16_to_float(float_to_bf16(f));
    return v;
  };
  testing::expect_bitwise_equal(widen(permuted.download()), want.permuted, pr.what("bf16 moe_permute"));
  testing::expect_bitwise_equal(token_rows(widen(dx.download()), pr), rounded(want.dx),
                                pr.what("bf16 moe_permute_backward"));
  testing::expect_bitwise_equal(token_rows(widen(combined.download()), pr), rounded(want.combined),
                                pr.what("bf16 moe_unpermute"));
  testing::expect_bitwise_equal(widen(dy.download()), rounded(want.dy), pr.what("bf16 moe_unpermute dy"));
  // dweights: the same dot products, whose order of summation a kernel may vectorise differently per dtype.
  const int64_t k = pr.c.top_k;
  testing::expect_close(
      dweights.download(), want.dweights, pr.what("bf16 moe_unpermute dweights"), [&](size_t a) {
        const int32_t row = pr.sorted.row_of[a];
        double magnitude = 0;
        for (int64_t i = 0; row >= 0 && i < hidden; ++i)
          magnitude += std::abs(double{pr.dout[(a / k) * pr.x_stride + i]} * pr.y[row * hidden + i]);
        return 2 * testing::reduction_tolerance(hidden) * magnitude;
      });
}

class MoeSortOp : public testing::OpTest<Case> {};

TEST_P(MoeSortOp, IsTheStableSortWithCapacity) {
  const Case& c = test_case();
  const std::vector<int32_t> ids = random_ids(c, 5);
  const Sorted got = run_sort(device(), ids, c.tokens, c.top_k, c.experts, c.capacity, c.align, c.fill);
  expect_sorted_equal(got, reference_sort(ids, c.experts, c.capacity, c.align, c.fill), c.name());
  expect_aligned_segments(got, ids, c.capacity, c.align, c.name(), c.fill);
  // Dropless, the same ids.
  const Sorted dropless = run_sort(device(), ids, c.tokens, c.top_k, c.experts, 0, c.align);
  expect_sorted_equal(dropless, reference_sort(ids, c.experts, 0, c.align), c.name() + " dropless");
  expect_aligned_segments(dropless, ids, 0, c.align, c.name() + " dropless");
}

// Padding rows: zeros in permute's out and unpermute_backward's dy (both start as NaN).
inline void expect_padding_rows_zero(const Results& got, const Problem& pr, const std::string& what) {
  const int64_t hidden = pr.c.hidden;
  int64_t bad = 0;
  for (int64_t r = 0; r < pr.rows; ++r)
    if (pr.sorted.source[r] < 0)
      for (int64_t i = 0; i < hidden; ++i)
        bad += std::bit_cast<uint32_t>(got.permuted[r * hidden + i]) != 0u ||
               std::bit_cast<uint32_t>(got.dy[r * hidden + i]) != 0u;
  EXPECT_EQ(bad, 0) << what << ": padding rows' permuted or dy elements that are not +0";
}

class MoePermuteOp : public testing::OpTest<Case> {};

TEST_P(MoePermuteOp, Bf16RowsAreTheFp32ResultsRoundedOnce) {
  expect_bf16_rows_round_the_fp32_results(device(), Problem(test_case(), 23));
}

TEST_P(MoePermuteOp, MatchesTheReference) {
  const Problem pr(test_case(), 21);
  const Results cpu = run_ops(Device::cpu, pr);
  expect_padding_rows_zero(cpu, pr, pr.what("cpu"));
  if (!on_cpu()) {
    const Results got = run_ops(device(), pr);
    expect_padding_rows_zero(got, pr, pr.what("device"));
    testing::expect_bitwise_equal(got.permuted, cpu.permuted, pr.what("moe_permute"));
    testing::expect_bitwise_equal(got.dx, cpu.dx, pr.what("moe_permute_backward"));
    testing::expect_bitwise_equal(got.dy, cpu.dy, pr.what("moe_unpermute_backward dy"));
    const int64_t k = pr.c.top_k, hidden = pr.c.hidden;
    testing::expect_close(got.combined, cpu.combined, pr.what("moe_unpermute"), [&](size_t i) {
      const int64_t t = static_cast<int64_t>(i) / hidden, col = static_cast<int64_t>(i) % hidden;
      double magnitude = 0;
      for (int64_t j = 0; j < k; ++j)
        if (const int32_t row = pr.sorted.row_of[t * k + j]; row >= 0)
          magnitude += std::abs(double{pr.weights[t * k + j]} * pr.y[row * hidden + col]);
      return 2 * (k + 1) * testing::kU * magnitude;
    });
    testing::expect_close(
        got.dweights, cpu.dweights, pr.what("moe_unpermute_backward dweights"), [&](size_t a) {
          const int32_t row = pr.sorted.row_of[a];
          double magnitude = 0;
          for (int64_t i = 0; row >= 0 && i < hidden; ++i)
            magnitude += std::abs(double{pr.dout[(a / k) * pr.x_stride + i]} * pr.y[row * hidden + i]);
          return 2 * testing::reduction_tolerance(hidden) * magnitude;
        });
    return;
  }
  const auto x = testing::to_double(pr.x), y = testing::to_double(pr.y), w = testing::to_double(pr.weights);
  // Copies are exact.
  const std::vector<double> permuted = reference_permute(pr, x);
  EXPECT_EQ(testing::relative_error(cpu.permuted, permuted), 0.0) << pr.what("moe_permute");
  EXPECT_LT(testing::relative_error(cpu.combined, token_rows(reference_unpermute(pr, y, w), pr)), 1e-6);
  // dy is the exact product; dweights has zeros exactly where the assignment was dropped.
  for (int64_t a = 0; a < pr.c.tokens * pr.c.top_k; ++a)
    if (pr.sorted.row_of[a] < 0) {
      EXPECT_EQ(cpu.dweights[a], 0.0f) << "dropped assignment " << a;
    }
  if (!test_case().finite_differences()) return;
  // Gradients: the loss <dout, forward(input)>, differentiated numerically in double.
  const auto dsorted = testing::to_double(pr.dsorted), dout = testing::to_double(pr.dout);
  const auto dx = testing::finite_difference(
      [&](const std::vector<double>& v) { return testing::dot(dsorted, reference_permute(pr, v)); }, x);
  EXPECT_LT(testing::relative_error(cpu.dx, token_rows(dx, pr)), 1e-6) << pr.what("moe_permute_backward");
  const auto dy = testing::finite_difference(
      [&](const std::vector<double>& v) { return testing::dot(dout, reference_unpermute(pr, v, w)); }, y);
  if (pr.rows > 0) {
    EXPECT_LT(testing::relative_error(cpu.dy, dy), 1e-6) << pr.what("moe_unpermute_backward dy");
  }
  const auto dw = testing::finite_difference(
      [&](const std::vector<double>& v) { return testing::dot(dout, reference_unpermute(pr, y, v)); }, w);
  EXPECT_LT(testing::relative_error(cpu.dweights, dw), 1e-5) << pr.what("moe_unpermute_backward dweights");
}

// The same inputs give the same bits (no atomics, no order left to the scheduler).
TEST_P(MoePermuteOp, RepeatedCallsGiveTheSameBits) {
  const Problem pr(test_case(), 31);
  const Results first = run_ops(device(), pr), second = run_ops(device(), pr);
  testing::expect_bitwise_equal(second.dx, first.dx, "dx");
  testing::expect_bitwise_equal(second.combined, first.combined, "combined");
  testing::expect_bitwise_equal(second.dweights, first.dweights, "dweights");
}

// The sorted rows of `from` (an array [from.rows, hidden]) in the order of `to`'s rows: row_of[a]'s row of
// `from` goes to row_of[a] of `to`, padding rows of `to` get `fill`.
inline std::vector<float> move_rows(const std::vector<float>& v, const Problem& from, const Problem& to,
                                    float fill) {
  const int64_t hidden = from.c.hidden;
  std::vector<float> out(to.rows * hidden, fill);
  for (size_t a = 0; a < from.sorted.row_of.size(); ++a)
    if (const int32_t row = from.sorted.row_of[a]; row >= 0)
      std::copy_n(v.begin() + row * hidden, hidden, out.begin() + to.sorted.row_of[a] * hidden);
  return out;
}

// Padding changes nothing but the sorted rows: with the same ids and token-side inputs, and the sorted-side
// inputs moved to the padded rows (NaN in the padding rows, which no op may read), dx, the combination and
// dweights are bitwise those of align 1 without filling to the capacity, and the kept rows of permuted and
// dy are its rows.
TEST_P(MoePermuteOp, PaddingChangesOnlyTheSortedRows) {
  Case flat_case = test_case();
  flat_case.align = 1, flat_case.fill = false;
  const Problem flat(flat_case, 41);
  const Results want = run_ops(device(), flat);
  for (int64_t align : {int64_t{1}, int64_t{4}, int64_t{16}}) {
    Case c = test_case();
    c.align = align;
    if (align == 1 && !c.fill) continue;  // that is flat_case
    Problem padded(c, 41);
    ASSERT_EQ(padded.ids, flat.ids);
    for (size_t a = 0; a < flat.sorted.row_of.size(); ++a)
      ASSERT_EQ(padded.sorted.row_of[a] < 0, flat.sorted.row_of[a] < 0) << "assignment " << a;
    padded.y = move_rows(flat.y, flat, padded, std::nanf(""));
    padded.dsorted = move_rows(flat.dsorted, flat, padded, std::nanf(""));
    const Results got = run_ops(device(), padded);
    const std::string what = padded.what("padded") + " to " + std::to_string(align);
    expect_padding_rows_zero(got, padded, what);
    testing::expect_bitwise_equal(got.dx, want.dx, what + " dx");
    testing::expect_bitwise_equal(got.combined, want.combined, what + " combined");
    testing::expect_bitwise_equal(got.dweights, want.dweights, what + " dweights");
    testing::expect_bitwise_equal(move_rows(got.permuted, padded, flat, 0.0f), want.permuted,
                                  what + " permuted");
    testing::expect_bitwise_equal(move_rows(got.dy, padded, flat, 0.0f), want.dy, what + " dy");
  }
}

// A hand-worked example: 4 tokens, top 2 of 4 experts (expert 3 unused), dropless and with capacity 2.
class MoeSortFixed : public testing::OpTest<testing::FixedCase> {};

TEST_P(MoeSortFixed, StableOrderCapacityAndEmptyExperts) {
  // Assignment a = t * 2 + j:   a: 0  1  2  3  4  5  6  7
  const std::vector<int32_t> ids = {2, 0, 0, 2, 2, 1, 0, 2};
  Sorted dropless = run_sort(device(), ids, 4, 2, 4, 0);
  EXPECT_EQ(dropless.offsets, (std::vector<int64_t>{0, 3, 4, 8, 8}));
  EXPECT_EQ(dropless.counts, (std::vector<int64_t>{3, 1, 4, 0}));
  EXPECT_EQ(dropless.source, (std::vector<int32_t>{1, 2, 6, 5, 0, 3, 4, 7}));
  EXPECT_EQ(dropless.row_of, (std::vector<int32_t>{4, 0, 1, 5, 6, 3, 2, 7}));
  // Capacity 2: expert 0 drops its third assignment (6), expert 2 its last two (4, 7); counts are before the
  // drop; source ends in -1 past the 5 kept rows.
  Sorted capped = run_sort(device(), ids, 4, 2, 4, 2);
  EXPECT_EQ(capped.offsets, (std::vector<int64_t>{0, 2, 3, 5, 5}));
  EXPECT_EQ(capped.counts, (std::vector<int64_t>{3, 1, 4, 0}));
  EXPECT_EQ(capped.source, (std::vector<int32_t>{1, 2, 5, 0, 3, -1, -1, -1}));
  EXPECT_EQ(capped.row_of, (std::vector<int32_t>{3, 0, 1, 4, -1, 2, -1, -1}));
  // No tokens: offsets all zero, counts zero.
  Sorted none = run_sort(device(), {}, 0, 2, 3, 0);
  EXPECT_EQ(none.offsets, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(none.counts, (std::vector<int64_t>{0, 0, 0}));
}

// The same ids with align 4: every non-empty segment is 4 rows, padding last; expert 3 stays empty.
TEST_P(MoeSortFixed, AlignPadsEachExpertsSegment) {
  const std::vector<int32_t> ids = {2, 0, 0, 2, 2, 1, 0, 2};
  const int32_t _ = -1;  // padding, and past R
  Sorted dropless = run_sort(device(), ids, 4, 2, 4, 0, 4);
  EXPECT_EQ(dropless.offsets, (std::vector<int64_t>{0, 4, 8, 12, 12}));
  EXPECT_EQ(dropless.counts, (std::vector<int64_t>{3, 1, 4, 0}));
  EXPECT_EQ(dropless.source, (std::vector<int32_t>{1, 2, 6, _, 5, _, _, _, 0, 3, 4, 7,  // R = 12
                                                   _, _, _, _, _, _, _, _}));           // 8 + 4 * 3
  EXPECT_EQ(dropless.row_of, (std::vector<int32_t>{8, 0, 1, 9, 10, 4, 2, 11}));
  // Capacity 2: counts stay before the drop and without padding.
  Sorted capped = run_sort(device(), ids, 4, 2, 4, 2, 4);
  EXPECT_EQ(capped.offsets, (std::vector<int64_t>{0, 4, 8, 12, 12}));
  EXPECT_EQ(capped.counts, (std::vector<int64_t>{3, 1, 4, 0}));
  EXPECT_EQ(capped.source,
            (std::vector<int32_t>{1, 2, _, _, 5, _, _, _, 0, 3, _, _, _, _, _, _, _, _, _, _}));
  EXPECT_EQ(capped.row_of, (std::vector<int32_t>{8, 0, 1, 9, _, 4, _, _}));
  // Align 16, capacity 3: expert 2 drops its last assignment (7), each non-empty segment is 16 rows.
  Sorted wide = run_sort(device(), ids, 4, 2, 4, 3, 16);
  EXPECT_EQ(wide.offsets, (std::vector<int64_t>{0, 16, 32, 48, 48}));
  EXPECT_EQ(wide.row_of, (std::vector<int32_t>{32, 0, 1, 33, 34, 16, 2, _}));
  EXPECT_EQ(wide.source.size(), 8u + 4 * 15);
  // No tokens: empty segments, and source (3 * 15 entries) all -1.
  Sorted none = run_sort(device(), {}, 0, 2, 3, 0, 16);
  EXPECT_EQ(none.offsets, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(none.counts, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(none.source, std::vector<int32_t>(45, -1));
}

// The same ids filled to capacity 2: every expert's segment is 2 rows, the unused expert 3's too.
TEST_P(MoeSortFixed, PadToCapacityFillsEverySegment) {
  const std::vector<int32_t> ids = {2, 0, 0, 2, 2, 1, 0, 2};
  const int32_t _ = -1;
  Sorted filled = run_sort(device(), ids, 4, 2, 4, 2, 1, true);
  EXPECT_EQ(filled.offsets, (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(filled.counts, (std::vector<int64_t>{3, 1, 4, 0}));
  EXPECT_EQ(filled.source, (std::vector<int32_t>{1, 2, 5, _, 0, 3, _, _}));
  EXPECT_EQ(filled.row_of, (std::vector<int32_t>{4, 0, 1, 5, _, 2, _, _}));
  // Align 4 on top: segments of 4. No tokens: still every segment, all padding.
  Sorted aligned = run_sort(device(), ids, 4, 2, 4, 2, 4, true);
  EXPECT_EQ(aligned.offsets, (std::vector<int64_t>{0, 4, 8, 12, 16}));
  Sorted none = run_sort(device(), {}, 0, 2, 3, 2, 1, true);
  EXPECT_EQ(none.offsets, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(none.source, std::vector<int32_t>(6, -1));
  // Without a capacity there is nothing to fill to: the support query refuses it, in one line.
  ops::MoeSortParams p;
  p.tokens = 4, p.top_k = 2, p.experts = 4, p.pad_to_capacity = true;
  std::string why;
  EXPECT_FALSE(ops::supports_moe_sort_by_expert(p, device(), &why));
  EXPECT_NE(why.find("pad_to_capacity needs a capacity"), std::string::npos) << why;
}

TEST_P(MoeSortFixed, AnExpertIdOutOfRangeIsOneLine) {
  for (int32_t bad : {4, -1}) {
    const std::vector<int32_t> ids = {2, 0, 0, 2, 1, bad, 0, 2};
    testing::expect_error_containing([&] { run_sort(device(), ids, 4, 2, 4, 0); },
                                     {"moe_sort_by_expert", "expert id " + std::to_string(bad),
                                      "assignment 5 (token 2, choice 1)", "outside [0, 4)"});
  }
}

}  // namespace forge::op_tests::moe_permute
