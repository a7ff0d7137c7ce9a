// Sampling (temperature, top-k, top-p in Hugging Face's order, greedy) against an independent reference of
// the distribution each setting defines, and generation's contracts: determinism by seed, a draw per token
// that depends only on (seed, n), stop tokens, the context limit, streaming, and refused settings.
#include "forge/models/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

#include "forge/models/llama/llama_model.h"
#include "op_harness.h"

namespace forge::sampling_test {
using namespace forge::models;
namespace {

SamplingOptions settings(double temperature, int64_t top_k, double top_p) {
  SamplingOptions o;
  o.temperature = temperature, o.top_k = top_k, o.top_p = top_p;
  return o;
}

// The distribution a setting defines, computed plainly: softmax(logits / T) in double; keep the top_k most
// likely (ties: lower id); renormalise; keep the shortest most-likely prefix with mass >= top_p; renormalise.
// Returns (token, probability) in decreasing probability.
std::vector<std::pair<int32_t, double>> reference_distribution(const std::vector<float>& logits, double t,
                                                               int64_t top_k, double top_p) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double top = logits[order[0]];
  std::vector<std::pair<int32_t, double>> kept;
  for (int32_t id : order) kept.push_back({id, std::exp((logits[id] - top) / t)});
  if (top_k > 0 && top_k < vocab) kept.resize(top_k);
  auto normalise = [&] {
    double total = 0;
    for (auto& [id, p] : kept) total += p;
    for (auto& [id, p] : kept) p /= total;
  };
  normalise();
  double mass = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    mass += kept[i].second;
    if (mass >= top_p) {
      kept.resize(i + 1);
      break;
    }
  }
  normalise();
  return kept;
}

std::vector<float> spread_logits(int64_t vocab, uint32_t seed) {
  return testing::random_floats(vocab, seed, -3, 3);
}

TEST(PickToken, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  for (double draw : {0.0, 0.3, 0.999}) {
    EXPECT_EQ(pick_token(logits.data(), 5, settings(0, 0, 1), draw), 1);
    EXPECT_EQ(pick_token(logits.data(), 5, settings(0, 3, 0.5), draw), 1);
  }
}

TEST(PickToken, TopKOneAndTinyTopPAreGreedy) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::vector<float> logits = spread_logits(50, seed);
    logits[seed % 50] = logits[(seed * 7 + 3) % 50] = 10.0f;  // a tie at the top in most rows
    const int32_t greedy = pick_token(logits.data(), 50, settings(0, 0, 1), 0.5);
    for (double draw : {0.0, 0.37, 0.999999}) {
      EXPECT_EQ(pick_token(logits.data(), 50, settings(1.3, 1, 1), draw), greedy);
      EXPECT_EQ(pick_token(logits.data(), 50, settings(1.3, 0, 1e-9), draw), greedy);
      EXPECT_EQ(pick_token(logits.data(), 50, settings(0.7, 5, 1e-9), draw), greedy);
    }
  }
}

// Without truncation the draw walks the cumulative distribution of softmax(logits / T) in id order; top-p 1
// and top-k >= vocab are no truncation.
TEST(PickToken, PlainSamplingIsTheInverseCdfInIdOrder) {
  const int64_t vocab = 40;
  const std::vector<float> logits = spread_logits(vocab, 3);
  for (double t : {0.5, 1.0, 2.0}) {
    std::vector<double> cdf(vocab);
    double total = 0;
    for (int64_t i = 0; i < vocab; ++i) total += std::exp(logits[i] / t);
    double running = 0;
    for (int64_t i = 0; i < vocab; ++i) cdf[i] = (running += std::exp(logits[i] / t) / total);
    for (int i = 0; i < 200; ++i) {
      const double draw = (i + 0.5) / 200;
      const int32_t want = static_cast<int32_t>(std::upper_bound(cdf.begin(), cdf.end(), draw) - cdf.begin());
      // Draws within rounding of a boundary may go either way.
      if (std::abs(cdf[want] - draw) < 1e-9 || (want > 0 && std::abs(cdf[want - 1] - draw) < 1e-9)) continue;
      EXPECT_EQ(pick_token(logits.data(), vocab, settings(t, 0, 1), draw), want)
          << "t " << t << " draw " << draw;
      EXPECT_EQ(pick_token(logits.data(), vocab, settings(t, vocab, 1), draw), want);
      EXPECT_EQ(pick_token(logits.data(), vocab, settings(t, vocab + 5, 1.0), draw), want);
    }
  }
}

