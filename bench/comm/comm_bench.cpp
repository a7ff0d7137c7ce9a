// Collective bandwidth under mpirun (bench/comm/run.sh): all_reduce, all_gather, reduce_scatter, all_to_all,
// all_to_allv with uneven splits (as the expert-parallel token dispatch makes them), broadcast and a
// send/recv ping-pong, for message sizes from 4 KiB to 64 MiB in powers of 4, on the mpi or nccl backend.
// Conventions of nccl-tests:
//   size   bytes per rank: the buffer (all_reduce, broadcast, sendrecv), the gathered output (all_gather),
//          the input to scatter (reduce_scatter) or to exchange (all_to_all, all_to_allv: what this rank
//          sends, its own block included); f32 elements
//   time   mean per operation of the slowest rank (ping-pong: half a round trip between ranks 0 and 1)
//   algbw  size / time
//   busbw  algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all, all_to_allv),
//          1 (broadcast, sendrecv): the rate each rank's link must sustain, comparable across rank counts
// all_to_allv's splits: rank i sends rank j a share of its size proportional to 1 + 0.75 sin(3 + 7i + 5j),
// so the blocks differ by up to 7x (a routing's hot and cold experts) and every rank receives a different
// total, as a MoE layer's dispatch (and, reversed, its combine) does.
#define OMPI_SKIP_MPICXX 1  // the C API only (OpenMPI's C++ bindings are not linked)
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/comm/nccl/device_memory.h"
#include "forge/core/error.h"

namespace forge::comm {
namespace {

struct Options {
  std::string backend = "mpi";
  int64_t min_bytes = int64_t{4} << 10, max_bytes = int64_t{64} << 20;
  int iters = 0;  // 0: chosen per size
  int warmup = 2;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("forge_comm_bench: {} needs a value", arg);
      return argv[++i];
    };
    if (arg == "--backend") {
      o.backend = next();
    } else if (arg == "--min-bytes") {
      o.min_bytes = std::stoll(next());
    } else if (arg == "--max-bytes") {
      o.max_bytes = std::stoll(next());
    } else if (arg == "--iters") {
      o.iters = std::stoi(next());
    } else if (arg == "--warmup") {
      o.warmup = std::stoi(next());
    } else if (arg == "--help" || arg == "-h") {
      std::printf(
          "usage: mpirun -np N forge_comm_bench [--backend mpi|nccl] [--min-bytes 4096] [--max-bytes "
          "67108864]\n"
          "                                     [--iters N (default: by size)] [--warmup 2]\n");
      std::exit(0);
    } else {
      fail("forge_comm_bench: unknown argument '{}' (see --help)", arg);
    }
  }
  if (o.backend != "mpi" && o.backend != "nccl")
    fail("forge_comm_bench: --backend is mpi or nccl, not '{}'", o.backend);
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes)
    fail("forge_comm_bench: need 4 <= --min-bytes <= --max-bytes");
  return o;
}

// Host buffers (mpi) or device buffers (nccl), filled with ones so that no page is first touched while timed.
class Buffer {
 public:
  Buffer(bool device, int64_t floats) : device_(device), bytes_(floats * 4) {
    std::vector<float> ones(static_cast<size_t>(floats), 1.0f);
    if (device_) {
      ptr_ = nccl::device_alloc(bytes_);
      nccl::copy_to_device(ptr_, ones.data(), bytes_);
    } else {
      host_ = std::move(ones);
      ptr_ = host_.data();
    }
  }
  ~Buffer() {
    if (device_) nccl::device_free(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() { return ptr_; }

 private:
  bool device_;
  int64_t bytes_;
  std::vector<float> host_;
  void* ptr_ = nullptr;
};

int iterations_for(const Options& o, int64_t bytes) {
  if (o.iters > 0) return o.iters;
  // About 256 MiB moved per point, between 5 and 200 iterations.
  return static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 5, 200));
}

std::string human_bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

