#include "forge/ckpt/async_save.h"

#include <chrono>
#include <cstring>

#include "forge/core/error.h"

namespace forge::ckpt {
namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

AsyncCheckpointSave::AsyncCheckpointSave(std::string root, comm::Communicator& world,
                                         std::span<const ShardPiece> pieces, CheckpointState state,
                                         const CheckpointSaveOptions& options)
    : root_(std::move(root)), world_(world), state_(std::move(state)), keep_last_(options.keep_last) {
  const auto start = Clock::now();
  files_.assign(options.files.begin(), options.files.end());
  pieces_.assign(pieces.begin(), pieces.end());
  storage_.resize(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ShardPiece& p = pieces_[i];
    const int64_t n = p.flat_end - p.flat_begin;
    storage_[i].resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(storage_[i].data(), p.data, static_cast<size_t>(n) * sizeof(float));
    p.data = storage_[i].data();
  }
  copy_seconds_ = seconds_since(start);
  staging_ = begin_checkpoint_step_save(root_, world_, state_.step);
  const int rank = world_.rank(), size = world_.size();
  writer_ = std::thread([this, rank, size] {
    const auto begin = Clock::now();
    result_ = write_shard_of_save(staging_, rank, size, pieces_);
    write_seconds_ = seconds_since(begin);
    storage_ = {};  // the copy is on disk now: its memory goes back early
    written_.store(true, std::memory_order_release);
  });
}

AsyncCheckpointSave::~AsyncCheckpointSave() {
  if (writer_.joinable()) writer_.join();
}

std::string AsyncCheckpointSave::finish() {
  FORGE_CHECK(!finished_, "the asynchronous save of step {} is finished twice", state_.step);
  finished_ = true;
  if (writer_.joinable()) writer_.join();
  CheckpointSaveOptions options;
  options.keep_last = keep_last_;
  options.files = files_;
  return finish_checkpoint_step_save(root_, world_, staging_, result_, state_, options);
}

}  // namespace forge::ckpt
