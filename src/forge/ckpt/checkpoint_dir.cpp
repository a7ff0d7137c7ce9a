// Checkpoint directories: step folders committed by `latest` (checkpoint_dir.h, docs/formats.md).
#include "forge/ckpt/checkpoint_dir.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "forge/core/error.h"
#include "forge/core/fault_injection.h"
#include "forge/core/file_io.h"

namespace forge::ckpt {
namespace fs = std::filesystem;
namespace {

constexpr const char* kLatest = "latest";
constexpr const char* kManifest = "manifest.json";

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "step-<digits>" -> the step.
std::optional<int64_t> step_of_name(std::string_view name) {
  if (!name.starts_with("step-")) return std::nullopt;
  name.remove_prefix(5);
  if (!all_digits(name) || name.size() > 18) return std::nullopt;
  return std::stoll(std::string(name));
}

struct StepFolder {
  int64_t step = 0;
  std::string name;
};

// The step folders under root, oldest first.
std::vector<StepFolder> step_folders(const fs::path& root) {
  std::vector<StepFolder> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (const auto step = step_of_name(name); step && entry.is_directory(ec)) out.push_back({*step, name});
  }
  std::sort(out.begin(), out.end(), [](const StepFolder& a, const StepFolder& b) {
    return a.step != b.step ? a.step < b.step : a.name < b.name;
  });
  return out;
}

// A staging folder a save writes before renaming it into place (".<name>.partial", ".<name>.partial.old").
bool is_staging_name(std::string_view name) {
  return name.starts_with(".") && (name.ends_with(".partial") || name.ends_with(".partial.old"));
}

// A shard of a single-folder checkpoint (or its temporary).
bool is_shard_name(std::string_view name) {
  if (name.ends_with(".tmp")) name.remove_suffix(4);
  return is_shard_file_name(name);
}

// The files of a single-folder checkpoint, version 1 (model.safetensors, optimizer.safetensors) included.
bool is_legacy_file_name(std::string_view name) {
  return is_shard_name(name) || name == "model.safetensors" || name == "optimizer.safetensors" ||
         name == "model.safetensors.tmp" || name == "optimizer.safetensors.tmp";
}

// Why the checkpoint folder `dir` is not complete ("" when it is).
std::string incompleteness(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return "it does not exist";
  if (!fs::exists(dir / kManifest, ec)) return "it has no manifest.json";
  try {
    const CheckpointState state = read_checkpoint_manifest_at(dir.string(), /*verify_files=*/false);
    if (const auto step = step_of_name(dir.filename().string()); step && *step != state.step)
      return fmt::format("corrupt: its manifest.json says step {}, its name step {}", state.step, *step);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Whether a problem incompleteness() found is damage to what is there (a garbled, edited or mismatched
// manifest, a file of the wrong size) rather than something missing.
bool is_corruption(std::string_view problem) {
  return !problem.empty() && problem.find("incomplete") == std::string_view::npos &&
         problem != "it has no manifest.json" && problem != "it does not exist";
}

struct Latest {
  std::string name;  // the step folder it names ("" when it names none)
  std::string note;  // what is wrong with it ("" when nothing, or when there is no series to read)
};

// <root>/latest: the step folder it names, or why it names none. Only step folder names are valid; the text
// is quoted in the note only when it is UTF-8 (the note travels in JSON and on terminals).
Latest read_latest(const fs::path& root, bool has_step_folders) {
  std::error_code ec;
  const fs::path file = root / kLatest;
  if (!fs::exists(file, ec))
    return {"", has_step_folders
                    ? fmt::format("{} has no `latest` file: the step folders are read newest first",
                                  root.string())
                    : ""};
  if (!fs::is_regular_file(file, ec)) return {"", fmt::format("{} is not a file", file.string())};
  std::string text = read_file(file, "checkpoint pointer");
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  if (text.empty()) return {"", fmt::format("{} is empty", file.string())};
  if (step_of_name(text)) return {text, ""};
  try {
    const std::string quoted = nlohmann::json(text.substr(0, 64)).dump();  // throws on invalid UTF-8
    return {"", fmt::format("{} names {}, which is not a step folder name", file.string(), quoted)};
  } catch (const nlohmann::json::exception&) {
    return {"", fmt::format("{} is not text (not valid UTF-8)", file.string())};
  }
}

}  // namespace

std::string checkpoint_step_name(int64_t step) { return fmt::format("step-{:08d}", step); }

CheckpointSeries checkpoint_series(const std::string& path) {
  const fs::path root(path);
  const std::vector<StepFolder> folders = step_folders(root);
  const Latest latest = read_latest(root, !folders.empty());
  CheckpointSeries series;
  series.latest_note = latest.note;
  // The one `latest` names first (even when its folder is gone), then the older ones, newest first.
  std::optional<int64_t> below;
  std::error_code ec;
  if (!latest.name.empty() && !fs::exists(root / latest.name, ec))
    series.latest_note =
        fmt::format("{}/latest names {}, which does not exist: the step folders are read newest first", path,
                    latest.name);
  else if (!latest.name.empty()) {
    const int64_t step = *step_of_name(latest.name);
    series.steps.push_back({(root / latest.name).string(), latest.name, step, ""});
    below = step;
  }
  for (auto it = folders.rbegin(); it != folders.rend(); ++it)
    if (!below || it->step < *below)
      series.steps.push_back({(root / it->name).string(), it->name, it->step, ""});
  for (SeriesCheckpoint& c : series.steps) {
    c.problem = incompleteness(c.dir);
    c.corrupt = is_corruption(c.problem);
  }
  return series;
}

ResolvedCheckpoint resolve_checkpoint(const std::string& path) {
  const fs::path root(path);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) fail("checkpoint {} does not exist", path);
  const CheckpointSeries series = checkpoint_series(path);
  ResolvedCheckpoint out;
  out.note = series.latest_note;
  auto add_note = [&](const std::string& more) { out.note += (out.note.empty() ? "" : "; ") + more; };
  for (const SeriesCheckpoint& c : series.steps) {
    if (c.problem.empty()) {
      out.dir = c.dir;
      out.step = c.step;
      return out;
    }
    out.passed_over.push_back(c);
    add_note(fmt::format("checkpoint {}: passed over {}: {}", path, c.name, c.problem));
  }
  if (fs::exists(root / kManifest, ec)) {
    out.dir = path;
    return out;
  }
  if (!series.steps.empty()) {
    const SeriesCheckpoint& newest = series.steps.front();
    fail("checkpoint {} is {}: no step folder holds a complete checkpoint (the newest, {}: {})", path,
         newest.corrupt ? "corrupt" : "incomplete", newest.name, newest.problem);
  }
  if (holds_checkpoint_data(path)) fail("checkpoint {} is incomplete: it has no manifest.json", path);
  fail("checkpoint {} holds no checkpoint (no manifest.json, no step-* folders)", path);
}

bool holds_checkpoint_data(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    const std::string name = entry.path().filename().string();
    // model.safetensors alone is a Hugging Face folder (a version 1 checkpoint also has its manifest), and a
    // staging folder is never a checkpoint: a crash during a run's first save leaves nothing to resume.
    if (name == kManifest || name == kLatest || step_of_name(name) || is_shard_name(name)) return true;
  }
  return false;
}

std::optional<int64_t> latest_checkpoint_step(const std::string& path) {
  try {
    return read_checkpoint_manifest_at(resolve_checkpoint(path).dir, /*verify_files=*/false).step;
  } catch (const Error&) {
    return std::nullopt;
  }
}

namespace {

// Deletes a single-folder checkpoint at `root` (the layout before step folders): the manifest first, so
// that it never reads as complete with files missing.
void remove_single_folder_checkpoint(const fs::path& root) {
  std::error_code ec;
  fs::remove(root / kManifest, ec);
  fsync_directory(root);
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_legacy_file_name(name) || name == "tokenizer.json" || name == "manifest.json.tmp")
      fs::remove(entry.path(), ec);
  }
}

