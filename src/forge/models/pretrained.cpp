// Pretrained models in: Hugging Face folders of the families in the registry and forge checkpoints (see
// pretrained.h).
// Export lives in hf_export.cpp.
#include "forge/models/pretrained.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/finite_check.h"
#include "forge/ckpt/safetensors.h"
#include "forge/ckpt/sharded.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/memory.h"
#include "forge/models/deepseek_v3/deepseek_v3_config.h"

namespace forge::models {
using namespace forge::ckpt;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// Strict: a key given twice (in config.json or the index) is refused, not silently resolved to the last.
json read_json_file(const fs::path& path) {
  return parse_json_strict(read_file(path, "JSON file"), path.string());
}

// Where the tensors of a directory live: the file of each tensor name (relative to the directory), and
// the file that says so (the index, or the single file itself) for messages about missing tensors.
struct WeightLayout {
  fs::path listing;                            // model.safetensors.index.json, or the single file
  std::map<std::string, std::string> tensors;  // only for an index: tensor -> shard file name
  std::vector<std::string> files;              // every safetensors file, sorted
  bool indexed = false;
};

WeightLayout hugging_face_layout(const fs::path& dir) {
  WeightLayout layout;
  const fs::path single = dir / kSingleFile, index = dir / kIndexFile;
  const bool has_single = fs::exists(single), has_index = fs::exists(index);
  if (has_single && has_index)
    fail("{}: holds both {} and {}; remove the stale one so it is clear which weights to read", dir.string(),
         kSingleFile, kIndexFile);
  if (!has_single && !has_index) {
    for (const char* torch_file : {"pytorch_model.bin", "pytorch_model.bin.index.json"})
      if (fs::exists(dir / torch_file))
        fail("{}: holds PyTorch pickle weights ({}), which forge does not read; save them as safetensors",
             dir.string(), torch_file);
    fail("{}: Hugging Face folder has no weights ({} or {})", dir.string(), kSingleFile, kIndexFile);
  }
  if (has_single) {
    layout.listing = single;
    layout.files = {kSingleFile};
    return layout;
  }

  layout.indexed = true;
  layout.listing = index;
  const std::string source = index.string();
  const json parsed = read_json_file(index);
  if (!parsed.is_object())
    fail("{}: expected a JSON object at the top level, got {}", source, parsed.type_name());
  if (auto it = parsed.find("metadata"); it != parsed.end() && !it->is_null() && !it->is_object())
    fail("{}: 'metadata' must be an object, got {}", source, it->type_name());
  auto map = parsed.find("weight_map");
  if (map == parsed.end()) fail("{}: missing required key 'weight_map'", source);
  if (!map->is_object()) fail("{}: 'weight_map' must be an object, got {}", source, map->type_name());
  std::set<std::string> files;
  for (const auto& [tensor, file] : map->items()) {
    if (!file.is_string())
      fail("{}: weight_map entry for tensor '{}' must be a file name, got {}", source, tensor, file.dump());
    const std::string name = file.get<std::string>();
    // Shards sit next to the index: a path elsewhere is a malformed (or malicious) index.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      fail("{}: weight_map entry for tensor '{}' names '{}', which is not a file name in the folder", source,
           tensor, name);
    if (files.insert(name).second && !fs::is_regular_file(dir / name))
      fail("{}: weight_map names shard '{}' (for tensor '{}'), but {} does not exist", source, name, tensor,
           (dir / name).string());
    layout.tensors[tensor] = name;
  }
  if (layout.tensors.empty()) fail("{}: 'weight_map' is empty", source);
  layout.files.assign(files.begin(), files.end());
  return layout;
}

struct Located {
  const SafetensorsFile* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
};

