// Sharded checkpoints (sharded.h, docs/formats.md): one safetensors file per rank, manifest.json written
// last, and loading under any layout by mapping every piece, saved or wanted, to runs of global elements
// and copying their intersections.
#include "forge/ckpt/sharded.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/finite_check.h"
#include "forge/ckpt/safetensors.h"
#include "forge/core/error.h"
#include "forge/core/fault_injection.h"
#include "forge/core/file_io.h"

namespace forge::ckpt {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "forge-checkpoint";
constexpr int kVersion = 3;  // 3 added the manifest's own checksum
constexpr const char* kManifest = "manifest.json";
// Version 1 (one process): whole tensors in these two files.
constexpr const char* kV1Model = "model.safetensors";
constexpr const char* kV1Optimizer = "optimizer.safetensors";

// ---- Files

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
    const std::streamsize got = in.gcount();
    if (got <= 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(got));
    d.bytes += static_cast<uint64_t>(got);
  }
  if (in.bad()) fail("checkpoint file {}: read failed", path.string());
  d.crc32 = static_cast<uint32_t>(crc);
  return d;
}

uint32_t crc32_of(std::string_view bytes) {
  return static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                                     static_cast<uInt>(bytes.size())));
}

// A name the manifest may list: a plain file inside the checkpoint directory, never a path out of it.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name != kManifest;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

bool is_shard_file_name(std::string_view name) {
  constexpr std::string_view prefix = "shard-", middle = "-of-", suffix = ".safetensors";
  if (!name.starts_with(prefix) || !name.ends_with(suffix)) return false;
  name = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  const size_t of = name.find(middle);
  return of != std::string_view::npos && all_digits(name.substr(0, of)) &&
         all_digits(name.substr(of + middle.size()));
}

namespace {

// ---- Pieces as runs of global elements

std::string index_string(int64_t flat, const Shape& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return shape_string(index);
}

// Throws naming the tensor when the piece does not describe a range of a slice of its global tensor.
// `where` says whose piece it is (a shard file, the manifest, the caller's destination).
void check_piece(const ShardPiece& p, const std::string& where, bool needs_data) {
  if (p.name.empty()) fail("{}: a piece has an empty tensor name", where);
  const int rank = static_cast<int>(p.global_shape.size());
  if (static_cast<int>(p.local_shape.size()) != rank)
    fail("{}: tensor '{}': local shape {} and global shape {} differ in rank", where, p.name,
         shape_string(p.local_shape), shape_string(p.global_shape));
  for (int d = 0; d < rank; ++d)
    if (p.global_shape[d] < 0 || p.local_shape[d] < 0)
      fail("{}: tensor '{}': negative dimension in {} / {}", where, p.name, shape_string(p.local_shape),
           shape_string(p.global_shape));
  if (p.split_dim < -1 || p.split_dim >= rank)
    fail("{}: tensor '{}': split_dim {} is not -1 or a dimension of {}", where, p.name, p.split_dim,
         shape_string(p.global_shape));
  for (int d = 0; d < rank; ++d)
    if (d != p.split_dim && p.local_shape[d] != p.global_shape[d])
      fail("{}: tensor '{}': local shape {} and global shape {} differ outside the split dimension ({})",
           where, p.name, shape_string(p.local_shape), shape_string(p.global_shape), p.split_dim);
  if (p.split_start < 0 || (p.split_dim < 0 && p.split_start != 0))
    fail("{}: tensor '{}': split_start {} is invalid for split_dim {}", where, p.name, p.split_start,
         p.split_dim);
  const int64_t numel = shape_numel(p.local_shape);
  if (p.flat_begin < 0 || p.flat_begin > p.flat_end || p.flat_end > numel)
    fail("{}: tensor '{}': flat range [{}, {}) is not inside its local tensor of {} elements", where, p.name,
         p.flat_begin, p.flat_end, numel);
  if (needs_data && p.flat_end > p.flat_begin && p.data == nullptr)
    fail("{}: tensor '{}': piece has no data", where, p.name);
}

// Global elements [global_begin, global_begin + length) lie at `offset` elements into piece `piece`'s data.
struct Run {
  int64_t global_begin = 0, length = 0, offset = 0;
  int piece = 0;
  int64_t global_end() const { return global_begin + length; }
};

// A piece's elements as runs of global elements, padding left out.
void append_runs(const ShardPiece& p, int piece, std::vector<Run>& out) {
  for (const ShardRun& r :
       shard_runs(p.local_shape, p.global_shape, p.split_dim, p.split_start, p.flat_begin, p.flat_end))
    out.push_back({r.global, r.count, r.local - p.flat_begin, piece});
}

// `key`: the shard's tensor holding the piece's data, recorded when it is not the tensor name.
json piece_json(const ShardPiece& p, const std::string& key) {
  json piece = {{"name", p.name},           {"global_shape", p.global_shape}, {"local_shape", p.local_shape},
                {"split_dim", p.split_dim}, {"split_start", p.split_start},   {"flat_begin", p.flat_begin},
                {"flat_end", p.flat_end}};
  if (key != p.name) piece["key"] = key;
  return piece;
}

// ---- The manifest

struct SavedTensor {
  Shape shape;
  std::vector<ShardPiece> pieces;  // data unused
  std::vector<std::string> files;  // the file of each piece
  std::vector<std::string> keys;   // the tensor of that file holding the piece's data
};

struct Manifest {
  fs::path root, path;
  int version = 0;
  CheckpointState state;
  std::map<std::string, FileDigest> files;
  std::map<std::string, SavedTensor> tensors;
};

void check_file(const Manifest& m, const std::string& name, bool crc) {
  const FileDigest& expected = m.files.at(name);
  const fs::path file = m.root / name;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec))
    fail("checkpoint {} is incomplete: {} is missing", m.root.string(), name);
  const uint64_t bytes = fs::file_size(file, ec);
  if (ec || bytes != expected.bytes)
    fail("checkpoint {} is corrupt: {} has {} bytes, manifest.json says {}", m.root.string(), name, bytes,
         expected.bytes);
  if (crc && digest_file(file).crc32 != expected.crc32)
    fail("checkpoint {} is corrupt: {} does not match its checksum in manifest.json", m.root.string(), name);
}

