// Asynchronous checkpoints: the training step blocks at most while the state is copied to host memory
// (see Source below); the shard is written, checksummed and fsynced by a background thread while training
// goes on, and the manifest (the commit point, checkpoint_dir.h) is written last, once every rank has
// reported its shard written. So a crash at any moment of a background save leaves the previous checkpoint
// valid, and the new one exists only when it is whole.
//
// The background thread does no communication (MPI and NCCL calls stay on the training thread); the ranks
// agree that every shard is written with an all-reduce the caller already makes between steps (any_pending
// below), and then call finish() together.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"

namespace forge::ckpt {

class AsyncCheckpointSave {
 public:
  // How the step's state reaches the background writer.
  //   copy   the pieces are copied into the host buffer before the constructor returns: their memory may
  //          change at once (a GPU's state, staged to the host for the save, is released right after).
  //   live   nothing is copied yet: the writer reads the pieces' memory (CPU training state) while training
  //          goes on, until detach() is called before that memory next changes (the next optimizer
  //          update), which copies only what the writer has not read yet. A save whose write is done by
  //          then cost the step nothing at all.
  enum class Source { copy, live };
  // Collective over `world`: makes the staging folder of step folder state.step under `root`
  // (begin_checkpoint_step_save) and starts writing this rank's shard in the background, the pieces' data
  // taken as `source` says. `buffer` (may be null) holds the copy: a caller saving again and again passes
  // the same one, whose memory is then allocated (and faulted in) once rather than at every save; it must
  // outlive the save.
  AsyncCheckpointSave(std::string root, comm::Communicator& world, std::span<const ShardPiece> pieces,
                      CheckpointState state, const CheckpointSaveOptions& options,
                      std::vector<float>* buffer = nullptr, Source source = Source::copy);
  ~AsyncCheckpointSave();  // joins the writer; a save never finished is left as a staging folder
  AsyncCheckpointSave(const AsyncCheckpointSave&) = delete;
  AsyncCheckpointSave& operator=(const AsyncCheckpointSave&) = delete;

  int64_t step() const { return state_.step; }
  // Source::live: copies what the writer has not read yet, after which the pieces' memory may change.
  // Returns at once when the writer is done reading, or when it was already detached (or Source::copy).
  void detach();
  // This rank's shard is on disk (or its write failed): finish() will not wait.
  bool written() const { return written_.load(std::memory_order_acquire); }
  // Collective: waits for this rank's shard, then commits the checkpoint like save_checkpoint_step (an error
  // on any rank, a full disk say, is thrown on every rank; the previous checkpoint stays the newest).
  // Returns the new checkpoint's folder.
  std::string finish();

  // The seconds the training thread spent on the save's copies (the constructor's or detach()'s).
  double blocked_seconds() const { return blocked_seconds_; }
  double write_seconds() const { return write_seconds_; }  // the background write (valid once written)

 private:
  void read(size_t piece, uint64_t offset, void* destination, size_t bytes);

  std::string root_;
  comm::Communicator& world_;
  CheckpointState state_;
  int64_t keep_last_ = 0;
  std::vector<NamedFile> files_;
  std::vector<ShardPiece> pieces_;      // the live memory (Source::live) or the copy
  std::vector<size_t> buffer_offsets_;  // where each piece's copy goes in the buffer
  std::vector<float> own_buffer_;       // the copy, unless the caller lent a buffer
  std::vector<float>* buffer_ = nullptr;
  // Source::live: the writer's position (piece, byte offset in it) and whether the copy took over; guarded
  // by mutex_, which the writer holds while it reads a chunk.
  std::mutex mutex_;
  bool live_ = false;
  size_t read_piece_ = 0;
  uint64_t read_offset_ = 0;
  std::string staging_;
  ShardWrite result_;
  std::atomic<bool> written_{false};
  double blocked_seconds_ = 0, write_seconds_ = 0;
  std::thread writer_;
  bool finished_ = false;
};

}  // namespace forge::ckpt
