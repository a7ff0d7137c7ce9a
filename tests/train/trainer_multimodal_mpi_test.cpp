// Layout equivalence of multimodal training: the tiny LLaVA on synthetic captioned images, 8 steps under
// tensor (with and without sequence parallelism), data (with and without ZeRO-1) and pipeline parallelism,
// against the same run on one rank with dp x grad_accum micro-batches per step. The encoder and projector are
// replicated over tensor-parallel ranks (under sequence parallelism each sees the gradient of its own rows of
// the image features, summed over the group) and live on the first pipeline stage. Run by mpirun with 2 and 4
// ranks; each rank also runs the one-rank reference itself.
//
// Tolerances (fp32 compute), as trainer_mpi_test.cpp's: the layouts sum the same products in other orders.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/train/trainer.h"
#include "train/toy_run.h"

namespace forge::trainer_multimodal_mpi_test {
using namespace forge::train;
namespace {
namespace fs = std::filesystem;

struct Layout {
  int tp = 1, dp = 1, pp = 1;
  bool sequence_parallel = false, zero = false;
};

class MultimodalLayouts : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    dir_ = toy::make_shared_test_dir(comm::world(), "forge_multimodal_mpi",
                                     [](const fs::path& dir) { toy::write_llava_toy_inputs(dir); });
  }
  void TearDown() override { toy::remove_shared_test_dir(comm::world(), dir_); }
  TrainConfig config(const std::string& run) const {
    TrainConfig c = toy::llava_toy_config(dir_, run);
    c.train.dtype = "fp32";
    c.train.steps = 8;
    c.train.grad_clip = 0.5;
    c.parallel.bucket_mb = 0.01;  // several buckets
    c.parallel.make_vocab_size_divisible_by = 48;
    c.parallel.timeout_s = 60;
    return c;
  }
  // The layout's parallel settings on `c`.
  static TrainConfig laid_out(TrainConfig c, const Layout& l) {
    c.parallel.tp = l.tp, c.parallel.dp = l.dp, c.parallel.pp = l.pp;
    c.parallel.sequence_parallel = l.sequence_parallel;
    c.parallel.distributed_optimizer = l.zero;
    return c;
  }
  fs::path dir_;
};

TEST_P(MultimodalLayouts, ReproduceTheOneRankRun) {
  comm::Communicator& world = comm::world();
  const Layout l = GetParam();
  if (l.tp * l.dp * l.pp != world.size()) GTEST_SKIP() << "needs " << l.tp * l.dp * l.pp << " ranks";
  TrainConfig ref = config("reference-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * l.dp;
  auto self = comm::make_self();
  const TrainResult want = Trainer(ref, self.get()).run();

  const TrainConfig par = laid_out(config("parallel"), l);
  const TrainResult got = Trainer(par, &world).run();

  ASSERT_EQ(got.losses.size(), want.losses.size());
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-5 * want.losses[s]) << "step " << s + 1;
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-3 * want.grad_norms[s]) << "step " << s + 1;
  }
  EXPECT_NEAR(got.heldout_loss, want.heldout_loss, 2e-5 * want.heldout_loss);
  // The encoder's key biases have a true gradient of zero (softmax ignores a shift shared by every key): they
  // move by rounding noise alone (1e-8 here), which no relative bound can hold.
  toy::expect_weights_close(fs::path(ref.log.run_dir) / "checkpoint",
                            fs::path(par.log.run_dir) / "checkpoint", 2e-4, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MultimodalLayouts,
                         ::testing::Values(Layout{.tp = 2}, Layout{.tp = 2, .sequence_parallel = true},
                                           Layout{.dp = 2}, Layout{.dp = 2, .zero = true}, Layout{.pp = 2},
                                           Layout{.tp = 2, .dp = 2, .sequence_parallel = true, .zero = true},
                                           Layout{.tp = 2, .pp = 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           const Layout& l = info.param;
                           return "tp" + std::to_string(l.tp) + "_dp" + std::to_string(l.dp) + "_pp" +
                                  std::to_string(l.pp) + (l.sequence_parallel ? "_sp" : "") +
                                  (l.zero ? "_zero1" : "");
                         });

// FP8 in the encoder and projector too (fp8.vision, delayed scaling, bf16 GEMMs): the layouts follow the
// one-rank FP8 run within toy_run.h's FP8 tolerances (an element that crosses an E4M3 rounding boundary under
// another summation order moves by a whole FP8 step), and every rank holds the same delayed scales, the
// replicated encoder's included.
class MultimodalFp8Layouts : public MultimodalLayouts {};

TEST_P(MultimodalFp8Layouts, FollowTheOneRankFp8Run) {
  comm::Communicator& world = comm::world();
  const Layout l = GetParam();
  if (l.tp * l.dp * l.pp != world.size()) GTEST_SKIP() << "needs " << l.tp * l.dp * l.pp << " ranks";
  auto fp8_config = [&](const std::string& run) {
    TrainConfig c = config(run);
    c.train.dtype = "bf16";
    c.fp8.recipe = "delayed", c.fp8.vision = true, c.fp8.amax_history_len = 8;
    return c;
  };
  TrainConfig ref = fp8_config("reference-fp8-" + std::to_string(world.rank()));
  ref.train.grad_accum = 2 * l.dp;
  auto self = comm::make_self();
  const TrainResult want = Trainer(ref, self.get()).run();

  const TrainConfig par = laid_out(fp8_config("parallel-fp8"), l);
  const TrainResult got = Trainer(par, &world).run();
  toy::expect_follows_fp8_run(got.losses, got.heldout_loss, want.losses, want.heldout_loss);
  if (l.pp > 1) return;  // each stage holds its own Linears' scales
  ASSERT_EQ(got.fp8_scales.size(), want.fp8_scales.size());
  ASSERT_EQ(got.fp8_scales.size(), (2u * 4 + 2 * 4 + 2) * 3);  // language, encoder, projector Linears
  std::vector<float> all(got.fp8_scales.size() * static_cast<size_t>(world.size()));
  world
      .all_gather(got.fp8_scales.data(), all.data(), static_cast<int64_t>(got.fp8_scales.size()),
                  comm::Type::f32)
      .wait();
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], got.fp8_scales[i % got.fp8_scales.size()]) << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, MultimodalFp8Layouts,
                         ::testing::Values(Layout{.tp = 2, .sequence_parallel = true},
                                           Layout{.dp = 2, .zero = true}, Layout{.pp = 2},
                                           Layout{.tp = 2, .dp = 2, .sequence_parallel = true, .zero = true}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           const Layout& l = info.param;
                           return "tp" + std::to_string(l.tp) + "_dp" + std::to_string(l.dp) + "_pp" +
                                  std::to_string(l.pp) + (l.sequence_parallel ? "_sp" : "") +
                                  (l.zero ? "_zero1" : "");
                         });

}  // namespace
}  // namespace forge::trainer_multimodal_mpi_test
