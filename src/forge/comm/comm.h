// comm: process groups and collectives behind one API with asynchronous handles.
//
// A Communicator is a group of ranks (the world, or one dimension of the parallel layout: tp, dp, ...).
// Every collective returns a Request at once; wait() blocks until it completes. Buffers must stay alive and
// untouched until then. Backends: "self" (one process, no MPI: collectives are copies), "mpi" (OpenMPI,
// host memory, non-blocking MPI collectives) and "nccl" (device memory, one CUDA stream per communicator,
// the unique id bootstrapped through an MPI communicator).
//
// A request that does not complete within the communicator's timeout aborts the whole job (MPI_Abort) with
// one line naming the group, the operation and the rank, instead of hanging: a peer that died or took a
// different code path is reported, not waited on forever.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "forge/core/dtype.h"

namespace forge::comm {

enum class Type : uint8_t { f32, f64, bf16, i32, i64, u8 };
enum class ReduceOp : uint8_t { sum, max, min };
size_t type_size(Type t);
// The message type of a tensor's elements (fp32, bf16 moved as its bits and summed in fp32 then rounded,
// int32, int64, uint8); fails naming any other dtype.
Type type_of(DType dtype);
const char* type_name(Type t);
const char* reduce_op_name(ReduceOp op);

// One in-flight operation (backend-specific).
class Work {
 public:
  virtual ~Work() = default;
  virtual bool test() = 0;                    // true once complete (drives progress; never blocks)
  virtual const char* operation() const = 0;  // "all_reduce", ...
  // What the timeout message calls it: "collective all_reduce", "send to rank 1 (tag 0)".
  virtual std::string description() const { return std::string("collective ") + operation(); }
};

// Handle of an asynchronous operation. A default-constructed Request is complete. Copies share the
// operation. The last handle of an operation that was never waited on completes it when destroyed (under
// the same timeout), since its buffers may not be released while the backend still uses them.
class Request {
 public:
  Request() = default;
  Request(std::shared_ptr<Work> work, class Communicator* comm) : work_(std::move(work)), comm_(comm) {}
  bool test();  // non-blocking; true once complete
  void wait();  // blocks until complete; aborts the job past the communicator's timeout
  bool pending() const { return work_ != nullptr; }
  // For backends: the operation behind the handle (null once complete), and dropping the handle of an
  // operation the backend has completed another way (Communicator::wait_on_stream).
  Work* work() const { return work_.get(); }
  void release() { work_.reset(); }

 private:
  friend void wait_all(std::span<Request> requests);
  std::shared_ptr<Work> work_;
  class Communicator* comm_ = nullptr;
};
// Waits for every request; each one's timeout counts from the call, not one after another.
void wait_all(std::span<Request> requests);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const char* backend() const = 0;  // "self", "mpi", "nccl"
  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_rank() const { return world_rank_; }     // this process's rank in the world (for messages)
  const std::string& name() const { return name_; }  // "world", "tp", "dp", ...

  // Seconds a request may take before the job is aborted (default 300; <= 0 waits forever).
  double timeout_seconds() const { return timeout_s_; }
  void set_timeout_seconds(double s) { timeout_s_ = s; }

  // In place: buf[count] on every rank becomes the reduction over ranks.
  virtual Request all_reduce(void* buf, int64_t count, Type type, ReduceOp op) = 0;
  // The same, synchronous: for the critical path (tensor parallelism), where nothing overlaps with it. The
  // MPI backend issues one blocking MPI_Allreduce (OpenMPI's non-blocking all-reduce runs 1.4-2.8x slower
  // on 1-16 MiB, bench/comm) and keeps the timeout with a watchdog thread that ends the process, and with
  // it the job, with the same one-line message. Other backends wait on all_reduce().
  virtual void all_reduce_blocking(void* buf, int64_t count, Type type, ReduceOp op) {
    all_reduce(buf, count, type, op).wait();
  }
  // Completion in the device's stream order, for device collectives on the critical path of device
  // computation (tensor parallelism), where a host wait would drain the device's queue of work: afterwards
  // everything queued on the stream the communicator was made to follow (make_nccl's producer_stream) runs
  // after the operation, and the host goes on at once. The request is then complete for every holder, and
  // its buffers may be released (the device's allocator reuses them in that stream's order). A watchdog keeps
  // the timeout: an operation still running past it ends the process with the usual one-line message.
  // Host-memory backends, and NCCL without a producer stream, wait() on the host.
  virtual void wait_on_stream(Request& request) { request.wait(); }
  // recv[size * count] = concatenation of every rank's send[count], in rank order. send may be this rank's
  // own block of recv (in place); otherwise send and recv of any operation must not overlap.
  virtual Request all_gather(const void* send, void* recv, int64_t count, Type type) = 0;
  // recv = concatenation of every rank's send[counts[rank]]; counts has size() entries.
  virtual Request all_gatherv(const void* send, void* recv, std::span<const int64_t> counts, Type type) = 0;
  // send[size * count]: rank r receives recv[count] = reduction over ranks of send[r*count .. (r+1)*count).
  // recv may be this rank's own block of send (in place); the rest of send is then undefined afterwards.
  virtual Request reduce_scatter(const void* send, void* recv, int64_t count, Type type, ReduceOp op) = 0;
  // send[size * count]: block j goes to rank j; recv[size * count]: block j came from rank j.
  virtual Request all_to_all(const void* send, void* recv, int64_t count, Type type) = 0;
  // Counts and displacements (in elements) per peer, size() entries each.
  virtual Request all_to_allv(const void* send, std::span<const int64_t> send_counts,
                              std::span<const int64_t> send_displs, void* recv,
                              std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                              Type type) = 0;
  virtual Request send(const void* buf, int64_t count, Type type, int peer, int tag = 0) = 0;
  virtual Request recv(void* buf, int64_t count, Type type, int peer, int tag = 0) = 0;
  virtual Request broadcast(void* buf, int64_t count, Type type, int root) = 0;
  virtual Request barrier() = 0;

