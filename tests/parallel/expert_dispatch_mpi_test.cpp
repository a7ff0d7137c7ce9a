// The token dispatcher of expert parallelism (nn/expert_parallel.h over parallel::CommExpertParallel), the
// whole world one expert-parallel group (run by mpirun with 2 and 4 ranks):
//   - on a hand-made routing table every row lands exactly where the plan says (source-major from the
//     wire, expert-major after the local permute) and comes back to its place;
//   - the full round trip of the Moe layer's data path (sort, permute, dispatch, combine, unpermute with
//     every gate 1/k) restores each token's row bit for bit, and its backward the gradient;
//   - with a capacity no expert takes more than its capacity from any rank; with FP8's padding of every
//     expert's segment to 16 rows, or of every one to the capacity (fixed shapes: each expert takes exactly
//     capacity rows from each rank), the round trip gives the same bits as without.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/kernels/ops.h"
#include "forge/nn/expert_parallel.h"
#include "forge/parallel/comm_expert_parallel.h"

namespace forge::expert_dispatch_mpi_test {
namespace {

constexpr int64_t kLocal = 2;  // experts per rank

// Rows rank s sends expert e in the hand-made table (some zero).
int64_t hand_count(int s, int64_t e) { return (3 * s + 2 * e + 1) % 4; }
// The value of row j of (source s, expert e), column c: every row distinct.
float hand_value(int s, int64_t e, int64_t j, int64_t c) {
  return static_cast<float>(10000 * s + 100 * e + 10 * j + c);
}

TEST(ExpertDispatch, HandMadeTableMovesEveryRowToItsPlace) {
  comm::Communicator& world = comm::world();
  parallel::CommExpertParallel ep(&world);
  const int P = world.size(), me = world.rank();
  const int64_t experts = kLocal * P, cols = 3;
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + hand_count(me, e);
  Tensor sorted = Tensor::empty({offsets.back(), cols}, DType::f32);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t j = 0; j < hand_count(me, e); ++j)
      for (int64_t c = 0; c < cols; ++c) sorted.f32()[(offsets[e] + j) * cols + c] = hand_value(me, e, j, c);

  const nn::DispatchPlan plan = nn::plan_dispatch(&ep, offsets);
  ASSERT_EQ(plan.ranks, P);
  EXPECT_EQ(plan.first_expert, me * kLocal);
  int64_t out = 0;
  for (int q = 0; q < P; ++q) {
    EXPECT_EQ(plan.send_rows[q], hand_count(me, q * kLocal) + hand_count(me, q * kLocal + 1)) << "to " << q;
    if (q != me) out += plan.send_rows[q];
  }
  EXPECT_EQ(plan.sent(), out);
  std::vector<int64_t> want_offsets{0};
  for (int64_t l = 0; l < kLocal; ++l) {
    int64_t n = 0;
    for (int s = 0; s < P; ++s) {
      EXPECT_EQ(plan.recv_counts[s * kLocal + l], hand_count(s, me * kLocal + l));
      n += hand_count(s, me * kLocal + l);
    }
    want_offsets.push_back(want_offsets.back() + n);
  }
  EXPECT_EQ(plan.local_offsets, want_offsets);

