#include "forge/ckpt/async_save.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
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
                                         const CheckpointSaveOptions& options, std::vector<float>* buffer)
    : root_(std::move(root)),
      world_(world),
      state_(std::move(state)),
      keep_last_(options.keep_last),
      buffer_(buffer ? buffer : &own_buffer_) {
  const auto start = Clock::now();
  files_.assign(options.files.begin(), options.files.end());
  pieces_.assign(pieces.begin(), pieces.end());
  size_t total = 0;
  for (const ShardPiece& p : pieces_) total += static_cast<size_t>(p.flat_end - p.flat_begin);
  if (buffer_->size() < total) buffer_->resize(total);  // grows once; later saves reuse its pages
  size_t at = 0;
  for (ShardPiece& p : pieces_) {
    const size_t n = static_cast<size_t>(p.flat_end - p.flat_begin);
    copy_host_parallel(buffer_->data() + at, p.data, n * sizeof(float));
    p.data = buffer_->data() + at;
    at += n;
  }
  copy_seconds_ = seconds_since(start);
  staging_ = begin_checkpoint_step_save(root_, world_, state_.step);
  const int rank = world_.rank(), size = world_.size();
  writer_ = std::thread([this, rank, size] {
    // The lowest priority: the training threads keep their cores (OpenMP teams stall at every barrier when
    // one of their threads is preempted), and the writer fills the gaps and waits for the disk.
    setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    const auto begin = Clock::now();
    result_ = write_shard_of_save(staging_, rank, size, pieces_);
    write_seconds_ = seconds_since(begin);
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
