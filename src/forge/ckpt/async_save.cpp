#include "forge/ckpt/async_save.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "forge/core/error.h"
#include "forge/core/memory.h"

namespace forge::ckpt {
namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

AsyncCheckpointSave::AsyncCheckpointSave(std::string root, comm::Communicator& world,
                                         std::span<const ShardPiece> pieces, CheckpointState state,
                                         const CheckpointSaveOptions& options, std::vector<float>* buffer,
                                         Source source)
    : root_(std::move(root)),
      world_(world),
      state_(std::move(state)),
      keep_last_(options.keep_last),
      buffer_(buffer ? buffer : &own_buffer_),
      live_(source == Source::live) {
  const auto start = Clock::now();
  files_.assign(options.files.begin(), options.files.end());
  pieces_.assign(pieces.begin(), pieces.end());
  size_t total = 0;
  for (const ShardPiece& p : pieces_) {
    buffer_offsets_.push_back(total);
    total += static_cast<size_t>(p.flat_end - p.flat_begin);
  }
  if (buffer_->size() < total) buffer_->resize(total);  // grows once; later saves reuse its pages
  if (!live_) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      ShardPiece& p = pieces_[i];
      copy_host_parallel(buffer_->data() + buffer_offsets_[i], p.data,
                         static_cast<size_t>(p.flat_end - p.flat_begin) * sizeof(float));
      p.data = buffer_->data() + buffer_offsets_[i];
    }
  }
  blocked_seconds_ = seconds_since(start);
  staging_ = begin_checkpoint_step_save(root_, world_, state_.step);
  const int rank = world_.rank(), size = world_.size();
  writer_ = std::thread([this, rank, size] {
    // At the normal priority: on a CPU the writer must get through the live state during the next step
    // for detach() to have little left to copy (at nice 19 it got no CPU beside the training threads: the
    // step blocked 35 ms instead of 14 ms, bench/checkpoint_stall.sh).
    const auto begin = Clock::now();
    result_ = write_shard_of_save(staging_, rank, size, pieces_,
                                  [this](size_t piece, uint64_t offset, void* destination, size_t bytes) {
                                    read(piece, offset, destination, bytes);
                                  });
    write_seconds_ = seconds_since(begin);
    written_.store(true, std::memory_order_release);
  });
}

void AsyncCheckpointSave::read(size_t piece, uint64_t offset, void* destination, size_t bytes) {
  std::lock_guard lock(mutex_);
  std::memcpy(destination, reinterpret_cast<const char*>(pieces_[piece].data) + offset, bytes);
  read_piece_ = piece, read_offset_ = offset + bytes;
}

void AsyncCheckpointSave::detach() {
  const auto start = Clock::now();
  std::lock_guard lock(mutex_);
  if (!live_) return;
  live_ = false;
  // Everything from the writer's position on is copied and read from the copy from now on.
  for (size_t i = read_piece_; i < pieces_.size(); ++i) {
    ShardPiece& p = pieces_[i];
    const uint64_t bytes = static_cast<uint64_t>(p.flat_end - p.flat_begin) * sizeof(float);
    const uint64_t from = i == read_piece_ ? std::min(read_offset_, bytes) : 0;
    float* copy = buffer_->data() + buffer_offsets_[i];
    copy_host_parallel(reinterpret_cast<char*>(copy) + from, reinterpret_cast<const char*>(p.data) + from,
                       bytes - from);
    p.data = copy;  // the bytes before `from` are never read again
  }
  blocked_seconds_ += seconds_since(start);
}

AsyncCheckpointSave::~AsyncCheckpointSave() {
  if (writer_.joinable()) writer_.join();
}

std::string AsyncCheckpointSave::finish() {
  FORGE_CHECK(!finished_, "the asynchronous save of step {} is finished twice", state_.step);
  finished_ = true;
  if (writer_.joinable()) writer_.join();
  live_ = false;
  CheckpointSaveOptions options;
  options.keep_last = keep_last_;
  options.files = files_;
  return finish_checkpoint_step_save(root_, world_, staging_, result_, state_, options);
}

}  // namespace forge::ckpt