  const Tensor local = nn::dispatch_rows(&ep, plan, sorted, cols);
  ASSERT_EQ(local.numel(), plan.received() * cols);
  int64_t row = 0;  // expert-major: local expert, then source rank, then the source's order
  for (int64_t l = 0; l < kLocal; ++l)
    for (int s = 0; s < P; ++s)
      for (int64_t j = 0; j < hand_count(s, me * kLocal + l); ++j, ++row)
        for (int64_t c = 0; c < cols; ++c)
          ASSERT_EQ(local.f32()[row * cols + c], hand_value(s, me * kLocal + l, j, c))
              << "row " << row << " of rank " << me;
  const Tensor back = nn::combine_rows(&ep, plan, local, cols);
  ASSERT_EQ(back.numel(), sorted.numel());
  EXPECT_EQ(std::memcmp(back.raw(), sorted.raw(), sorted.numel() * sizeof(float)), 0);
  // bf16 rows (a bf16 run's) move in bf16, half the bytes, bit for bit.
  Tensor sorted16 = Tensor::empty({offsets.back(), cols}, DType::bf16);
  for (int64_t i = 0; i < sorted.numel(); ++i) sorted16.bf16()[i] = float_to_bf16(sorted.f32()[i]);
  const Tensor local16 = nn::dispatch_rows(&ep, plan, sorted16, cols);
  ASSERT_EQ(local16.dtype(), DType::bf16);
  for (int64_t i = 0; i < local.numel(); ++i)
    ASSERT_EQ(local16.bf16()[i], float_to_bf16(local.f32()[i])) << "element " << i << " of rank " << me;
  const Tensor back16 = nn::combine_rows(&ep, plan, local16, cols);
  EXPECT_EQ(std::memcmp(back16.raw(), sorted16.raw(), sorted16.bytes()), 0);
}

// One rank's micro-batch through the Moe layer's data path and back, with gates 1/k (a power of two: the sum
// of k halves or quarters of a row is the row, exactly).
struct RoundTrip {
  Tensor out, dx;
  std::vector<int64_t> offsets;
  nn::DispatchPlan plan;
};

RoundTrip round_trip(nn::ExpertParallel* ep, const Tensor& x, const std::vector<int32_t>& ids, int64_t k,
                     int64_t experts, int64_t capacity, int64_t align, bool pad_to_capacity = false) {
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  ops::MoeSortParams q;
  q.tokens = tokens, q.top_k = k, q.experts = experts, q.capacity = capacity, q.align = align;
  q.pad_to_capacity = pad_to_capacity;
  Tensor row_of = Tensor::empty({tokens * k}, DType::i32);
  Tensor source = Tensor::empty({ops::moe_sorted_rows_bound(q)}, DType::i32);
  Tensor offsets = Tensor::empty({experts + 1}, DType::i64);
  q.expert_ids = ids.data(), q.row_of = row_of.i32(), q.source = source.i32(),
  q.offsets = offsets.data<int64_t>();
  ops::moe_sort_by_expert(q, Device::cpu);
  RoundTrip r;
  r.offsets.assign(offsets.data<int64_t>(), offsets.data<int64_t>() + experts + 1);
  const int64_t rows = r.offsets.back();
  Tensor sorted = Tensor::empty({rows, hidden}, DType::f32);
  ops::MoePermuteParams p;
  p.tokens = tokens, p.top_k = k, p.hidden = hidden, p.rows = rows, p.row_of = row_of.i32();
  p.source = source.i32(), p.x = x.f32(), p.out = sorted.f32();
  ops::moe_permute(p, Device::cpu);
  r.plan = nn::plan_dispatch(ep, r.offsets);
  const Tensor local = nn::dispatch_rows(ep, r.plan, sorted, hidden);
  const Tensor ys = nn::combine_rows(ep, r.plan, local, hidden);
  std::vector<float> gates(tokens * k, 1.0f / static_cast<float>(k));
  r.out = Tensor::empty({tokens, hidden}, DType::f32);
  ops::MoeUnpermuteParams u;
  u.tokens = tokens, u.top_k = k, u.hidden = hidden, u.rows = rows, u.row_of = row_of.i32();
  u.source = source.i32(), u.weights = gates.data(), u.y = ys.f32(), u.out = r.out.f32();
  ops::moe_unpermute(u, Device::cpu);
  // Backward with dout = x: through the combination, the wire both ways, and the permutation.
  Tensor dys = Tensor::empty({rows, hidden}, DType::f32);
  u.dout = x.f32(), u.dy = dys.f32(), u.out = nullptr;
  ops::moe_unpermute_backward(u, Device::cpu);
  const Tensor local_dys = nn::dispatch_rows(ep, r.plan, dys, hidden);
  const Tensor dxs = nn::combine_rows(ep, r.plan, local_dys, hidden);
  r.dx = Tensor::empty({tokens, hidden}, DType::f32);
  p.dout = dxs.f32(), p.dx = r.dx.f32(), p.out = nullptr, p.x = nullptr;
  ops::moe_permute_backward(p, Device::cpu);
  return r;
}

struct Routed {
  Tensor x;
  std::vector<int32_t> ids;
};

// Random tokens with top-k distinct experts each; the rank seeds its own (every rank routes other tokens).
Routed random_routing(int rank, int64_t tokens, int64_t hidden, int64_t k, int64_t experts) {
  std::mt19937 rng(1234 + 17 * rank);
  std::normal_distribution<float> normal;
  Routed r{Tensor::empty({tokens, hidden}, DType::f32), {}};
  for (int64_t i = 0; i < tokens * hidden; ++i) r.x.f32()[i] = normal(rng);
  std::vector<int32_t> all(experts);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    r.ids.insert(r.ids.end(), all.begin(), all.begin() + k);
  }
  return r;
}