// Every tensor of every weight file, by name. For an index, each shard must hold exactly the tensors the
// weight_map assigns to it.
std::map<std::string, Located> locate_tensors(const WeightLayout& layout, const fs::path& dir,
                                              std::vector<SafetensorsFile>& files) {
  files.clear();
  files.reserve(layout.files.size());
  for (const auto& name : layout.files) files.push_back(SafetensorsFile::open((dir / name).string()));
  std::map<std::string, Located> located;
  for (size_t f = 0; f < files.size(); ++f) {
    for (const auto& entry : files[f].entries()) {
      if (layout.indexed) {
        auto mapped = layout.tensors.find(entry.name);
        if (mapped == layout.tensors.end())
          fail("{}: tensor '{}' is not in the weight_map of {}", files[f].path(), entry.name,
               layout.listing.string());
        if (mapped->second != layout.files[f])
          fail("{}: holds tensor '{}', but the weight_map of {} assigns it to '{}'", files[f].path(),
               entry.name, layout.listing.string(), mapped->second);
      }
      located[entry.name] = {&files[f], &entry};
    }
  }
  for (const auto& [tensor, file] : layout.tensors)
    if (!located.count(tensor))
      fail("{}: weight_map assigns tensor '{}' to '{}', which does not hold it", layout.listing.string(),
           tensor, file);
  return located;
}

// Old Hugging Face exports saved each layer's RoPE frequencies as a buffer; forge computes them.
bool is_rotary_buffer(const std::string& name, int64_t layers) {
  constexpr std::string_view prefix = "model.layers.", suffix = ".self_attn.rotary_emb.inv_freq";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix))
    return false;
  const std::string index = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (index.empty() || index.size() > 9 ||
      !std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  if (index.size() > 1 && index[0] == '0') return false;
  return std::stoll(index) < layers;
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16;
}

void check_tensor(const Located& at, const std::string& name, const Shape& shape,
                  const std::string& config_source) {
  if (!is_float_dtype(at.entry->dtype))
    fail("{}: tensor '{}' has dtype {}; forge loads F32, BF16 or F16 weights", at.file->path(), name,
         safetensors_dtype_name(at.entry->dtype));
  if (at.entry->shape != shape)
    fail("{}: tensor '{}' has shape {}, but the config ({}) needs {}", at.file->path(), name,
         shape_string(at.entry->shape), config_source, shape_string(shape));
}

std::string config_source(const PretrainedDir& source) {
  return source.kind == PretrainedDir::Kind::hugging_face
             ? (source.dir / kConfigFile).string()
             : (source.dir / "manifest.json").string() + " model_config";
}

}  // namespace

// Shared with hf_export.cpp: the store must hold exactly the tensors of `config`, with their (global)
// shapes; a tensor-parallel store holds shards of them (ShardSpec), which export refuses.
void check_store_matches_config(const ParameterStore& params, const ModelConfig& config,
                                const std::string& source) {
  if (!params.allocated()) fail("{}: the parameter store is not allocated", source);
  const auto expected = config.tensor_shapes();
  for (const auto& [name, shape] : expected) {
    const int id = params.find(name);
    if (id < 0) fail("{}: the model has no parameter '{}' that the config needs", source, name);
    if (params.info(id).global_shape() != shape)
      fail("{}: parameter '{}' has shape {} in the model, but the config needs {}", source, name,
           shape_string(params.info(id).global_shape()), shape_string(shape));
  }
  if (params.count() != static_cast<int>(expected.size())) {
    std::set<std::string> names;
    for (const auto& [name, shape] : expected) names.insert(name);
    for (const auto& info : params.infos())
      if (!names.count(info.name))
        fail("{}: the model has a parameter '{}' that the config does not describe", source, info.name);
  }
}

