#include "forge/comm/mpi/mpi_comm.h"

#include <fmt/format.h>
// forge uses MPI's C API only; OpenMPI's mpi.h would otherwise pull in its deprecated C++ bindings, which
// live in a library (libmpi_cxx) forge does not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "forge/comm/comm_internal.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"

namespace forge::comm::mpi {
namespace {

struct MpiState {
  bool running = false;
  int world_rank = -1;
  bool initialised_here = false;  // forge called MPI_Init_thread, so forge finalises
  std::array<MPI_Op, 3> bf16_ops{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // indexed by ReduceOp
};

MpiState& state() {
  static MpiState s;
  return s;
}

[[noreturn]] void fail_call(std::string_view call, int code, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  fail("{}:{}: {} failed: {}", file, line, call.substr(0, call.find('(')),
       length > 0 ? std::string_view(text, static_cast<size_t>(length)) : std::string_view("MPI error"));
}

}  // namespace
}  // namespace forge::comm::mpi

// Throws forge::Error "file:line: MPI_Xxx failed: <MPI's text>" (forge's communicators return errors
// instead of MPI's default of aborting without saying where).
#define FORGE_MPI_CHECK(call)                                                    \
  do {                                                                           \
    const int forge_mpi_code_ = (call);                                          \
    if (forge_mpi_code_ != MPI_SUCCESS)                                          \
      ::forge::comm::mpi::fail_call(#call, forge_mpi_code_, __FILE__, __LINE__); \
  } while (0)

namespace forge::comm::mpi {
namespace {

MPI_Datatype datatype(Type t) {
  switch (t) {
    case Type::f32:
      return MPI_FLOAT;
    case Type::f64:
      return MPI_DOUBLE;
    case Type::bf16:
      return MPI_UINT16_T;  // moved as raw bits; reductions use forge's bf16 operations
    case Type::i32:
      return MPI_INT32_T;
    case Type::i64:
      return MPI_INT64_T;
    case Type::u8:
      return MPI_UINT8_T;
  }
  fail("comm: unknown element type {}", static_cast<int>(t));
}

MPI_Op reduction(Type t, ReduceOp op) {
  if (t == Type::bf16) return state().bf16_ops[static_cast<size_t>(op)];
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  fail("comm: unknown reduction {}", static_cast<int>(op));
}

// bf16 sum: each pair is added in fp32 and rounded back to nearest even, as a bf16 kernel would.
void bf16_sum(void* in, void* inout, int* length, MPI_Datatype*) {
  constexpr int kChunk = 2048;
  float a[kChunk], b[kChunk];
  const auto* x = static_cast<const uint16_t*>(in);
  auto* y = static_cast<uint16_t*>(inout);
  for (int begin = 0; begin < *length; begin += kChunk) {
    const int n = std::min(kChunk, *length - begin);
    convert_bf16_to_f32(x + begin, a, static_cast<size_t>(n));
    convert_bf16_to_f32(y + begin, b, static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) b[i] += a[i];
    convert_f32_to_bf16(b, y + begin, static_cast<size_t>(n));
  }
}

// bf16 max/min pick one of the inputs, so no rounding; NaN wins, so an overflow on any rank is seen by all.
template <bool kMax>
void bf16_select(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* x = static_cast<const uint16_t*>(in);
  auto* y = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float a = bf16_bits_to_f32(x[i]), b = bf16_bits_to_f32(y[i]);
    if (a != a || (b == b && (kMax ? a > b : a < b))) y[i] = x[i];
  }
}

class MpiWork final : public Work {
 public:
  MpiWork(const char* op, std::shared_ptr<const std::string> label, double timeout_s)
      : op_(op), label_(std::move(label)), timeout_s_(timeout_s) {}
  ~MpiWork() override {
    if (!done_ && running()) detail::complete_in_destructor(*this, *label_, timeout_s_);
  }

  bool test() override {
    if (done_) return true;
    int flag = 0;
    FORGE_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
    done_ = flag != 0;
    if (done_ && on_complete) on_complete();
    return done_;
  }
  const char* operation() const override { return op_; }
  std::string description() const override {
    if (peer < 0) return Work::description();
    return fmt::format("{} {} rank {} (tag {})", op_, std::string_view(op_) == "send" ? "to" : "from", peer,
                       tag);
  }

  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> arrays;            // counts and displacements that MPI reads until the operation completes
  int peer = -1, tag = 0;             // point-to-point only
  std::function<void()> on_complete;  // runs once, when the operation is found complete

 private:
  const char* op_;
  std::shared_ptr<const std::string> label_;
  double timeout_s_;
  bool done_ = false;
};

// Keeps the timeout of blocking MPI calls, which cannot be polled: armed before the call and disarmed
// after it; if the deadline passes first it prints the one-line message and ends this process (mpirun then
// ends the job). It never calls MPI, so MPI_THREAD_FUNNELED suffices. One thread per process, made on
// first use and never joined (it outlives static destruction by design).
class Watchdog {
 public:
  static Watchdog& get() {
    static Watchdog* w = new Watchdog();
    return *w;
  }
  void arm(double timeout_s, std::string message) {
    if (timeout_s <= 0) return;
    std::lock_guard lock(mutex_);
    deadline_ =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(timeout_s));
    message_ = std::move(message);
    armed_ = true;
    wake_.notify_one();
  }
  void disarm() {
    std::lock_guard lock(mutex_);
    armed_ = false;
  }

 private:
  Watchdog() {
    std::thread([this] { run(); }).detach();
  }
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return armed_; });
      if (wake_.wait_until(lock, deadline_, [this] { return !armed_; })) continue;
      detail::exit_from_watchdog(message_);
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::chrono::steady_clock::time_point deadline_;
  std::string message_;
  bool armed_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, int world_rank, double timeout_s) : comm_(comm) {
    FORGE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    FORGE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    name_ = std::move(name);
    world_rank_ = world_rank;
    timeout_s_ = timeout_s;
    label_ = std::make_shared<const std::string>(detail::group_label(*this));
  }
  ~MpiCommunicator() override {
    if (running()) MPI_Comm_free(&comm_);  // MPI releases it once any pending operation completes
  }

  const char* backend() const override { return "mpi"; }

  Request all_reduce(void* buf, int64_t count, Type type, ReduceOp op) override {
    detail::check_count(*this, "all_reduce", count);
    detail::check_buffer(*this, "all_reduce", buf, count, "buffer");
    const int n = to_int("all_reduce", count, "count");
    auto work = start("all_reduce");
    FORGE_MPI_CHECK(
        MPI_Iallreduce(MPI_IN_PLACE, buf, n, datatype(type), reduction(type, op), comm_, &work->request));
    return {std::move(work), this};
  }

  void all_reduce_blocking(void* buf, int64_t count, Type type, ReduceOp op) override {
    detail::check_count(*this, "all_reduce", count);
    detail::check_buffer(*this, "all_reduce", buf, count, "buffer");
    const int n = to_int("all_reduce", count, "count");
    Watchdog::get().arm(timeout_s_, detail::timeout_message("collective all_reduce", *label_, timeout_s_));
    const int code = MPI_Allreduce(MPI_IN_PLACE, buf, n, datatype(type), reduction(type, op), comm_);
    Watchdog::get().disarm();
    FORGE_MPI_CHECK(code);
  }

  Request all_gather(const void* send, void* recv, int64_t count, Type type) override {
    check_pair("all_gather", send, recv, count, count * size_);
    const int n = to_int("all_gather", count, "count");
    const bool in_place =
        send == static_cast<char*>(recv) + rank_ * count * static_cast<int64_t>(type_size(type));
    auto work = start("all_gather");
    FORGE_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, datatype(type), recv, n, datatype(type),
                                   comm_, &work->request));
    return {std::move(work), this};
  }

  Request all_gatherv(const void* send, void* recv, std::span<const int64_t> counts, Type type) override {
    detail::check_per_rank(*this, "all_gatherv", counts, "counts");
    auto work = start("all_gatherv");
    std::vector<int>& a = work->arrays;  // [counts | displacements]
    a.resize(2 * static_cast<size_t>(size_));
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      a[r] = to_int("all_gatherv", counts[r], "count");
      a[size_ + r] = to_int("all_gatherv", total, "displacement");
      total += counts[r];
    }
    check_pair("all_gatherv", send, recv, counts[rank_], total);
    const bool in_place =
        send == static_cast<char*>(recv) + int64_t{a[size_ + rank_]} * static_cast<int64_t>(type_size(type));
    FORGE_MPI_CHECK(MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, a[rank_], datatype(type), recv, a.data(),
                                    a.data() + size_, datatype(type), comm_, &work->request));
    return {std::move(work), this};
  }

  Request reduce_scatter(const void* send, void* recv, int64_t count, Type type, ReduceOp op) override {
    check_pair("reduce_scatter", send, recv, count * size_, count);
    const int n = to_int("reduce_scatter", count, "count");
    const size_t bytes = static_cast<size_t>(count) * type_size(type);
    const bool in_place = count > 0 && recv == static_cast<const char*>(send) + rank_ * bytes;
    auto work = start("reduce_scatter");
    if (in_place) {
      // MPI's in-place form reads send and leaves this rank's result at its start: moved to its own block
      // once complete.
      void* buffer = const_cast<void*>(send);
      if (rank_ > 0) work->on_complete = [buffer, recv, bytes] { std::memmove(recv, buffer, bytes); };
      FORGE_MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buffer, n, datatype(type), reduction(type, op),
                                                comm_, &work->request));
    } else {
      FORGE_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, n, datatype(type), reduction(type, op), comm_,
                                                &work->request));
    }
    return {std::move(work), this};
  }

  Request all_to_all(const void* send, void* recv, int64_t count, Type type) override {
    check_pair("all_to_all", send, recv, count * size_, count * size_);
    const int n = to_int("all_to_all", count, "count");
    auto work = start("all_to_all");
    FORGE_MPI_CHECK(MPI_Ialltoall(send, n, datatype(type), recv, n, datatype(type), comm_, &work->request));
    return {std::move(work), this};
  }

  Request all_to_allv(const void* send, std::span<const int64_t> send_counts,
                      std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                      std::span<const int64_t> recv_displs, Type type) override {
    const char* op = "all_to_allv";
    detail::check_per_rank(*this, op, send_counts, "send_counts");
    detail::check_per_rank(*this, op, send_displs, "send_displs");
    detail::check_per_rank(*this, op, recv_counts, "recv_counts");
    detail::check_per_rank(*this, op, recv_displs, "recv_displs");
    auto work = start(op);
    std::vector<int>& a = work->arrays;  // [send counts | send displs | recv counts | recv displs]
    const size_t n = static_cast<size_t>(size_);
    a.resize(4 * n);
    int64_t send_extent = 0, recv_extent = 0;
    for (size_t r = 0; r < n; ++r) {
      a[r] = to_int(op, send_counts[r], "send count");
      a[n + r] = to_int(op, send_displs[r], "send displacement");
      a[2 * n + r] = to_int(op, recv_counts[r], "recv count");
      a[3 * n + r] = to_int(op, recv_displs[r], "recv displacement");
      send_extent = std::max(send_extent, send_displs[r] + send_counts[r]);
      recv_extent = std::max(recv_extent, recv_displs[r] + recv_counts[r]);
    }
    check_pair(op, send, recv, send_extent, recv_extent);
    FORGE_MPI_CHECK(MPI_Ialltoallv(send, a.data(), a.data() + n, datatype(type), recv, a.data() + 2 * n,
                                   a.data() + 3 * n, datatype(type), comm_, &work->request));
    return {std::move(work), this};
  }

  Request send(const void* buf, int64_t count, Type type, int peer, int tag) override {
    auto work = start_p2p("send", buf, count, peer, tag);
    FORGE_MPI_CHECK(
        MPI_Isend(buf, to_int("send", count, "count"), datatype(type), peer, tag, comm_, &work->request));
    return {std::move(work), this};
  }

  Request recv(void* buf, int64_t count, Type type, int peer, int tag) override {
    auto work = start_p2p("recv", buf, count, peer, tag);
    FORGE_MPI_CHECK(
        MPI_Irecv(buf, to_int("recv", count, "count"), datatype(type), peer, tag, comm_, &work->request));
    return {std::move(work), this};
  }

  Request broadcast(void* buf, int64_t count, Type type, int root) override {
    detail::check_rank(*this, "broadcast", root, "root");
    detail::check_count(*this, "broadcast", count);
    detail::check_buffer(*this, "broadcast", buf, count, "buffer");
    const int n = to_int("broadcast", count, "count");
    auto work = start("broadcast");
    FORGE_MPI_CHECK(MPI_Ibcast(buf, n, datatype(type), root, comm_, &work->request));
    return {std::move(work), this};
  }

  Request barrier() override { return barrier_named("barrier"); }

  // A barrier that timeout messages call `op`.
  Request barrier_named(const char* op) {
    auto work = start(op);
    FORGE_MPI_CHECK(MPI_Ibarrier(comm_, &work->request));
    return {std::move(work), this};
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    // MPI_Comm_split blocks without a timeout: first meet every rank in a barrier that has one, so a rank
    // that never calls split is reported instead of hanging the job.
    barrier_named("split").wait();
    MPI_Comm child = MPI_COMM_NULL;
    FORGE_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child));
    if (child == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(child, std::move(name), world_rank_, timeout_s_);
  }

  [[noreturn]] void abort(const std::string& message) override { detail::abort_job(message); }

 private:
  std::shared_ptr<MpiWork> start(const char* op) { return std::make_shared<MpiWork>(op, label_, timeout_s_); }

  std::shared_ptr<MpiWork> start_p2p(const char* op, const void* buf, int64_t count, int peer, int tag) {
    detail::check_count(*this, op, count);
    detail::check_buffer(*this, op, buf, count, "buffer");
    detail::check_rank(*this, op, peer, "peer");
    if (tag < 0) fail("comm: {} on {}: tag {} is negative", op, *label_, tag);
    auto work = start(op);
    work->peer = peer;
    work->tag = tag;
    return work;
  }

  void check_pair(const char* op, const void* send, const void* recv, int64_t send_count,
                  int64_t recv_count) {
    detail::check_count(*this, op, send_count);
    detail::check_buffer(*this, op, send, send_count, "send");
    detail::check_buffer(*this, op, recv, recv_count, "recv");
  }

  // MPI counts are ints: a larger message must be split by the caller rather than silently truncated.
  int to_int(const char* op, int64_t value, const char* what) const {
    if (value < 0) fail("comm: {} on {}: {} is negative ({})", op, *label_, what, value);
    if (value > INT_MAX)
      fail("comm: {} on {}: {} {} exceeds MPI's limit of {} elements per call; split the message", op,
           *label_, what, value, INT_MAX);
    return static_cast<int>(value);
  }

  MPI_Comm comm_;
  std::shared_ptr<const std::string> label_;
};

}  // namespace

