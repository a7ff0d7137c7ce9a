#include "forge/ckpt/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "forge/ckpt/safetensors.h"

namespace forge {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "forge-checkpoint";
constexpr int kVersion = 1;

struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

FileDigest digest_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("checkpoint file {} cannot be opened", path.string());
  std::vector<char> buffer(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  FileDigest d;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    std::streamsize got = in.gcount();
    if (got <= 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(got));
    d.bytes += static_cast<uint64_t>(got);
  }
  d.crc32 = static_cast<uint32_t>(crc);
  return d;
}

void write_file_durably(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write {}", tmp.string());
    out << text;
    out.flush();
    if (!out) fail("cannot write {}", tmp.string());
  }
  int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  fs::rename(tmp, path);
  int dfd = ::open(path.parent_path().c_str(), O_RDONLY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

bool checkpoint_exists(const std::string& dir) { return fs::exists(fs::path(dir) / "manifest.json"); }

void save_checkpoint(const std::string& dir, const nn::ParameterStore& params, const AdamW* optimizer,
                     const CheckpointState& state) {
  fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("cannot create checkpoint directory {}: {}", dir, ec.message());
  // The old manifest goes first: from here until the new one lands, the directory reads as incomplete.
  fs::remove(root / "manifest.json", ec);

  std::vector<std::pair<std::string, Tensor>> weights;
  for (int i = 0; i < params.count(); ++i) weights.emplace_back(params.info(i).name, params.param(i));
  write_safetensors((root / "model.safetensors").string(), weights, {{"format", "pt"}});
  std::vector<std::string> files = {"model.safetensors"};
  if (optimizer) {
    std::vector<std::pair<std::string, Tensor>> moments;
    for (const auto& info : params.infos()) {
      moments.emplace_back("exp_avg." + info.name, optimizer->exp_avg().view(info.offset, info.shape));
      moments.emplace_back("exp_avg_sq." + info.name, optimizer->exp_avg_sq().view(info.offset, info.shape));
    }
    write_safetensors((root / "optimizer.safetensors").string(), moments,
                      {{"optimizer_steps", std::to_string(optimizer->steps_taken())}});
    files.push_back("optimizer.safetensors");
  }

  nlohmann::json manifest;
  manifest["format"] = kFormat;
  manifest["version"] = kVersion;
  manifest["step"] = state.step;
  manifest["model_config"] = state.model_config;
  manifest["extra"] = state.extra;
  if (optimizer) manifest["optimizer_steps"] = optimizer->steps_taken();
  for (const auto& name : files) {
    FileDigest d = digest_file(root / name);
    manifest["files"][name] = {{"bytes", d.bytes}, {"crc32", d.crc32}};
  }
  write_file_durably(root / "manifest.json", manifest.dump(2) + "\n");
}

CheckpointState read_checkpoint_manifest(const std::string& dir) {
  fs::path root(dir);
  if (!fs::is_directory(root)) fail("checkpoint {} does not exist", dir);
  fs::path manifest_path = root / "manifest.json";
  if (!fs::exists(manifest_path)) fail("checkpoint {} is incomplete: it has no manifest.json", dir);
  nlohmann::json manifest;
  try {
    std::ifstream in(manifest_path);
    manifest = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint manifest {} is not valid JSON: {}", manifest_path.string(), e.what());
  }
  if (!manifest.is_object() || manifest.value("format", "") != kFormat)
    fail("{} is not a forge checkpoint manifest", manifest_path.string());
  if (manifest.value("version", 0) != kVersion)
    fail("{}: unsupported checkpoint version {}", manifest_path.string(), manifest.value("version", 0));
  if (!manifest.contains("files") || !manifest["files"].is_object())
    fail("{}: missing the 'files' table", manifest_path.string());
  for (const auto& [name, entry] : manifest["files"].items()) {
    fs::path file = root / name;
    if (!fs::exists(file)) fail("checkpoint {} is incomplete: {} is missing", dir, name);
    FileDigest d = digest_file(file);
    if (d.bytes != entry.value("bytes", uint64_t{0}) || d.crc32 != entry.value("crc32", uint32_t{0}))
      fail("checkpoint {} is corrupt: {} does not match its checksum in manifest.json", dir, name);
  }
  CheckpointState state;
  state.step = manifest.value("step", int64_t{0});
  state.model_config = manifest.value("model_config", nlohmann::json::object());
  state.extra = manifest.value("extra", nlohmann::json::object());
  return state;
}

CheckpointState load_checkpoint(const std::string& dir, nn::ParameterStore& params, AdamW* optimizer) {
  CheckpointState state = read_checkpoint_manifest(dir);
  fs::path root(dir);
  auto model = SafetensorsFile::open((root / "model.safetensors").string());
  for (int i = 0; i < params.count(); ++i) {
    const auto& info = params.info(i);
    const SafetensorsEntry* entry = model.find(info.name);
    if (!entry) fail("checkpoint {} has no tensor '{}'", dir, info.name);
    if (entry->shape != info.shape)
      fail("checkpoint {}: '{}' has shape {}, the model expects {}", dir, info.name, shape_string(entry->shape),
           shape_string(info.shape));
    model.read_into(info.name, params.param(i));
  }
  params.refresh_bf16();
  if (optimizer) {
    fs::path opt_path = root / "optimizer.safetensors";
    if (!fs::exists(opt_path)) fail("checkpoint {} holds no optimizer state (optimizer.safetensors)", dir);
    auto opt = SafetensorsFile::open(opt_path.string());
    for (const auto& info : params.infos()) {
      for (const auto& [prefix, buffer] : {std::pair{"exp_avg.", &optimizer->exp_avg()},
                                           std::pair{"exp_avg_sq.", &optimizer->exp_avg_sq()}}) {
        std::string name = prefix + info.name;
        const SafetensorsEntry* entry = opt.find(name);
        if (!entry || entry->shape != info.shape) fail("checkpoint {}: optimizer tensor '{}' missing or misshapen", dir, name);
        opt.read_into(name, buffer->view(info.offset, info.shape));
      }
    }
    auto it = opt.metadata().find("optimizer_steps");
    if (it == opt.metadata().end()) fail("checkpoint {}: optimizer.safetensors lacks optimizer_steps", dir);
    optimizer->set_steps_taken(std::stoll(it->second));
  }
  return state;
}

}  // namespace forge
