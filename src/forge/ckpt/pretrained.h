// Pretrained models in and out: Hugging Face LlamaForCausalLM folders and forge checkpoints.
//
// A Hugging Face folder holds config.json and either model.safetensors or model.safetensors.index.json
// with the shards it names ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}); tensors are
// F32, BF16 or F16 under the Hugging Face names. A forge checkpoint is a directory with manifest.json
// (see checkpoint.h). open_pretrained() tells the two apart and reads the architecture; loading checks
// every tensor's presence, dtype and shape against the config before any weight is used.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "forge/core/dtype.h"
#include "forge/models/llama.h"
#include "forge/nn/parameters.h"

namespace forge {

struct PretrainedDir {
  enum class Kind { hugging_face, forge_checkpoint };
  Kind kind = Kind::hugging_face;
  std::filesystem::path dir;
  nlohmann::json config_json;  // the Hugging Face config.json
  LlamaConfig config;
};

// Throws forge::Error naming `dir` when it is neither kind, or its config is invalid.
PretrainedDir open_pretrained(const std::filesystem::path& dir);

// Loads every parameter of `params` (fp32 master weights) from the directory; the store must have been
// built for source.config. Missing, unexpected, mistyped or misshapen tensors are errors naming the
// tensor and file.
void load_pretrained_weights(const PretrainedDir& source, nn::ParameterStore& params);

// Builds a model for the directory's config and loads its weights.
std::unique_ptr<LlamaModel> load_pretrained_model(const std::filesystem::path& dir, nn::ComputeOptions options);

struct HfExportOptions {
  DType dtype = DType::f32;               // f32, bf16 or f16
  uint64_t max_shard_bytes = 5ull << 30;  // a larger model is split into model-0000i-of-0000N.safetensors
};

// Writes a Hugging Face folder (config.json, safetensors shard(s), the index when sharded). The folder is
// written under a temporary name and renamed into place, so it is either complete or absent.
void export_hugging_face(const nn::ParameterStore& params, const nlohmann::json& config_json,
                         const std::filesystem::path& out_dir, const HfExportOptions& options);

}  // namespace forge
