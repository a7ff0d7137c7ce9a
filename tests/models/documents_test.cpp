// Packed documents (document masks): a micro-batch that packs several documents into its sequences gives each
// document's loss and every gradient of running each document alone, in fp32 within 1e-6, for a LLaMA, a
// Qwen2 (q/k/v biases), a Mistral with a sliding window shorter than the documents, Qwen3's QK-norm, a
// Gemma 2 (soft-capped attention) and DeepSeek-V3's MLA (with and without a q LoRA), under every recompute
// policy; malformed document lists are refused in one line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/core/philox.h"
#include "forge/models/model.h"
#include "op_harness.h"
#include "test_files.h"

namespace forge::documents_test {
using namespace forge::models;
namespace {

using nlohmann::json;
using testing::expect_error_containing;

json config_of(const std::string& family) {
  json c = {{"hidden_size", 32},        {"intermediate_size", 48},  {"num_hidden_layers", 2},
            {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
            {"rms_norm_eps", 1e-5},     {"vocab_size", 61},         {"max_position_embeddings", 64}};
  if (family == "llama") c["architectures"] = {"LlamaForCausalLM"}, c["model_type"] = "llama";
  if (family == "qwen2") c["architectures"] = {"Qwen2ForCausalLM"}, c["model_type"] = "qwen2";
  if (family == "qwen3") c["architectures"] = {"Qwen3ForCausalLM"}, c["model_type"] = "qwen3";
  if (family == "mistral")
    c["architectures"] = {"MistralForCausalLM"}, c["model_type"] = "mistral", c["sliding_window"] = 3;
  if (family == "deepseek_v3" || family == "deepseek_v3_q_lora") {  // MLA; every layer dense, no MTP
    c["architectures"] = {"DeepseekV3ForCausalLM"}, c["model_type"] = "deepseek_v3";
    c["q_lora_rank"] = family == "deepseek_v3" ? json(nullptr) : json(12);
    c["kv_lora_rank"] = 16, c["qk_nope_head_dim"] = 8, c["qk_rope_head_dim"] = 4, c["v_head_dim"] = 6;
    c["num_key_value_heads"] = 4, c["first_k_dense_replace"] = 2, c["num_nextn_predict_layers"] = 0;
    c["n_routed_experts"] = 4, c["num_experts_per_tok"] = 2, c["moe_intermediate_size"] = 8, c["n_group"] = 1;
    c["topk_group"] = 1, c["rope_interleave"] = true, c["n_shared_experts"] = 1, c["routed_scaling_factor"] = 1.0;
    c["norm_topk_prob"] = true, c["scoring_func"] = "sigmoid", c["topk_method"] = "noaux_tc";
    c["tie_word_embeddings"] = false, c["rope_theta"] = 10000.0;
    c.erase("head_dim");  // derived from qk_rope_head_dim
  }
  if (family == "gemma2")
    c["architectures"] = {"Gemma2ForCausalLM"}, c["model_type"] = "gemma2", c["sliding_window"] = 4,
    c["attn_logit_softcapping"] = 20.0, c["final_logit_softcapping"] = 10.0, c["query_pre_attn_scalar"] = 8;
  return c;
}

constexpr int64_t kSeq = 16;
const std::vector<int64_t> kDocuments = {5, 7, 4, 16, 1, 9, 6};  // three sequences of 16

struct Outcome {
  double loss = 0;
  std::vector<Tensor> grads;
};

std::vector<int32_t> tokens(int64_t n, uint32_t stream) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] =
        static_cast<int32_t>(philox4x32_10({static_cast<uint32_t>(i), stream, 0, 0}, {9, 0})[0] % 61);
  return ids;
}

// Each document's targets: its next tokens, nothing after its last.
std::vector<int32_t> targets_of(const std::vector<int32_t>& ids, const std::vector<int64_t>& documents) {
  std::vector<int32_t> targets(ids.size(), -1);
  int64_t row = 0;
  for (const int64_t length : documents) {
    for (int64_t t = 0; t + 1 < length; ++t)
      targets[static_cast<size_t>(row + t)] = ids[static_cast<size_t>(row + t + 1)];
    row += length;
  }
  return targets;
}

Outcome run(const json& config_json, nn::Recompute recompute, bool packed) {
  const auto config = parse_model_config(config_json, "documents test");
  auto model = build_model(*config, nn::ComputeOptions{DType::f32, recompute}, StageSpec{}, 0.02f);
  model->initialize(5);
  const std::vector<int32_t> ids = tokens(3 * kSeq, 1), targets = targets_of(ids, kDocuments);
  ParameterStore& params = model->params();
  params.zero_grads();
  Outcome out;
  auto step = [&](const int32_t* i, const int32_t* t, int64_t batch, int64_t seq,
                  const std::vector<int64_t>* docs) {
    MicroBatch mb{i, t, batch, seq, 1.0f};
    mb.documents = docs;
    std::unique_ptr<StageActivations> saved;
    out.loss += model->forward(mb, Tensor(), &saved).loss.sum;
    model->backward(Tensor(), *saved);
  };
  if (packed) {
    params.begin_grad_step(1);
    step(ids.data(), targets.data(), 3, kSeq, &kDocuments);
  } else {
    params.begin_grad_step(static_cast<int>(kDocuments.size()));
    int64_t row = 0;
    for (const int64_t length : kDocuments) {
      step(ids.data() + row, targets.data() + row, 1, length, nullptr);
      row += length;
    }
  }
  for (int i = 0; i < params.count(); ++i) out.grads.push_back(params.grad(i).to(Device::cpu).clone());
  return out;
}

class PackedDocuments : public ::testing::TestWithParam<const char*> {};

TEST_P(PackedDocuments, EqualEachDocumentAlone) {
  const json config = config_of(GetParam());
  for (const nn::Recompute recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    SCOPED_TRACE(static_cast<int>(recompute));
    const Outcome alone = run(config, recompute, false), packed = run(config, recompute, true);
    EXPECT_NEAR(packed.loss, alone.loss, 1e-6 * alone.loss);
    ASSERT_EQ(packed.grads.size(), alone.grads.size());
    for (size_t i = 0; i < alone.grads.size(); ++i)
      EXPECT_LT(testing::rel_error(packed.grads[i], alone.grads[i]), 1e-6) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, PackedDocuments,
                         ::testing::Values("llama", "qwen2", "qwen3", "mistral", "gemma2", "deepseek_v3",
                                           "deepseek_v3_q_lora"));

TEST(PackedDocuments, RefusesMalformedDocumentLists) {
  const auto config = parse_model_config(config_of("llama"), "documents test");
  auto model = build_model(*config, nn::ComputeOptions{DType::f32, nn::Recompute::none}, StageSpec{}, 0.02f);
  model->initialize(5);
  const std::vector<int32_t> ids = tokens(2 * kSeq, 1);
  auto forward = [&](const std::vector<int64_t>& documents) {
    MicroBatch mb{ids.data(), ids.data(), 2, kSeq, 1.0f};
    mb.documents = &documents;
    std::unique_ptr<StageActivations> saved;
    model->forward(mb, Tensor(), &saved);
  };
  expect_error_containing(
      [&] {
        forward({10, 10, 12});
      },
      {"packed documents", "row 10", "one sequence of 16"});
  expect_error_containing([&] { forward({16, 8}); }, {"add up to 24", "2 x 16"});
  expect_error_containing([&] { forward({16, 0, 16}); }, {"a document of 0 tokens"});
}

}  // namespace
}  // namespace forge::documents_test