// With truncation the draw walks the kept tokens from the most likely: each token owns an interval of draws
// as long as its probability under the reference distribution.
TEST(PickToken, TruncatedSamplingFollowsTheReferenceDistribution) {
  const int64_t vocab = 300;  // more than the first sorted prefix (64), so the lazy sort must extend
  struct Setting {
    double t;
    int64_t k;
    double p;
  };
  for (const Setting s : {Setting{1.0, 5, 1.0}, Setting{0.8, 0, 0.9}, Setting{1.5, 0, 0.999},
                          Setting{1.0, 20, 0.5}, Setting{3.0, 250, 0.95}, Setting{0.6, 0, 0.3}}) {
    const std::vector<float> logits = spread_logits(vocab, 17);
    const auto want = reference_distribution(logits, s.t, s.k, s.p);
    double start = 0;
    for (const auto& [id, probability] : want) {
      // The middle of this token's interval of draws, away from rounding at its edges.
      const double draw = start + probability / 2;
      EXPECT_EQ(pick_token(logits.data(), vocab, settings(s.t, s.k, s.p), draw), id)
          << "t " << s.t << " k " << s.k << " p " << s.p << " draw " << draw;
      start += probability;
    }
    // No draw reaches beyond the kept set.
    std::set<int32_t> kept;
    for (const auto& [id, probability] : want) kept.insert(id);
    for (int i = 0; i < 100; ++i)
      EXPECT_TRUE(kept.count(pick_token(logits.data(), vocab, settings(s.t, s.k, s.p), i / 100.0)));
  }
}

// Hugging Face order: top-p measures mass after top-k renormalised. Probabilities 0.5, 0.3, 0.2: top-k 2
// renormalises to 0.625, 0.375, so top-p 0.6 keeps one token (over the full distribution it would keep two).
TEST(PickToken, TopPAppliesAfterTopK) {
  const std::vector<float> logits = {std::log(0.3f), std::log(0.5f), std::log(0.2f)};
  for (double draw : {0.1, 0.7, 0.99}) EXPECT_EQ(pick_token(logits.data(), 3, settings(1, 2, 0.6), draw), 1);
  EXPECT_EQ(pick_token(logits.data(), 3, settings(1, 0, 0.6), 0.9), 0);  // without top-k: 0.5 < 0.6, two kept
}

TEST(PickToken, RefusesNaNLogits) {
  std::vector<float> logits = {0.0f, std::nanf(""), 1.0f};
  testing::expect_error_containing([&] { pick_token(logits.data(), 3, settings(1, 0, 1), 0.5); },
                                   {"token 1", "NaN"});
}

// A small model with spread-out logits (init std 0.5), so sampling has real choices.
class Generation : public ::testing::Test {
 protected:
  void SetUp() override {
    LlamaConfig c;
    c.hidden_size = 32, c.intermediate_size = 64, c.num_hidden_layers = 2, c.num_attention_heads = 4;
    c.num_key_value_heads = 2, c.head_dim = 8, c.vocab_size = 50, c.max_position_embeddings = 48;
    model_ = std::make_unique<LlamaModel>(c, nn::ComputeOptions{DType::f32, nn::Recompute::none}, 0.5f);
    model_->initialize(99);
  }
  std::unique_ptr<LlamaModel> model_;
  const std::vector<int32_t> prompt_ = {1, 7, 3, 42};
};

TEST_F(Generation, DeterministicBySeedAndPrefixStable) {
  SamplingOptions o = settings(1.0, 20, 0.9);
  o.max_new_tokens = 30, o.seed = 5;
  const auto a = generate_sequence(*model_, prompt_, o).tokens;
  EXPECT_EQ(a, generate_sequence(*model_, prompt_, o).tokens);
  ASSERT_EQ(a.size(), 30u);
  // The draw for token n depends only on (seed, n): a shorter run is a prefix of the longer one.
  o.max_new_tokens = 12;
  const auto shorter = generate_sequence(*model_, prompt_, o).tokens;
  EXPECT_EQ(shorter, std::vector<int32_t>(a.begin(), a.begin() + 12));
  o.max_new_tokens = 30, o.seed = 6;
  EXPECT_NE(a, generate_sequence(*model_, prompt_, o).tokens);
  EXPECT_EQ(sampling_draw(5, 3), sampling_draw(5, 3));
  EXPECT_NE(sampling_draw(5, 3), sampling_draw(5, 4));
  EXPECT_NE(sampling_draw(5, 3), sampling_draw(6, 3));
}

