// Tensor (+ sequence) parallel DeepseekV3Model against the same model on one rank: every rank loads a twin
// fixture's weights (tests/reference/deepseek_v3_twin.py; their routing margins keep every expert choice
// the same under another summation order) into the unsplit reference and into its shard of the split model;
// losses (main and MTP), logits and every gradient element (at its global index) must agree within fp32
// reduction-order tolerance. Run by mpirun with 2 and 4 ranks; the whole world is the tensor-parallel group.
// Under sequence parallelism the MTP depths (whose rows are shifted by a position, across the shards) run
// tensor-parallel over every row, gathered from the shards.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "forge/ckpt/safetensors.h"
#include "forge/comm/comm.h"
#include "forge/models/deepseek_v3/deepseek_v3_model.h"
#include "forge/parallel/comm_tensor_parallel.h"
#include "test_files.h"

namespace forge::deepseek_v3_tp_mpi_test {
using namespace forge::models;
namespace {

using testing::fixture;

// Every parameter of `params` from the file: the whole tensor, or this rank's shard of it.
void load_shards(const ckpt::SafetensorsFile& file, ParameterStore& params) {
  for (int id = 0; id < params.count(); ++id) {
    const ParamInfo& p = params.info(id);
    const Tensor global = file.read(p.name);
    float* local = params.param(id).f32();
    for (const ShardRun& r : shard_runs(p))
      for (int64_t j = 0; j < r.count; ++j) local[r.local + j] = global.f32()[r.global + j];
  }
  params.refresh_bf16();
}

struct Case {
  std::string fixture;
  bool sequence_parallel;
  // The split model recomputes every module selectively (MLA's up-projections, the norms' outputs and so the
  // all-gathers of sequence parallelism, the experts' activations) where the reference keeps everything.
  bool fine_recompute = false;
};

class DeepseekV3TensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(DeepseekV3TensorParallel, MatchesOneRank) {
  comm::Communicator& world = comm::world();
  const Case c = GetParam();
  const ckpt::SafetensorsFile file = ckpt::SafetensorsFile::open(fixture(c.fixture + ".safetensors"));
  const DeepseekV3Config config = DeepseekV3Config::from_json_file(fixture(c.fixture + ".config.json"));
  if (config.num_attention_heads % world.size() != 0) GTEST_SKIP();
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;
  DeepseekV3Model reference(config, options);
  load_shards(file, reference.params());

  parallel::CommTensorParallel group(&world, c.sequence_parallel);
  nn::ComputeOptions split_options = options;
  split_options.tp = &group;
  split_options.vocab_divisible_by = 8;
  if (c.fine_recompute)
    split_options.recompute = nn::Recompute::selective,
    split_options.recompute_modules =
        nn::recompute_modules_from_names("core_attn,mlp_act,moe_act,norm,mla_up_proj");
  DeepseekV3Model split(config, split_options);
  load_shards(file, split.params());

  const Tensor ids = file.read("input_ids"), labels = file.read("labels");
  const int64_t batch = ids.dim(0), seq = ids.dim(1);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  for (DeepseekV3Model* m : {&reference, &split}) m->set_balance_scale(0.01f / static_cast<float>(batch));
  // Two micro-batches: replicated gradients are summed over the group once, when the last makes them final.
  reference.params().begin_grad_step(2);
  const LossSum want = reference.forward_backward(ids.i32(), labels.i32(), batch, seq, scale);
  const std::vector<MtpDepthStats> want_mtp = reference.mtp_stats();
  reference.forward_backward(ids.i32(), labels.i32(), batch, seq, scale);
  split.params().begin_grad_step(2);
  const LossSum got = split.forward_backward(ids.i32(), labels.i32(), batch, seq, scale);
  const std::vector<MtpDepthStats> got_mtp = split.mtp_stats();
  split.forward_backward(ids.i32(), labels.i32(), batch, seq, scale);
  EXPECT_FALSE(split.params().grad_step_active());
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_NEAR(got.sum, want.sum, 1e-5 * std::abs(want.sum));
  ASSERT_EQ(got_mtp.size(), want_mtp.size());
  for (size_t k = 0; k < got_mtp.size(); ++k)
    EXPECT_NEAR(got_mtp[k].loss.sum, want_mtp[k].loss.sum, 1e-5 * std::abs(want_mtp[k].loss.sum)) << k;
  for (size_t j = 0; j < reference.moe_stats().size(); ++j)
    EXPECT_EQ(split.moe_stats()[j].load, reference.moe_stats()[j].load) << "MoE layer " << j;

  const ParameterStore& ref = reference.params();
  const ParameterStore& mine = split.params();
  ASSERT_EQ(ref.count(), mine.count());
  for (int id = 0; id < mine.count(); ++id) {
    const ParamInfo& p = mine.info(id);
    const int ref_id = ref.find(p.name);
    ASSERT_GE(ref_id, 0) << p.name;
    ASSERT_EQ(ref.info(ref_id).shape, p.global_shape()) << p.name;
    const float* g = mine.grad(id).f32();
    const float* rg = ref.grad(ref_id).f32();
    double max_ref = 0;
    for (int64_t i = 0; i < shape_numel(ref.info(ref_id).shape); ++i)
      max_ref = std::max(max_ref, std::abs(double(rg[i])));
    int bad = 0;
    for (const ShardRun& r : shard_runs(p))
      for (int64_t j = 0; j < r.count; ++j) {
        const int64_t i = r.local + j, gi = r.global + j;
        if (std::abs(g[i] - rg[gi]) > 2e-5 * max_ref + 1e-9 && ++bad <= 3)
          ADD_FAILURE() << p.name << " grad element " << i << " (global " << gi << "): " << g[i] << " vs "
                        << rg[gi];
      }
  }

  Tensor lw = reference.logits(ids.i32(), batch, seq), lg = split.logits(ids.i32(), batch, seq);
  ASSERT_EQ(lw.shape(), lg.shape());
  for (int64_t i = 0; i < lw.numel(); ++i) ASSERT_NEAR(lg.f32()[i], lw.f32()[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DeepseekV3TensorParallel,
                         ::testing::Values(Case{"deepseek_v3_tiny", false}, Case{"deepseek_v3_tiny", true},
                                           Case{"deepseek_v3_yarn_mtp", false},
                                           Case{"deepseek_v3_yarn_mtp", true},
                                           Case{"deepseek_v3_mtp2", false}, Case{"deepseek_v3_mtp2", true},
                                           Case{"deepseek_v3_tiny", true, true},
                                           Case{"deepseek_v3_yarn_mtp", false, true}),
                         [](const auto& info) {
                           return info.param.fixture.substr(12) +
                                  (info.param.sequence_parallel ? "_sp" : "") +
                                  (info.param.fine_recompute ? "_recompute_modules" : "");
                         });

}  // namespace
}  // namespace forge::deepseek_v3_tp_mpi_test