// Everything `latest_name` supersedes (checkpoint_dir.h).
void prune(const fs::path& root, const std::string& latest_name, int64_t keep_last) {
  std::error_code ec;
  const std::vector<StepFolder> steps = step_folders(root);
  const auto latest =
      std::find_if(steps.begin(), steps.end(), [&](const StepFolder& f) { return f.name == latest_name; });
  if (latest == steps.end()) return;
  std::vector<std::string> doomed;
  for (auto it = latest + 1; it != steps.end(); ++it) doomed.push_back(it->name);  // newer: another timeline
  if (keep_last > 0) {
    const int64_t older = latest - steps.begin();
    for (int64_t i = 0; i < older - (keep_last - 1); ++i)
      doomed.push_back(steps[static_cast<size_t>(i)].name);
  }
  for (const std::string& name : doomed) {
    // Renamed to a staging name first, so that a crash mid-deletion leaves no half-deleted step folder that
    // could read as a checkpoint.
    const fs::path aside = root / fmt::format(".{}.partial", name);
    fs::remove_all(aside, ec);
    fs::rename(root / name, aside, ec);
    fs::remove_all(ec ? root / name : aside, ec);
  }
  for (const auto& entry : fs::directory_iterator(root, ec))
    if (is_staging_name(entry.path().filename().string())) fs::remove_all(entry.path(), ec);
  if (fs::exists(root / kManifest, ec)) remove_single_folder_checkpoint(root);
  fsync_directory(root);
}

}  // namespace