// A vocabulary limit (the tokenizer's, under a padded model vocabulary) keeps every draw below it, and is
// the greedy choice among those ids; a negative one is refused.
TEST_F(Generation, VocabLimitKeepsDrawsBelowIt) {
  SamplingOptions o = settings(1.5, 0, 1);
  o.max_new_tokens = 40;
  const auto free_run = generate_sequence(*model_, prompt_, o).tokens;
  ASSERT_TRUE(std::any_of(free_run.begin(), free_run.end(), [](int32_t t) { return t >= 10; }));
  o.vocab_limit = 10;
  for (int32_t t : generate_sequence(*model_, prompt_, o).tokens) EXPECT_LT(t, 10);
  o.vocab_limit = -1;
  EXPECT_THROW(generate_sequence(*model_, prompt_, o), Error);
}

TEST_F(Generation, TopKOneEqualsGreedy) {
  SamplingOptions greedy = settings(0, 0, 1), top1 = settings(1.0, 1, 1);
  greedy.max_new_tokens = top1.max_new_tokens = 25;
  EXPECT_EQ(generate_sequence(*model_, prompt_, greedy).tokens,
            generate_sequence(*model_, prompt_, top1).tokens);
}

TEST_F(Generation, StopsAtAStopTokenAndIncludesIt) {
  SamplingOptions o = settings(1.0, 0, 1);
  o.max_new_tokens = 30;
  const auto free_run = generate_sequence(*model_, prompt_, o).tokens;
  const int32_t stop = free_run[5];
  const auto first = std::find(free_run.begin(), free_run.end(), stop) - free_run.begin();  // <= 5
  o.stop_tokens = {stop};
  GenerationResult r = generate_sequence(*model_, prompt_, o);
  EXPECT_EQ(r.stop, StopReason::stop_token);
  EXPECT_EQ(r.tokens, std::vector<int32_t>(free_run.begin(), free_run.begin() + first + 1));
  EXPECT_EQ(r.note(), "");
}

TEST_F(Generation, StopsWithANoteWhenTheContextIsFull) {
  SamplingOptions o = settings(0.9, 10, 1);
  o.max_new_tokens = 100;
  GenerationResult r = generate_sequence(*model_, prompt_, o);  // 48 positions
  EXPECT_EQ(r.stop, StopReason::context_full);
  EXPECT_EQ(r.tokens.size(), 48u - prompt_.size());
  EXPECT_NE(r.note().find("48 positions"), std::string::npos) << r.note();
  EXPECT_EQ(generate(*model_, prompt_, o), r.tokens);
  o.context = 10;  // a tighter limit than max_position_embeddings
  r = generate_sequence(*model_, prompt_, o);
  EXPECT_EQ(r.stop, StopReason::context_full);
  EXPECT_EQ(r.tokens.size(), 6u);
  // Exactly filling the context is the requested length, not an early stop.
  o.max_new_tokens = 6;
  EXPECT_EQ(generate_sequence(*model_, prompt_, o).stop, StopReason::max_new_tokens);
  o.max_new_tokens = 0;
  EXPECT_TRUE(generate_sequence(*model_, prompt_, o).tokens.empty());
}

TEST_F(Generation, StreamsEveryTokenInOrder) {
  SamplingOptions o = settings(1.0, 0, 0.95);
  o.max_new_tokens = 15;
  std::vector<int32_t> streamed;
  o.on_token = [&](int32_t t) { streamed.push_back(t); };
  GenerationResult r = generate_sequence(*model_, prompt_, o);
  EXPECT_EQ(streamed, r.tokens);
  EXPECT_EQ(r.prompt_tokens, 4);
  EXPECT_GT(r.prefill_seconds, 0);
  EXPECT_GT(r.decode_seconds, 0);
}

TEST_F(Generation, RefusesBadSettingsAndPrompts) {
  auto expect_refused = [&](SamplingOptions o, std::initializer_list<std::string_view> culprit,
                            std::vector<int32_t> prompt = {1, 2}) {
    testing::expect_error_containing([&] { generate_sequence(*model_, prompt, o); }, culprit);
  };
  expect_refused(settings(-0.5, 0, 1), {"temperature", "-0.5"});
  expect_refused(settings(std::nan(""), 0, 1), {"temperature"});
  expect_refused(settings(1, -1, 1), {"top-k", "-1"});
  expect_refused(settings(1, 0, 0), {"top-p", "(0, 1]"});
  expect_refused(settings(1, 0, 1.5), {"top-p", "1.5"});
  SamplingOptions o = settings(1, 0, 1);
  expect_refused(o, {"non-empty prompt"}, {});
  expect_refused(o, {"50 tokens", "48 positions"}, std::vector<int32_t>(50, 1));
  o.max_new_tokens = -1;
  expect_refused(o, {"max_new_tokens"});
}

}  // namespace
}  // namespace forge::sampling_test
