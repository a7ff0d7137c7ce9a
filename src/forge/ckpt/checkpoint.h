// forge checkpoints: one format for every parallel layout (sharded.h, docs/formats.md). A directory holds
//   shard-RRRRR-of-WWWWW.safetensors  the pieces of state rank R of W owned, as 1-D fp32 tensors named
//                                     like the Hugging Face weights ("exp_avg.<name>", "exp_avg_sq.<name>"
//                                     for the AdamW moments)
//   manifest.json                     written last (tmp file, fsync, rename): format, version, step, the
//                                     size and CRC32 of each file, where each piece lies, the world size
//                                     and layout it was saved under, the model's config.json and
//                                     caller-supplied state
// A directory without manifest.json, or whose files do not match it, is incomplete and is refused.
// Version 1 checkpoints (model.safetensors + optimizer.safetensors, one process) are still read.
//
// The functions here are the single-process API: a one-rank world whose store holds whole tensors.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "forge/core/parameters.h"

namespace forge::ckpt {

struct CheckpointState {
  int64_t step = 0;                 // optimizer steps completed
  nlohmann::json model_config;      // Hugging Face config.json of the model
  nlohmann::json extra;             // trainer state (tokens seen, config, ...)
  nlohmann::json layout = nullptr;  // the parallel layout it was saved under ({"tp": 2, ...}; null: none)
  int64_t optimizer_steps = -1;     // AdamW steps taken (-1: not recorded; load_checkpoint then uses step)
  int world_size = 1;               // set when reading: the number of ranks that wrote it
};

// Saves the store (and the optimizer's moments and step count, when given) as a one-rank checkpoint.
void save_checkpoint(const std::string& dir, const ParameterStore& params, const OptimizerMoments* optimizer,
                     const CheckpointState& state);

// Reads manifest.json of the checkpoint `dir` stands for (a checkpoint folder, or a checkpoint directory
// resolved to its latest complete checkpoint: checkpoint_dir.h) and checks its structure, its checksum and
// that every file it lists exists with its size; with verify_files, also each file's CRC32 (reading every
// byte). Throws forge::Error naming the problem.
CheckpointState read_checkpoint_manifest(const std::string& dir, bool verify_files = true);
bool checkpoint_exists(const std::string& dir);  // `dir` resolves to a complete checkpoint

// Loads weights (and, when optimizer is given, its moments and step count: AdamW::moments()) into existing
// buffers, from a
// checkpoint saved under any layout; every element of every parameter must be covered, global shapes
// equal. Nothing is written before everything is checked.
CheckpointState load_checkpoint(const std::string& dir, ParameterStore& params, OptimizerMoments* optimizer);

}  // namespace forge::ckpt