  // Collective over this communicator: ranks with the same color form a new communicator, ordered by key
  // (then by rank). Every rank must call it; a rank with a negative color joins no group and gets nullptr.
  // The new communicator inherits this one's timeout.
  virtual std::unique_ptr<Communicator> split(int color, int key, std::string name) = 0;

  // Aborts every process of the job with one line "forge: error: <message>" (exit status 1).
  [[noreturn]] virtual void abort(const std::string& message) = 0;

 protected:
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  std::string name_ = "world";
  double timeout_s_ = 300;
};

// The world: MPI's when the process was started by a launcher (mpirun, srun: detected from its
// environment) or when force_mpi; otherwise a one-rank "self" communicator, and MPI is never initialised.
// Initialises MPI (MPI_THREAD_FUNNELED) on first use. finalize() at exit is collective: it meets every rank
// under the world's timeout, then shuts MPI down.
//
// Start-up and shutdown have timeouts too, kept by a watchdog thread, since MPI_Init and MPI_Finalize wait
// for every rank without one: a rank that never reaches MPI_Init, or stalls after its last collective,
// would hang the job forever. Past the timeout the process prints one line "forge: error: rank R: MPI
// start-up (shutdown) did not complete within N s (parallel.timeout_s / FORGE_COMM_TIMEOUT); ..." and exits
// with status 1, and mpirun ends the job. Start-up uses FORGE_COMM_TIMEOUT when set, else
// set_startup_timeout_seconds's value (default 300; <= 0 waits forever); shutdown the world's timeout.
Communicator& world(bool force_mpi = false);
bool launched_by_mpi();  // OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_NTASKS > 1, or PMIX_RANK set
void finalize();
// For a caller that reads its own setting before first calling world() (forge train: parallel.timeout_s).
void set_startup_timeout_seconds(double s);

// A one-rank communicator (no MPI): every collective is a copy.
std::unique_ptr<Communicator> make_self(std::string name = "self");

// NCCL over this process's CUDA device cuda_device: a collective over bootstrap (an MPI communicator, or
// self for one rank) through which rank 0 hands out the unique id. Buffers are device pointers; operations
// run on the communicator's own CUDA stream. Sends and receives posted one after another start together at
// the next test(), wait() or collective; NCCL matches them by order, so tags are ignored. Fails with a clear
// message where forge was built without NCCL or no CUDA device is present.
// producer_stream (a cudaStream_t, or null): the stream that writes the buffers (the CUDA kernels' stream).
// Each operation then first waits, on the device, for the work queued there so far, and wait_on_stream()
// makes the producer stream wait for the operation in turn; without it the communicator's stream is a
// blocking one, ordered only with the legacy default stream. Either way wait() returns once the operation is
// complete, so work issued afterwards sees its result.
std::unique_ptr<Communicator> make_nccl(Communicator& bootstrap, int cuda_device, std::string name = "world",
                                        void* producer_stream = nullptr);
bool nccl_usable();  // built with NCCL and at least one CUDA device is visible
// Replaces what make_nccl builds (null: NCCL again). The device emulation (train/device_emulation.h) installs
// communicators over emulated device memory here, so that the GPU paths of tensor and data parallelism run
// under mpirun on machines without GPUs. The factory gets make_nccl's bootstrap and name.
using DeviceCommunicatorFactory = std::unique_ptr<Communicator> (*)(Communicator& bootstrap,
                                                                    std::string name);
void override_device_communicators(DeviceCommunicatorFactory factory);

// Convenience, synchronous.
void all_reduce_sum(Communicator& c, float* buf, int64_t count);
void all_reduce_sum(Communicator& c, double* buf, int64_t count);
double all_reduce_sum(Communicator& c, double value);
double all_reduce_max(Communicator& c, double value);
// Every rank's string, in rank order, on every rank (error messages, small reports).
std::vector<std::string> all_gather_strings(Communicator& c, const std::string& mine);

}  // namespace forge::comm
