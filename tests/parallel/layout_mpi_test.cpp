// make_groups under mpirun (2 and 4 ranks): every group's communicator has the layout's size and rank, and
// collectives over it reach exactly the ranks the layout names.
#include <gtest/gtest.h>

#include <numeric>

#include "forge/comm/comm.h"
#include "forge/parallel/layout.h"
#include "op_harness.h"

namespace forge::parallel::layout_mpi_test {
namespace {

using forge::testing::expect_error_containing;

comm::Communicator& world() { return comm::world(); }

void expect_groups_match(const LayoutSpec& spec) {
  comm::Communicator& w = world();
  const Layout layout(spec, w.size(), w.rank());
  SCOPED_TRACE(layout.describe());
  const ParallelGroups groups = make_groups(w, layout);
  for (Dim dim : kAllDims) {
    if (dim == Dim::world) continue;
    SCOPED_TRACE(dim_name(dim));
    comm::Communicator& group = groups.get(dim);
    const std::vector<int> members = layout.group_ranks(dim);
    EXPECT_EQ(group.name(), dim_name(dim));
    EXPECT_EQ(group.size(), layout.size(dim));
    EXPECT_EQ(group.rank(), layout.coordinate(dim));
    EXPECT_EQ(group.world_rank(), w.rank());
    EXPECT_EQ(group.timeout_seconds(), w.timeout_seconds());

    // The sum of the world ranks over the group is the sum of exactly its members.
    int64_t sum = w.rank();
    group.all_reduce(&sum, 1, comm::Type::i64, comm::ReduceOp::sum).wait();
    EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), int64_t{0}));

    // And the members sit in the layout's order: gathering world ranks gives group_ranks().
    const int32_t mine = w.rank();
    std::vector<int32_t> gathered(group.size(), -1);
    group.all_gather(&mine, gathered.data(), 1, comm::Type::i32).wait();
    EXPECT_EQ(std::vector<int>(gathered.begin(), gathered.end()), members);
  }
}

TEST(MakeGroups, TwoRanks) {
  if (world().size() != 2) GTEST_SKIP() << "needs 2 ranks";
  expect_groups_match({.tp = 2, .pp = 1, .dp = 1});
  expect_groups_match({});  // dp = 2, derived
  expect_groups_match({.tp = 1, .pp = 2, .dp = 1});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 1, .cp = 2});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 0, .cp = 1, .ep = 2});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 1, .cp = 2, .ep = 2});
}

TEST(MakeGroups, FourRanks) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_groups_match({.tp = 2, .pp = 1, .dp = 2});
  expect_groups_match({.tp = 2, .pp = 2, .dp = 1});
  expect_groups_match({.tp = 1, .pp = 2, .dp = 2});
  expect_groups_match({.tp = 2, .pp = 1, .dp = 1, .cp = 2});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 2, .cp = 2, .ep = 2});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 2, .cp = 2, .ep = 4});
  expect_groups_match({.tp = 1, .pp = 1, .dp = 0, .cp = 1, .ep = 2});
  expect_groups_match({.tp = 4, .pp = 1, .dp = 1});
}

TEST(MakeGroups, WrongSizesFailOnEveryRankBeforeAnyCollective) {
  comm::Communicator& w = world();
  expect_error_containing([&] { Layout({.tp = 3, .pp = 1, .dp = 1}, w.size(), w.rank()); },
                          {fmt::format("= 3 ranks, but the job has {} (mpirun -np)", w.size())});
  const Layout bigger({}, w.size() * 2, w.rank());
  expect_error_containing([&] { make_groups(w, bigger); },
                          {"make_groups: communicator 'world'", "but the layout was built for"});
  // The world still works afterwards: nobody is stuck in a split.
  EXPECT_EQ(comm::all_reduce_sum(w, 1.0), static_cast<double>(w.size()));
}

}  // namespace
}  // namespace forge::parallel::layout_mpi_test
