// A checkpoint directory (checkpoint.dir, default <run_dir>/checkpoint) holds a series of checkpoints,
// one folder per saved step, and names the committed one in `latest` (docs/formats.md):
//
//   step-00000040/   a complete checkpoint (sharded.h): shards, tokenizer.json, manifest.json last
//   step-00000042/
//   latest           "step-00000042": the commit point, replaced in one rename after the folder is complete
//   .step-00000044.partial/   a save in progress (or one a crash interrupted: ignored, removed by the next)
//
// A save never touches the committed checkpoint: the new step folder is complete (renamed into place)
// before `latest` moves to it, and older folders are deleted only after that. So at every instant, a
// crash included, the directory resolves to a complete checkpoint: the new one or the previous one.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "forge/ckpt/sharded.h"

namespace forge::ckpt {

std::string checkpoint_step_name(int64_t step);  // "step-00000042"

struct CheckpointSaveOptions {
  int64_t keep_last = 0;             // checkpoints kept, the new one included (0 = all)
  std::span<const NamedFile> files;  // added to the checkpoint (the run's tokenizer.json)
};

// Collective over `world`: saves `state` as <root>/step-<step> (save_sharded_checkpoint), then rank 0
// commits it by pointing <root>/latest at it (tmp, fsync, rename), and then deletes what the new latest
// supersedes: step folders beyond the newest keep_last, step folders newer than it (a run that went on past
// the checkpoint this one resumed from), staging folders of crashed saves, and a checkpoint of the old
// single-folder layout at <root> itself. Returns the new checkpoint's folder.
std::string save_checkpoint_step(const std::string& root, comm::Communicator& world,
                                 std::span<const ShardPiece> pieces, const CheckpointState& state,
                                 const CheckpointSaveOptions& options = {});

// save_checkpoint_step in phases (sharded.h's begin / write / finish), for saves written in the background
// (async_save.h): begin is collective and returns the staging folder; the shard is written with
// write_shard_of_save; finish is collective, commits, moves `latest` and prunes, and returns the folder.
std::string begin_checkpoint_step_save(const std::string& root, comm::Communicator& world, int64_t step);
std::string finish_checkpoint_step_save(const std::string& root, comm::Communicator& world,
                                        const std::string& staging, const ShardWrite& mine,
                                        const CheckpointState& state, const CheckpointSaveOptions& options);

// The complete step folders under the checkpoint directory `path`, newest first (manifests checked as
// resolve_checkpoint does; file contents not read). Empty when there are none.
std::vector<std::string> complete_checkpoints(const std::string& path);

struct ResolvedCheckpoint {
  std::string dir;   // the checkpoint folder to read
  std::string note;  // why it is not the one `latest` names ("" when it is, or when there is no `latest`)
};

// The checkpoint `path` stands for: the folder `latest` names when it is complete; else the newest complete
// step folder (with a note); else `path` itself when it holds a manifest.json (a single checkpoint: a step
// folder, `forge convert --to forge` output, or the old single-folder layout). Complete: manifest.json
// is present, valid, matches its checksum, and every file it lists has its size. Throws "checkpoint P
// does not exist", "checkpoint P is incomplete: ..." when P holds checkpoint data but no complete
// checkpoint, or "checkpoint P holds no checkpoint".
ResolvedCheckpoint resolve_checkpoint(const std::string& path);

// Whether `path` holds checkpoint data (a manifest, `latest`, step folders, shards of the single-folder
// layout): a directory a fresh run must not write into. Staging folders of crashed saves do not count.
bool holds_checkpoint_data(const std::string& path);

// The step of the newest complete checkpoint under `path`, if any (no file is read beyond manifests).
std::optional<int64_t> latest_checkpoint_step(const std::string& path);

// Deletes every checkpoint and everything a save leaves in `root` (step and staging folders, `latest`,
// a single-folder checkpoint's files), nothing else. For a fresh run told to overwrite.
void remove_checkpoint_data(const std::string& root);

}  // namespace forge::ckpt
