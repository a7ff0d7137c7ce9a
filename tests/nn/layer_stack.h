// Decoder layers of grouped-query attention and SwiGLU for the module tests, registered the way a family
// registers them (names are the test's own: nn/ knows none) and composed from nn/ parts.
#pragma once

#include <cmath>
#include <memory>
#include <string>

#include "forge/nn/attention.h"
#include "forge/nn/decoder_layer.h"
#include "forge/nn/mlp.h"

namespace forge::nn::testing_layers {

struct LayerShape {
  AttentionShape attention;
  int64_t ffn = 0;
  float norm_eps = 1e-5f;
};

struct LayerIds {
  int norm1 = -1, norm2 = -1;
  AttentionParams attention;
  MlpParams mlp;
};

// Registers layer `index` of `layers` (output projections' init scaled by 1/sqrt(2 layers), as the families
// do).
inline LayerIds register_layer(ParameterStore& store, int index, const LayerShape& s, float init_std,
                               int layers) {
  const std::string p = "layers." + std::to_string(index) + ".";
  const auto& a = s.attention;
  const int64_t d = a.head_dim;
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(layers));
  LayerIds ids;
  ids.norm1 = store.add(p + "norm1", {a.hidden}, false, Init::ones);
  ids.attention.q = store.add(p + "q", {a.heads * d, a.hidden}, true, Init::normal, init_std);
  ids.attention.k = store.add(p + "k", {a.kv_heads * d, a.hidden}, true, Init::normal, init_std);
  ids.attention.v = store.add(p + "v", {a.kv_heads * d, a.hidden}, true, Init::normal, init_std);
  ids.attention.o = store.add(p + "o", {a.hidden, a.heads * d}, true, Init::normal, out_std);
  ids.norm2 = store.add(p + "norm2", {a.hidden}, false, Init::ones);
  ids.mlp.gate = store.add(p + "gate", {s.ffn, a.hidden}, true, Init::normal, init_std);
  ids.mlp.up = store.add(p + "up", {s.ffn, a.hidden}, true, Init::normal, init_std);
  ids.mlp.down = store.add(p + "down", {a.hidden, s.ffn}, true, Init::normal, out_std);
  return ids;
}

// Once the store is allocated.
inline DecoderLayer make_layer(ParameterStore& store, const LayerIds& ids, const LayerShape& s,
                               const RopeTable* rope, ComputeOptions options) {
  return DecoderLayer(&store, ids.norm1,
                      std::make_unique<Attention>(&store, ids.attention, s.attention, rope, options),
                      ids.norm2, std::make_unique<Mlp>(&store, ids.mlp, s.attention.hidden, s.ffn, options),
                      s.norm_eps, options);
}

}  // namespace forge::nn::testing_layers