namespace {

// A forge checkpoint folder (a step of a series, or a single checkpoint): its manifest's model config. Files
// are checked for presence and size here; their checksums when the weights are read.
PretrainedDir open_checkpoint_folder(const fs::path& folder) {
  PretrainedDir result;
  result.kind = PretrainedDir::Kind::forge_checkpoint;
  result.dir = folder;
  CheckpointState state = read_checkpoint_manifest(folder.string(), /*verify_files=*/false);
  const std::string source = config_source(result);
  if (!state.model_config.is_object() || state.model_config.empty())
    fail("{}: the checkpoint records no model config", source);
  result.config_json = state.model_config;
  result.config = parse_model_config(result.config_json, source);
  return result;
}

// A Hugging Face model folder: config.json and the weight files it needs.
PretrainedDir open_pretrained_folder(const fs::path& dir) {
  PretrainedDir result;
  result.dir = dir;
  if (!fs::exists(dir / kConfigFile))
    fail("{}: neither a forge checkpoint (no manifest.json) nor a Hugging Face model folder (no {})",
         dir.string(), kConfigFile);
  result.kind = PretrainedDir::Kind::hugging_face;
  const std::string source = config_source(result);
  result.config_json = read_json_file(dir / kConfigFile);
  result.config = parse_model_config(result.config_json, source);
  hugging_face_layout(dir);
  return result;
}

std::string joined(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

}  // namespace

std::string PretrainedDir::describe() const {
  if (series.empty())
    return fmt::format("{} {}", kind == Kind::hugging_face ? "Hugging Face folder" : "checkpoint",
                       dir.string());
  return fmt::format("checkpoint {} at step {} ({})", series.string(), step, dir.filename().string());
}

PretrainedDir read_pretrained(const fs::path& dir, const SeriesReading& reading,
                              const std::function<void(const PretrainedDir&)>& read) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) fail("{}: no such directory", dir.string());
  if (!fs::is_directory(dir, ec)) fail("{}: not a directory", dir.string());
  const CheckpointSeries series =
      holds_checkpoint_data(dir.string()) ? checkpoint_series(dir.string()) : CheckpointSeries{};
  if (series.steps.empty()) {
    // A Hugging Face folder, a single checkpoint folder, or checkpoint data that resolves to none (the
    // error).
    PretrainedDir source = holds_checkpoint_data(dir.string())
                               ? open_checkpoint_folder(resolve_checkpoint(dir.string()).dir)
                               : open_pretrained_folder(dir);
    if (read) read(source);
    return source;
  }
  std::vector<std::string> notes;
  if (!series.latest_note.empty()) notes.push_back(series.latest_note);
  for (const SeriesCheckpoint& step : series.steps) {
    std::string problem = step.problem;
    if (problem.empty()) {
      try {
        PretrainedDir source = open_checkpoint_folder(step.dir);
        source.series = dir, source.step = step.step, source.note = joined(notes);
        if (read) read(source);
        return source;
      } catch (const OutOfMemory&) {
        throw;  // this machine's limit, not the checkpoint's damage
      } catch (const Error& e) {
        problem = e.what();
      }
    }
    if (!reading.allow_older)
      fail(
          "checkpoint {}: its newest step, {}, is unusable: {}{}; {} reads the newest step that loads "
          "instead",
          dir.string(), step.name, problem, notes.empty() ? "" : " (" + joined(notes) + ")",
          reading.allow_with);
    notes.push_back(fmt::format("passed over {}: {}", step.name, problem));
  }
  fail("checkpoint {}: none of its steps loads ({})", dir.string(), joined(notes));
}

PretrainedDir open_pretrained(const fs::path& dir, const SeriesReading& reading) {
  return read_pretrained(dir, reading, {});
}