// Version 1 held whole tensors under their names; they become one unsplit piece each.
void read_v1_tensors(Manifest& m) {
  for (const char* name : {kV1Model, kV1Optimizer}) {
    if (!m.files.count(name)) continue;
    check_file(m, name, /*crc=*/false);
    const SafetensorsFile file = SafetensorsFile::open((m.root / name).string());
    for (const auto& entry : file.entries()) {
      SavedTensor& t = m.tensors[entry.name];
      if (!t.pieces.empty()) fail("{}: tensor '{}' appears in two files", m.path.string(), entry.name);
      t.shape = entry.shape;
      ShardPiece piece;
      piece.name = entry.name;
      piece.global_shape = piece.local_shape = entry.shape;
      piece.flat_end = shape_numel(entry.shape);
      t.pieces.push_back(piece);
      t.files.push_back(name);
      t.keys.push_back(entry.name);
    }
  }
}

// An integer field of the manifest, checked: present when `required`, an integer, within [lo, hi].
int64_t manifest_integer(const json& j, const char* key, int64_t fallback, int64_t lo, int64_t hi,
                         const std::string& where, bool required = false) {
  if (!j.contains(key)) {
    if (required) fail("{}: '{}' is missing", where, key);
    return fallback;
  }
  const json& v = j[key];
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)))
    fail("{}: '{}' must be an integer in [{}, {}], got {}", where, key, lo, hi, v.dump());
  const int64_t value = v.get<int64_t>();
  if (value < lo || value > hi)
    fail("{}: '{}' must be an integer in [{}, {}], got {}", where, key, lo, hi, value);
  return value;
}

