// The loss head's top-1 count (LossTotals::top1) on the problem of nn/loss_head_problem.h, against a
// brute-force count over the full logits: on one rank (fp32 and bf16 operands, forward only and with the
// gradients, logits kept or recomputed), vocabulary-parallel over 2 to 4 ranks (in-process: a thread per
// rank; parallel/loss_head_tp_mpi_test.cpp runs it over MPI), and under the device emulation.
#include "forge/nn/loss_head.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <thread>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/parameters.h"
#include "forge/kernels/emulated_device.h"
#include "forge/nn/tensor_parallel.h"
#include "nn/loss_head_problem.h"

namespace forge::nn::loss_head_test {
namespace {
using namespace loss_head_testing;

// The problem is one worth counting: some hits, some misses, and hits that tie with another column.
TEST(LossHeadTop1, TheProblemHasHitsMissesAndTies) {
  const Problem pr;
  EXPECT_GT(pr.top1, 0);
  EXPECT_LT(pr.top1, pr.tokens);
  int64_t tied_hits = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    if (pr.targets[r] < 0) continue;
    const double* row = pr.logits.data() + r * kVocab;
    const double max = *std::max_element(row, row + kVocab);
    tied_hits += row[pr.targets[r]] == max && std::count(row, row + kVocab, max) > 1;
  }
  EXPECT_GT(tied_hits, 0);
}

// One rank: the count matches the brute force over the head's own full logits (and the exact ones), in
// every mode; without count_top1 it is 0 and the loss is bitwise the same.
TEST(LossHeadTop1, OneRankMatchesTheBruteForceCount) {
  const Problem pr;
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const int64_t keep_logits_bytes : {int64_t{0}, int64_t{1} << 30})
      for (const bool gradients : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " keep_logits_bytes " << keep_logits_bytes
                                          << (gradients ? " with gradients" : " forward only"));
        ComputeOptions options;
        options.gemm_dtype = dtype, options.keep_logits_bytes = keep_logits_bytes;
        const Head h(pr.weight, 0, kVocab, options);
        const Tensor logits = h.head.logits(host_tensor(pr.hidden, {kRows, kDim}));
        const std::vector<float> full(logits.f32(), logits.f32() + logits.numel());
        EXPECT_EQ(brute_force_top1(full, pr.targets), pr.top1);
        const HeadRun with = run_head(h, pr.hidden, pr.targets, Device::cpu, gradients, true);
        const HeadRun without = run_head(h, pr.hidden, pr.targets, Device::cpu, gradients, false);
        EXPECT_EQ(with.totals.top1, pr.top1);
        EXPECT_EQ(with.totals.tokens, pr.tokens);
        EXPECT_EQ(without.totals.top1, 0);
        EXPECT_EQ(without.totals.tokens, pr.tokens);
        EXPECT_EQ(without.totals.sum, with.totals.sum);
        EXPECT_EQ(without.dhidden, with.dhidden);
      }
}

// An in-process tensor-parallel group: a thread per rank; each collective publishes the rank's host buffer,
// reads everyone's once all have published, and writes its result only after all have read.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : barrier_(size), buffers_(size) {}
  int size() const { return static_cast<int>(buffers_.size()); }
  const std::vector<const float*>& publish(int rank, const float* buffer) {
    buffers_[rank] = buffer;
    barrier_.arrive_and_wait();
    return buffers_;
  }
  void all_read() { barrier_.arrive_and_wait(); }

 private:
  std::barrier<> barrier_;
  std::vector<const float*> buffers_;
};

