// The MPI backend under mpirun (2 and 4 ranks): every collective against its definition (collective_checks.h)
// on the world and on split sub-groups, outstanding requests overlapping, tags, zero-size messages, and the
// argument checks (which every rank fails alike, before any MPI call).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "comm/collective_checks.h"
#include "forge/comm/comm.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"

namespace forge::comm::comm_mpi_test {
namespace {

Communicator& the_world() { return world(); }  // tests/mpi_main.cpp created it with MPI

TEST(CommMpi, WorldIsMpi) {
  Communicator& w = the_world();
  EXPECT_STREQ(w.backend(), "mpi");
  EXPECT_EQ(w.name(), "world");
  EXPECT_GE(w.size(), 2);
  EXPECT_EQ(w.world_rank(), w.rank());
  EXPECT_TRUE(launched_by_mpi());
}

TEST(CommMpi, EveryCollectiveOnTheWorld) {
  checks::HostMemory memory;
  checks::check_every_collective(the_world(), memory);
}

TEST(CommMpi, SplitIntoEvenAndOddRanks) {
  Communicator& w = the_world();
  const double saved_timeout = w.timeout_seconds();
  w.set_timeout_seconds(77);
  // key = -rank reverses the order inside each group.
  std::unique_ptr<Communicator> half = w.split(w.rank() % 2, -w.rank(), "half");
  w.set_timeout_seconds(saved_timeout);
  ASSERT_NE(half, nullptr);
  const int members = (w.size() + 1 - w.rank() % 2) / 2;  // ranks of my parity
  EXPECT_EQ(half->name(), "half");
  EXPECT_STREQ(half->backend(), "mpi");
  EXPECT_EQ(half->size(), members);
  EXPECT_EQ(half->rank(), members - 1 - w.rank() / 2);
  EXPECT_EQ(half->world_rank(), w.rank());
  EXPECT_EQ(half->timeout_seconds(), 77);  // inherited at the split

  // Sum of the world ranks in my group, through the group.
  double expected = 0;
  for (int r = w.rank() % 2; r < w.size(); r += 2) expected += r;
  EXPECT_EQ(all_reduce_sum(*half, static_cast<double>(w.rank())), expected);

  checks::HostMemory memory;
  checks::check_every_collective(*half, memory);

  // A split of a split.
  std::unique_ptr<Communicator> single = half->split(half->rank(), 0, "single");
  ASSERT_NE(single, nullptr);
  EXPECT_EQ(single->size(), 1);
  EXPECT_EQ(single->world_rank(), w.rank());
  checks::check_every_collective(*single, memory);
}

TEST(CommMpi, SplitWithNegativeColorLeavesTheRankOut) {
  Communicator& w = the_world();
  std::unique_ptr<Communicator> rest = w.split(w.rank() == 0 ? -1 : 0, w.rank(), "rest");
  if (w.rank() == 0) {
    EXPECT_EQ(rest, nullptr);
    return;
  }
  ASSERT_NE(rest, nullptr);
  EXPECT_EQ(rest->size(), w.size() - 1);
  EXPECT_EQ(rest->rank(), w.rank() - 1);
  EXPECT_EQ(all_reduce_max(*rest, static_cast<double>(w.rank())), w.size() - 1);
}

// Host memory has no stream to order by: wait_on_stream waits on the host, and the handle is spent.
TEST(CommMpi, WaitOnStreamWaitsOnTheHost) {
  Communicator& w = world();
  std::vector<float> values(1000, static_cast<float>(w.rank() + 1));
  Request request =
      w.all_reduce(values.data(), static_cast<int64_t>(values.size()), Type::f32, ReduceOp::sum);
  w.wait_on_stream(request);
  EXPECT_FALSE(request.pending());
  const float want = static_cast<float>(w.size() * (w.size() + 1) / 2);
  EXPECT_EQ(std::count(values.begin(), values.end(), want), static_cast<std::ptrdiff_t>(values.size()));
}

TEST(CommMpi, ManyOutstandingRequestsOverlap) {
  Communicator& w = the_world();
  const int n = w.size(), me = w.rank();
  constexpr int kReduces = 4;
  constexpr int64_t kCount = 20000;
  std::vector<std::vector<float>> sums(kReduces, std::vector<float>(kCount));
  for (int k = 0; k < kReduces; ++k)
    for (int64_t i = 0; i < kCount; ++i) sums[k][i] = static_cast<float>(me + k + i % 5);
  std::vector<int64_t> mine(100, me), gathered(100 * n, -1);
  std::vector<double> broadcast_value(64, me);
  std::vector<int32_t> ring_out(5000, me), ring_in(5000, -1);

  std::vector<Request> requests;
  for (int k = 0; k < kReduces; ++k)
    requests.push_back(w.all_reduce(sums[k].data(), kCount, Type::f32, ReduceOp::sum));
  requests.push_back(w.all_gather(mine.data(), gathered.data(), 100, Type::i64));
  requests.push_back(w.recv(ring_in.data(), 5000, Type::i32, (me + n - 1) % n, 3));
  requests.push_back(w.broadcast(broadcast_value.data(), 64, Type::f64, n - 1));
  requests.push_back(w.send(ring_out.data(), 5000, Type::i32, (me + 1) % n, 3));
  for (Request& r : requests) EXPECT_TRUE(r.pending());
  // Drive them by test() for a while, then wait for the rest together.
  for (int spin = 0; spin < 100; ++spin) {
    bool all = true;
    for (Request& r : requests) all = r.test() && all;
    if (all) break;
  }
  wait_all(requests);
  for (Request& r : requests) EXPECT_FALSE(r.pending());

  const float rank_sum = static_cast<float>(n * (n - 1) / 2);
  for (int k = 0; k < kReduces; ++k)
    for (int64_t i = 0; i < kCount; i += 997)
      ASSERT_EQ(sums[k][i], rank_sum + static_cast<float>(n * (k + i % 5)))
          << "reduce " << k << " element " << i;
  for (int r = 0; r < n; ++r) EXPECT_EQ(gathered[100 * r + 99], r);
  EXPECT_EQ(broadcast_value[63], n - 1);
  EXPECT_EQ(ring_in[4999], (me + n - 1) % n);
}

TEST(CommMpi, TagsMatchMessagesPostedInAnotherOrder) {
  Communicator& w = the_world();
  if (w.rank() > 1) return;  // a conversation between ranks 0 and 1
  std::vector<int32_t> first(10, 1), second(20, 2);
  if (w.rank() == 0) {
    Request a = w.send(first.data(), 10, Type::i32, 1, /*tag=*/1);
    Request b = w.send(second.data(), 20, Type::i32, 1, /*tag=*/2);
    a.wait();
    b.wait();
  } else {
    std::vector<int32_t> got_second(20, 0), got_first(10, 0);
    Request b = w.recv(got_second.data(), 20, Type::i32, 0, 2);
    Request a = w.recv(got_first.data(), 10, Type::i32, 0, 1);
    b.wait();
    a.wait();
    EXPECT_EQ(got_first, first);
    EXPECT_EQ(got_second, second);
  }
}

TEST(CommMpi, ZeroSizeMessagesWithNullBuffers) {
  Communicator& w = the_world();
  const int n = w.size(), me = w.rank();
  std::vector<int64_t> zeros(n, 0);
  std::vector<Request> requests;
  requests.push_back(w.all_reduce(nullptr, 0, Type::f32, ReduceOp::sum));
  requests.push_back(w.all_gather(nullptr, nullptr, 0, Type::bf16));
  requests.push_back(w.all_gatherv(nullptr, nullptr, zeros, Type::f64));
  requests.push_back(w.reduce_scatter(nullptr, nullptr, 0, Type::i64, ReduceOp::max));
  requests.push_back(w.all_to_all(nullptr, nullptr, 0, Type::u8));
  requests.push_back(w.all_to_allv(nullptr, zeros, zeros, nullptr, zeros, zeros, Type::i32));
  requests.push_back(w.broadcast(nullptr, 0, Type::f32, 0));
  requests.push_back(w.recv(nullptr, 0, Type::f32, (me + n - 1) % n));
  requests.push_back(w.send(nullptr, 0, Type::f32, (me + 1) % n));
  requests.push_back(w.barrier());
  wait_all(requests);
}

TEST(CommMpi, DroppedRequestCompletesBeforeItsBuffersGo) {
  Communicator& w = the_world();
  std::vector<double> buf(1000, 1.0);
  { Request dropped = w.all_reduce(buf.data(), 1000, Type::f64, ReduceOp::sum); }
  EXPECT_EQ(buf[999], w.size());
}

TEST(CommMpi, BlockingAllReduceMatchesTheRequest) {
  Communicator& w = world();
  for (int64_t count : {int64_t{0}, int64_t{7}, int64_t{300000}}) {
    std::vector<float> a(count), b(count);
    for (int64_t i = 0; i < count; ++i)
      a[i] = b[i] = static_cast<float>((i * 7 + w.rank() * 13) % 101) / 8.0f;
    w.all_reduce(a.data(), count, Type::f32, ReduceOp::sum).wait();
    w.all_reduce_blocking(b.data(), count, Type::f32, ReduceOp::sum);
    EXPECT_EQ(a, b) << count;  // multiples of 1/8: exact in any order
  }
  double m = w.rank();
  w.all_reduce_blocking(&m, 1, Type::f64, ReduceOp::max);
  EXPECT_EQ(m, w.size() - 1);
}

TEST(CommMpi, ConvenienceHelpers) {
  Communicator& w = the_world();
  const int n = w.size();
  EXPECT_EQ(all_reduce_sum(w, 1.5), 1.5 * n);
  EXPECT_EQ(all_reduce_max(w, static_cast<double>(w.rank())), n - 1);
  std::vector<float> f(10, 2.0f);
  all_reduce_sum(w, f.data(), 10);
  EXPECT_EQ(f[9], 2.0f * n);
  std::vector<double> d(3, 0.25);
  all_reduce_sum(w, d.data(), 3);
  EXPECT_EQ(d[2], 0.25 * n);
}

TEST(CommMpi, Bf16SumRoundsToNearestEven) {
  // Rank 0 has 256, rank 1 has 1, the rest 0: in any reduction order the one inexact addition is 256 + 1,
  // a tie between the bf16 neighbours 256 and 258 (8 significant bits) that goes to the even mantissa.
  Communicator& w = the_world();
  uint16_t x = f32_to_bf16_bits(w.rank() == 0 ? 256.0f : w.rank() == 1 ? 1.0f : 0.0f);
  w.all_reduce(&x, 1, Type::bf16, ReduceOp::sum).wait();
  EXPECT_EQ(bf16_bits_to_f32(x), 256.0f);
  uint16_t nan_or_one = f32_to_bf16_bits(w.rank() == 1 ? std::numeric_limits<float>::quiet_NaN() : 1.0f);
  w.all_reduce(&nan_or_one, 1, Type::bf16, ReduceOp::max).wait();
  EXPECT_TRUE(
      std::isnan(bf16_bits_to_f32(nan_or_one)));  // NaN wins, so an overflow anywhere is seen everywhere
}

TEST(CommMpi, ArgumentsAreCheckedBeforeAnyMpiCall) {
  Communicator& w = the_world();
  float one = 1;
  const int64_t too_many = int64_t{INT_MAX} + 1;
  try {
    w.all_reduce(&one, too_many, Type::f32, ReduceOp::sum);
    FAIL() << "a count beyond INT_MAX was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds MPI's limit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce on group 'world'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(w.send(&one, too_many, Type::f32, (w.rank() + 1) % w.size()), Error);
  EXPECT_THROW(w.send(&one, 1, Type::f32, w.size()), Error);
  EXPECT_THROW(w.recv(&one, 1, Type::f32, -1), Error);
  EXPECT_THROW(w.send(&one, 1, Type::f32, 0, /*tag=*/-3), Error);
  EXPECT_THROW(w.broadcast(&one, 1, Type::f32, w.size()), Error);
  EXPECT_THROW(w.all_reduce(&one, -1, Type::f32, ReduceOp::sum), Error);
  EXPECT_THROW(w.all_reduce(nullptr, 5, Type::f32, ReduceOp::sum), Error);
  std::vector<int64_t> short_counts(w.size() - 1, 1);
  EXPECT_THROW(w.all_gatherv(&one, &one, short_counts, Type::f32), Error);
  // The world is still in step after all that: nothing reached MPI.
  EXPECT_EQ(all_reduce_sum(w, 1.0), w.size());
}

}  // namespace
}  // namespace forge::comm::comm_mpi_test
