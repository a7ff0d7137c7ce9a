// Checkpoints under a parallel layout: every rank writes the pieces of state it owns into its own file,
// and a checkpoint saved under one layout (tp, dp, ZeRO or not) loads under any other.
//
// A piece is a contiguous range [flat_begin, flat_end) of the row-major elements of a rank's local tensor,
// which is itself the slice [split_start, split_start + local_shape[split_dim]) along split_dim of a global
// tensor (split_dim = -1: the local tensor is the global one). Local indices past the global extent are
// padding (a padded vocabulary): stored as given, never loaded into anything. Saving writes each piece once
// (callers pass each element of the global state from exactly one rank: the primary tensor-parallel copy,
// one data-parallel owner); loading fills each destination piece from whatever pieces of the saved layout
// cover it, and fails naming the tensor if any element is missing or the global shapes differ.
//
// On disk (docs/formats.md): shard-RRRRR-of-WWWWW.safetensors per rank, each piece a 1-D F32 tensor under
// its tensor name, and manifest.json, written last by rank 0, listing every file (size, CRC32) and every
// piece (file, shapes, split, flat range) with the step, configs, layout, world size and its own checksum.
// The directory must be on a file system every rank sees. Functions that read take a checkpoint folder
// or a checkpoint directory of step folders (checkpoint_dir.h), which they resolve to its latest
// complete checkpoint.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/safetensors.h"
#include "forge/comm/comm.h"
#include "forge/core/parameters.h"
#include "forge/core/tensor.h"

namespace forge::ckpt {

// A file rank 0 adds to a checkpoint before its manifest (the run's tokenizer.json), listed in the
// manifest with its size and CRC32 like the shards.
struct NamedFile {
  std::string name;
  std::string bytes;
};

// Collective over `world`: writes one complete checkpoint at `dir`, atomically. The ranks write their
// shards into a staging folder beside it (".<name>.partial", each file tmp + fsync + rename); rank 0 adds
// `files` and then manifest.json (with each file's size and CRC32, world.size(), state.layout and the
// manifest's own checksum), and renames the folder to `dir` in one step: exchanging it with a checkpoint
// already there, which is then deleted. Until that rename `dir` is exactly as it was, so a crash or an
// error at any moment leaves the previous checkpoint intact. An error on any rank (an unwritable
// directory, a malformed piece, a full disk) is thrown on every rank, and the staging folder is removed.
// A `dir` that exists and is neither empty nor a checkpoint is refused, never replaced.
// Checkpoint series (step folders, `latest`, keep_last) are built on this in checkpoint_dir.h.
void save_sharded_checkpoint(const std::string& dir, comm::Communicator& world,
                             std::span<const ShardPiece> pieces, const CheckpointState& state,
                             std::span<const NamedFile> files = {});

// Collective over `world`: fills every destination piece; returns the manifest state (step, configs,
// layout and world size it was saved under). Each rank checks everything before writing any destination
// (the manifest, that every destination element is covered and every global shape matches, and the size
// and CRC32 of each file it reads), and reads one saved piece at a time. An error on any rank is thrown on
// every rank.
CheckpointState load_sharded_checkpoint(const std::string& dir, comm::Communicator& world,
                                        std::span<const ShardPiece> pieces);

// The manifest of the checkpoint folder `dir` itself (not resolved through `latest`), with the checks of
// read_checkpoint_manifest (checkpoint.h).
CheckpointState read_checkpoint_manifest_at(const std::string& dir, bool verify_files);

// The names of the tensors a checkpoint holds, sorted (from its manifest; no file is read).
std::vector<std::string> checkpoint_tensor_names(const std::string& dir);

// Pieces covering a parameter store (and the AdamW moments "exp_avg.<name>", "exp_avg_sq.<name>" when
// optimizer is given), each whole local tensor as one piece with the store's ShardSpec. For saving, only
// primary copies (ShardSpec::primary); for loading, every parameter, replicated copies included.
std::vector<ShardPiece> parameter_store_pieces(const ParameterStore& params,
                                               const OptimizerMoments* optimizer, bool for_saving);

// ---- The steps of a save, for callers that drive the ranks themselves (tests simulate several ranks in one
// process): save_sharded_checkpoint is begin_checkpoint_save (rank 0), barrier, write_checkpoint_shard into
// the staging folder (every rank), gather, write_checkpoint_manifest and commit_checkpoint (rank 0).

struct ShardFile {
  std::string file;  // name inside the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
  nlohmann::json pieces;  // one object per piece: name, global_shape, local_shape, split_dim, ...
};

std::string shard_file_name(int rank, int world_size);  // "shard-00003-of-00004.safetensors"
// shard-<digits>-of-<digits>.safetensors: the names any save writes, whatever its world size.
bool is_shard_file_name(std::string_view name);

// The checksum a version 3 manifest records under "checksum": the CRC32 of its canonical text (sorted keys,
// no spaces) without that key, so that it does not depend on the file's layout ("crc32:1a2b3c4d").
std::string manifest_checksum(const nlohmann::json& manifest);

// The staging folder of a save to `dir`: ".<name>.partial" beside it.
std::string checkpoint_staging_dir(const std::string& dir);
// Refuses a `dir` that is neither absent, empty nor a checkpoint; creates its parent and a fresh, empty
// staging folder (removing one a crashed save left) and returns it.
std::string begin_checkpoint_save(const std::string& dir);
// Writes one rank's shard (tmp file, fsync, rename) and returns its size, CRC32 and piece descriptions.
// `read` (optional) fetches the pieces' bytes instead of their data pointers (write_safetensors_blobs).
ShardFile write_checkpoint_shard(const std::string& dir, int rank, int world_size,
                                 std::span<const ShardPiece> pieces, const BlobReader& read = {});
// Writes `files`, then manifest.json (tmp file, fsync, rename) for `shards` (one per rank, in rank order)
// into `dir`. The manifest is the last file of a checkpoint: a folder without one is incomplete.
void write_checkpoint_manifest(const std::string& dir, std::span<const ShardFile> shards,
                               const CheckpointState& state, std::span<const NamedFile> files = {});
// save_sharded_checkpoint in its three phases, for a save whose shard is written in the background
// (async_save.h): begin (collective: rank 0 prepares the staging folder; returns it), write this rank's
// shard (no communication; errors are returned, not thrown, so that every rank still takes part in the
// finish), finish (collective: the ranks' reports gathered, rank 0 writes the manifest last and commits;
// an error on any rank is thrown on every rank and the staging folder is removed).
struct ShardWrite {
  ShardFile shard;
  std::string error;  // "" when the shard is written
};
std::string begin_sharded_save(const std::string& dir, comm::Communicator& world);
ShardWrite write_shard_of_save(const std::string& staging, int rank, int world_size,
                               std::span<const ShardPiece> pieces, const BlobReader& read = {});
void finish_sharded_save(const std::string& dir, comm::Communicator& world, const std::string& staging,
                         const ShardWrite& mine, const CheckpointState& state,
                         std::span<const NamedFile> files = {});
// Renames the staging folder to `dir` in one step (exchanging and then deleting a previous checkpoint
// there), with fsyncs so that the rename survives a power loss.
void commit_checkpoint(const std::string& staging, const std::string& dir);

}  // namespace forge::ckpt
