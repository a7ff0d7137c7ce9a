#include "forge/train/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::ckpt;
namespace fs = std::filesystem;

DirectoryLock::DirectoryLock(const fs::path& dir, std::string_view key) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("{} {}: cannot create it: {}", key, dir.string(), ec.message());
  const fs::path file = dir / ".forge.lock";
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{} {}: cannot create {}: {}", key, dir.string(), file.string(), std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    std::string holder = read_file(file, "lock file");
    while (!holder.empty() && holder.back() == '\n') holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (error == EWOULDBLOCK)
      fail("{} {} is in use by another forge run ({}); give each run its own {}", key, dir.string(),
           holder.empty() ? "holder unknown" : holder, key);
    fail("{} {}: cannot lock {}: {}", key, dir.string(), file.string(), std::strerror(error));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[32] = {};
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string holder = fmt::format("pid {} on host {}, since {}\n", ::getpid(), host, when);
  if (::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, holder.data(), holder.size(), 0) < 0) {
    // Who holds the lock is only for the message; the lock itself is what counts.
  }
}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock
}

namespace {

bool same_folder(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return fs::equivalent(a, b, ec);
}

bool inside(const fs::path& child, const fs::path& parent) {
  std::error_code ec;
  const fs::path c = fs::weakly_canonical(child, ec), p = fs::weakly_canonical(parent, ec);
  const auto [pe, ce] = std::mismatch(p.begin(), p.end(), c.begin(), c.end());
  return pe == p.end();
}

std::string step_text(const std::string& dir) {
  const auto step = latest_checkpoint_step(dir);
  return step ? fmt::format("its latest complete checkpoint is step {}", *step) : "none of it is complete";
}

}  // namespace

ResumeDecision decide_resume(const TrainConfig& c) {
  const fs::path root = c.checkpoint_dir();
  const bool has_data = holds_checkpoint_data(root.string());
  ResumeDecision d;
  if (c.resume_mode() == ResumeMode::automatic) {
    if (!has_data) return d;                                         // nothing to continue: a fresh run
    const ResolvedCheckpoint r = resolve_checkpoint(root.string());  // "incomplete" when nothing is
    d.checkpoint = r.dir;
    d.note = r.note;
    d.from_own_directory = true;
    return d;
  }
  if (c.resume_mode() == ResumeMode::fresh) {
    if (!has_data) return d;
    if (!c.checkpoint.overwrite)
      fail(
          "{} already holds checkpoints ({}): continue that run with --set checkpoint.resume=auto, or start "
          "over with --set checkpoint.overwrite=true, or give this run another log.run_dir",
          root.string(), step_text(root.string()));
    remove_checkpoint_data(root.string());
    d.note = fmt::format("checkpoint.overwrite: removed the checkpoints in {}", root.string());
    return d;
  }
  const ResolvedCheckpoint r = resolve_checkpoint(c.checkpoint.resume);
  d.checkpoint = r.dir;
  d.note = r.note;
  if (!has_data) return d;
  std::string own;
  try {
    own = resolve_checkpoint(root.string()).dir;
  } catch (const Error&) {
  }
  d.from_own_directory = !own.empty() && same_folder(own, r.dir);
  if (d.from_own_directory) return d;
  if (!c.checkpoint.overwrite)
    fail(
        "checkpoint.resume = {}: this run saves into {}, which holds other checkpoints ({}); saving there "
        "would mix the two runs. Set checkpoint.dir (or log.run_dir) to another directory, or "
        "--set checkpoint.overwrite=true to let this run replace them",
        c.checkpoint.resume, root.string(), step_text(root.string()));
  // Checkpoints past the resumed one go at this run's first save (checkpoint_dir.h); a directory the
  // resumed checkpoint does not live in is cleared now.
  if (!inside(r.dir, root)) {
    remove_checkpoint_data(root.string());
    d.note = fmt::format("checkpoint.overwrite: removed the checkpoints in {}", root.string());
  }
  return d;
}

void trim_metrics(const fs::path& run_dir, int64_t step) {
  const fs::path path = run_dir / "metrics.jsonl";
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::istringstream in(read_file(path, "metrics file"));
  std::string kept;
  bool dropped = false;
  for (std::string line; std::getline(in, line);) {
    // A record past the resumed step, or a partial line a crash left: the resumed run writes it again.
    bool keep = false;
    try {
      const nlohmann::json record = nlohmann::json::parse(line);
      keep = record.is_object() && (!record.contains("step") || !record["step"].is_number_integer() ||
                                    record["step"].get<int64_t>() <= step);
    } catch (const nlohmann::json::exception&) {
    }
    if (keep)
      kept += line + "\n";
    else
      dropped = true;
  }
  if (dropped) write_file_atomically(path, kept, "metrics file");
}

}  // namespace forge::train
