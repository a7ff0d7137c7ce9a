// Embedding lookup and its weight gradient (ops::embedding_*), written once for every backend (op_harness.h):
// on the CPU against the gathered rows and the double-precision sum of each id's gradient rows (and finite
// differences where small), elsewhere against the CPU kernel, bitwise: the forward is a copy, and every
// backend adds each id's rows onto dweight[id] one after another in row order.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::embedding {

using testing::DeviceArray;

struct Case {
  int64_t rows, dim, vocab;
  double skew;  // fraction of rows that take id vocab / 2 (a frequent token)
  std::string name() const {
    return "rows" + std::to_string(rows) + "_dim" + std::to_string(dim) + "_vocab" + std::to_string(vocab) +
           (skew > 0 ? "_skewed" : "");
  }
  bool finite_differences() const { return vocab * dim * rows * dim <= 100000000; }
};

inline const std::vector<Case> kCases = {
    {11, 37, 6, 0.0},      {37, 200, 50, 0.0},      {1000, 129, 7, 0.0},  // many repeats of few ids
    {1000, 300, 97, 0.6},                            // one frequent id; most of the table untouched
    {5, 1, 1, 0.0},        {20000, 33, 70000, 0.1},  // a wide vocabulary: several radix passes
    {4099, 257, 501, 0.3},
};

struct Problem {
  Case c;
  std::vector<int32_t> ids;
  std::vector<float> weight, dout, dweight;
  Problem(const Case& c_, uint32_t seed) : c(c_) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(c.vocab) - 1);
    ids.resize(c.rows);
    for (auto& v : ids) v = id(gen);
    std::mt19937 skew_gen(seed + 1);
    std::uniform_real_distribution<double> coin(0, 1);
    for (auto& v : ids)
      if (coin(skew_gen) < c.skew) v = static_cast<int32_t>(c.vocab / 2);
    weight = testing::random_floats(c.vocab * c.dim, seed + 2);
    dout = testing::random_floats(c.rows * c.dim, seed + 3);
    dweight = testing::random_floats(c.vocab * c.dim, seed + 4);  // accumulated onto
  }
  std::string what(const char* op) const { return std::string(op) + " " + c.name(); }
};

// Every array of the ops on one device; `local` rows of the tables (the whole vocabulary unless
// vocab-parallel).
struct Buffers {
  DeviceArray<int32_t> ids;
  DeviceArray<float> weight, out, dout, dweight;
  Buffers(Device device, const Problem& pr, int64_t local)
      : ids(device, pr.ids),
        weight(device, std::vector<float>(pr.weight.begin(), pr.weight.begin() + local * pr.c.dim)),
        out(device, pr.c.rows * pr.c.dim),
        dout(device, pr.dout),
        dweight(device, std::vector<float>(pr.dweight.begin(), pr.dweight.begin() + local * pr.c.dim)) {}
  ops::EmbeddingParams params(const Problem& pr, int64_t local) {
    ops::EmbeddingParams p;
    p.rows = pr.c.rows, p.dim = pr.c.dim, p.vocab = local;
    p.ids = ids.data(), p.weight = weight.data(), p.out = out.data(), p.dout = dout.data();
    p.dweight = dweight.data();
    return p;
  }
};

class EmbeddingOp : public testing::OpTest<Case> {
 protected:
  // out (forward) or dweight (backward_weight) of the op on `on`.
  static std::vector<float> run(Device on, const Problem& pr, bool backward) {
    Buffers b(on, pr, pr.c.vocab);
    if (!backward) {
      FORGE_TEST_OP(embedding_forward, on, b.params(pr, pr.c.vocab));
      return b.out.download();
    }
    FORGE_TEST_OP(embedding_backward_weight, on, b.params(pr, pr.c.vocab));
    return b.dweight.download();
  }
};