void load_pretrained_weights(const PretrainedDir& source, ParameterStore& params) {
  const std::string config_name = config_source(source);
  check_store_matches_config(params, *source.config, config_name);
  if (source.kind == PretrainedDir::Kind::forge_checkpoint) {
    // Saved under any layout: the store's pieces are assembled from whichever shards hold them, each
    // element checked present, shapes equal and files checksummed before any weight is written (and every
    // value checked finite as it is read).
    const auto self = comm::make_self();
    if (params.device() == Device::cpu) {
      load_sharded_checkpoint(source.dir.string(), *self,
                              parameter_store_pieces(params, nullptr, /*for_saving=*/false));
    } else {
      // A model on a device loads into a host store of the same parameters, then copies it over.
      ParameterStore host;
      for (const ParamInfo& info : params.infos())
        host.add(info.name, info.shape, info.weight_decay, info.init, info.init_std, info.shard);
      host.allocate(/*with_bf16_shadow=*/false, /*with_grads=*/false);
      load_sharded_checkpoint(source.dir.string(), *self, parameter_store_pieces(host, nullptr, false));
      Tensor weights = params.params();
      weights.copy_from(host.params());
    }
    params.refresh_bf16();
    return;
  }
  const WeightLayout layout = hugging_face_layout(source.dir);
  std::vector<SafetensorsFile> files;
  const std::map<std::string, Located> located = locate_tensors(layout, source.dir, files);

  // Check everything before writing a single weight.
  const auto expected = source.config->tensor_shapes();
  const ModelShape shape = source.config->shape();
  std::set<std::string> expected_names;
  for (const auto& [name, shape] : expected) {
    expected_names.insert(name);
    auto it = located.find(name);
    if (it == located.end())
      fail("{}: tensor '{}' is missing (the config {} needs it)", layout.listing.string(), name, config_name);
    check_tensor(it->second, name, shape, config_name);
  }
  const Located* tied_head = nullptr;
  for (const auto& [name, at] : located) {
    if (expected_names.count(name) || is_rotary_buffer(name, shape.layers)) continue;
    // DeepSeek's release stores copies of the shared embedding and head per MTP module.
    if (const auto* deepseek = dynamic_cast<const DeepseekV3Config*>(source.config.get());
        deepseek && deepseek->is_ignored_duplicate(name))
      continue;
    if (name == "lm_head.weight" && !expected_names.count(name) &&
        expected_names.count("model.embed_tokens.weight")) {
      check_tensor(at, name, {shape.vocab, shape.hidden}, config_name);
      tied_head = &at;
      continue;
    }
    fail("{}: unexpected tensor '{}' (not a {} parameter under the config {})", at.file->path(), name,
         source.config->architecture(), config_name);
  }

  if (tied_head) {
    // Some exporters write the tied head anyway; it is harmless only if it is the embedding itself.
    const Located& embedding = located.at("model.embed_tokens.weight");
    Tensor head = tied_head->file->read_f32("lm_head.weight");
    Tensor embed = embedding.file->read_f32("model.embed_tokens.weight");
    if (std::memcmp(head.raw(), embed.raw(), embed.bytes()) != 0)
      fail(
          "{}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but the config {} ties them "
          "(tie_word_embeddings is true)",
          tied_head->file->path(), config_name);
  }

  // A model on a device is filled through a host copy of its weights (every one of them comes from the
  // files).
  const bool staged = params.device() != Device::cpu;
  const Tensor host = staged ? Tensor::zeros({params.numel()}, DType::f32) : Tensor();
  auto destination = [&](int id) {
    const ParamInfo& info = params.info(id);
    return staged ? host.view(info.offset, info.shape) : params.param(id);
  };
  for (const auto& [name, shape] : expected) {
    const Located& at = located.at(name);
    const ParamInfo& info = params.info(params.find(name));
    if (info.shard.dim < 0) {
      const Tensor into = destination(params.find(name));
      at.file->read_into(name, into);
      check_finite(into.f32(), into.numel(), name, at.file->path());
    } else {  // a tensor-parallel shard: read the whole tensor, keep this rank's slice
      Tensor whole = at.file->read_f32(name);
      check_finite(whole.f32(), whole.numel(), name, at.file->path());
      float* local = destination(params.find(name)).f32();
      std::fill(local, local + shape_numel(info.shape), 0.0f);  // vocabulary padding
      for (const ShardRun& r : shard_runs(info))
        std::copy_n(whole.f32() + r.global, r.count, local + r.local);
    }
  }
  if (staged) {
    Tensor weights = params.params();
    weights.copy_from(host);
  }
  params.refresh_bf16();
}

std::unique_ptr<Model> load_pretrained_model(const fs::path& dir, nn::ComputeOptions options,
                                             const SeriesReading& reading, PretrainedDir* used) {
  std::unique_ptr<Model> model;
  PretrainedDir source = read_pretrained(dir, reading, [&](const PretrainedDir& candidate) {
    model = build_model(*candidate.config, options, StageSpec::whole(), 0.02f, /*with_grads=*/false);
    load_pretrained_weights(candidate, model->params());
  });
  if (used) *used = std::move(source);
  return model;
}

}  // namespace forge::models