std::string begin_checkpoint_step_save(const std::string& root, comm::Communicator& world, int64_t step) {
  const fs::path dir = fs::path(root) / checkpoint_step_name(step);
  std::error_code ec;
  if (world.rank() == 0) {
    fs::create_directories(root, ec);  // errors surface in the save's first step
    // A folder of this step that `latest` does not name is not committed (a crash between the rename and
    // `latest`, or a damaged one resolving skipped): it goes, rather than being exchanged as a checkpoint.
    if (fs::exists(dir, ec) && read_latest(root, false).name != dir.filename().string())
      fs::remove_all(dir, ec);
  }
  return begin_sharded_save(dir.string(), world);
}

std::string finish_checkpoint_step_save(const std::string& root, comm::Communicator& world,
                                        const std::string& staging, const ShardWrite& mine,
                                        const CheckpointState& state, const CheckpointSaveOptions& options) {
  const std::string name = checkpoint_step_name(state.step);
  const fs::path dir = fs::path(root) / name;
  finish_sharded_save(dir.string(), world, staging, mine, state, options.files);
  std::string error;
  if (world.rank() == 0) {
    try {
      write_file_atomically(fs::path(root) / kLatest, name + "\n", "checkpoint pointer");
      kill_point("save.latest_written", 0);
      prune(root, name, options.keep_last);
      kill_point("save.pruned", 0);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank returns once the checkpoint is committed (or fails with rank 0's error).
  if (world.size() > 1) {
    const std::vector<std::string> errors = comm::all_gather_strings(world, error);
    error = errors[0];
  }
  if (!error.empty()) throw Error(error);
  return dir.string();
}

std::string save_checkpoint_step(const std::string& root, comm::Communicator& world,
                                 std::span<const ShardPiece> pieces, const CheckpointState& state,
                                 const CheckpointSaveOptions& options) {
  const std::string staging = begin_checkpoint_step_save(root, world, state.step);
  const ShardWrite mine = write_shard_of_save(staging, world.rank(), world.size(), pieces);
  return finish_checkpoint_step_save(root, world, staging, mine, state, options);
}

std::vector<std::string> complete_checkpoints(const std::string& path) {
  std::vector<std::string> out;
  const fs::path root(path);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  const std::vector<StepFolder> steps = step_folders(root);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (incompleteness(root / it->name).empty()) out.push_back((root / it->name).string());
  return out;
}

void remove_checkpoint_data(const std::string& path) {
  const fs::path root(path);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  fs::remove(root / kLatest, ec);
  fsync_directory(root);
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (step_of_name(name) || is_staging_name(name)) fs::remove_all(entry.path(), ec);
  }
  if (fs::exists(root / kManifest, ec) || holds_checkpoint_data(path)) remove_single_folder_checkpoint(root);
}

}  // namespace forge::ckpt