TEST_P(EmbeddingOp, ForwardGathersRows) {
  const Problem pr(test_case(), 80);
  const int64_t dim = pr.c.dim;
  const std::vector<float> cpu = run(Device::cpu, pr, false);
  if (on_cpu()) {
    for (int64_t r = 0; r < pr.c.rows; ++r)
      EXPECT_EQ(0, std::memcmp(&cpu[r * dim], &pr.weight[pr.ids[r] * dim], dim * sizeof(float))) << r;
    return;
  }
  testing::expect_bitwise_equal(run(device(), pr, false), cpu, pr.what("embedding_forward"));
}

// bf16 rows (the distributed optimizer's bf16 weights): out is each row widened exactly, on every backend,
// plain and vocabulary-parallel.
TEST_P(EmbeddingOp, Bf16RowsWidenExactly) {
  const Problem pr(test_case(), 85);
  const int64_t rows = pr.c.rows, dim = pr.c.dim;
  std::vector<uint16_t> table(pr.weight.size());
  for (size_t i = 0; i < table.size(); ++i) table[i] = f32_to_bf16_bits(pr.weight[i]);
  for (bool parallel : {false, true}) {
    const int64_t first = parallel ? pr.c.vocab / 3 : 0;
    const int64_t local = parallel ? std::max<int64_t>(1, pr.c.vocab / 3) : pr.c.vocab;
    Buffers b(device(), pr, local);
    DeviceArray<uint16_t> weight(device(), std::vector<uint16_t>(table.begin(), table.begin() + local * dim));
    ops::EmbeddingParams p = b.params(pr, local);
    p.weight = weight.data(), p.vocab_parallel = parallel, p.first = first;
    FORGE_TEST_OP(embedding_forward, device(), p);
    const std::vector<float> out = b.out.download();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = pr.ids[r] - first;
      const bool mine = row >= 0 && row < local;
      for (int64_t j = 0; j < dim; ++j)
        ASSERT_EQ(out[r * dim + j], mine ? bf16_bits_to_f32(table[row * dim + j]) : 0.0f)
            << pr.what("bf16 embedding_forward") << (parallel ? " vocab-parallel" : "") << " row " << r << ", "
            << j;
    }
  }
}

TEST_P(EmbeddingOp, BackwardWeight) {
  const Problem pr(test_case(), 90);
  const int64_t rows = pr.c.rows, dim = pr.c.dim;
  const std::vector<float> cpu = run(Device::cpu, pr, true);
  if (!on_cpu()) {
    testing::expect_bitwise_equal(run(device(), pr, true), cpu, pr.what("embedding_backward_weight"));
    return;
  }
  // dweight + each id's dout rows, in double: a float sum of count additions errs by at most count ulps of
  // the sum of its terms' magnitudes (u = 2^-24 each, to first order).
  std::vector<double> want(pr.dweight.begin(), pr.dweight.end()), magnitude(cpu.size());
  std::vector<int64_t> count(pr.c.vocab, 0);
  for (size_t i = 0; i < magnitude.size(); ++i) magnitude[i] = std::abs(pr.dweight[i]);
  for (int64_t r = 0; r < rows; ++r) {
    count[pr.ids[r]] += 1;
    for (int64_t j = 0; j < dim; ++j) {
      want[pr.ids[r] * dim + j] += pr.dout[r * dim + j];
      magnitude[pr.ids[r] * dim + j] += std::abs(pr.dout[r * dim + j]);
    }
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cpu.size(); ++i)
    if (std::abs(double{cpu[i]} - want[i]) > (count[i / dim] + 1) * testing::kU * magnitude[i] && bad++ == 0)
      first = i;
  EXPECT_EQ(bad, 0u) << pr.what("embedding_backward_weight") << ": first at " << first << ": " << cpu[first]
                     << ", want " << want[first];
  // For small tables also the finite differences of <dout, out(weight)>.
  if (!test_case().finite_differences()) return;
  std::vector<float> delta(cpu.size());
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = cpu[i] - pr.dweight[i];
  const auto doutd = testing::to_double(pr.dout);
  const auto fd = testing::finite_difference(
      [&](const std::vector<double>& table) {
        double s = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < dim; ++j) s += doutd[r * dim + j] * table[pr.ids[r] * dim + j];
        return s;
      },
      testing::to_double(pr.weight));
  EXPECT_LT(testing::relative_error(delta, fd), 1e-6);
}