namespace {

// Keeps one blocking phase (start-up, shutdown) to its timeout with the watchdog, for the scope's length.
class GuardedPhase {
 public:
  GuardedPhase(std::string_view phase, int rank, double timeout_s) {
    Watchdog::get().arm(timeout_s, detail::phase_timeout_message(phase, rank, timeout_s));
  }
  GuardedPhase(const GuardedPhase&) = delete;
  GuardedPhase& operator=(const GuardedPhase&) = delete;
  ~GuardedPhase() { Watchdog::get().disarm(); }
};

}  // namespace

std::unique_ptr<Communicator> init_world(double timeout_s) {
  MpiState& s = state();
  detail::die_with_launcher();  // before anything can stall: a killed job leaves no rank behind
  // MPI_Init (and MPI_Comm_dup below) wait for every rank of the job, without a timeout of their own.
  const GuardedPhase guard("start-up", detail::launcher_rank(), timeout_s);
  detail::stall_if_injected("before_init", detail::launcher_rank());
  int initialised = 0, provided = 0;
  FORGE_MPI_CHECK(MPI_Initialized(&initialised));
  if (!initialised) {
    // Open MPI's memory patcher hooks the process's munmap/madvise to keep its cache of RDMA registrations
    // right. forge keeps activations in the heap (core/tensor.cpp tunes malloc so that blocks freed every
    // micro-batch are reused, not returned to the kernel); under the patcher they were faulted in again and
    // zeroed by the kernel every micro-batch: 20% of a DeepSeek-V3 step's time on 2 ranks, every op 1.3-1.5x
    // slower than the same ranks run apart (found by the simulator's validation, docs/simulator.md). The
    // transports forge uses (shared memory, TCP; UCX brings its own hooks) do not need it. A user's own
    // OMPI_MCA_memory setting wins.
    setenv("OMPI_MCA_memory", "^patcher", /*overwrite=*/0);
    FORGE_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    s.initialised_here = true;
  } else {
    FORGE_MPI_CHECK(MPI_Query_thread(&provided));
  }
  if (provided < MPI_THREAD_FUNNELED)
    fail("comm: MPI provides thread level {}, forge needs MPI_THREAD_FUNNELED ({})", provided,
         MPI_THREAD_FUNNELED);
  FORGE_MPI_CHECK(MPI_Op_create(bf16_sum, /*commute=*/1, &s.bf16_ops[static_cast<size_t>(ReduceOp::sum)]));
  FORGE_MPI_CHECK(MPI_Op_create(bf16_select<true>, 1, &s.bf16_ops[static_cast<size_t>(ReduceOp::max)]));
  FORGE_MPI_CHECK(MPI_Op_create(bf16_select<false>, 1, &s.bf16_ops[static_cast<size_t>(ReduceOp::min)]));
  MPI_Comm comm = MPI_COMM_NULL;
  FORGE_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  FORGE_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));  // split children inherit it
  int world_rank = 0;
  FORGE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  s.running = true;
  s.world_rank = world_rank;
  return std::make_unique<MpiCommunicator>(comm, "world", world_rank, /*timeout_s=*/300);
}

void meet_before_finalize(Communicator& world) {
  if (running()) static_cast<MpiCommunicator&>(world).barrier_named("finalize").wait();
}

void finalize(double timeout_s) {
  MpiState& s = state();
  if (!s.running) return;
  // MPI_Finalize waits for every rank (OpenMPI's exit fence) without a timeout; the barrier before it has
  // one, but a rank can still stall between the two.
  // The injected stall is outside this rank's own guard, as a real one (a hung file system, a stuck thread)
  // would be: the other ranks' guards end the job, and mpirun then kills the stalled rank.
  detail::stall_if_injected("after_last_collective", s.world_rank);
  const GuardedPhase guard("shutdown", s.world_rank, timeout_s);
  for (MPI_Op& op : s.bf16_ops)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  s.running = false;
  if (s.initialised_here) MPI_Finalize();
  s.initialised_here = false;
}

bool running() { return state().running; }

void abort_world() {
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);  // MPI_Abort does not return; this only satisfies [[noreturn]]
}

}  // namespace forge::comm::mpi