Manifest read_manifest(const std::string& dir) {
  Manifest m;
  m.root = dir;
  m.path = m.root / kManifest;
  std::error_code ec;
  if (!fs::is_directory(m.root, ec)) fail("checkpoint {} does not exist", dir);
  if (!fs::exists(m.path, ec)) fail("checkpoint {} is incomplete: it has no manifest.json", dir);
  const std::string where = m.path.string();
  // Strict: a key given twice (an edit, or two writers) is refused rather than resolved to the last.
  const json j = parse_json_strict(read_file(m.path, "checkpoint manifest"), "checkpoint manifest " + where);
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat)
    fail("{} is not a forge checkpoint manifest", where);
  try {
    m.version = static_cast<int>(manifest_integer(j, "version", 0, 0, 1 << 20, where, /*required=*/true));
    if (m.version < 1 || m.version > kVersion)
      fail("{}: unsupported checkpoint version {} (this forge reads versions 1 to {})", where, m.version,
           kVersion);
    if (m.version >= 3) {
      if (!j.contains("checksum") || !j["checksum"].is_string())
        fail("checkpoint {} is corrupt: manifest.json has no checksum", dir);
      if (j["checksum"].get<std::string>() != manifest_checksum(j))
        fail("checkpoint {} is corrupt: manifest.json does not match its checksum (edited or damaged)", dir);
    }
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    m.state.step = manifest_integer(j, "step", 0, 0, kMax, where, /*required=*/m.version >= 3);
    m.state.optimizer_steps = manifest_integer(j, "optimizer_steps", -1, -1, kMax, where);
    m.state.world_size =
        static_cast<int>(manifest_integer(j, "world_size", 1, 1, std::numeric_limits<int>::max(), where));
    m.state.model_config = j.value("model_config", json::object());
    m.state.extra = j.value("extra", json::object());
    m.state.layout = j.value("layout", json());
    auto object_field = [&](json& field, const char* key) {
      if (field.is_null()) field = json::object();  // saved from a default CheckpointState
      if (!field.is_object()) fail("{}: '{}' must be an object, got {}", where, key, field.type_name());
    };
    object_field(m.state.model_config, "model_config");
    object_field(m.state.extra, "extra");
    const json& files = j.at("files");
    if (!files.is_object()) fail("{}: 'files' must be an object", where);
    for (const auto& [name, entry] : files.items()) {
      if (!is_plain_file_name(name))
        fail("{}: file '{}' is not a file name in the checkpoint directory", where, name);
      const std::string file_where = fmt::format("{}: file '{}'", where, name);
      m.files[name] = {
          static_cast<uint64_t>(manifest_integer(entry, "bytes", 0, 0, kMax, file_where, true)),
          static_cast<uint32_t>(manifest_integer(entry, "crc32", 0, 0, UINT32_MAX, file_where, true))};
    }
    if (m.version == 1) {
      read_v1_tensors(m);
      return m;
    }
    const json& tensors = j.at("tensors");
    if (!tensors.is_object()) fail("{}: 'tensors' must be an object", where);
    for (const auto& [name, entry] : tensors.items()) {
      SavedTensor& t = m.tensors[name];
      t.shape = entry.at("shape").get<Shape>();
      for (const json& p : entry.at("pieces")) {
        ShardPiece piece;
        piece.name = name;
        piece.global_shape = t.shape;
        piece.local_shape = p.at("local_shape").get<Shape>();
        piece.split_dim = p.at("split_dim").get<int>();
        piece.split_start = p.at("split_start").get<int64_t>();
        piece.flat_begin = p.at("flat_begin").get<int64_t>();
        piece.flat_end = p.at("flat_end").get<int64_t>();
        check_piece(piece, where, /*needs_data=*/false);
        const std::string file = p.at("file").get<std::string>();
        if (!m.files.count(file) || !is_shard_file_name(file))
          fail("{}: tensor '{}' has a piece in '{}', which 'files' does not list as a shard", where, name,
               file);
        // The data of a piece is stored under its tensor's name, or "<name>@<flat_begin>"
        // (write_checkpoint_shard): any other key would load another tensor's values.
        const std::string key = p.value("key", name);
        if (key != name && key != fmt::format("{}@{}", name, piece.flat_begin))
          fail("{}: tensor '{}' has a piece stored as '{}', which is not its own name", where, name, key);
        t.keys.push_back(key);
        t.pieces.push_back(std::move(piece));
        t.files.push_back(file);
      }
    }
  } catch (const json::exception& e) {
    fail("{}: malformed manifest: {}", where, e.what());
  }
  return m;
}

