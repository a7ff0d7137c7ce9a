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

// One checkpoint of a series, as a reader meets it.
struct SeriesCheckpoint {
  std::string dir;   // the step folder
  std::string name;  // "step-00000042"
  int64_t step = 0;
  std::string problem;   // why it is unusable ("" when complete: see resolve_checkpoint)
  bool corrupt = false;  // the problem is damage to what is there, not something missing
};

// The checkpoints of the series at `path` in the order a reader tries them: the step folder `latest` names
// first (even when it is gone), then every older step folder, newest first; without a usable `latest`
// every step folder, newest first. latest_note: what is wrong with `latest` itself (missing beside step
// folders, empty, not a step name, not UTF-8); "" when nothing is.
struct CheckpointSeries {
  std::vector<SeriesCheckpoint> steps;
  std::string latest_note;
};
CheckpointSeries checkpoint_series(const std::string& path);

struct ResolvedCheckpoint {
  std::string dir;    // the checkpoint folder to read
  int64_t step = -1;  // its step, when it is a step folder of a series (-1: a single checkpoint folder)
  // The newer checkpoints of the series passed over (unusable), newest first.
  std::vector<SeriesCheckpoint> passed_over;
  // What is wrong with `latest` and why each newer checkpoint was passed over, in one line ("" when
  // nothing is).
  std::string note;
};

// The checkpoint `path` stands for: the first complete checkpoint of its series (checkpoint_series), with
// a note on what it passed over; else `path` itself when it holds a manifest.json (a single checkpoint: a
// step folder, `forge convert --to forge` output, or the old single-folder layout). Complete: manifest.json
// is present, valid, matches its checksum, and every file it lists has its size (the files' checksums are
// verified when they are read). Throws "checkpoint P does not exist"; "checkpoint P is incomplete: ..." or
// "checkpoint P is corrupt: ..." (as the newest step's problem is) when P holds step folders but none is
// complete, "... is incomplete: it has no manifest.json" for other checkpoint data; or "checkpoint P holds
// no checkpoint".
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
