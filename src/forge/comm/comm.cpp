#include "forge/comm/comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <thread>
#ifdef __linux__
#include <sys/prctl.h>
#include <unistd.h>
#endif

#include "forge/comm/comm_internal.h"
#include "forge/comm/mpi/mpi_comm.h"
#include "forge/core/error.h"

namespace forge::comm {

Type type_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return Type::f32;
    case DType::bf16:
      return Type::bf16;
    case DType::i32:
      return Type::i32;
    case DType::i64:
      return Type::i64;
    case DType::u8:
      return Type::u8;
    default:
      fail("comm: no message type for {} elements", dtype_name(dtype));
  }
}

size_t type_size(Type t) {
  switch (t) {
    case Type::f32:
      return 4;
    case Type::f64:
      return 8;
    case Type::bf16:
      return 2;
    case Type::i32:
      return 4;
    case Type::i64:
      return 8;
    case Type::u8:
      return 1;
  }
  fail("comm: unknown element type {}", static_cast<int>(t));
}

const char* type_name(Type t) {
  switch (t) {
    case Type::f32:
      return "f32";
    case Type::f64:
      return "f64";
    case Type::bf16:
      return "bf16";
    case Type::i32:
      return "i32";
    case Type::i64:
      return "i64";
    case Type::u8:
      return "u8";
  }
  fail("comm: unknown element type {}", static_cast<int>(t));
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  fail("comm: unknown reduction {}", static_cast<int>(op));
}

namespace {

// Spins (yielding the core) for the first few milliseconds, since most operations finish by then and MPI's
// non-blocking collectives only advance inside test(); then sleeps, doubling up to a millisecond, so that a
// long wait does not burn a core another rank on the same machine may need.
class Backoff {
 public:
  double elapsed_seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void pause() {
    if (elapsed_seconds() < kSpinSeconds) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  static constexpr double kSpinSeconds = 0.01;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::microseconds sleep_{20};
};

bool timed_out(double elapsed, double timeout_s) { return timeout_s > 0 && elapsed > timeout_s; }

}  // namespace

namespace detail {

std::string group_label(const Communicator& c) {
  return fmt::format("group '{}' (rank {} of {}, world rank {})", c.name(), c.rank(), c.size(),
                     c.world_rank());
}

std::string timeout_message(const std::string& what, const std::string& group_label, double timeout_s) {
  return fmt::format("{} on {} did not complete within {:g} s", what, group_label, timeout_s);
}

std::string timeout_message(const Work& work, const std::string& group_label, double timeout_s) {
  return timeout_message(work.description(), group_label, timeout_s);
}

std::string phase_timeout_message(std::string_view phase, int rank, double timeout_s) {
  const bool start = phase == "start-up";
  return fmt::format(
      "rank {}: MPI {} did not complete within {:g} s (parallel.timeout_s / FORGE_COMM_TIMEOUT); {}",
      rank < 0 ? std::string("?") : std::to_string(rank), phase, timeout_s,
      start ? "a rank that never reached MPI_Init, or died in it, holds up every rank"
            : "a rank stalled or died between its last collective and the end of MPI_Finalize");
}

int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    char* end = nullptr;
    if (!value || !*value) continue;
    const long rank = std::strtol(value, &end, 10);
    if (*end == '\0' && rank >= 0) return static_cast<int>(rank);
  }
  return -1;
}

void die_with_launcher() {
#ifdef __linux__
  if (launcher_rank() < 0) return;
  const pid_t launcher = getppid();
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return;  // cannot fail with a valid signal
  // The launcher died before the request took effect: the signal will never come.
  if (getppid() != launcher) std::raise(SIGKILL);
#endif
}

