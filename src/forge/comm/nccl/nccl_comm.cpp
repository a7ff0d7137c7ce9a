// The NCCL backend: device buffers, one CUDA stream per communicator, and a CUDA event per request (test()
// queries it). Point-to-point operations wait on the host until the next test(), wait() or collective, and
// then start together in one NCCL group: NCCL runs one operation after another on a stream, so a receive
// posted before its matching send (a ring of sends and receives, as MPI allows) would otherwise deadlock.
// Compiled only where CMake found nccl.h, libnccl and the CUDA runtime (FORGE_HAVE_NCCL); elsewhere
// nccl_unavailable.cpp answers instead.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/comm/comm_internal.h"
#include "forge/comm/nccl/device_memory.h"
#include "forge/core/error.h"

namespace forge::comm::nccl {
namespace {

std::string_view function_name(std::string_view call) { return call.substr(0, call.find('(')); }

[[noreturn]] void fail_cuda(std::string_view call, cudaError_t code, const char* file, int line) {
  fail("{}:{}: {} failed: {}", file, line, function_name(call), cudaGetErrorString(code));
}

[[noreturn]] void fail_nccl(std::string_view call, ncclResult_t code, const char* file, int line) {
  const char* detail = ncclGetLastError(nullptr);
  fail("{}:{}: {} failed: {}{}{}", file, line, function_name(call), ncclGetErrorString(code),
       detail && *detail ? ": " : "", detail ? detail : "");
}

}  // namespace
}  // namespace forge::comm::nccl

#define FORGE_CUDA_CHECK(call)                                                     \
  do {                                                                             \
    const cudaError_t forge_cuda_code_ = (call);                                   \
    if (forge_cuda_code_ != cudaSuccess)                                           \
      ::forge::comm::nccl::fail_cuda(#call, forge_cuda_code_, __FILE__, __LINE__); \
  } while (0)

#define FORGE_NCCL_CHECK(call)                                                     \
  do {                                                                             \
    const ncclResult_t forge_nccl_code_ = (call);                                  \
    if (forge_nccl_code_ != ncclSuccess)                                           \
      ::forge::comm::nccl::fail_nccl(#call, forge_nccl_code_, __FILE__, __LINE__); \
  } while (0)

namespace forge::comm::nccl {
namespace {

ncclDataType_t datatype(Type t) {
  switch (t) {
    case Type::f32:
      return ncclFloat32;
    case Type::f64:
      return ncclFloat64;
    case Type::bf16:
      return ncclBfloat16;
    case Type::i32:
      return ncclInt32;
    case Type::i64:
      return ncclInt64;
    case Type::u8:
      return ncclUint8;
  }
  fail("comm: unknown element type {}", static_cast<int>(t));
}

ncclRedOp_t reduction(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  fail("comm: unknown reduction {}", static_cast<int>(op));
}

const char* offset(const void* base, int64_t elements, Type type) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(type_size(type));
}
char* offset(void* base, int64_t elements, Type type) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(type_size(type));
}

// A CUDA event shared by the requests of one launch (a group of point-to-point operations shares one).
using Event = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

Event record_event(cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  FORGE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  Event shared(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
  FORGE_CUDA_CHECK(cudaEventRecord(event, stream));
  return shared;
}

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  // owner: the communicator that has yet to launch this point-to-point operation (null once launched).
  NcclWork(const char* op, ncclComm_t comm, std::shared_ptr<const std::string> label, double timeout_s,
           int peer, NcclCommunicator* owner, Event event)
      : op_(op),
        comm_(comm),
        label_(std::move(label)),
        timeout_s_(timeout_s),
        peer_(peer),
        owner_(owner),
        event_(std::move(event)) {}
  ~NcclWork() override {
    if (!done_) detail::complete_in_destructor(*this, *label_, timeout_s_);
  }

  bool test() override;
  void launched(Event event) {
    event_ = std::move(event);
    owner_ = nullptr;
  }
  // Completes this request in `stream`'s order instead of on the host (Communicator::wait_on_stream): the
  // stream waits for the operation's event, which is returned for the watchdog. Call after test() said
  // "not yet" (so the operation has been launched).
  Event ordered_on(cudaStream_t stream) {
    FORGE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_.get(), 0));
    done_ = true;
    return event_;
  }
  const char* operation() const override { return op_; }
  std::string description() const override {
    if (peer_ < 0) return Work::description();
    return fmt::format("{} {} rank {}", op_, std::string_view(op_) == "send" ? "to" : "from", peer_);
  }

 private:
  const char* op_;
  ncclComm_t comm_;
  std::shared_ptr<const std::string> label_;
  double timeout_s_;
  int peer_;
  NcclCommunicator* owner_;
  Event event_;
  bool done_ = false;
};