// The manifest as text: the small fields indented, then one line per tensor (a big model has thousands).
std::string manifest_text(const json& head, const std::map<std::string, json>& tensors) {
  std::string text = head.dump(2);
  text.resize(text.size() - 2);  // "\n}"
  text += ",\n  \"tensors\": {";
  bool first = true;
  for (const auto& [name, entry] : tensors) {
    text += first ? "\n    " : ",\n    ";
    text += json(name).dump() + ": " + entry.dump();
    first = false;
  }
  text += "\n  }\n}\n";
  return text;
}

// ---- Loading plan

// Copy `length` floats from `source_offset` in a saved piece to `destination_offset` in destination piece
// `destination`.
struct CopyOp {
  int destination = 0;
  int64_t destination_offset = 0, source_offset = 0, length = 0;
};

// Everything to take from one saved piece.
struct SourcePlan {
  std::string tensor, key, file;
  int64_t length = 0;  // the saved piece's elements
  std::vector<CopyOp> ops;
};

std::string saved_under(const Manifest& m) {
  std::string text = fmt::format("{} rank{}", m.state.world_size, m.state.world_size == 1 ? "" : "s");
  if (!m.state.layout.is_null()) text += ", layout " + m.state.layout.dump();
  return text;
}

std::vector<SourcePlan> plan_load(const Manifest& m, std::span<const ShardPiece> destinations) {
  const std::string dir = m.root.string();
  std::map<std::string, std::vector<int>> by_name;
  for (size_t i = 0; i < destinations.size(); ++i) {
    check_piece(destinations[i], "loading " + dir, /*needs_data=*/true);
    by_name[destinations[i].name].push_back(static_cast<int>(i));
  }
  std::vector<SourcePlan> plans;
  for (const auto& [name, ids] : by_name) {
    auto found = m.tensors.find(name);
    if (found == m.tensors.end()) fail("checkpoint {} has no tensor '{}'", dir, name);
    const SavedTensor& saved = found->second;
    for (int id : ids)
      if (destinations[id].global_shape != saved.shape)
        fail("checkpoint {}: tensor '{}' has global shape {} in the checkpoint, but {} is expected", dir,
             name, shape_string(saved.shape), shape_string(destinations[id].global_shape));

    // Saved runs in global order, made disjoint (were two pieces to overlap, the first wins).
    std::vector<Run> runs;
    for (size_t k = 0; k < saved.pieces.size(); ++k) append_runs(saved.pieces[k], static_cast<int>(k), runs);
    std::sort(runs.begin(), runs.end(),
              [](const Run& a, const Run& b) { return a.global_begin < b.global_begin; });
    std::vector<Run> disjoint;
    int64_t covered_to = std::numeric_limits<int64_t>::min();
    for (Run r : runs) {
      if (r.global_end() <= covered_to) continue;
      if (r.global_begin < covered_to) {
        const int64_t cut = covered_to - r.global_begin;
        r.global_begin += cut, r.offset += cut, r.length -= cut;
      }
      disjoint.push_back(r);
      covered_to = r.global_end();
    }

    std::vector<int> plan_of_piece(saved.pieces.size(), -1);
    for (int id : ids) {
      std::vector<Run> wanted;
      append_runs(destinations[id], id, wanted);
      for (const Run& w : wanted) {
        int64_t at = w.global_begin;
        auto s = std::partition_point(disjoint.begin(), disjoint.end(),
                                      [&](const Run& r) { return r.global_end() <= at; });
        while (at < w.global_end()) {
          if (s == disjoint.end() || s->global_begin > at)
            fail(
                "checkpoint {}: no saved piece covers element {} of tensor '{}' (global shape {}; saved by "
                "{})",
                dir, index_string(at, saved.shape), name, shape_string(saved.shape), saved_under(m));
          const int64_t n = std::min(w.global_end(), s->global_end()) - at;
          int& plan = plan_of_piece[s->piece];
          if (plan < 0) {
            plan = static_cast<int>(plans.size());
            plans.push_back({name,
                             saved.keys[s->piece],
                             saved.files[s->piece],
                             saved.pieces[s->piece].flat_end - saved.pieces[s->piece].flat_begin,
                             {}});
          }
          const CopyOp op{id, w.offset + (at - w.global_begin), s->offset + (at - s->global_begin), n};
          std::vector<CopyOp>& ops = plans[plan].ops;
          if (!ops.empty() && ops.back().destination == id &&
              ops.back().destination_offset + ops.back().length == op.destination_offset &&
              ops.back().source_offset + ops.back().length == op.source_offset)
            ops.back().length += n;  // a row continuing the previous one
          else
            ops.push_back(op);
          at += n;
          ++s;
        }
      }
    }
  }
  return plans;
}