void stall_if_injected(std::string_view point, int rank) {
  const char* value = std::getenv("FORGE_FAULT_STALL");
  if (!value || !*value) return;
  std::string_view rest(value);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const size_t colon = item.rfind(':');
    if (colon == std::string_view::npos || item.substr(0, colon) != point) continue;
    if (item.substr(colon + 1) != std::to_string(rank)) continue;
    std::fprintf(stderr, "forge: FORGE_FAULT_STALL: rank %d stalls at %.*s (test fault injection)\n", rank,
                 static_cast<int>(point.size()), point.data());
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

namespace {
void print_error_line(const std::string& message) {
  std::string line = message;
  std::replace(line.begin(), line.end(), '\n', ' ');  // one line, whatever the message
  std::fflush(stdout);
  std::fprintf(stderr, "forge: error: %s\n", line.c_str());
  std::fflush(stderr);
}
}  // namespace

void abort_job(const std::string& message) {
  print_error_line(message);
  if (mpi::running()) mpi::abort_world();
  std::exit(1);
}

void exit_from_watchdog(const std::string& message) {
  print_error_line(message);
  std::_Exit(1);
}

bool poll_until_complete(Work& work, double timeout_s) {
  Backoff backoff;
  while (!work.test()) {
    if (timed_out(backoff.elapsed_seconds(), timeout_s)) return false;
    backoff.pause();
  }
  return true;
}

void complete_in_destructor(Work& work, const std::string& group_label, double timeout_s) noexcept {
  try {
    if (!poll_until_complete(work, timeout_s)) abort_job(timeout_message(work, group_label, timeout_s));
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
}

void check_count(const Communicator& c, const char* op, int64_t count, const char* what) {
  if (count < 0) fail("comm: {} on {}: {} is negative ({})", op, group_label(c), what, count);
}

void check_per_rank(const Communicator& c, const char* op, std::span<const int64_t> values,
                    const char* what) {
  if (values.size() != static_cast<size_t>(c.size()))
    fail("comm: {} on {}: {} has {} entries, expected one per rank ({})", op, group_label(c), what,
         values.size(), c.size());
  for (size_t r = 0; r < values.size(); ++r)
    if (values[r] < 0)
      fail("comm: {} on {}: {}[{}] is negative ({})", op, group_label(c), what, r, values[r]);
}

void check_rank(const Communicator& c, const char* op, int rank, const char* what) {
  if (rank < 0 || rank >= c.size())
    fail("comm: {} on {}: {} {} is not a rank of the group (0 .. {})", op, group_label(c), what, rank,
         c.size() - 1);
}

void check_buffer(const Communicator& c, const char* op, const void* buf, int64_t count, const char* what) {
  if (buf == nullptr && count > 0)
    fail("comm: {} on {}: {} is null but holds {} elements", op, group_label(c), what, count);
}

}  // namespace detail

bool Request::test() {
  if (!work_) return true;
  if (!work_->test()) return false;
  work_.reset();
  return true;
}

void Request::wait() {
  if (!work_) return;
  const double timeout_s = comm_ ? comm_->timeout_seconds() : 0;
  if (!detail::poll_until_complete(*work_, timeout_s))
    comm_->abort(detail::timeout_message(*work_, detail::group_label(*comm_), timeout_s));
  work_.reset();
}

void wait_all(std::span<Request> requests) {
  Backoff backoff;
  for (;;) {
    bool all_done = true;
    for (Request& r : requests) all_done = r.test() && all_done;  // test every one: each drives progress
    if (all_done) return;
    const double elapsed = backoff.elapsed_seconds();
    for (Request& r : requests) {
      if (r.pending() && r.comm_ && timed_out(elapsed, r.comm_->timeout_seconds()))
        r.comm_->abort(
            detail::timeout_message(*r.work_, detail::group_label(*r.comm_), r.comm_->timeout_seconds()));
    }
    backoff.pause();
  }
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    const char* value = std::getenv(name);
    if (value && std::atoi(value) > 1) return true;
  }
  // PMIx launchers (mpirun, srun --mpi=pmix) set PMIX_RANK in every process they start.
  return std::getenv("PMIX_RANK") != nullptr;
}