// Keeps the timeout of operations completed in stream order (wait_on_stream), which no host thread waits
// for: a thread per communicator, started on first use, looks at the oldest such operation every 50 ms.
// Past the timeout, or on an asynchronous NCCL error (a peer or the network failed), it prints the one-line
// message and ends the process (mpirun then ends the job); it never calls MPI, so MPI_THREAD_FUNNELED still
// suffices. Operations complete in order on the communicator's one stream, so the oldest is the one to watch.
class StreamWatchdog {
 public:
  StreamWatchdog(ncclComm_t comm, int device, std::shared_ptr<const std::string> label)
      : comm_(comm), device_(device), label_(std::move(label)) {}
  ~StreamWatchdog() { stop(); }

  // timeout_s <= 0: waits forever (an asynchronous error still ends the process).
  void watch(Event event, std::string what, double timeout_s) {
    std::lock_guard lock(mutex_);
    watched_.push_back({std::move(event), std::move(what), std::chrono::steady_clock::now(), timeout_s});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  // Joins the thread (before the communicator goes): what is still watched then is the destructor's to wait for.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Watched {
    Event event;
    std::string what;
    std::chrono::steady_clock::time_point since;
    double timeout_s;
  };

  void run() {
    cudaSetDevice(device_);  // event queries are the device's
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(50), [this] { return stopping_; })) {
      while (!watched_.empty() && cudaEventQuery(watched_.front().event.get()) == cudaSuccess) watched_.pop_front();
      if (watched_.empty()) continue;
      const Watched& oldest = watched_.front();
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
        detail::exit_from_watchdog(fmt::format("{} on {} failed: {}: {}", oldest.what, *label_, ncclGetErrorString(async),
                                ncclGetLastError(comm_)));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - oldest.since).count();
      if (oldest.timeout_s > 0 && waited > oldest.timeout_s)
        detail::exit_from_watchdog(detail::timeout_message(oldest.what, *label_, oldest.timeout_s));
    }
  }

  ncclComm_t comm_;
  int device_;
  std::shared_ptr<const std::string> label_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Watched> watched_;
  std::thread thread_;
  bool stopping_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, std::string name, int world_rank, double timeout_s,
                   cudaStream_t producer)
      : comm_(comm), device_(device), producer_(producer) {
    FORGE_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    FORGE_NCCL_CHECK(ncclCommCount(comm_, &size_));
    name_ = std::move(name);
    world_rank_ = world_rank;
    timeout_s_ = timeout_s;
    label_ = std::make_shared<const std::string>(detail::group_label(*this));
    watchdog_ = std::make_unique<StreamWatchdog>(comm_, device_, label_);
    FORGE_CUDA_CHECK(cudaSetDevice(device_));
    // A blocking stream: it waits for work queued before on the default stream (where the caller wrote the
    // buffers) and the default stream waits for it. An explicit event handoff with the CUDA kernel layer's
    // streams would let computation overlap communication.
    FORGE_CUDA_CHECK(cudaStreamCreate(&stream_));
    FORGE_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    FORGE_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(float), stream_));
  }
  ~NcclCommunicator() override {
    // Errors are ignored: a destructor cannot report them, and the process is usually ending.
    try {
      launch_point_to_point();
    } catch (const std::exception&) {
    }
    watchdog_->stop();
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommFinalize(comm_);
    ncclCommDestroy(comm_);
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  const char* backend() const override { return "nccl"; }

  Request all_reduce(void* buf, int64_t count, Type type, ReduceOp op) override {
    detail::check_count(*this, "all_reduce", count);
    detail::check_buffer(*this, "all_reduce", buf, count, "buffer");
    if (count == 0) return {};
    return enqueue("all_reduce", [&] {
      FORGE_NCCL_CHECK(
          ncclAllReduce(buf, buf, static_cast<size_t>(count), datatype(type), reduction(op), comm_, stream_));
    });
  }

  void wait_on_stream(Request& request) override {
    auto* work = dynamic_cast<NcclWork*>(request.work());
    if (work == nullptr || producer_ == nullptr) {
      request.wait();
      return;
    }
    // test() launches a pending group of sends and receives and reports asynchronous errors; an operation
    // already complete needs no ordering.
    if (!work->test()) {
      FORGE_CUDA_CHECK(cudaSetDevice(device_));
      watchdog_->watch(work->ordered_on(producer_), work->description(), timeout_s_);
    }
    request.release();
  }

  Request all_gather(const void* send, void* recv, int64_t count, Type type) override {
    check_pair("all_gather", send, recv, count, count * size_);
    if (count == 0) return {};
    return enqueue(
        "all_gather", [&] {  // in place (send is this rank's block of recv) is NCCL's in-place form
          FORGE_NCCL_CHECK(
              ncclAllGather(send, recv, static_cast<size_t>(count), datatype(type), comm_, stream_));
        });
  }

  Request all_gatherv(const void* send, void* recv, std::span<const int64_t> counts, Type type) override {
    detail::check_per_rank(*this, "all_gatherv", counts, "counts");
    std::vector<int64_t> displs(counts.size());
    int64_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) displs[r] = std::exchange(total, total + counts[r]);
    check_pair("all_gatherv", send, recv, counts[rank_], total);
    if (total == 0) return {};
    return enqueue("all_gatherv", [&] {
      // Grouped sends and receives; this rank's own block is a device copy (none when in place).
      copy_own_block(offset(recv, displs[rank_], type), send, counts[rank_], type);
      FORGE_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        if (counts[rank_] > 0)
          FORGE_NCCL_CHECK(
              ncclSend(send, static_cast<size_t>(counts[rank_]), datatype(type), p, comm_, stream_));
        if (counts[p] > 0)
          FORGE_NCCL_CHECK(ncclRecv(offset(recv, displs[p], type), static_cast<size_t>(counts[p]),
                                    datatype(type), p, comm_, stream_));
      }
      FORGE_NCCL_CHECK(ncclGroupEnd());
    });
  }

  Request reduce_scatter(const void* send, void* recv, int64_t count, Type type, ReduceOp op) override {
    check_pair("reduce_scatter", send, recv, count * size_, count);
    if (count == 0) return {};
    return enqueue("reduce_scatter", [&] {
      FORGE_NCCL_CHECK(ncclReduceScatter(send, recv, static_cast<size_t>(count), datatype(type),
                                         reduction(op), comm_, stream_));
    });
  }

  Request all_to_all(const void* send, void* recv, int64_t count, Type type) override {
    check_pair("all_to_all", send, recv, count * size_, count * size_);
    if (count == 0) return {};
    return enqueue("all_to_all", [&] {
      copy_own_block(offset(recv, rank_ * count, type), offset(send, rank_ * count, type), count, type);
      FORGE_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        FORGE_NCCL_CHECK(ncclSend(offset(send, p * count, type), static_cast<size_t>(count), datatype(type),
                                  p, comm_, stream_));
        FORGE_NCCL_CHECK(ncclRecv(offset(recv, p * count, type), static_cast<size_t>(count), datatype(type),
                                  p, comm_, stream_));
      }
      FORGE_NCCL_CHECK(ncclGroupEnd());
    });
  }

  Request all_to_allv(const void* send, std::span<const int64_t> send_counts,
                      std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                      std::span<const int64_t> recv_displs, Type type) override {
    const char* op = "all_to_allv";
    detail::check_per_rank(*this, op, send_counts, "send_counts");
    detail::check_per_rank(*this, op, send_displs, "send_displs");
    detail::check_per_rank(*this, op, recv_counts, "recv_counts");
    detail::check_per_rank(*this, op, recv_displs, "recv_displs");
    if (send_counts[rank_] != recv_counts[rank_])
      fail("comm: all_to_allv on {}: this rank sends itself {} elements but expects {}", *label_,
           send_counts[rank_], recv_counts[rank_]);
    return enqueue(op, [&] {
      copy_own_block(offset(recv, recv_displs[rank_], type), offset(send, send_displs[rank_], type),
                     send_counts[rank_], type);
      FORGE_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        if (send_counts[p] > 0)
          FORGE_NCCL_CHECK(ncclSend(offset(send, send_displs[p], type), static_cast<size_t>(send_counts[p]),
                                    datatype(type), p, comm_, stream_));
        if (recv_counts[p] > 0)
          FORGE_NCCL_CHECK(ncclRecv(offset(recv, recv_displs[p], type), static_cast<size_t>(recv_counts[p]),
                                    datatype(type), p, comm_, stream_));
      }
      FORGE_NCCL_CHECK(ncclGroupEnd());
    });
  }

  Request send(const void* buf, int64_t count, Type type, int peer, int tag) override {
    return post_point_to_point("send", const_cast<void*>(buf), count, type, peer);
  }

  Request recv(void* buf, int64_t count, Type type, int peer, int tag) override {
    return post_point_to_point("recv", buf, count, type, peer);
  }

  Request broadcast(void* buf, int64_t count, Type type, int root) override {
    detail::check_rank(*this, "broadcast", root, "root");
    detail::check_count(*this, "broadcast", count);
    detail::check_buffer(*this, "broadcast", buf, count, "buffer");
    if (count == 0) return {};
    return enqueue("broadcast", [&] {
      FORGE_NCCL_CHECK(
          ncclBroadcast(buf, buf, static_cast<size_t>(count), datatype(type), root, comm_, stream_));
    });
  }

  Request barrier() override {
    return enqueue("barrier", [&] {
      FORGE_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    });
  }

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    // ncclCommSplit blocks without a timeout: meet every rank first in an operation that has one.
    enqueue("split", [&] {
      FORGE_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    }).wait();
    ncclComm_t child = nullptr;
    FORGE_NCCL_CHECK(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr));
    if (child == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(child, device_, std::move(name), world_rank_, timeout_s_, producer_);
  }

  [[noreturn]] void abort(const std::string& message) override {
    ncclCommAbort(comm_);  // unblocks NCCL's kernels and proxy threads so that the process can go
    detail::abort_job(message);
  }

  // Starts the posted point-to-point operations, all in one NCCL group.
  void launch_point_to_point() {
    if (posted_.empty()) return;
    std::vector<Posted> batch;
    batch.swap(posted_);
    FORGE_CUDA_CHECK(cudaSetDevice(device_));
    wait_for_producer();
    FORGE_NCCL_CHECK(ncclGroupStart());
    for (const Posted& p : batch) {
      if (p.send)
        FORGE_NCCL_CHECK(ncclSend(p.buf, p.count, p.type, p.peer, comm_, stream_));
      else
        FORGE_NCCL_CHECK(ncclRecv(p.buf, p.count, p.type, p.peer, comm_, stream_));
    }
    FORGE_NCCL_CHECK(ncclGroupEnd());
    const Event event = record_event(stream_);
    for (const Posted& p : batch) p.work->launched(event);
  }

 private:
  struct Posted {
    bool send;
    void* buf;
    size_t count;
    ncclDataType_t type;
    int peer;
    std::shared_ptr<NcclWork> work;
  };

  // The communicator's stream waits (on the device) for the work queued so far on the producer stream.
  void wait_for_producer() {
    if (!producer_) return;
    cudaEvent_t event = nullptr;
    FORGE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    FORGE_CUDA_CHECK(cudaEventRecord(event, producer_));
    FORGE_CUDA_CHECK(cudaStreamWaitEvent(stream_, event, 0));
    FORGE_CUDA_CHECK(cudaEventDestroy(event));  // released once the wait has happened
  }

  template <typename Enqueue>
  Request enqueue(const char* op, Enqueue&& issue) {
    launch_point_to_point();  // operations start in the order they were posted
    FORGE_CUDA_CHECK(cudaSetDevice(device_));
    wait_for_producer();
    issue();
    return {std::make_shared<NcclWork>(op, comm_, label_, timeout_s_, -1, nullptr, record_event(stream_)),
            this};
  }

  Request post_point_to_point(const char* op, void* buf, int64_t count, Type type, int peer) {
    check_p2p(op, buf, count, peer);
    if (count == 0) return {};
    auto work = std::make_shared<NcclWork>(op, comm_, label_, timeout_s_, peer, this, nullptr);
    posted_.push_back(
        {std::string_view(op) == "send", buf, static_cast<size_t>(count), datatype(type), peer, work});
    return {std::move(work), this};
  }

  void copy_own_block(void* dst, const void* src, int64_t count, Type type) {
    if (count > 0 && dst != src)
      FORGE_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * type_size(type),
                                       cudaMemcpyDeviceToDevice, stream_));
  }

  void check_pair(const char* op, const void* send, const void* recv, int64_t send_count,
                  int64_t recv_count) {
    detail::check_count(*this, op, send_count);
    detail::check_buffer(*this, op, send, send_count, "send");
    detail::check_buffer(*this, op, recv, recv_count, "recv");
  }

  void check_p2p(const char* op, const void* buf, int64_t count, int peer) {
    detail::check_count(*this, op, count);
    detail::check_buffer(*this, op, buf, count, "buffer");
    detail::check_rank(*this, op, peer, "peer");
  }

  ncclComm_t comm_;
  int device_;
  cudaStream_t producer_ = nullptr;  // make_nccl's producer_stream
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;  // the barrier's one-element all-reduce
  std::shared_ptr<const std::string> label_;
  std::vector<Posted> posted_;  // point-to-point operations not launched yet
  std::unique_ptr<StreamWatchdog> watchdog_;
};