// ---- Agreement across ranks

// Every rank throws the first failing rank's error, or none does: a rank that failed alone would leave the
// others waiting in the next collective.
void agree(comm::Communicator& world, const std::string& error) {
  if (world.size() == 1) {
    if (!error.empty()) throw Error(error);
    return;
  }
  const std::vector<std::string> errors = comm::all_gather_strings(world, error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) throw Error(fmt::format("rank {}: {}", r, errors[r]));
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  }
  return {};
}

}  // namespace

// ---- Public

std::string manifest_checksum(const json& manifest) {
  json body = manifest;
  body.erase("checksum");
  return fmt::format("crc32:{:08x}", crc32_of(body.dump()));
}

std::string shard_file_name(int rank, int world_size) {
  return fmt::format("shard-{:05d}-of-{:05d}.safetensors", rank, world_size);
}

std::string checkpoint_staging_dir(const std::string& dir) {
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();  // "ckpt/" names "ckpt"
  return (target.parent_path() / fmt::format(".{}.partial", target.filename().string())).string();
}

std::string begin_checkpoint_save(const std::string& dir) {
  const fs::path target(dir);
  std::error_code ec;
  const auto status = fs::symlink_status(target, ec);
  if (fs::exists(status)) {
    if (!fs::is_directory(status)) fail("checkpoint {}: exists and is not a directory", dir);
    // Replacing is for checkpoints only: a folder of anything else is never deleted by a save.
    if (!fs::is_empty(target, ec) && !fs::exists(target / kManifest, ec) && !holds_checkpoint_data(dir))
      fail("checkpoint {}: exists, is not empty and holds no checkpoint; refusing to replace it", dir);
  }
  const fs::path staging = checkpoint_staging_dir(dir);
  fs::remove_all(staging, ec);  // a crashed save's leftovers
  if (ec)
    fail("checkpoint {}: cannot remove the stale staging folder {}: {}", dir, staging.string(), ec.message());
  fs::create_directories(staging, ec);
  if (ec) fail("cannot create checkpoint directory {}: {}", staging.string(), ec.message());
  fsync_directory(staging.parent_path());
  return staging.string();
}