namespace {

struct WorldState {
  std::unique_ptr<Communicator> world;
  bool mpi = false;
  bool finalized = false;
  double startup_timeout_s = 300;  // set_startup_timeout_seconds
};

WorldState& world_state() {
  static WorldState state;
  return state;
}

// FORGE_COMM_TIMEOUT: seconds before a stuck request aborts the job (<= 0 waits forever). Unset: nullopt.
std::optional<double> timeout_from_environment() {
  const char* value = std::getenv("FORGE_COMM_TIMEOUT");
  if (!value || !*value) return std::nullopt;
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  if (end == value || *end != '\0') fail("FORGE_COMM_TIMEOUT='{}' is not a number of seconds", value);
  return seconds;
}

void apply_timeout_from_environment(Communicator& c) {
  if (const std::optional<double> seconds = timeout_from_environment()) c.set_timeout_seconds(*seconds);
}

// MPI start-up's timeout: FORGE_COMM_TIMEOUT, else set_startup_timeout_seconds's. A malformed variable is
// reported (as one line) right after start-up, by apply_timeout_from_environment; start-up keeps the other.
double startup_timeout_seconds() {
  try {
    return timeout_from_environment().value_or(world_state().startup_timeout_s);
  } catch (const Error&) {
    return world_state().startup_timeout_s;
  }
}

}  // namespace

Communicator& world(bool force_mpi) {
  WorldState& state = world_state();
  if (state.finalized) fail("comm::world: called after comm::finalize()");
  const bool want_mpi = force_mpi || launched_by_mpi();
  if (state.world) {
    if (want_mpi && !state.mpi)
      fail("comm::world: MPI was requested, but the world was already created as one process without MPI");
    return *state.world;
  }
  if (want_mpi) {
    state.world = mpi::init_world(startup_timeout_seconds());
    state.mpi = true;
  } else {
    state.world = make_self("world");
  }
  apply_timeout_from_environment(*state.world);
  return *state.world;
}

void set_startup_timeout_seconds(double s) { world_state().startup_timeout_s = s; }

void finalize() {
  WorldState& state = world_state();
  if (state.mpi && state.world) mpi::meet_before_finalize(*state.world);
  const double timeout_s = state.world ? state.world->timeout_seconds() : startup_timeout_seconds();
  state.world.reset();
  if (state.mpi) mpi::finalize(timeout_s);
  state.mpi = false;
  state.finalized = true;
}

namespace {
DeviceCommunicatorFactory g_device_communicators = nullptr;
}  // namespace

void override_device_communicators(DeviceCommunicatorFactory factory) { g_device_communicators = factory; }

std::unique_ptr<Communicator> make_nccl(Communicator& bootstrap, int cuda_device, std::string name,
                                        void* producer_stream) {
  if (std::string_view(bootstrap.backend()) == "nccl")
    fail("make_nccl: the bootstrap communicator '{}' is nccl; it must hold host memory (mpi or self)",
         bootstrap.name());
  if (g_device_communicators) return g_device_communicators(bootstrap, std::move(name));
  return detail::make_nccl_backend(bootstrap, cuda_device, std::move(name), producer_stream);
}

void all_reduce_sum(Communicator& c, float* buf, int64_t count) {
  c.all_reduce(buf, count, Type::f32, ReduceOp::sum).wait();
}

void all_reduce_sum(Communicator& c, double* buf, int64_t count) {
  c.all_reduce(buf, count, Type::f64, ReduceOp::sum).wait();
}

double all_reduce_sum(Communicator& c, double value) {
  c.all_reduce(&value, 1, Type::f64, ReduceOp::sum).wait();
  return value;
}

double all_reduce_max(Communicator& c, double value) {
  c.all_reduce(&value, 1, Type::f64, ReduceOp::max).wait();
  return value;
}

std::vector<std::string> all_gather_strings(Communicator& c, const std::string& mine) {
  const int n = c.size();
  if (n == 1) return {mine};
  std::vector<int64_t> lengths(n);
  const int64_t length = static_cast<int64_t>(mine.size());
  c.all_gather(&length, lengths.data(), 1, Type::i64).wait();
  int64_t total = 0;
  for (int64_t l : lengths) total += l;
  std::string all(static_cast<size_t>(total), '\0');
  c.all_gatherv(mine.data(), all.data(), lengths, Type::u8).wait();
  std::vector<std::string> out;
  int64_t at = 0;
  for (int64_t l : lengths) {
    out.push_back(all.substr(static_cast<size_t>(at), static_cast<size_t>(l)));
    at += l;
  }
  return out;
}

}  // namespace forge::comm
