// The loss head's top-1 count over MPI: the whole world is the tensor-parallel group (CommTensorParallel,
// host buffers), each rank holding a vocabulary range of the problem of nn/loss_head_problem.h (ranges of
// ceil(50 / world) + 1 columns, so the last holds padding), with and without sequence parallelism. Every rank
// must report the brute-force count over the full logits, and the one-rank loss.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/parallel/comm_tensor_parallel.h"
#include "nn/loss_head_problem.h"

namespace forge::loss_head_tp_mpi_test {
namespace {
using namespace nn::loss_head_testing;

TEST(LossHeadTop1TensorParallel, MatchesTheBruteForceCount) {
  comm::Communicator& world = comm::world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks or more";
  const Problem pr;
  nn::ComputeOptions one_rank;
  one_rank.gemm_dtype = DType::f32;
  const HeadRun whole =
      run_head(Head(pr.weight, 0, kVocab, one_rank), pr.hidden, pr.targets, Device::cpu, true, true);
  ASSERT_EQ(whole.totals.top1, pr.top1);
  const int tp = world.size(), rank = world.rank();
  const int64_t local = (kVocab + tp - 1) / tp + 1;
  const std::vector<float> weight = make_weight(tp * local);
  for (const bool sequence_parallel : {false, true})
    for (const DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message()
                   << (sequence_parallel ? "sequence parallel " : "") << dtype_name(dtype));
      parallel::CommTensorParallel group(&world, sequence_parallel);
      nn::ComputeOptions options;
      options.gemm_dtype = dtype, options.tp = &group;
      const Head h(weight, rank * local, local, options);
      // Under sequence parallelism this rank's rows of hidden; the targets cover every row either way.
      const int64_t rows = sequence_parallel ? kRows / tp : kRows,
                    first = sequence_parallel ? rank * rows : 0;
      const std::vector<float> hidden(pr.hidden.begin() + first * kDim,
                                      pr.hidden.begin() + (first + rows) * kDim);
      for (const bool gradients : {false, true}) {
        const HeadRun run = run_head(h, hidden, pr.targets, Device::cpu, gradients, true);
        EXPECT_EQ(run.totals.top1, pr.top1) << "rank " << rank;
        EXPECT_EQ(run.totals.tokens, pr.tokens) << "rank " << rank;
        EXPECT_NEAR(run.totals.sum, whole.totals.sum, 1e-5 * std::abs(whole.totals.sum)) << "rank " << rank;
        EXPECT_EQ(run_head(h, hidden, pr.targets, Device::cpu, gradients, false).totals.top1, 0);
      }
    }
}

}  // namespace
}  // namespace forge::loss_head_tp_mpi_test