// Vocabulary-parallel: the table holds global rows [first, first + local); the ids of other ranks' ranges
// give zero rows and no gradient. A middle third of each case's vocabulary, both ops.
TEST_P(EmbeddingOp, VocabularyParallelRangeTakesOnlyItsIds) {
  const Problem pr(test_case(), 110);
  const int64_t rows = pr.c.rows, dim = pr.c.dim;
  const int64_t first = pr.c.vocab / 3, local = std::max<int64_t>(1, pr.c.vocab / 3);
  auto run_parallel = [&](Device on) {
    Buffers b(on, pr, local);
    ops::EmbeddingParams p = b.params(pr, local);
    p.vocab_parallel = true, p.first = first;
    FORGE_TEST_OP(embedding_forward, on, p);
    FORGE_TEST_OP(embedding_backward_weight, on, p);
    return std::pair{b.out.download(), b.dweight.download()};
  };
  const auto [out, dweight] = run_parallel(Device::cpu);
  if (!on_cpu()) {
    const auto [got_out, got_dweight] = run_parallel(device());
    testing::expect_bitwise_equal(got_out, out, pr.what("vocab-parallel embedding_forward"));
    testing::expect_bitwise_equal(got_dweight, dweight, pr.what("vocab-parallel embedding_backward_weight"));
    return;
  }
  std::vector<float> want_dweight(pr.dweight.begin(), pr.dweight.begin() + local * dim);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = pr.ids[r] - first;
    const bool mine = row >= 0 && row < local;
    for (int64_t j = 0; j < dim; ++j) {
      ASSERT_EQ(out[r * dim + j], mine ? pr.weight[row * dim + j] : 0.0f) << r << "," << j;
      if (mine) want_dweight[row * dim + j] += pr.dout[r * dim + j];
    }
  }
  EXPECT_EQ(dweight, want_dweight);  // rows added in increasing order: bitwise
}

TEST_P(EmbeddingOp, BackwardWeightIsBitwiseRepeatable) {
  const Problem pr(test_case(), 100);
  const std::vector<float> first = run(device(), pr, true);
  for (int run_index = 1; run_index < 3; ++run_index)
    testing::expect_bitwise_equal(run(device(), pr, true), first,
                                  pr.what("embedding_backward_weight") + " run " + std::to_string(run_index));
}

// An id outside [0, vocab) fails both ops with one line naming the id and its row (the first bad row, when
// there are several), before anything is written.
TEST_P(EmbeddingOp, RejectsIdsOutsideTheVocabulary) {
  const Problem pr(test_case(), 110);
  const int64_t rows = pr.c.rows, vocab = pr.c.vocab;
  const std::vector<std::pair<int64_t, int64_t>> bad = {{std::min<int64_t>(3, rows - 1), -1},
                                                        {rows - 1, vocab},
                                                        {0, int64_t{1} << 30},
                                                        {4 % rows, vocab},
                                                        {4 % rows, -1}};
  for (auto [row, id] : bad) {
    Problem wrong = pr;
    wrong.ids[row] = static_cast<int32_t>(id);
    if (row != rows - 1) wrong.ids[rows - 1] = -7;  // a later bad row: the first one is reported
    Buffers b(device(), wrong, vocab);
    const ops::EmbeddingParams p = b.params(wrong, vocab);
    const std::string token = "token id " + std::to_string(id), at = "at row " + std::to_string(row);
    const std::string range = "[0, " + std::to_string(vocab) + ")";
    testing::expect_error_containing([&] { ops::embedding_forward(p, device()); },
                                     {"embedding_forward", token, at, range});
    testing::expect_error_containing([&] { ops::embedding_backward_weight(p, device()); },
                                     {"embedding_backward_weight", token, at, range});
    testing::expect_bitwise_equal(b.dweight.download(), pr.dweight, pr.what("dweight after a bad id"));
  }
}

}  // namespace forge::op_tests::embedding
