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
// piece (file, shapes, split, flat range) with the step, configs, layout and world size. The directory
// must be on a file system every rank sees.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "forge/ckpt/checkpoint.h"
#include "forge/comm/comm.h"
#include "forge/core/tensor.h"

namespace forge {

struct ShardPiece {
  std::string name;    // tensor name: the parameter's HF name, or "exp_avg.<name>", "exp_avg_sq.<name>"
  Shape global_shape;  // of the whole tensor
  Shape local_shape;   // of this rank's slice
  int split_dim = -1;
  int64_t split_start = 0;
  int64_t flat_begin = 0, flat_end = 0;  // elements of the local tensor this piece covers
  float* data = nullptr;                 // flat_end - flat_begin floats
};

// Collective over `world`: every rank writes its pieces (several of one tensor must not overlap); rank 0
// writes manifest.json last, after all files are complete, with each file's size and CRC32, world.size() and
// state.layout. The old manifest is removed first, so an interrupted save reads as incomplete; shard files
// of an older save that the new manifest does not list are removed after it lands. An error on any rank
// (an unwritable directory, a malformed piece) is thrown on every rank, and no manifest is written.
void save_sharded_checkpoint(const std::string& dir, comm::Communicator& world,
                             std::span<const ShardPiece> pieces, const CheckpointState& state);

// Collective over `world`: fills every destination piece; returns the manifest state (step, configs,
// layout and world size it was saved under). Each rank checks everything before writing any destination
// (the manifest, that every destination element is covered and every global shape matches, and the size
// and CRC32 of each file it reads), and reads one saved piece at a time. An error on any rank is thrown on
// every rank.
CheckpointState load_sharded_checkpoint(const std::string& dir, comm::Communicator& world,
                                        std::span<const ShardPiece> pieces);

// The names of the tensors a checkpoint holds, sorted (from its manifest; no file is read).
std::vector<std::string> checkpoint_tensor_names(const std::string& dir);

// Pieces covering a parameter store (and the AdamW moments "exp_avg.<name>", "exp_avg_sq.<name>" when
// optimizer is given), each whole local tensor as one piece with the store's ShardSpec. For saving, only
// primary copies (ShardSpec::primary); for loading, every parameter, replicated copies included.
std::vector<ShardPiece> parameter_store_pieces(const nn::ParameterStore& params, const AdamW* optimizer,
                                               bool for_saving);

// ---- The steps of a save, for callers that drive the ranks themselves (tests simulate several ranks in one
// process); save_sharded_checkpoint is begin (rank 0), barrier, write_checkpoint_shard (every rank), gather,
// write_checkpoint_manifest (rank 0).

struct ShardFile {
  std::string file;  // name inside the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
  nlohmann::json pieces;  // one object per piece: name, global_shape, local_shape, split_dim, ...
};

std::string shard_file_name(int rank, int world_size);  // "shard-00003-of-00004.safetensors"

// Creates the directory and removes its manifest; returns the files the removed manifest listed (to clean
// up once the new one lands).
std::vector<std::string> begin_checkpoint_save(const std::string& dir);
// Writes one rank's shard (tmp file, fsync, rename) and returns its size, CRC32 and piece descriptions.
ShardFile write_checkpoint_shard(const std::string& dir, int rank, int world_size,
                                 std::span<const ShardPiece> pieces);
// Writes manifest.json (tmp file, fsync, rename) for `shards` (one per rank, in rank order), then removes
// the files of `previous_files` and any shard-*-of-*.safetensors the new manifest does not list.
void write_checkpoint_manifest(const std::string& dir, std::span<const ShardFile> shards,
                               const CheckpointState& state,
                               std::span<const std::string> previous_files = {});

}  // namespace forge
