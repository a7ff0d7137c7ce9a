#include "forge/parallel/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "op_harness.h"

namespace forge::parallel::layout_test {
namespace {

using forge::testing::expect_error_containing;
using Ranks = std::vector<int>;

LayoutSpec spec(int tp, int pp, int dp, int cp = 1, int ep = 1) { return {tp, pp, dp, cp, ep}; }

// Every rank's group along every dimension: the groups partition the world, each member sees the same
// list, a rank's position in it is its coordinate, the list ascends, and its size is size(dim).
void expect_consistent(const LayoutSpec& s, int world) {
  SCOPED_TRACE(fmt::format("tp {} pp {} dp {} cp {} ep {} world {}", s.tp, s.pp, s.dp, s.cp, s.ep, world));
  const Layout layout(s, world, 0);
  for (Dim dim : kAllDims) {
    SCOPED_TRACE(dim_name(dim));
    std::set<Ranks> groups;
    for (int r = 0; r < world; ++r) {
      const Ranks group = layout.group_ranks_of(r, dim);
      ASSERT_EQ(static_cast<int>(group.size()), layout.size(dim));
      EXPECT_TRUE(std::is_sorted(group.begin(), group.end()));
      const auto at = std::find(group.begin(), group.end(), r);
      ASSERT_NE(at, group.end()) << "rank " << r << " is not in its own group";
      EXPECT_EQ(at - group.begin(), layout.coordinate_of(r, dim));
      for (int member : group) EXPECT_EQ(layout.group_ranks_of(member, dim), group);
      groups.insert(group);
    }
    EXPECT_EQ(static_cast<int>(groups.size()) * layout.size(dim), world)
        << "groups do not partition the world";
  }
  // The mapping is a bijection and agrees with the Megatron formula.
  for (int r = 0; r < world; ++r) {
    const Coordinates c = layout.coordinates_of(r);
    EXPECT_EQ(layout.rank_of(c.tp, c.cp, c.dp, c.pp), r);
    EXPECT_EQ(r, c.tp + layout.tp() * (c.cp + layout.cp() * (c.dp + layout.dp() * c.pp)));
    const int flat = c.cp + layout.cp() * c.dp;
    EXPECT_EQ(c.ep, flat % layout.ep());
    EXPECT_EQ(c.expert_dp, flat / layout.ep());
    EXPECT_EQ(Layout(s, world, r).coordinates(), c);
  }
}

TEST(Layout, SingleRankIsTrivial) {
  const Layout layout(LayoutSpec{}, 1, 0);
  EXPECT_EQ(layout.dp(), 1);
  for (Dim dim : kAllDims) {
    EXPECT_EQ(layout.size(dim), 1);
    EXPECT_EQ(layout.group_ranks(dim), Ranks{0});
    EXPECT_EQ(layout.coordinate(dim), 0);
  }
  EXPECT_EQ(layout.describe(),
            "layout: world 1 = tp 1 x cp 1 x dp 1 x pp 1 (ep 1) | rank 0: tp 0, cp 0, dp 0, pp 0");
}

TEST(Layout, DataParallelIsDerivedFromTheWorld) {
  EXPECT_EQ(Layout(LayoutSpec{}, 4, 0).dp(), 4);
  EXPECT_EQ(Layout(spec(2, 1, 0), 8, 0).dp(), 4);
  EXPECT_EQ(Layout(spec(2, 2, 0, 2), 16, 0).dp(), 2);
  const Layout layout(spec(2, 1, 0), 8, 0);
  EXPECT_EQ(layout.spec(), spec(2, 1, 4));
}

// Megatron-LM's documented example (parallel_state.initialize_model_parallel): 16 GPUs, tp 2, pp 4, so dp 2.
TEST(Layout, MegatronExampleWorld16Tp2Pp4Dp2) {
  const Layout layout(spec(2, 4, 2), 16, 0);
  std::set<Ranks> tp, dp, pp, mp;
  for (int r = 0; r < 16; ++r) {
    tp.insert(layout.group_ranks_of(r, Dim::tp));
    dp.insert(layout.group_ranks_of(r, Dim::dp));
    pp.insert(layout.group_ranks_of(r, Dim::pp));
    mp.insert(layout.group_ranks_of(r, Dim::model_parallel));
  }
  EXPECT_EQ(tp, (std::set<Ranks>{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(dp, (std::set<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(pp, (std::set<Ranks>{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(mp, (std::set<Ranks>{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));

  const Layout rank11(spec(2, 4, 2), 16, 11);  // 11 = tp 1 + 2 * (dp 1 + 2 * pp 2)
  EXPECT_EQ(rank11.coordinates(), (Coordinates{.tp = 1, .cp = 0, .dp = 1, .pp = 2, .ep = 0, .expert_dp = 1}));
  EXPECT_EQ(rank11.group_ranks(Dim::tp), (Ranks{10, 11}));
  EXPECT_EQ(rank11.group_ranks(Dim::dp), (Ranks{9, 11}));
  EXPECT_EQ(rank11.group_ranks(Dim::dp_cp), (Ranks{9, 11}));
  EXPECT_EQ(rank11.group_ranks(Dim::pp), (Ranks{3, 7, 11, 15}));
  EXPECT_EQ(rank11.group_ranks(Dim::cp), (Ranks{11}));
  EXPECT_EQ(rank11.group_ranks(Dim::ep), (Ranks{11}));
  EXPECT_EQ(rank11.group_ranks(Dim::expert_dp), (Ranks{9, 11}));
  EXPECT_EQ(rank11.group_ranks(Dim::model_parallel), (Ranks{2, 3, 6, 7, 10, 11, 14, 15}));
  EXPECT_EQ(rank11.coordinate(Dim::model_parallel), 5);  // tp 1 + 2 * pp 2
  EXPECT_EQ(rank11.group_ranks(Dim::world).size(), 16u);
  EXPECT_EQ(rank11.describe(),
            "layout: world 16 = tp 2 x cp 1 x dp 2 x pp 4 (ep 1) | rank 11: tp 1, cp 0, dp 1, pp 2");
}

TEST(Layout, TensorAndDataParallelOnFourRanks) {
  const Layout layout(spec(2, 1, 2), 4, 3);
  EXPECT_EQ(layout.describe(),
            "layout: world 4 = tp 2 x cp 1 x dp 2 x pp 1 (ep 1) | rank 3: tp 1, cp 0, dp 1, pp 0");
  EXPECT_EQ(layout.group_ranks(Dim::tp), (Ranks{2, 3}));
  EXPECT_EQ(layout.group_ranks(Dim::dp), (Ranks{1, 3}));
  EXPECT_EQ(layout.group_ranks(Dim::pp), (Ranks{3}));
  EXPECT_EQ(layout.group_ranks(Dim::model_parallel), (Ranks{2, 3}));
}

TEST(Layout, ContextParallelSitsBetweenTensorAndData) {
  // world 8 = tp 2 x cp 2 x dp 2: rank = tp + 2 * (cp + 2 * dp).
  const Layout layout(spec(2, 1, 2, 2), 8, 5);  // tp 1, cp 0, dp 1
  EXPECT_EQ(layout.coordinates(), (Coordinates{.tp = 1, .cp = 0, .dp = 1, .pp = 0, .ep = 0, .expert_dp = 2}));
  EXPECT_EQ(layout.group_ranks(Dim::tp), (Ranks{4, 5}));
  EXPECT_EQ(layout.group_ranks(Dim::cp), (Ranks{5, 7}));
  EXPECT_EQ(layout.group_ranks(Dim::dp), (Ranks{1, 5}));
  EXPECT_EQ(layout.group_ranks(Dim::dp_cp), (Ranks{1, 3, 5, 7}));
  EXPECT_EQ(layout.coordinate(Dim::dp_cp), 2);  // cp 0 + 2 * dp 1
  EXPECT_EQ(layout.group_ranks(Dim::model_parallel), (Ranks{4, 5}));
}

TEST(Layout, ExpertGroupsAreCarvedFromDataParallelRanks) {
  // Megatron's example shape: tp 2, dp 4, ep 2 on 8 ranks. Expert-parallel groups are runs of ep consecutive
  // dp positions at one tp position; expert-data-parallel groups take the same place in every run.
  const Layout layout(spec(2, 1, 4, 1, 2), 8, 0);
  std::set<Ranks> ep, edp;
  for (int r = 0; r < 8; ++r) {
    ep.insert(layout.group_ranks_of(r, Dim::ep));
    edp.insert(layout.group_ranks_of(r, Dim::expert_dp));
  }
  EXPECT_EQ(ep, (std::set<Ranks>{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  EXPECT_EQ(edp, (std::set<Ranks>{{0, 4}, {2, 6}, {1, 5}, {3, 7}}));
  EXPECT_EQ(layout.expert_dp(), 2);
  const Layout rank6(spec(2, 1, 4, 1, 2), 8, 6);  // tp 0, dp 3
  EXPECT_EQ(rank6.coordinate(Dim::ep), 1);
  EXPECT_EQ(rank6.coordinate(Dim::expert_dp), 1);
  EXPECT_EQ(
      rank6.describe(),
      "layout: world 8 = tp 2 x cp 1 x dp 4 x pp 1 (ep 2 x expert_dp 2) | rank 6: tp 0, cp 0, dp 3, pp 0, "
      "ep 1, expert_dp 1");
}

TEST(Layout, ExpertGroupsSpanContextAndDataParallel) {
  // world 8 = cp 2 x dp 2 x pp 2, ep 2: flat (cp, dp) index = rank % 4; ep runs pair cp ranks.
  const Layout layout(spec(1, 2, 2, 2, 2), 8, 5);  // cp 1, dp 0, pp 1
  EXPECT_EQ(layout.group_ranks(Dim::ep), (Ranks{4, 5}));
  EXPECT_EQ(layout.group_ranks(Dim::expert_dp), (Ranks{5, 7}));
  EXPECT_EQ(layout.group_ranks(Dim::cp), (Ranks{4, 5}));
  EXPECT_EQ(layout.group_ranks(Dim::dp), (Ranks{5, 7}));
  EXPECT_EQ(layout.group_ranks(Dim::dp_cp), (Ranks{4, 5, 6, 7}));
  EXPECT_EQ(layout.group_ranks(Dim::pp), (Ranks{1, 5}));
  // ep = dp x cp: one expert group holds all of them, expert dp is trivial; ep 4 across cp 2 x dp 2.
  const Layout wide(spec(1, 2, 2, 2, 4), 8, 6);
  EXPECT_EQ(wide.group_ranks(Dim::ep), (Ranks{4, 5, 6, 7}));
  EXPECT_EQ(wide.group_ranks(Dim::expert_dp), (Ranks{6}));
}

TEST(Layout, EveryLayoutIsConsistent) {
  expect_consistent(spec(1, 1, 0), 1);
  expect_consistent(spec(1, 1, 0), 4);
  expect_consistent(spec(4, 1, 1), 4);
  expect_consistent(spec(1, 4, 1), 4);
  expect_consistent(spec(1, 1, 1, 4), 4);
  expect_consistent(spec(2, 1, 2), 4);
  expect_consistent(spec(2, 4, 2), 16);
  expect_consistent(spec(2, 2, 2, 2), 16);
  expect_consistent(spec(2, 1, 4, 1, 2), 8);
  expect_consistent(spec(2, 1, 4, 1, 4), 8);
  expect_consistent(spec(1, 2, 2, 2, 2), 8);
  expect_consistent(spec(2, 3, 0, 2, 3), 36);  // dp 3, ep 3 over cp 2 x dp 3
  expect_consistent(spec(3, 2, 4, 1, 2), 24);
}

TEST(LayoutErrors, SizeDoesNotMatchTheWorld) {
  expect_error_containing(
      [] { Layout(spec(2, 1, 2), 3, 0); },
      {"parallel layout tp=2 x cp=1 x dp=2 x pp=1 = 4 ranks, but the job has 3 (mpirun -np)"});
  expect_error_containing([] { Layout(spec(1, 2, 2, 2), 4, 0); }, {"= 8 ranks, but the job has 4"});
  expect_error_containing([] { Layout(spec(2, 1, 0), 3, 0); },
                          {"parallel layout tp=2 x cp=1 x pp=1 = 2 ranks per data-parallel replica does not "
                           "divide the job's 3 ranks"});
  expect_error_containing([] { Layout(spec(4, 1, 0), 2, 0); },
                          {"= 4 ranks per data-parallel replica", "2 ranks"});
  // Products past int range are an error, not a wrapped-around match.
  expect_error_containing([] { Layout(spec(65536, 65536, 1), 1, 0); },
                          {"= 4294967296 ranks, but the job has 1"});
}

TEST(LayoutErrors, SizesMustBePositive) {
  expect_error_containing([] { Layout(spec(0, 1, 1), 1, 0); }, {"parallel.tp must be >= 1, got 0"});
  expect_error_containing([] { Layout(spec(1, -1, 1), 1, 0); }, {"parallel.pp must be >= 1, got -1"});
  expect_error_containing([] { Layout(spec(1, 1, 1, 0), 1, 0); }, {"parallel.cp must be >= 1, got 0"});
  expect_error_containing([] { Layout(spec(1, 1, 1, 1, 0), 1, 0); }, {"parallel.ep must be >= 1, got 0"});
  expect_error_containing([] { Layout(spec(1, 1, -2), 1, 0); }, {"parallel.dp must be >= 1", "got -2"});
  expect_error_containing([] { Layout(LayoutSpec{}, 0, 0); }, {"world size must be >= 1, got 0"});
  expect_error_containing([] { Layout(LayoutSpec{}, 4, 4); }, {"rank 4 is outside the world of 4 ranks"});
  expect_error_containing([] { Layout(LayoutSpec{}, 4, -1); }, {"rank -1 is outside the world of 4 ranks"});
}

TEST(LayoutErrors, ExpertParallelMustDivideDataTimesContext) {
  expect_error_containing([] { Layout(spec(1, 1, 0, 1, 3), 4, 0); },
                          {"parallel.ep = 3 does not divide dp x cp = 4 x 1 = 4"});
  // ep cannot take tensor- or pipeline-parallel ranks.
  expect_error_containing([] { Layout(spec(2, 1, 1, 1, 2), 2, 0); },
                          {"parallel.ep = 2 does not divide dp x cp"});
}

TEST(LayoutErrors, QueriesOutsideTheLayout) {
  const Layout layout(spec(2, 1, 2), 4, 0);
  expect_error_containing([&] { layout.coordinates_of(4); }, {"rank 4 is outside the world of 4 ranks"});
  expect_error_containing([&] { layout.group_ranks_of(-1, Dim::tp); }, {"rank -1"});
  expect_error_containing([&] { layout.rank_of(2, 0, 0, 0); },
                          {"coordinates tp 2, cp 0, dp 0, pp 0", "outside tp 2 x cp 1 x dp 2 x pp 1"});
  const ParallelGroups none;
  expect_error_containing([&] { none.get(Dim::world); }, {"no 'world' group"});
  expect_error_containing([&] { none.get(Dim::dp); }, {"'dp' group was not made"});
}

TEST(Layout, DimNames) {
  std::set<std::string> names;
  for (Dim dim : kAllDims) names.insert(dim_name(dim));
  EXPECT_EQ(names, (std::set<std::string>{"tp", "cp", "dp", "pp", "ep", "expert_dp", "dp_cp",
                                          "model_parallel", "world"}));
}

ModelDims llama_like() {
  return {.hidden = 256, .heads = 8, .kv_heads = 2, .ffn = 768, .vocab = 2048, .layers = 8};
}

TEST(ModelFit, DividingLayoutsPass) {
  EXPECT_NO_THROW(validate_model_fit(Layout(LayoutSpec{}, 1, 0), llama_like(), 128));
  EXPECT_NO_THROW(validate_model_fit(Layout(spec(2, 4, 1), 8, 0), llama_like(), 128));
  EXPECT_NO_THROW(validate_model_fit(Layout(spec(8, 1, 1), 8, 0), llama_like(), 128));  // kv heads replicated
  EXPECT_NO_THROW(validate_model_fit(Layout(spec(4, 2, 2), 16, 0), llama_like(), 1));
  ModelDims odd_vocab = llama_like();
  odd_vocab.vocab = 2049;  // the vocabulary is padded, never checked
  EXPECT_NO_THROW(validate_model_fit(Layout(spec(2, 1, 1), 2, 0), odd_vocab, 128));
}

TEST(ModelFitErrors, EachRuleNamesItsKey) {
  ModelDims dims = llama_like();
  expect_error_containing([&] { validate_model_fit(Layout(spec(3, 1, 1), 3, 0), dims, 128); },
                          {"parallel.tp = 3 does not divide num_attention_heads = 8"});
  dims = llama_like();
  dims.heads = 12;
  dims.kv_heads = 3;  // tp 2: neither divides the other
  dims.ffn = 768;
  expect_error_containing([&] { validate_model_fit(Layout(spec(2, 1, 1), 2, 0), dims, 128); },
                          {"parallel.tp = 2 and num_key_value_heads = 3: one must divide the other"});
  dims.kv_heads = 6;  // tp 4: 6 % 4 and 4 % 6 both non-zero
  expect_error_containing([&] { validate_model_fit(Layout(spec(4, 1, 1), 4, 0), dims, 128); },
                          {"num_key_value_heads = 6"});
  dims = llama_like();
  dims.ffn = 770;
  expect_error_containing([&] { validate_model_fit(Layout(spec(4, 1, 1), 4, 0), dims, 128); },
                          {"parallel.tp = 4 does not divide intermediate_size = 770"});
  dims = llama_like();
  // Uneven pipeline splits are the pipeline's to check (stage_layer_counts); a stage without a layer is not.
  validate_model_fit(Layout(spec(1, 3, 1), 3, 0), dims, 128);
  expect_error_containing([&] { validate_model_fit(Layout(spec(1, 16, 1), 16, 0), dims, 128); },
                          {"parallel.pp = 16 exceeds num_hidden_layers = 8"});
  expect_error_containing([&] { validate_model_fit(Layout(LayoutSpec{}, 1, 0), dims, 0); },
                          {"parallel.make_vocab_size_divisible_by must be >= 1, got 0"});
  dims.heads = 0;
  expect_error_containing([&] { validate_model_fit(Layout(LayoutSpec{}, 1, 0), dims, 128); },
                          {"num_attention_heads must be >= 1, got 0"});
  dims = llama_like();
  dims.layers = -1;
  expect_error_containing([&] { validate_model_fit(Layout(LayoutSpec{}, 1, 0), dims, 128); },
                          {"num_hidden_layers must be >= 1, got -1"});
}

TEST(PaddedVocab, RoundsUpToDivisibleTimesTp) {
  EXPECT_EQ(padded_vocab_size(50257, 128, 1), 50257);  // one rank keeps the config's shapes
  EXPECT_EQ(padded_vocab_size(50257, 128, 2), 50432);  // 197 x 256
  EXPECT_EQ(padded_vocab_size(50257, 128, 8), 51200);  // 50 x 1024
  EXPECT_EQ(padded_vocab_size(32000, 128, 2), 32000);  // already a multiple
  EXPECT_EQ(padded_vocab_size(32001, 128, 4), 32256);  // 63 x 512
  EXPECT_EQ(padded_vocab_size(2048, 128, 3), 2304);    // 6 x 384
  EXPECT_EQ(padded_vocab_size(1, 1, 2), 2);
  EXPECT_EQ(padded_vocab_size(7, 1, 1), 7);
  for (int tp : {2, 3, 4, 8})
    for (int64_t vocab : {1, 255, 256, 257, 129280}) {
      const int64_t padded = padded_vocab_size(vocab, 64, tp);
      EXPECT_EQ(padded % (64 * tp), 0);
      EXPECT_GE(padded, vocab);
      EXPECT_LT(padded - vocab, 64 * tp);
    }
}

TEST(PaddedVocabErrors, BadInputs) {
  expect_error_containing([] { padded_vocab_size(0, 128, 2); }, {"vocab_size must be >= 1, got 0"});
  expect_error_containing([] { padded_vocab_size(100, 0, 2); },
                          {"parallel.make_vocab_size_divisible_by must be >= 1, got 0"});
  expect_error_containing([] { padded_vocab_size(100, 128, 0); }, {"parallel.tp must be >= 1, got 0"});
}

}  // namespace
}  // namespace forge::parallel::layout_test
