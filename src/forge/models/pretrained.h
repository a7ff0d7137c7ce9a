// Pretrained models in and out: Hugging Face folders (of any family in the registry, models/model.h) and
// forge checkpoints. A family's tensors are its Hugging Face state_dict (ModelConfig::tensor_shapes), which
// forge registers under the same names.
//
// A Hugging Face folder holds config.json and either model.safetensors or model.safetensors.index.json
// with the shards it names ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}); tensors are
// F32, BF16 or F16 under the Hugging Face names. A forge checkpoint is a directory with manifest.json
// (see checkpoint.h). open_pretrained() tells the two apart and reads the architecture; loading checks
// every tensor's presence, dtype and shape against the config before any weight is used.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/parameters.h"
#include "forge/models/model.h"

namespace forge::models {

struct PretrainedDir {
  enum class Kind { hugging_face, forge_checkpoint };
  Kind kind = Kind::hugging_face;
  std::filesystem::path dir;                  // the folder read (a series' step folder)
  nlohmann::json config_json;                 // the Hugging Face config.json
  std::shared_ptr<const ModelConfig> config;  // parsed by its family
  // A checkpoint series (a checkpoint directory of step folders): the directory given, the step read, and
  // what was noted on the way (a damaged `latest`, newer steps passed over); else series is empty.
  std::filesystem::path series;
  int64_t step = -1;
  std::string note;
  // "checkpoint runs/x/checkpoint at step 40 (step-00000040)", "Hugging Face folder DIR" or "checkpoint DIR",
  // for log lines (the note apart).
  std::string describe() const;
};

// How a command reads a checkpoint series whose newest step is unusable (its manifest deleted, garbled or
// edited, a shard truncated, missing or failing its checksum; docs/checkpoints.md): by default it refuses,
// naming the step, the damage and `allow_with` (the flag or key that accepts the fallback); with
// allow_older it reads the newest step that loads and says which steps it passed over and why.
struct SeriesReading {
  bool allow_older = false;
  std::string allow_with = "--allow-older-checkpoint";
};

// Throws forge::Error naming `dir` when it is neither kind, or its config is invalid. For a Hugging Face
// folder it also checks that the weight files exist (model.safetensors, or the index and every shard it
// names); the tensors themselves are checked by load_pretrained_weights.
// A forge checkpoint directory (step folders and `latest`) is read as its newest complete checkpoint,
// under `reading` when that is not the newest step.
PretrainedDir open_pretrained(const std::filesystem::path& dir, const SeriesReading& reading = {});
// Opens `dir` and calls read(source) with it. A checkpoint series is read newest step first; a step that is
// unusable, or whose read throws forge::Error (a file failing its checksum, a non-finite weight), is
// refused, or under reading.allow_older passed over for the next older one. Returns the source read.
PretrainedDir read_pretrained(const std::filesystem::path& dir, const SeriesReading& reading,
                              const std::function<void(const PretrainedDir&)>& read);

// Throws forge::Error (starting with `source`) unless `params` is allocated and holds exactly the tensors
// of config.tensor_shapes(), with those shapes.
void check_store_matches_config(const ParameterStore& params, const ModelConfig& config,
                                const std::string& source);

// Loads every parameter of `params` (fp32 master weights) from the directory; the store must have been
// built for source.config. Missing, unexpected, mistyped or misshapen tensors are errors naming the
// tensor and file. Everything is checked before the first weight is written, so on error the store is
// untouched, except for non-finite weights (NaN, infinity; check_finite in finite_check.h): they are found
// as each tensor is read, so that error, naming the tensor, the file and the first bad index, leaves part
// of the store overwritten (discard it). F32, BF16 and F16 convert exactly; the bf16 shadow, if any, is
// refreshed. Tolerated: the `model.layers.N.self_attn.rotary_emb.inv_freq` buffers old exports carry, and,
// in a tied model, an lm_head.weight bitwise equal to the embedding.
void load_pretrained_weights(const PretrainedDir& source, ParameterStore& params);

// Builds an inference model (no gradient buffers) for the directory's config and loads its weights
// (read_pretrained). `used`, when given, receives the source read.
std::unique_ptr<Model> load_pretrained_model(const std::filesystem::path& dir, nn::ComputeOptions options,
                                             const SeriesReading& reading = {},
                                             PretrainedDir* used = nullptr);

struct HfExportOptions {
  DType dtype = DType::f32;                  // f32, bf16 or f16 (fp32 rounds to nearest, ties to even)
  uint64_t max_shard_bytes = 5'000'000'000;  // "5GB", Hugging Face's default; a larger model is split
                                             // into model-0000i-of-0000N.safetensors
  // An existing non-empty out_dir is refused unless overwrite is set, and even then only when it holds a
  // model (config.json or manifest.json), so a mistyped path cannot wipe an unrelated folder.
  bool overwrite = false;
  std::vector<std::filesystem::path> extra_files;  // copied into the folder (tokenizer.json, ...)
};

// Writes a Hugging Face folder (config.json, safetensors shard(s), the index when sharded). The folder is
// written under a temporary name and renamed into place, so it is either complete or absent.
// config.json is `config_json` (which must describe the store) with "torch_dtype" set to the dtype.
// Shards are filled greedily in parameter order; a tensor is never split, so one larger than
// max_shard_bytes gets a shard of its own. One shard is written as model.safetensors without an index.
void export_hugging_face(const ParameterStore& params, const nlohmann::json& config_json,
                         const std::filesystem::path& out_dir, const HfExportOptions& options);

// Writes a forge checkpoint (save_checkpoint: fp32 weights, no optimizer state, step 0) with the same
// staging, overwrite rule and extra files as export_hugging_face. Its model_config is
// the family's parse of config_json, to_json(): what the trainer records and compares on resume.
void export_forge_checkpoint(const ParameterStore& params, const nlohmann::json& config_json,
                             const std::filesystem::path& out_dir, bool overwrite,
                             const std::vector<std::filesystem::path>& extra_files = {});

// A byte count as Hugging Face writes max_shard_size: digits with an optional case-insensitive unit,
// B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024): "5GB", "500MB", "1024".
// Throws forge::Error naming the text when it is malformed, zero or too large.
uint64_t parse_byte_size(std::string_view text);

}  // namespace forge::models