ShardFile write_checkpoint_shard(const std::string& dir, int rank, int world_size,
                                 std::span<const ShardPiece> pieces, const BlobReader& read) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail("checkpoint {}: rank {} of a world of {} is invalid", dir, rank, world_size);
  ShardFile shard;
  shard.file = shard_file_name(rank, world_size);
  const fs::path path = fs::path(dir) / shard.file;
  // A rank may hold several ranges of one tensor (a parameter split between gradient buckets): each is
  // then stored as "<name>@<flat_begin>", and they must not overlap.
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges;
  for (const ShardPiece& p : pieces) {
    check_piece(p, path.string(), /*needs_data=*/true);
    ranges[p.name].push_back({p.flat_begin, p.flat_end});
  }
  for (auto& [name, list] : ranges) {
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i)
      if (list[i].first < list[i - 1].second || list[i].first == list[i - 1].first)
        fail("{}: rank {} gives overlapping pieces [{}, {}) and [{}, {}) of tensor '{}'", path.string(), rank,
             list[i - 1].first, list[i - 1].second, list[i].first, list[i].second, name);
  }
  std::set<std::string> keys;
  // Written straight from the pieces' memory; the CRC32 is summed as the bytes go out.
  std::vector<SafetensorsBlob> blobs;
  shard.pieces = json::array();
  for (const ShardPiece& p : pieces) {
    const int64_t n = p.flat_end - p.flat_begin;
    const std::string key = ranges[p.name].size() == 1 ? p.name : fmt::format("{}@{}", p.name, p.flat_begin);
    if (!keys.insert(key).second)
      fail("{}: rank {} gives two pieces stored as '{}'; rename one of the tensors", path.string(), rank,
           key);
    blobs.push_back({key, DType::f32, Shape{n}, p.data, static_cast<uint64_t>(n) * sizeof(float)});
    shard.pieces.push_back(piece_json(p, key));
  }
  shard.crc32 = write_safetensors_blobs(path.string(), blobs, {}, read);
  std::error_code ec;
  shard.bytes = fs::file_size(path, ec);
  if (ec) fail("checkpoint file {}: {}", path.string(), ec.message());
  return shard;
}

void write_checkpoint_manifest(const std::string& dir, std::span<const ShardFile> shards,
                               const CheckpointState& state, std::span<const NamedFile> files) {
  const fs::path root(dir);
  json head;
  head["format"] = kFormat;
  head["version"] = kVersion;
  head["step"] = state.step;
  if (state.optimizer_steps >= 0) head["optimizer_steps"] = state.optimizer_steps;
  head["world_size"] = shards.size();
  head["layout"] = state.layout;
  head["model_config"] = state.model_config;
  head["extra"] = state.extra;
  head["files"] = json::object();
  std::map<std::string, json> tensors;
  std::map<std::string, std::string> shape_source;  // tensor -> the file that first gave its global shape
  for (const ShardFile& shard : shards) {
    if (!is_plain_file_name(shard.file) || head["files"].contains(shard.file))
      fail("checkpoint {}: shard file '{}' is invalid or given twice", dir, shard.file);
    head["files"][shard.file] = {{"bytes", shard.bytes}, {"crc32", shard.crc32}};
    for (const json& p : shard.pieces) {
      const std::string name = p.at("name").get<std::string>();
      json& t = tensors[name];
      if (t.is_null()) {
        t = {{"shape", p.at("global_shape")}, {"pieces", json::array()}};
        shape_source[name] = shard.file;
      } else if (t["shape"] != p.at("global_shape")) {
        fail("checkpoint {}: tensor '{}' has global shape {} in {} but {} in {}", dir, name,
             t["shape"].dump(), shape_source[name], p.at("global_shape").dump(), shard.file);
      }
      json piece = p;
      piece.erase("name");
      piece.erase("global_shape");
      piece["file"] = shard.file;
      t["pieces"].push_back(std::move(piece));
    }
  }
  for (const NamedFile& f : files) {
    if (!is_plain_file_name(f.name) || is_shard_file_name(f.name) || head["files"].contains(f.name))
      fail("checkpoint {}: file '{}' is invalid or given twice", dir, f.name);
    write_file_atomically(root / f.name, f.bytes, "checkpoint file");
    head["files"][f.name] = {{"bytes", f.bytes.size()}, {"crc32", crc32_of(f.bytes)}};
  }
  json whole = head;
  whole["tensors"] = json::object();
  for (const auto& [name, entry] : tensors) whole["tensors"][name] = entry;
  head["checksum"] = manifest_checksum(whole);
  write_file_atomically(root / kManifest, manifest_text(head, tensors), "checkpoint manifest");
}

