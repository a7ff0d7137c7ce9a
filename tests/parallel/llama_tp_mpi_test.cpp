// Tensor (+ sequence) parallel LlamaModel against the same model on one rank: every rank builds the
// unsplit reference and its shard of the split model from the same seed; losses, logits and every
// gradient element (mapped to its global index) must agree within fp32 reduction-order tolerance.
// Run by mpirun with 2 and 4 ranks; the whole world is the tensor-parallel group. The cases with q/k/v biases
// are a Qwen2's layers (the biases split like their weights, summed like them when kv heads are replicated);
// with QK-norm a Qwen3's (the [head_dim] norm weights replicated, their gradients summed over the group);
// with a window a Mistral's; a Gemma 2 and a Gemma 3 (family_stacks.h) split the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/philox.h"
#include "forge/models/llama/llama_model.h"
#include "forge/parallel/comm_tensor_parallel.h"
#include "parallel/family_stacks.h"

namespace forge::llama_tp_mpi_test {
using namespace forge::models;
namespace {

LlamaConfig tiny_config(int64_t kv_heads, bool tied, bool bias, bool qk_norm = false, int64_t window = 0) {
  LlamaConfig c;
  c.qkv_bias = bias;
  c.qk_norm = qk_norm;
  c.attention_window = window;
  c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = kv_heads, c.head_dim = 8;
  c.vocab_size = 61;  // not a multiple of anything: exercises the padded, masked vocabulary rows
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 64;
  return c;
}

struct Case {
  int64_t kv_heads;
  bool sequence_parallel, tied;
  bool bias = false;
  bool qk_norm = false;
  int64_t window = 0;
  int gemma = 0;  // 2 or 3: a Gemma of that generation (the other options unused)
  // The split model recomputes every module selectively (the norms' outputs, and so the all-gathers of
  // sequence parallelism, the attention core, the MLP activation) where the reference keeps everything.
  bool fine_recompute = false;
};

// Biases start at zero and QK-norm weights at one; give them values that depend only on the name and the
// global index, so that the forward uses them and every layout holds the same.
void set_biases(ParameterStore& store) {
  for (int id = 0; id < store.count(); ++id) {
    const ParamInfo& p = store.info(id);
    const bool bias = p.name.find("_proj.bias") != std::string::npos;
    if (!bias && p.name.find("self_attn.q_norm") == std::string::npos &&
        p.name.find("self_attn.k_norm") == std::string::npos)
      continue;
    for (const ShardRun& r : shard_runs(p))
      for (int64_t j = 0; j < r.count; ++j)
        store.param(id).f32()[r.local + j] =
            (bias ? 0.0f : 1.0f) +
            0.05f * std::sin(0.7f * static_cast<float>(r.global + j) + static_cast<float>(p.name.size()));
  }
  store.refresh_bf16();
}

class LlamaTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaTensorParallel, MatchesOneRank) {
  comm::Communicator& world = comm::world();
  const Case c = GetParam();
  std::unique_ptr<LlamaConfig> config_holder =
      c.gemma ? std::unique_ptr<LlamaConfig>(layout_models::tiny_gemma(c.gemma, c.kv_heads))
              : std::make_unique<LlamaConfig>(tiny_config(c.kv_heads, c.tied, c.bias, c.qk_norm, c.window));
  const LlamaConfig& config = *config_holder;
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;
  auto reference_holder = layout_models::make_stack(config, options);
  DecoderStack& reference = *reference_holder;
  reference.initialize(7);
  set_biases(reference.params());
  if (c.gemma) layout_models::set_gemma_norms(reference.params());

  parallel::CommTensorParallel group(&world, c.sequence_parallel);
  nn::ComputeOptions split_options = options;
  split_options.tp = &group;
  split_options.vocab_divisible_by = 8;
  if (c.fine_recompute)
    split_options.recompute = nn::Recompute::selective,
    split_options.recompute_modules = nn::recompute_modules_from_names("core_attn,mlp_act,norm");
  auto split_holder = layout_models::make_stack(config, split_options);
  DecoderStack& split = *split_holder;
  split.initialize(7);
  set_biases(split.params());
  if (c.gemma) layout_models::set_gemma_norms(split.params());
  EXPECT_EQ(split.padded_vocab_size() % (8 * world.size()), 0);

  const int64_t batch = 2, seq = 12;
  std::vector<int32_t> ids(batch * seq), targets(batch * seq);
  for (int64_t i = 0; i < batch * seq; ++i) {
    const auto bits = philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {11, 0});
    ids[i] = static_cast<int32_t>(bits[0] % config.vocab_size);
    targets[i] = i % 7 == 3 ? -1 : static_cast<int32_t>(bits[1] % config.vocab_size);
  }
  const float scale = 1.0f / (batch * seq);
  // Two micro-batches: replicated gradients are summed over the group once, when the last makes them final.
  reference.params().begin_grad_step(2);
  LossSum want = reference.forward_backward(ids.data(), targets.data(), batch, seq, scale);
  LossSum want2 = reference.forward_backward(ids.data(), targets.data(), batch, seq, scale);
  split.params().begin_grad_step(2);
  LossSum got = split.forward_backward(ids.data(), targets.data(), batch, seq, scale);
  LossSum got2 = split.forward_backward(ids.data(), targets.data(), batch, seq, scale);
  EXPECT_FALSE(split.params().grad_step_active());
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_NEAR(got.sum, want.sum, 1e-4 * std::abs(want.sum));
  EXPECT_NEAR(got2.sum, want2.sum, 1e-4 * std::abs(want2.sum));

