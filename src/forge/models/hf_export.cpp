// Pretrained models out: Hugging Face folders and weights-only forge checkpoints (see pretrained.h).
//
// Every output folder is assembled under a hidden sibling (".<name>.tmp-XXXXXX", same file system) and
// renamed into place at the end, so a crash or an error leaves either no folder or the previous one,
// never a folder that looks complete but is not.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>

#include "forge/ckpt/checkpoint.h"
#include "forge/models/pretrained.h"
#include "forge/ckpt/safetensors.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::models {
using namespace forge::ckpt;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void fsync_path(const fs::path& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// A hidden staging folder next to the output, committed by renaming it into place.
class StagedDir {
 public:
  StagedDir(const fs::path& out_dir, bool overwrite) {
    if (out_dir.empty()) fail("output directory: empty path");
    final_ = fs::absolute(out_dir).lexically_normal();
    if (!final_.has_filename()) final_ = final_.parent_path();  // "out/" names "out"
    if (final_ == final_.root_path())
      fail("output directory {}: refusing to write to the root", out_dir.string());
    std::error_code ec;
    const auto status = fs::symlink_status(final_, ec);
    if (fs::is_symlink(status))
      fail("output directory {}: is a symbolic link; give the folder's real path", final_.string());
    if (fs::exists(status)) {
      if (!fs::is_directory(status))
        fail("output directory {}: exists and is not a directory", final_.string());
      if (!fs::is_empty(final_, ec)) {
        if (!overwrite)
          fail(
              "output directory {}: exists and is not empty; refusing to overwrite it (forge convert: "
              "--overwrite)",
              final_.string());
        if (!fs::exists(final_ / "config.json") && !fs::exists(final_ / "manifest.json"))
          fail("output directory {}: holds no model (config.json or manifest.json); refusing to replace it",
               final_.string());
        replace_ = true;
      }
    }
    fs::create_directories(final_.parent_path(), ec);
    if (ec) fail("output directory {}: cannot create its parent: {}", final_.string(), ec.message());
    std::string pattern = hidden_sibling(".tmp-XXXXXX");
    if (!::mkdtemp(pattern.data()))
      fail("output directory {}: cannot create a staging folder next to it: {}", final_.string(),
           std::strerror(errno));
    staging_ = pattern;
  }
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;
  ~StagedDir() {
    std::error_code ec;
    if (!staging_.empty()) fs::remove_all(staging_, ec);
  }

  const fs::path& path() const { return staging_; }

  void copy_in(const std::vector<fs::path>& files) const {
    for (const auto& file : files) {
      if (!fs::is_regular_file(file)) fail("{}: cannot copy into the output: not a file", file.string());
      // Companion files are small; a checked write and fsync report a full disk, naming the file.
      write_file_atomically(staging_ / file.filename(), read_file(file, "file to copy"),
                            "copy of " + file.string());
    }
  }

  void commit() {
    fsync_path(staging_, O_RDONLY | O_DIRECTORY);
    if (replace_) {
      // Swap the two folders in one step, then delete the old one (now under the staging name).
      if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, final_.c_str(), RENAME_EXCHANGE) != 0) {
        if (errno != EINVAL && errno != ENOSYS)
          fail("output directory {}: cannot replace it with {}: {}", final_.string(), staging_.string(),
               std::strerror(errno));
        // A file system without the exchange: move the old folder aside first (briefly no folder at all).
        std::string aside = hidden_sibling(".old-XXXXXX");
        if (!::mkdtemp(aside.data()) || ::rename(final_.c_str(), aside.c_str()) != 0)
          fail("output directory {}: cannot move it aside: {}", final_.string(), std::strerror(errno));
        if (::rename(staging_.c_str(), final_.c_str()) != 0) {
          const int error = errno;
          ::rename(aside.c_str(), final_.c_str());
          fail("output directory {}: cannot move {} into place: {}", final_.string(), staging_.string(),
               std::strerror(error));
        }
        staging_ = aside;  // the destructor deletes the old folder
      }
    } else {
      // rename(2) also replaces an empty directory; one made non-empty meanwhile makes it fail.
      if (::rename(staging_.c_str(), final_.c_str()) != 0)
        fail("output directory {}: cannot move {} into place: {}", final_.string(), staging_.string(),
             std::strerror(errno));
      staging_.clear();
    }
    fsync_path(final_.parent_path(), O_RDONLY | O_DIRECTORY);
  }

 private:
  // A mkdtemp pattern for a hidden folder next to the output: <parent>/.<name><suffix>.
  std::string hidden_sibling(std::string_view suffix) const {
    std::string name(".");
    name.append(final_.filename().string()).append(suffix);
    return (final_.parent_path() / name).string();
  }

  fs::path final_, staging_;
  bool replace_ = false;
};

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      fail("Hugging Face export: dtype {} is not supported (fp32, bf16 or fp16)", dtype_name(dtype));
  }
}