void commit_checkpoint(const std::string& staging, const std::string& dir) {
  fsync_directory(staging);
  std::error_code ec;
  const fs::path target(dir);
  if (!fs::exists(fs::symlink_status(target, ec))) {
    if (::rename(staging.c_str(), dir.c_str()) != 0)
      fail("checkpoint {}: cannot rename {} into place: {}", dir, staging, std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(staging, ec);  // now the previous checkpoint
  } else {
    if (errno != EINVAL && errno != ENOSYS)
      fail("checkpoint {}: cannot exchange it with {}: {}", dir, staging, std::strerror(errno));
    // A file system without the exchange: the old folder moves aside first (briefly no folder at all;
    // a checkpoint directory's `latest` then resolves to the previous step, see checkpoint_dir.h).
    const std::string aside = staging + ".old";
    fs::remove_all(aside, ec);
    if (::rename(dir.c_str(), aside.c_str()) != 0)
      fail("checkpoint {}: cannot move it aside: {}", dir, std::strerror(errno));
    if (::rename(staging.c_str(), dir.c_str()) != 0) {
      const int error = errno;
      ::rename(aside.c_str(), dir.c_str());
      fail("checkpoint {}: cannot rename {} into place: {}", dir, staging, std::strerror(error));
    }
    fs::remove_all(aside, ec);
  }
  fsync_directory(target.parent_path());
}

std::string begin_sharded_save(const std::string& dir, comm::Communicator& world) {
  std::string error;
  if (world.rank() == 0) error = error_of([&] { begin_checkpoint_save(dir); });
  agree(world, error);  // also the barrier: the staging folder exists before any rank writes into it
  return checkpoint_staging_dir(dir);  // the same name on every rank
}

ShardWrite write_shard_of_save(const std::string& staging, int rank, int world_size,
                               std::span<const ShardPiece> pieces, const BlobReader& read) {
  ShardWrite out;
  out.error = error_of([&] {
    fail_point("save.write_shard", rank);
    out.shard = write_checkpoint_shard(staging, rank, world_size, pieces, read);
  });
  kill_point("save.shard_written", rank);
  return out;
}

void finish_sharded_save(const std::string& dir, comm::Communicator& world, const std::string& staging,
                         const ShardWrite& mine, const CheckpointState& state,
                         std::span<const NamedFile> files) {
  const int rank = world.rank();
  auto discard_staging = [&] {
    std::error_code ec;
    if (rank == 0) fs::remove_all(staging, ec);
  };
  const json report = {{"error", mine.error},
                       {"file", mine.shard.file},
                       {"bytes", mine.shard.bytes},
                       {"crc32", mine.shard.crc32},
                       {"pieces", mine.shard.pieces}};
  const std::vector<std::string> reports = world.size() == 1 ? std::vector<std::string>{report.dump()}
                                                             : comm::all_gather_strings(world, report.dump());
  std::vector<ShardFile> shards;
  for (size_t r = 0; r < reports.size(); ++r) {
    const json got = json::parse(reports[r]);
    const std::string failed = got["error"].get<std::string>();
    if (!failed.empty()) {
      discard_staging();
      throw Error(world.size() == 1 ? failed : fmt::format("rank {}: {}", r, failed));
    }
    shards.push_back({got["file"].get<std::string>(), got["bytes"].get<uint64_t>(),
                      got["crc32"].get<uint32_t>(), got["pieces"]});
  }

  std::string error;
  if (rank == 0)
    error = error_of([&] {
      fail_point("save.write_manifest", rank);
      write_checkpoint_manifest(staging, shards, state, files);
      kill_point("save.manifest_written", rank);
      commit_checkpoint(staging, dir);
      kill_point("save.committed", rank);
    });
  if (!error.empty()) discard_staging();
  agree(world, error);
}

void save_sharded_checkpoint(const std::string& dir, comm::Communicator& world,
                             std::span<const ShardPiece> pieces, const CheckpointState& state,
                             std::span<const NamedFile> files) {
  const std::string staging = begin_sharded_save(dir, world);
  const ShardWrite mine = write_shard_of_save(staging, world.rank(), world.size(), pieces);
  finish_sharded_save(dir, world, staging, mine, state, files);
}

CheckpointState load_sharded_checkpoint(const std::string& path, comm::Communicator& world,
                                        std::span<const ShardPiece> pieces) {
  Manifest m;
  std::vector<SourcePlan> plans;
  std::map<std::string, SafetensorsFile> files;
  int64_t largest = 0;
  std::string dir = path;
  std::string error = error_of([&] {
    dir = resolve_checkpoint(path).dir;
    m = read_manifest(dir);
    plans = plan_load(m, pieces);
    // Every file this rank reads is checked whole before any destination is written.
    for (const SourcePlan& plan : plans) {
      if (!files.count(plan.file)) {
        check_file(m, plan.file, /*crc=*/true);
        files.emplace(plan.file, SafetensorsFile::open((m.root / plan.file).string()));
      }
      const SafetensorsEntry* entry = files.at(plan.file).find(plan.key);
      if (!entry || entry->dtype != DType::f32 || shape_numel(entry->shape) != plan.length)
        fail(
            "checkpoint {}: {} does not hold '{}' (a piece of tensor '{}') as {} fp32 values, as "
            "manifest.json says",
            dir, plan.file, plan.key, plan.tensor, plan.length);
      largest = std::max(largest, plan.length);
    }
  });
  agree(world, error);

  error = error_of([&] {
    // One saved piece in memory at a time.
    const Tensor buffer = largest > 0 ? Tensor::empty({largest}, DType::f32) : Tensor();
    for (const SourcePlan& plan : plans) {
      const Tensor source = buffer.view(0, {plan.length});
      files.at(plan.file).read_into(plan.key, source);
      // A non-finite weight or moment cannot come from a healthy run (the trainer never saves one): the
      // checkpoint is damaged, and training or evaluating on it would only spread the NaN.
      check_finite(source.f32(), plan.length, plan.key, fmt::format("checkpoint {}: {}", dir, plan.file));
      for (const CopyOp& op : plan.ops)
        std::memcpy(pieces[op.destination].data + op.destination_offset, source.f32() + op.source_offset,
                    static_cast<size_t>(op.length) * sizeof(float));
    }
  });
  agree(world, error);
  return m.state;
}

std::vector<ShardPiece> parameter_store_pieces(const ParameterStore& params,
                                               const OptimizerMoments* optimizer, bool for_saving) {
  std::vector<ShardPiece> pieces;
  FORGE_CHECK(params.device() == Device::cpu,
              "checkpoint pieces of a parameter store on a device: stage it through a host copy first");
  auto add = [&](const std::string& prefix, const Tensor& buffer) {
    for (const ParamInfo& info : params.infos()) {
      if (for_saving && !info.shard.primary) continue;
      if (!prefix.empty() && !info.trainable) continue;  // a frozen parameter has no optimizer state
      ShardPiece p;
      p.name = prefix + info.name;
      p.global_shape = info.global_shape();
      p.local_shape = info.shape;
      p.split_dim = info.shard.dim;
      p.split_start = info.shard.dim < 0 ? 0 : info.shard.start;
      p.flat_end = shape_numel(info.shape);
      p.data = buffer.f32() + info.offset;
      pieces.push_back(std::move(p));
    }
  };
  add("", params.params());
  if (optimizer) {
    add("exp_avg.", optimizer->exp_avg);
    add("exp_avg_sq.", optimizer->exp_avg_sq);
  }
  return pieces;
}

std::vector<std::string> checkpoint_tensor_names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : read_manifest(resolve_checkpoint(dir).dir).tensors) names.push_back(name);
  return names;
}

// Declared in checkpoint.h: the manifest is this file's business.
bool checkpoint_exists(const std::string& dir) {
  try {
    resolve_checkpoint(dir);
    return true;
  } catch (const Error&) {
    return false;
  }
}

CheckpointState read_checkpoint_manifest_at(const std::string& dir, bool verify_files) {
  const Manifest m = read_manifest(dir);
  for (const auto& [name, digest] : m.files) check_file(m, name, verify_files);
  return m.state;
}

CheckpointState read_checkpoint_manifest(const std::string& dir, bool verify_files) {
  return read_checkpoint_manifest_at(resolve_checkpoint(dir).dir, verify_files);
}

}  // namespace forge::ckpt
