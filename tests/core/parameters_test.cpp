// Tensor-parallel shards in the ParameterStore: the element mapping to the global tensor (shard_runs,
// against runs written out by hand), and initialisation that gives a shard exactly the global tensor's
// values, zero in the padding.
#include "forge/core/parameters.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "forge/core/error.h"

namespace forge::parameters_test {

void PrintTo(const ShardRun& r, std::ostream* os) {
  *os << "{" << r.local << ", " << r.global << ", " << r.count << "}";
}

namespace {

TEST(ShardRuns, RowSplit) {
  // Rows 2..3 of a [5, 3] tensor: one run of 6 elements from global element 6.
  EXPECT_EQ(shard_runs({2, 3}, {5, 3}, 0, 2, 0, 6), (std::vector<ShardRun>{{0, 6, 6}}));
  // Rows 4..5 of 5: row 5 is padding.
  EXPECT_EQ(shard_runs({2, 3}, {5, 3}, 0, 4, 0, 6), (std::vector<ShardRun>{{0, 12, 3}}));
  // Wholly padding.
  EXPECT_TRUE(shard_runs({2, 3}, {5, 3}, 0, 6, 0, 6).empty());
}

TEST(ShardRuns, ColumnSplitAndFlatRange) {
  // Columns 2..3 of a [3, 5] tensor: one run per row.
  EXPECT_EQ(shard_runs({3, 2}, {3, 5}, 1, 2, 0, 6),
            (std::vector<ShardRun>{{0, 2, 2}, {2, 7, 2}, {4, 12, 2}}));
  // Local elements [1, 4) of that shard: the tail of row 0, row 1, nothing of row 2.
  EXPECT_EQ(shard_runs({3, 2}, {3, 5}, 1, 2, 1, 4), (std::vector<ShardRun>{{1, 3, 1}, {2, 7, 2}}));
  // Unsplit: the flat range itself.
  EXPECT_EQ(shard_runs({3, 5}, {3, 5}, -1, 0, 4, 9), (std::vector<ShardRun>{{4, 4, 5}}));
}

TEST(ShardRuns, InitialisationIsTheGlobalTensorsSlice) {
  ParameterStore whole, shard;
  whole.add("w", {3, 5}, true, Init::normal);
  shard.add("w", {3, 3}, true, Init::normal, 0.02f,
            ShardSpec{1, 3, {3, 5}, true});  // columns 3..5, 5 is padding
  whole.allocate(false);
  shard.allocate(false);
  whole.initialize(9);
  shard.initialize(9);
  const float* a = whole.param(0).f32();
  const float* b = shard.param(0).f32();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(b[r * 3 + 0], a[r * 5 + 3]);
    EXPECT_EQ(b[r * 3 + 1], a[r * 5 + 4]);
    EXPECT_EQ(b[r * 3 + 2], 0.0f);
  }
}

// Gradient readiness by count: each parameter is final after micro_batches x grad_uses contributions; a
// finalizer runs once all of its parameters are final and before the listeners hear of them; the step ends
// when every parameter is final; too many contributions are an error naming the parameter.
TEST(ParameterStore, GradientReadinessByCount) {
  ParameterStore store;
  const int a = store.add("a", {4}, true, Init::zeros);
  const int b = store.add("b", {4}, true, Init::zeros);
  const int c = store.add("c", {4}, true, Init::zeros);
  store.set_grad_uses(c, 2);  // as a tied embedding: two modules accumulate into it
  store.allocate(false);
  std::vector<std::string> events;
  store.add_grad_finalizer({a, b}, [&] { events.push_back("finalize a+b"); });
  const int listener =
      store.add_grad_listener([&](int id) { events.push_back("final " + store.info(id).name); });
  store.note_grad(a);  // outside a step: nothing happens
  EXPECT_TRUE(events.empty());
  for (int round = 0; round < 2; ++round) {
    events.clear();
    store.begin_grad_step(2);
    EXPECT_TRUE(store.grad_step_active());
    store.note_grad(b), store.note_grad(c), store.note_grad(a), store.note_grad(c);
    EXPECT_TRUE(events.empty());
    store.note_grad(b);  // b final, but its finalizer waits for a
    EXPECT_TRUE(events.empty());
    EXPECT_TRUE(store.grad_final(b));
    store.note_grad(c), store.note_grad(c);
    EXPECT_EQ(events, std::vector<std::string>{"final c"});
    store.note_grad(a);
    EXPECT_EQ(events, (std::vector<std::string>{"final c", "finalize a+b", "final a", "final b"}));
    EXPECT_FALSE(store.grad_step_active());
  }
  store.remove_grad_listener(listener);
  store.begin_grad_step(1);
  store.note_grad(a);
  EXPECT_THROW(store.note_grad(a), Error);
  EXPECT_THROW(store.begin_grad_step(1), Error);              // the step still waits for b and c
  EXPECT_THROW(store.add_grad_finalizer({a}, [] {}), Error);  // a already has one
}

// Registered interleaved (a model registers each layer's experts between its dense parameters), laid out by
// group: each group one flat range, in registration order inside it.
TEST(ParameterStore, GroupsAreAdjacent) {
  ParameterStore store;
  const int a = store.add("a", {4}, true, Init::zeros);
  const int e = store.add("e", {1, 4}, true, Init::zeros, 0.02f, {}, "expert");
  const int f = store.add("f", {2, 4}, true, Init::zeros, 0.02f, {}, "expert");
  const int b = store.add("b", {3}, true, Init::zeros);
  const int g = store.add("g", {4}, true, Init::zeros, 0.02f, {}, "expert");
  store.allocate(false);
  EXPECT_EQ(store.info(a).offset, 0);
  EXPECT_EQ(store.info(b).offset, 4);
  EXPECT_EQ(store.info(e).offset, 7);
  EXPECT_EQ(store.info(f).offset, 11);
  EXPECT_EQ(store.info(g).offset, 19);
  EXPECT_EQ(store.group_range("dense"), (std::pair<int64_t, int64_t>{0, 7}));
  EXPECT_EQ(store.group_range("expert"), (std::pair<int64_t, int64_t>{7, 23}));
  EXPECT_EQ(store.span(store.params(), e, 2, 4).shape(), (Shape{3, 4}));  // e and f: one matrix
}

// Frozen parameters (training stages of a multimodal model) are laid out after every trainable one: no
// gradient memory, no part in a gradient step, no place in a group's range; a weight gradient for one is a
// bug.
TEST(ParameterStore, FrozenParametersHaveNoGradient) {
  ParameterStore store;
  const int a = store.add("a", {4}, true, Init::ones);
  const int f = store.add("f", {3, 2}, true, Init::ones);
  const int b = store.add("b", {5}, true, Init::ones);
  const int e = store.add("e", {2}, true, Init::ones, 0.02f, {}, "expert");
  store.freeze(f);
  store.allocate(false);
  EXPECT_EQ(store.numel(), 17);
  EXPECT_EQ(store.trained_numel(), 11);
  EXPECT_EQ(store.grads().numel(), 11);
  EXPECT_EQ(store.info(a).offset, 0);
  EXPECT_EQ(store.info(b).offset, 4);
  EXPECT_EQ(store.info(e).offset, 9);
  EXPECT_EQ(store.info(f).offset, 11);  // after every trainable parameter
  EXPECT_FALSE(store.trainable(f));
  EXPECT_TRUE(store.trainable(a));
  EXPECT_EQ(store.group_range("dense"), (std::pair<int64_t, int64_t>{0, 9}));
  EXPECT_THROW(store.grad(f), Error);
  EXPECT_EQ(store.param(f).numel(), 6);  // the weights are there
  store.begin_grad_step(1);
  store.note_grad(a), store.note_grad(b), store.note_grad(e);
  EXPECT_FALSE(store.grad_step_active());  // complete without the frozen one
  EXPECT_THROW(store.note_grad(f), Error);
  EXPECT_THROW(store.freeze(a), Error);  // after allocation
}

}  // namespace
}  // namespace forge::parameters_test