class ThreadRank final : public TensorParallel {
 public:
  ThreadRank(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  bool sequence_parallel() const override { return false; }
  void all_reduce_sum(float* buf, int64_t count, Device where) override {
    reduce(buf, count, where, [](float a, float b) { return a + b; });
  }
  void all_reduce_max(float* buf, int64_t count, Device where) override {
    reduce(buf, count, where, [](float a, float b) { return std::max(a, b); });
  }
  void all_gather(const float* send, float* recv, int64_t count, Device where) override {
    host_only(where);
    const std::vector<const float*>& all = group_->publish(rank_, send);
    for (int i = 0; i < size(); ++i) std::copy_n(all[i], count, recv + i * count);
    group_->all_read();
  }
  Tensor all_gather_rows(const Tensor&) override { throw std::logic_error("no sequence parallelism here"); }
  Tensor reduce_scatter_rows(const Tensor&) override {
    throw std::logic_error("no sequence parallelism here");
  }

 private:
  static void host_only(Device where) {
    if (where != Device::cpu) throw std::logic_error("the thread group carries host buffers only");
  }
  template <typename Op>
  void reduce(float* buf, int64_t count, Device where, Op op) {
    host_only(where);
    const std::vector<const float*>& all = group_->publish(rank_, buf);
    std::vector<float> result(all[0], all[0] + count);
    for (int i = 1; i < size(); ++i)
      for (int64_t j = 0; j < count; ++j) result[j] = op(result[j], all[i][j]);
    group_->all_read();
    std::copy(result.begin(), result.end(), buf);
  }

  ThreadGroup* group_;
  int rank_;
};

// Vocabulary-parallel: every rank reports the brute-force count of the whole vocabulary, and the loss of one
// rank. Ranges of 26 x 2 (2 padding columns), 17 x 3 (1), and 17 x 4, whose last range is padding only.
TEST(LossHeadTop1, TensorParallelMatchesTheBruteForceCount) {
  const Problem pr;
  ComputeOptions one_rank;
  one_rank.gemm_dtype = DType::f32;
  const HeadRun whole =
      run_head(Head(pr.weight, 0, kVocab, one_rank), pr.hidden, pr.targets, Device::cpu, true, true);
  ASSERT_EQ(whole.totals.top1, pr.top1);
  struct Layout {
    int tp;
    int64_t local;
  };
  for (const Layout layout : {Layout{2, 26}, Layout{3, 17}, Layout{4, 17}})
    for (const DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << "tp " << layout.tp << " " << dtype_name(dtype));
      const std::vector<float> weight = make_weight(layout.tp * layout.local);
      ThreadGroup group(layout.tp);
      std::vector<HeadRun> runs(layout.tp);
      std::vector<std::exception_ptr> errors(layout.tp);
      std::vector<std::thread> threads;
      for (int rank = 0; rank < layout.tp; ++rank)
        threads.emplace_back([&, rank] {
          try {
            ThreadRank tp(&group, rank);
            ComputeOptions options;
            options.gemm_dtype = dtype, options.tp = &tp;
            const Head h(weight, rank * layout.local, layout.local, options);
            runs[rank] = run_head(h, pr.hidden, pr.targets, Device::cpu, true, true);
          } catch (...) {
            errors[rank] = std::current_exception();
          }
        });
      for (std::thread& t : threads) t.join();
      for (const std::exception_ptr& e : errors)
        if (e) std::rethrow_exception(e);
      for (int rank = 0; rank < layout.tp; ++rank) {
        EXPECT_EQ(runs[rank].totals.top1, pr.top1) << "rank " << rank;
        EXPECT_EQ(runs[rank].totals.tokens, pr.tokens) << "rank " << rank;
        EXPECT_NEAR(runs[rank].totals.sum, whole.totals.sum, 1e-5 * std::abs(whole.totals.sum))
            << "rank " << rank;
      }
    }
}

// The device path (the kernel's max logits and the target logits brought back from device memory) under the
// device emulation.
TEST(LossHeadTop1, EmulatedDeviceMatchesTheBruteForceCount) {
  const Problem pr;
  EmulatedDevice emulation;
  for (const bool gradients : {false, true}) {
    ComputeOptions options;
    options.gemm_dtype = DType::bf16, options.device = Device::cuda;
    const Head h(pr.weight, 0, kVocab, options);
    const HeadRun with = run_head(h, pr.hidden, pr.targets, Device::cuda, gradients, true);
    EXPECT_EQ(with.totals.top1, pr.top1) << (gradients ? "with gradients" : "forward only");
    EXPECT_EQ(with.totals.tokens, pr.tokens);
    EXPECT_EQ(run_head(h, pr.hidden, pr.targets, Device::cuda, gradients, false).totals.top1, 0);
  }
}

}  // namespace
}  // namespace forge::nn::loss_head_test
