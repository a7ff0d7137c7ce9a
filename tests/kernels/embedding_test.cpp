#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <string>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

struct Problem {
  int64_t rows = 11, dim = 37, vocab = 6;
  std::vector<int32_t> ids = {3, 0, 5, 3, 3, 1, 0, 5, 2, 3, 4};  // repeated ids: the scatter must add
  std::vector<float> weight, dout, out, dweight;
  Problem() {
    weight = testing::random_floats(vocab * dim, 41);
    dout = testing::random_floats(rows * dim, 42);
    out.assign(rows * dim, 0);
    dweight = testing::random_floats(vocab * dim, 43);  // accumulated onto
  }
  ops::EmbeddingParams params() {
    ops::EmbeddingParams p;
    p.rows = rows, p.dim = dim, p.vocab = vocab, p.ids = ids.data();
    p.weight = weight.data(), p.out = out.data(), p.dout = dout.data(), p.dweight = dweight.data();
    return p;
  }
  // out as a function of the table, in double.
  std::vector<double> reference_forward(const std::vector<double>& table) const {
    std::vector<double> y(rows * dim);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < dim; ++j) y[r * dim + j] = table[ids[r] * dim + j];
    return y;
  }
};

TEST(Embedding, ForwardGathersRows) {
  Problem pr;
  ops::embedding_forward(pr.params());
  for (int64_t r = 0; r < pr.rows; ++r)
    EXPECT_EQ(0, std::memcmp(&pr.out[r * pr.dim], &pr.weight[pr.ids[r] * pr.dim], pr.dim * sizeof(float)))
        << r;
}

TEST(Embedding, BackwardWeightMatchesFiniteDifferences) {
  Problem pr;
  const auto initial = pr.dweight;
  ops::embedding_backward_weight(pr.params());
  const auto doutd = testing::to_double(pr.dout);
  auto fd = testing::finite_difference(
      [&](const std::vector<double>& table) { return testing::dot(doutd, pr.reference_forward(table)); },
      testing::to_double(pr.weight));
  std::vector<float> delta(pr.dweight.size());
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = pr.dweight[i] - initial[i];
  EXPECT_LT(testing::relative_error(delta, fd), 1e-6);
}

TEST(Embedding, BackwardWeightDoesNotDependOnThreadCount) {
  Problem one, two;
  // Many rows hitting few ids, so different threads would race on the same rows without ownership.
  for (auto* pr : {&one, &two}) {
    pr->rows = 500, pr->dim = 100;
    pr->ids.resize(pr->rows);
    for (int64_t r = 0; r < pr->rows; ++r) pr->ids[r] = static_cast<int32_t>((r * 7) % pr->vocab);
    pr->dout = testing::random_floats(pr->rows * pr->dim, 44);
    pr->weight.assign(pr->vocab * pr->dim, 0);
    pr->dweight.assign(pr->vocab * pr->dim, 0);
  }
  testing::with_threads(1, [&] { ops::embedding_backward_weight(one.params()); });
  testing::with_threads(2, [&] { ops::embedding_backward_weight(two.params()); });
  EXPECT_EQ(0, std::memcmp(one.dweight.data(), two.dweight.data(), one.dweight.size() * sizeof(float)));
}

// Vocabulary-parallel: the table holds global rows [first, first + vocab); other ids give zero rows and no
// gradient (another rank holds them). Ids 0..5 of Problem against rows [2, 5) of them.
TEST(Embedding, VocabularyParallelRangeTakesOnlyItsIds) {
  Problem pr;
  const auto initial = pr.dweight;
  ops::EmbeddingParams p = pr.params();
  p.vocab_parallel = true, p.first = 2, p.vocab = 3;
  ops::embedding_forward(p);
  ops::embedding_backward_weight(p);
  std::vector<float> want_dweight = initial;
  for (int64_t r = 0; r < pr.rows; ++r) {
    const int64_t local = pr.ids[r] - 2;
    const bool mine = local >= 0 && local < 3;
    for (int64_t j = 0; j < pr.dim; ++j) {
      EXPECT_EQ(pr.out[r * pr.dim + j], mine ? pr.weight[local * pr.dim + j] : 0.0f) << r << "," << j;
      if (mine) want_dweight[local * pr.dim + j] += pr.dout[r * pr.dim + j];
    }
  }
  EXPECT_EQ(pr.dweight, want_dweight);  // rows added in increasing order: bitwise
}

TEST(Embedding, OutOfRangeIdThrowsNamingIdAndRow) {
  for (int32_t bad : {6, -1}) {
    Problem pr;
    pr.ids[4] = bad;
    for (bool backward : {false, true}) {
      try {
        backward ? ops::embedding_backward_weight(pr.params()) : ops::embedding_forward(pr.params());
        ADD_FAILURE() << "no exception for id " << bad;
      } catch (const Error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("id " + std::to_string(bad)), std::string::npos) << message;
        EXPECT_NE(message.find("row 4"), std::string::npos) << message;
      }
    }
  }
}

}  // namespace
}  // namespace forge