  // Every gradient element of every shard equals the reference's at its global index.
  const ParameterStore& ref = reference.params();
  const ParameterStore& mine = split.params();
  ASSERT_EQ(ref.count(), mine.count());
  for (int id = 0; id < mine.count(); ++id) {
    const ParamInfo& p = mine.info(id);
    const int ref_id = ref.find(p.name);
    ASSERT_GE(ref_id, 0) << p.name;
    ASSERT_EQ(ref.info(ref_id).shape, p.global_shape()) << p.name;
    const float* g = mine.grad(id).f32();
    const float* w = mine.param(id).f32();
    const float* rg = ref.grad(ref_id).f32();
    const float* rw = ref.param(ref_id).f32();
    double max_ref = 0;
    for (int64_t i = 0; i < shape_numel(ref.info(ref_id).shape); ++i)
      max_ref = std::max(max_ref, std::abs(double(rg[i])));
    // Padding rows: zero weights, no gradient. Everything else: the reference's element at its global index.
    std::vector<bool> covered(shape_numel(p.shape), false);
    int bad = 0;
    for (const ShardRun& r : shard_runs(p))
      for (int64_t j = 0; j < r.count; ++j) {
        const int64_t i = r.local + j, gi = r.global + j;
        covered[i] = true;
        EXPECT_EQ(w[i], rw[gi]) << p.name << " element " << i;  // initialisation is layout-independent
        if (std::abs(g[i] - rg[gi]) > 2e-5 * max_ref + 1e-9 && ++bad <= 3)
          ADD_FAILURE() << p.name << " grad element " << i << " (global " << gi << "): " << g[i] << " vs "
                        << rg[gi];
      }
    for (int64_t i = 0; i < shape_numel(p.shape); ++i)
      if (!covered[i]) {
        EXPECT_EQ(w[i], 0.0f) << p.name;
        EXPECT_EQ(g[i], 0.0f) << p.name;
      }
  }

  // Full logits gathered over the vocabulary ranges.
  Tensor lw = reference.logits(ids.data(), batch, seq), lg = split.logits(ids.data(), batch, seq);
  ASSERT_EQ(lw.shape(), lg.shape());
  for (int64_t i = 0; i < lw.numel(); ++i) ASSERT_NEAR(lg.f32()[i], lw.f32()[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LlamaTensorParallel,
    ::testing::Values(Case{4, false, false}, Case{4, true, false}, Case{2, false, false}, Case{2, true, true},
                      Case{1, true, false}, Case{2, true, false, true}, Case{1, false, true, true},
                      // Qwen3 (QK-norm, kv heads split and replicated), Mistral (a
                      // window of 5 over 12 positions), both
                      Case{2, true, false, false, true}, Case{1, false, false, false, true},
                      Case{2, false, false, false, false, 5}, Case{1, true, true, false, true, 5},
                      // Gemma 2 and 3: sandwich norms (summed over the group under sequence
                      // parallelism), soft caps, GeGLU, tied head, local RoPE and QK-norm
                      Case{2, true, true, false, false, 0, 2}, Case{1, false, true, false, false, 0, 3},
                      Case{2, true, true, false, false, 0, 3},
                      // Every module recomputed: plain, with biases, and around Gemma 2's sandwich norms
                      Case{2, true, false, false, false, 0, 0, true},
                      Case{1, true, false, true, false, 0, 0, true},
                      Case{2, false, true, false, false, 0, 2, true}),
    [](const auto& info) {
      return "kv" + std::to_string(info.param.kv_heads) + (info.param.sequence_parallel ? "_sp" : "") +
             (info.param.tied ? "_tied" : "") + (info.param.bias ? "_bias" : "") +
             (info.param.qk_norm ? "_qknorm" : "") +
             (info.param.window ? "_window" + std::to_string(info.param.window) : "") +
             (info.param.gemma ? "_gemma" + std::to_string(info.param.gemma) : "") +
             (info.param.fine_recompute ? "_recompute_modules" : "");
    });

TEST(LlamaTensorParallelErrors, SequenceParallelNeedsDivisibleRows) {
  comm::Communicator& world = comm::world();
  if (world.size() < 2) GTEST_SKIP();
  parallel::CommTensorParallel group(&world, true);
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;
  options.tp = &group;
  LlamaModel split(tiny_config(4, false, false), options);
  std::vector<int32_t> ids(3, 1), targets(3, 2);
  try {
    split.forward_backward(ids.data(), targets.data(), 1, 3, 1.0f);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence parallelism"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::llama_tp_mpi_test
