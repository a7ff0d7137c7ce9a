// Context-parallel LlamaModel against the same model on one rank (mpirun with 2 and 4 ranks; the whole world
// is the cp group): every rank builds the reference from the same seed and runs the whole sequences, and the
// split model runs this rank's two chunks of each (chunk r and chunk 2·cp − 1 − r, RoPE at their global
// positions, attention across the group in ring or all-to-all mode). The losses summed over the group, and
// every gradient summed over it, must be the reference's within fp32 reduction-order tolerance. With a
// sliding window (Mistral) the ring masks the blocks the window cuts by position and skips those it hides;
// with QK-norm (Qwen3) the norms run on the local tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/philox.h"
#include "forge/models/llama/llama_model.h"
#include "forge/parallel/comm_context_parallel.h"
#include "parallel/family_stacks.h"

namespace forge::llama_cp_mpi_test {
using namespace forge::models;
namespace {

struct Case {
  parallel::ContextAttention mode;
  int64_t kv_heads;  // 0: one per rank (all-to-all scatters the kv heads too)
  int64_t window = 0;
  bool qk_norm = false;
  int gemma = 0;  // 2 or 3: a Gemma of that generation (window and QK-norm its own)
};

class LlamaContextParallel : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaContextParallel, MatchesOneRank) {
  comm::Communicator& world = comm::world();
  const int cp = world.size();
  const Case c = GetParam();
  const int64_t kv_heads = c.kv_heads > 0 ? c.kv_heads : cp;
  std::unique_ptr<LlamaConfig> config_holder;
  if (c.gemma) {
    config_holder = layout_models::tiny_gemma(c.gemma, kv_heads);
  } else {
    config_holder = std::make_unique<LlamaConfig>();
    LlamaConfig& config = *config_holder;
    config.hidden_size = 32, config.intermediate_size = 48, config.num_hidden_layers = 2;
    config.num_attention_heads = 4, config.num_key_value_heads = kv_heads;
    config.head_dim = 8, config.vocab_size = 61, config.max_position_embeddings = 64;
    config.attention_window = c.window, config.qk_norm = c.qk_norm;
  }
  const LlamaConfig& config = *config_holder;
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;
  auto reference_holder = layout_models::make_stack(config, options);
  DecoderStack& reference = *reference_holder;
  reference.initialize(7);
  parallel::CommContextParallel group(&world, c.mode);
  nn::ComputeOptions split_options = options;
  split_options.cp = &group;
  auto split_holder = layout_models::make_stack(config, split_options);
  DecoderStack& split = *split_holder;
  split.initialize(7);
  if (c.gemma)
    layout_models::set_gemma_norms(reference.params()), layout_models::set_gemma_norms(split.params());

  const int64_t batch = 2, seq = 2 * cp * 3;
  std::vector<int32_t> ids(batch * seq), targets(batch * seq);
  for (int64_t i = 0; i < batch * seq; ++i) {
    const auto bits = philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {11, 0});
    ids[i] = static_cast<int32_t>(bits[0] % config.vocab_size);
    targets[i] = i % 7 == 3 ? -1 : static_cast<int32_t>(bits[1] % config.vocab_size);
  }
  const float scale = 1.0f / (batch * seq);  // over every token of the step, whichever rank holds it
  reference.params().begin_grad_step(1);
  const LossSum want = reference.forward_backward(ids.data(), targets.data(), batch, seq, scale);

  const parallel::ContextSplit mine = parallel::ContextSplit::make(cp, world.rank(), seq);
  std::vector<int32_t> local_ids(batch * mine.local()), local_targets(batch * mine.local());
  mine.take_local(ids.data(), local_ids.data(), batch, 1);
  mine.take_local(targets.data(), local_targets.data(), batch, 1);
  split.params().begin_grad_step(1);
  const LossSum got =
      split.forward_backward(local_ids.data(), local_targets.data(), batch, mine.local(), scale);
  double sums[2] = {got.sum, static_cast<double>(got.tokens)};
  comm::all_reduce_sum(world, sums, 2);
  EXPECT_EQ(static_cast<int64_t>(sums[1]), want.tokens);
  EXPECT_NEAR(sums[0], want.sum, 1e-5 * std::abs(want.sum));

  // The replicated parameters' gradients, summed over the group (as the data-parallel x cp reduction does).
  const ParameterStore& ref = reference.params();
  ParameterStore& params = split.params();
  ASSERT_EQ(ref.count(), params.count());
  double norm_want = 0, norm_got = 0;
  for (int id = 0; id < params.count(); ++id) {
    const int ref_id = ref.find(params.info(id).name);
    ASSERT_GE(ref_id, 0) << params.info(id).name;
    const int64_t n = params.grad(id).numel();
    std::vector<float> g(params.grad(id).f32(), params.grad(id).f32() + n);
    comm::all_reduce_sum(world, g.data(), n);
    const float* rg = ref.grad(ref_id).f32();
    double max_ref = 0;
    for (int64_t i = 0; i < n; ++i) max_ref = std::max(max_ref, std::abs(double(rg[i])));
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      norm_want += double(rg[i]) * rg[i], norm_got += double(g[i]) * g[i];
      if (std::abs(g[i] - rg[i]) > 2e-5 * max_ref + 1e-9 && ++bad <= 3)
        ADD_FAILURE() << params.info(id).name << " grad element " << i << ": " << g[i] << " vs " << rg[i];
    }
  }
  EXPECT_NEAR(std::sqrt(norm_got), std::sqrt(norm_want), 1e-4 * std::sqrt(norm_want));
}

INSTANTIATE_TEST_SUITE_P(Modes, LlamaContextParallel,
                         ::testing::Values(Case{parallel::ContextAttention::ring, 2},
                                           Case{parallel::ContextAttention::ring, 1},
                                           Case{parallel::ContextAttention::all_to_all, 0},
                                           // Chunks of 3 tokens: a window of 4 reaches into the chunk before
                                           // (cut by position) and hides the ones further back (skipped); 7
                                           // spans two chunks and a half; QK-norm alongside.
                                           Case{parallel::ContextAttention::ring, 2, 4},
                                           Case{parallel::ContextAttention::ring, 1, 7, true},
                                           Case{parallel::ContextAttention::all_to_all, 0, 4},
                                           // Gemma 2 (window 5, soft caps) and 3 (local RoPE, QK-norm).
                                           Case{parallel::ContextAttention::ring, 2, 0, false, 2},
                                           Case{parallel::ContextAttention::ring, 1, 0, false, 3},
                                           Case{parallel::ContextAttention::all_to_all, 0, 0, false, 2}),
                         [](const auto& info) {
                           return std::string(parallel::context_attention_name(info.param.mode)) + "_kv" +
                                  std::to_string(info.param.kv_heads) +
                                  (info.param.window ? "_window" + std::to_string(info.param.window) : "") +
                                  (info.param.qk_norm ? "_qknorm" : "") +
                                  (info.param.gemma ? "_gemma" + std::to_string(info.param.gemma) : "");
                         });

}  // namespace
}  // namespace forge::llama_cp_mpi_test