int run(int argc, char** argv) {
  Communicator& world = comm::world(/*force_mpi=*/true);
  const Options o = parse(argc, argv);
  const bool device = o.backend == "nccl";
  std::unique_ptr<Communicator> nccl;
  if (device) {
    const int devices = nccl::device_count();
    if (-all_reduce_max(world, -static_cast<double>(devices)) < 1)
      fail("forge_comm_bench: --backend nccl needs NCCL and a CUDA device on every rank");
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    const int local_rank = local ? std::atoi(local) : world.rank();
    nccl = make_nccl(world, local_rank % devices, "bench");
  }
  Communicator& c = device ? *nccl : world;
  const int n = c.size(), me = c.rank();

  if (me == 0) {
    std::printf("# forge_comm_bench: backend %s, %d ranks, f32; time = slowest rank's mean per operation\n",
                c.backend(), n);
    std::printf(
        "# busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all(v)), "
        "1 (broadcast, sendrecv)\n");
    std::printf("# peer = the same operation as one blocking MPI call (mpi backend); vs_peer = peer time / forge time\n");
    std::printf("%-15s %10s %6s %12s %12s %12s %12s %8s\n", "collective", "size", "iters", "time_us", "algbw_GB/s",
                "busbw_GB/s", "peer_us", "vs_peer");
  }

  const double ring = static_cast<double>(n - 1) / n;
  struct Case {
    const char* name;
    double bus_factor;
  };
  const Case cases[] = {{"all_reduce", 2 * ring}, {"all_gather", ring},  {"reduce_scatter", ring},
                        {"all_to_all", ring},     {"all_to_allv", ring}, {"broadcast", 1.0},
                        {"sendrecv", 1.0}};
  // all_to_allv: floats rank `from` sends rank `to` out of `total` (the shares of each sender sum to total).
  auto uneven = [n](int from, int to, int64_t total) {
    auto weight = [](int i, int j) { return 1.0 + 0.75 * std::sin(3.0 + 7.0 * i + 5.0 * j); };
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += weight(from, j);
    std::vector<int64_t> share(static_cast<size_t>(n));
    int64_t given = 0;
    for (int j = 0; j < n; ++j)
      given += share[static_cast<size_t>(j)] =
          static_cast<int64_t>(static_cast<double>(total) * weight(from, j) / sum);
    share[static_cast<size_t>(n - 1)] += total - given;
    return share[static_cast<size_t>(to)];
  };
  for (const Case& k : cases) {
    const std::string name = k.name;
    if (name == "sendrecv" && n < 2) continue;
    for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 4) {
      const int64_t floats = bytes / 4;
      const int64_t per_rank = std::max<int64_t>(floats / n, 1);  // all_gather / reduce_scatter / all_to_all
      // Buffers per collective: a (input or in-place buffer) and b (output).
      int64_t a_floats = floats, b_floats = 0;
      if (name == "all_gather") a_floats = per_rank, b_floats = per_rank * n;
      if (name == "reduce_scatter") a_floats = per_rank * n, b_floats = per_rank;
      if (name == "all_to_all") a_floats = per_rank * n, b_floats = per_rank * n;
      std::vector<int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
      std::vector<int> isc(n), isd(n), irc(n), ird(n);  // the same as MPI's ints, for the peer
      if (name == "all_to_allv") {
        int64_t out = 0, in = 0;
        for (int j = 0; j < n; ++j) {
          send_counts[j] = uneven(me, j, floats), send_displs[j] = out, out += send_counts[j];
          recv_counts[j] = uneven(j, me, floats), recv_displs[j] = in, in += recv_counts[j];
          isc[j] = static_cast<int>(send_counts[j]), isd[j] = static_cast<int>(send_displs[j]);
          irc[j] = static_cast<int>(recv_counts[j]), ird[j] = static_cast<int>(recv_displs[j]);
        }
        a_floats = std::max<int64_t>(out, 1), b_floats = std::max<int64_t>(in, 1);
      }
      Buffer a(device, a_floats), b(device, b_floats);

      std::function<void()> op;
      if (name == "all_reduce") {
        op = [&] { c.all_reduce(a.get(), floats, Type::f32, ReduceOp::sum).wait(); };
      } else if (name == "all_gather") {
        op = [&] { c.all_gather(a.get(), b.get(), per_rank, Type::f32).wait(); };
      } else if (name == "reduce_scatter") {
        op = [&] { c.reduce_scatter(a.get(), b.get(), per_rank, Type::f32, ReduceOp::sum).wait(); };
      } else if (name == "all_to_all") {
        op = [&] { c.all_to_all(a.get(), b.get(), per_rank, Type::f32).wait(); };
      } else if (name == "all_to_allv") {
        op = [&] {
          c.all_to_allv(a.get(), send_counts, send_displs, b.get(), recv_counts, recv_displs, Type::f32)
              .wait();
        };
      } else if (name == "broadcast") {
        op = [&] { c.broadcast(a.get(), floats, Type::f32, 0).wait(); };
      } else {  // ping-pong between ranks 0 and 1; one operation = one way
        op = [&] {
          if (me == 0) {
            c.send(a.get(), floats, Type::f32, 1).wait();
            c.recv(a.get(), floats, Type::f32, 1).wait();
          } else if (me == 1) {
            c.recv(a.get(), floats, Type::f32, 0).wait();
            c.send(a.get(), floats, Type::f32, 0).wait();
          }
        };
      }

      // The peer: the same operation as one blocking MPI call on MPI_COMM_WORLD (what an application
      // calling MPI directly gets), timed in the same run. Host buffers only.
      std::function<void()> peer;
      if (!device) {
        MPI_Comm w = MPI_COMM_WORLD;
        const int cnt = static_cast<int>(floats), pr = static_cast<int>(per_rank);
        if (name == "all_reduce") {
          peer = [&, w, cnt] { MPI_Allreduce(MPI_IN_PLACE, a.get(), cnt, MPI_FLOAT, MPI_SUM, w); };
        } else if (name == "all_gather") {
          peer = [&, w, pr] { MPI_Allgather(a.get(), pr, MPI_FLOAT, b.get(), pr, MPI_FLOAT, w); };
        } else if (name == "reduce_scatter") {
          peer = [&, w, pr] { MPI_Reduce_scatter_block(a.get(), b.get(), pr, MPI_FLOAT, MPI_SUM, w); };
        } else if (name == "all_to_all") {
          peer = [&, w, pr] { MPI_Alltoall(a.get(), pr, MPI_FLOAT, b.get(), pr, MPI_FLOAT, w); };
        } else if (name == "all_to_allv") {
          peer = [&, w] {
            MPI_Alltoallv(a.get(), isc.data(), isd.data(), MPI_FLOAT, b.get(), irc.data(), ird.data(),
                          MPI_FLOAT, w);
          };
        } else if (name == "broadcast") {
          peer = [&, w, cnt] { MPI_Bcast(a.get(), cnt, MPI_FLOAT, 0, w); };
        } else {
          peer = [&, w, cnt] {
            if (me == 0) {
              MPI_Send(a.get(), cnt, MPI_FLOAT, 1, 0, w);
              MPI_Recv(a.get(), cnt, MPI_FLOAT, 1, 0, w, MPI_STATUS_IGNORE);
            } else if (me == 1) {
              MPI_Recv(a.get(), cnt, MPI_FLOAT, 0, 0, w, MPI_STATUS_IGNORE);
              MPI_Send(a.get(), cnt, MPI_FLOAT, 0, 0, w);
            }
          };
        }
      }
      const int iters = iterations_for(o, bytes);
      auto time = [&](const std::function<void()>& f) {
        for (int i = 0; i < o.warmup; ++i) f();
        c.barrier().wait();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) f();
        double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
        if (name == "sendrecv") t /= 2;  // a round trip is two one-way messages
        return all_reduce_max(world, t);
      };
      const double seconds = time(op);
      const double peer_seconds = peer ? time(peer) : 0;
      const int64_t size = name == "all_gather" || name == "reduce_scatter" || name == "all_to_all"
                               ? per_rank * n * 4
                               : floats * 4;
      const double algbw = static_cast<double>(size) / seconds / 1e9;
      if (me == 0)
        std::printf("%-15s %10s %6d %12.1f %12.3f %12.3f %12.1f %8.2f\n", k.name, human_bytes(size).c_str(), iters,
                    seconds * 1e6, algbw, algbw * k.bus_factor, peer_seconds * 1e6,
                    peer ? peer_seconds / seconds : 0.0);
    }
  }
  std::fflush(stdout);
  nccl.reset();
  finalize();
  return 0;
}

}  // namespace
}  // namespace forge::comm

int main(int argc, char** argv) {
  try {
    return forge::comm::run(argc, argv);
  } catch (const forge::Error& e) {
    forge::comm::world().abort(e.what());  // one line, and the other ranks do not wait for this one
  }
}
