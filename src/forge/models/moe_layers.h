// What the MoE families on the decoder stack (Mixtral, Qwen3-MoE) share: the router's and the experts'
// tensors of one MoE layer under a family's names, in the order the stack registers them.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

// Appends "<layer><names.block>gate.weight" [experts, hidden] and every expert's gate and up [ffn, hidden]
// (expert by expert), then every down [hidden, ffn] (names.correction_bias is not supported here).
void append_moe_shapes(std::vector<std::pair<std::string, Shape>>& shapes, const std::string& layer,
                       const DecoderSpec::MoeNames& names, int64_t experts, int64_t hidden, int64_t ffn);

// The spec's MoE layer of a Mixtral-style family: softmax scores, top_k of `experts` SwiGLU experts of width
// ffn (renormalised when `normalize`), no shared experts, under `names`. The family marks its MoE layers.
void set_softmax_moe(DecoderSpec& spec, int64_t hidden, int64_t experts, int64_t top_k, int64_t ffn,
                     bool normalize, const DecoderSpec::MoeNames& names);

// router_aux_loss_coef (the weight of Hugging Face's load-balancing loss with output_router_logits), or
// `fallback` when absent; a negative or non-finite value is refused in one line naming the key.
double read_router_aux_loss_coef(const nlohmann::json& config, std::string_view source, double fallback);

// Weights of a MoE layer's matrix products: the router and `experts` SwiGLU experts of width ffn.
inline int64_t moe_matmul_parameters(int64_t experts, int64_t hidden, int64_t ffn) {
  return experts * hidden + experts * 3 * hidden * ffn;
}

// Weights of one layer's attention projections (q, k, v, o) of a LLaMA-family config.
inline int64_t attention_matmul_parameters(const LlamaConfig& c) {
  return 2 * c.hidden_size * c.q_size() + 2 * c.hidden_size * c.kv_size();
}

// Model FLOPs per trained token of a LLaMA-family config whose layers run `layers_matmul` weights of matrix
// products per token in all (the experts a token takes, not all of them): LlamaConfig::flops_per_token's
// accounting (6 per weight with the head's, 12 x layers x seq x q width for attention).
inline double decoder_flops_per_token(const LlamaConfig& c, double layers_matmul, int64_t seq_len) {
  const double matmul =
      2.0 * (layers_matmul + static_cast<double>(c.vocab_size) * static_cast<double>(c.hidden_size));
  return 3.0 * matmul + 12.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(seq_len) *
                            static_cast<double>(c.q_size());
}

}  // namespace forge::models