TEST(ExpertDispatch, DroplessRoundTripRestoresInputAndGradient) {
  comm::Communicator& world = comm::world();
  parallel::CommExpertParallel ep(&world);
  const int64_t experts = 4 * world.size(), hidden = 8;
  for (int64_t k : {2, 4}) {
    const int64_t tokens = 37 + 5 * world.rank();  // every rank its own count
    const Routed in = random_routing(world.rank(), tokens, hidden, k, experts);
    const RoundTrip r = round_trip(&ep, in.x, in.ids, k, experts, 0, 1);
    ASSERT_EQ(std::memcmp(r.out.raw(), in.x.raw(), in.x.numel() * sizeof(float)), 0) << "top-" << k;
    ASSERT_EQ(std::memcmp(r.dx.raw(), in.x.raw(), in.x.numel() * sizeof(float)), 0) << "top-" << k;
    // Every assignment travelled: the ranks' experts took all of them.
    const double taken = comm::all_reduce_sum(world, static_cast<double>(r.plan.received()));
    EXPECT_EQ(taken, comm::all_reduce_sum(world, static_cast<double>(tokens * k)));
  }
}

TEST(ExpertDispatch, CapacityBoundsEveryExpertAndPaddingChangesNothing) {
  comm::Communicator& world = comm::world();
  parallel::CommExpertParallel ep(&world);
  const int64_t experts = 2 * world.size(), hidden = 4, k = 2, tokens = 40;
  const Routed in = random_routing(world.rank(), tokens, hidden, k, experts);
  const int64_t capacity = tokens * k / experts / 2;  // half the mean load: many drops
  const RoundTrip capped = round_trip(&ep, in.x, in.ids, k, experts, capacity, 1);
  for (int s = 0; s < world.size(); ++s)
    for (int64_t l = 0; l < capped.plan.local_experts; ++l)
      EXPECT_LE(capped.plan.recv_counts[s * capped.plan.local_experts + l], capacity)
          << "expert " << capped.plan.first_expert + l << " from rank " << s;
  for (int64_t l = 0; l < capped.plan.local_experts; ++l)
    EXPECT_LE(capped.plan.local_offsets[l + 1] - capped.plan.local_offsets[l], capacity * world.size());
  for (int64_t cap : {int64_t{0}, capacity}) {
    const RoundTrip plain = round_trip(&ep, in.x, in.ids, k, experts, cap, 1);
    const RoundTrip padded = round_trip(&ep, in.x, in.ids, k, experts, cap, 16);
    for (int64_t l = 0; l < padded.plan.local_experts; ++l)
      EXPECT_EQ((padded.plan.local_offsets[l + 1] - padded.plan.local_offsets[l]) % 16, 0);
    EXPECT_EQ(std::memcmp(plain.out.raw(), padded.out.raw(), in.x.numel() * sizeof(float)), 0) << cap;
    EXPECT_EQ(std::memcmp(plain.dx.raw(), padded.dx.raw(), in.x.numel() * sizeof(float)), 0) << cap;
  }
  // Padded to the capacity (fixed shapes): every rank sends every expert exactly `capacity` rows, so each
  // local expert takes capacity x ranks, whatever the routing; the results are still the dropping ones.
  for (const int64_t align : {int64_t{1}, int64_t{16}}) {
    const RoundTrip plain = round_trip(&ep, in.x, in.ids, k, experts, capacity, 1);
    const RoundTrip filled = round_trip(&ep, in.x, in.ids, k, experts, capacity, align, true);
    const int64_t segment = (capacity + align - 1) / align * align;
    for (int q = 0; q < world.size(); ++q)
      EXPECT_EQ(filled.plan.send_rows[q], segment * filled.plan.local_experts);
    for (int64_t l = 0; l < filled.plan.local_experts; ++l)
      EXPECT_EQ(filled.plan.local_offsets[l + 1] - filled.plan.local_offsets[l], segment * world.size());
    EXPECT_EQ(std::memcmp(plain.out.raw(), filled.out.raw(), in.x.numel() * sizeof(float)), 0) << align;
    EXPECT_EQ(std::memcmp(plain.dx.raw(), filled.dx.raw(), in.x.numel() * sizeof(float)), 0) << align;
  }
}

TEST(ExpertDispatch, OneRankPlanMovesNothing) {
  const std::vector<int64_t> offsets{0, 3, 3, 7};
  const nn::DispatchPlan plan = nn::plan_dispatch(nullptr, offsets);
  EXPECT_EQ(plan.ranks, 1);
  EXPECT_EQ(plan.local_offsets, offsets);
  EXPECT_EQ(plan.sent(), 0);
  const Tensor rows = Tensor::zeros({7, 2}, DType::f32);
  EXPECT_EQ(nn::dispatch_rows(nullptr, plan, rows, 2).raw(), rows.raw());  // the same memory
}

}  // namespace
}  // namespace forge::expert_dispatch_mpi_test