// The config as written: the caller's, checked against the store, with the dtype of the weights.
json output_config(const ParameterStore& params, const json& config_json, DType dtype,
                   const fs::path& out_dir) {
  const std::string source = "config of the export to " + out_dir.string();
  const std::unique_ptr<ModelConfig> config = parse_model_config(config_json, source);
  check_store_matches_config(params, *config, source);
  for (const auto& info : params.infos())
    if (info.shape != info.global_shape())
      fail("{}: parameter '{}' is a tensor-parallel shard {} of {}; export a model loaded whole (forge convert "
           "reads a checkpoint of any layout)",
           source, info.name, shape_string(info.shape), shape_string(info.global_shape()));
  json out = config_json;
  out["torch_dtype"] = torch_dtype_name(dtype);
  // Hugging Face's AutoConfig needs these two to pick the model class.
  const ModelFamily& family = family_named(config->architecture());
  if (!out.contains("architectures") || out["architectures"].is_null())
    out["architectures"] = json::array({family.architecture});
  if (!out.contains("model_type") || out["model_type"].is_null()) out["model_type"] = family.model_type;
  return out;
}

Tensor converted(const Tensor& param, DType dtype) {
  if (dtype == DType::f32) return param;
  Tensor out = Tensor::empty(param.shape(), dtype);
  const size_t n = static_cast<size_t>(param.numel());
  if (dtype == DType::bf16)
    convert_f32_to_bf16(param.f32(), out.data<uint16_t>(), n);
  else
    convert_f32_to_f16(param.f32(), out.data<uint16_t>(), n);
  return out;
}

}  // namespace

void export_hugging_face(const ParameterStore& params, const json& config_json, const fs::path& out_dir,
                         const HfExportOptions& options) {
  const json config_out = output_config(params, config_json, options.dtype, out_dir);
  if (options.max_shard_bytes == 0)
    fail("Hugging Face export to {}: max shard size must be positive", out_dir.string());

  // Greedy in parameter order; a tensor never splits, so one larger than the limit sits alone.
  struct Shard {
    std::vector<int> ids;
    uint64_t bytes = 0;
  };
  std::vector<Shard> shards;
  uint64_t total_bytes = 0;
  for (int id = 0; id < params.count(); ++id) {
    const uint64_t bytes =
        static_cast<uint64_t>(shape_numel(params.info(id).shape)) * dtype_size(options.dtype);
    if (shards.empty() ||
        (!shards.back().ids.empty() && shards.back().bytes + bytes > options.max_shard_bytes))
      shards.emplace_back();
    shards.back().ids.push_back(id);
    shards.back().bytes += bytes;
    total_bytes += bytes;
  }
  const size_t n = shards.size();
  auto shard_name = [n](size_t k) {
    return n == 1 ? std::string("model.safetensors")
                  : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
  };

  StagedDir staged(out_dir, options.overwrite);
  json weight_map = json::object();
  for (size_t k = 0; k < n; ++k) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (int id : shards[k].ids) {
      tensors.emplace_back(params.info(id).name, converted(params.param(id), options.dtype));
      weight_map[params.info(id).name] = shard_name(k);
    }
    write_safetensors((staged.path() / shard_name(k)).string(), tensors, {{"format", "pt"}});
  }
  if (n > 1) {
    json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    write_file_atomically(staged.path() / "model.safetensors.index.json", index.dump(2) + "\n",
                          "weight index");
  }
  write_file_atomically(staged.path() / "config.json", config_out.dump(2) + "\n", "model config");
  staged.copy_in(options.extra_files);
  staged.commit();
}

void export_forge_checkpoint(const ParameterStore& params, const json& config_json,
                             const fs::path& out_dir, bool overwrite,
                             const std::vector<fs::path>& extra_files) {
  CheckpointState state;
  state.step = 0;
  output_config(params, config_json, DType::f32, out_dir);  // checks the config against the store
  // Exactly what the trainer writes and compares on resume (ModelConfig::to_json), not the source's text:
  // bookkeeping keys of a Hugging Face config.json would make the two differ.
  state.model_config = parse_model_config(config_json, "config of the export to " + out_dir.string())->to_json();
  state.extra = {{"weights_only", true}};
  StagedDir staged(out_dir, overwrite);
  save_checkpoint(staged.path().string(), params, nullptr, state);
  staged.copy_in(extra_files);
  staged.commit();
}

uint64_t parse_byte_size(std::string_view text) {
  auto bad = [&](std::string_view why) -> Error {
    return Error(
        fmt::format("size '{}' {} (expected a whole number of bytes with an optional unit B, KB, MB, "
                    "GB, TB, KiB, MiB, GiB or TiB, e.g. 5GB)",
                    text, why));
  };
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) throw bad("does not start with a number");
  uint64_t value = 0;
  for (size_t i = 0; i < digits; ++i)
    if (__builtin_mul_overflow(value, 10u, &value) || __builtin_add_overflow(value, text[i] - '0', &value))
      throw bad("is too large");
  std::string unit(text.substr(digits));
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  struct Unit {
    const char* name;
    uint64_t bytes;
  };
  static constexpr Unit kUnits[] = {{"", 1},
                                    {"b", 1},
                                    {"kb", 1000},
                                    {"mb", 1000'000},
                                    {"gb", 1000'000'000},
                                    {"tb", 1000'000'000'000},
                                    {"kib", 1ull << 10},
                                    {"mib", 1ull << 20},
                                    {"gib", 1ull << 30},
                                    {"tib", 1ull << 40}};
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(value, u.bytes, &bytes)) throw bad("is too large");
    if (bytes == 0) throw bad("is zero");
    return bytes;
  }
  throw bad(fmt::format("has an unknown unit '{}'", text.substr(digits)));
}

}  // namespace forge::models
