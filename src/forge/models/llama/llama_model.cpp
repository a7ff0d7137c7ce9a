#include "forge/models/llama/llama_model.h"

namespace forge::models {

DecoderSpec llama_spec(const LlamaConfig& config) {
  config.validate(config.origin.name.empty() ? "model config" : config.origin.name);
  DecoderSpec s;
  s.hidden = config.hidden_size, s.vocab = config.vocab_size, s.layers = config.num_hidden_layers;
  s.max_positions = config.max_position_embeddings;
  s.norm_eps = config.rms_norm_eps;
  s.tie_word_embeddings = config.tie_word_embeddings;
  s.init_depth = config.num_hidden_layers;
  s.ffn = config.intermediate_size;
  s.heads = config.num_attention_heads, s.kv_heads = config.num_key_value_heads, s.head_dim = config.head_dim;
  s.layer_specs.assign(static_cast<size_t>(config.num_hidden_layers), LayerSpec{});
  for (LayerSpec& layer : s.layer_specs) {
    layer.qkv_bias = config.qkv_bias;
    layer.qk_norm = config.qk_norm;
    layer.window = config.attention_window;
  }
  s.rope.positions = config.max_position_embeddings;
  s.rope.half_dim = config.head_dim / 2;
  s.rope.cos = Tensor::empty({s.rope.positions, s.rope.half_dim}, DType::f32);
  s.rope.sin = Tensor::empty({s.rope.positions, s.rope.half_dim}, DType::f32);
  rope_tables(s.rope.positions, config.head_dim, config.rope_theta, config.rope_scaling, s.rope.cos.f32(),
              s.rope.sin.f32());
  s.cache_heads = config.num_key_value_heads, s.cache_dim = config.head_dim;
  return s;
}

LlamaModel::LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads,
                       StageSpec stage, ParameterStore* into, std::string name_prefix)
    : DecoderStack(config, llama_spec(config), options, init_std, with_grads, stage, into,
                   std::move(name_prefix)) {}

ModelFamily llama_family() { return family_entry<LlamaConfig, LlamaModel>("LlamaForCausalLM", "llama"); }

}  // namespace forge::models