bool NcclWork::test() {
  if (done_) return true;
  if (owner_) owner_->launch_point_to_point();  // this request's group starts now
  const cudaError_t status = cudaEventQuery(event_.get());
  if (status == cudaSuccess) return done_ = true;
  if (status != cudaErrorNotReady) FORGE_CUDA_CHECK(status);
  // A failed peer or network shows up as an asynchronous error, never as completion: report it now.
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
      async != ncclInProgress) {
    const std::string message = fmt::format("{} on {} failed: {}: {}", description(), *label_,
                                            ncclGetErrorString(async), ncclGetLastError(comm_));
    ncclCommAbort(comm_);
    detail::abort_job(message);
  }
  return false;
}

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky error and report none
    return 0;
  }
  return count;
}

void* device_alloc(int64_t bytes) {
  void* ptr = nullptr;
  if (bytes > 0) FORGE_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
  return ptr;
}

void device_free(void* ptr) {
  if (ptr) FORGE_CUDA_CHECK(cudaFree(ptr));
}

void copy_to_device(void* device_dst, const void* host_src, int64_t bytes) {
  if (bytes > 0)
    FORGE_CUDA_CHECK(cudaMemcpy(device_dst, host_src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
}

void copy_to_host(void* host_dst, const void* device_src, int64_t bytes) {
  if (bytes > 0)
    FORGE_CUDA_CHECK(cudaMemcpy(host_dst, device_src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
}

}  // namespace forge::comm::nccl

namespace forge::comm {

bool nccl_usable() { return nccl::device_count() > 0; }

std::unique_ptr<Communicator> detail::make_nccl_backend(Communicator& bootstrap, int cuda_device, std::string name,
                                                        void* producer_stream) {
  const int devices = nccl::device_count();
  if (devices == 0) fail("make_nccl: no CUDA device is visible to world rank {}", bootstrap.world_rank());
  if (cuda_device < 0 || cuda_device >= devices)
    fail("make_nccl: cuda_device {} is out of range: world rank {} sees {} device(s)", cuda_device,
         bootstrap.world_rank(), devices);
  FORGE_CUDA_CHECK(cudaSetDevice(cuda_device));
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) FORGE_NCCL_CHECK(ncclGetUniqueId(&id));
  bootstrap.broadcast(&id, sizeof(id), Type::u8, 0).wait();
  ncclComm_t comm = nullptr;
  FORGE_NCCL_CHECK(ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()));
  return std::make_unique<nccl::NcclCommunicator>(comm, cuda_device, std::move(name), bootstrap.world_rank(),
                                                  bootstrap.timeout_seconds(),
                                                  static_cast<cudaStream_t>(producer_stream));
}

}  // namespace forge::comm
