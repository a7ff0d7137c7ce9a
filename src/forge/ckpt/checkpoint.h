// forge checkpoints (single process for now): a directory holding
//   model.safetensors      fp32 master weights under their Hugging Face names
//   optimizer.safetensors  AdamW moments as "exp_avg.<name>" and "exp_avg_sq.<name>"
//   manifest.json          written last (tmp file, fsync, rename): format, step, the CRC32 and size of
//                          each file, the model's config.json and caller-supplied state
// A directory without manifest.json, or whose files do not match it, is incomplete and is refused.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "forge/nn/parameters.h"
#include "forge/optim/adamw.h"

namespace forge {

struct CheckpointState {
  int64_t step = 0;          // optimizer steps completed
  nlohmann::json model_config;  // Hugging Face config.json of the model
  nlohmann::json extra;         // trainer state (tokens seen, config, ...)
};

void save_checkpoint(const std::string& dir, const nn::ParameterStore& params, const AdamW* optimizer,
                     const CheckpointState& state);

// Reads manifest.json and checks every file against it; throws forge::Error naming the problem.
CheckpointState read_checkpoint_manifest(const std::string& dir);
bool checkpoint_exists(const std::string& dir);  // a manifest is present

// Loads weights (and, when optimizer is given, its moments and step count) into existing buffers; every
// parameter of the store must be present with the same shape.
CheckpointState load_checkpoint(const std::string& dir, nn::ParameterStore& params, AdamW* optimizer);

}  // namespace forge
