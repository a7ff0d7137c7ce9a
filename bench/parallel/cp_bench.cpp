// Context parallelism's attention, measured (bench/parallel/run_cp.sh), under mpirun -np CP.
//
// One causal attention layer (GQA) over a long sequence, forward and backward:
//   1. one rank: rank 0 runs the whole sequence while the other ranks wait (the same cores per rank);
//   2. context-parallel, ring (p2p): every rank runs its two chunks (parallel/context_parallel.h), keys and
//      values passed around the ring while the blocks compute; the time each rank spends blocked on the
//      transfers is measured inside the same calls (ContextAttentionStats);
//   3. context-parallel, all-to-all (Ulysses), when the heads divide by cp: its exchanges are blocking, so
//      all of their time is exposed.
// Beside the ring's measured time, two things computed from costs measured in the same run:
//   - the transfers alone: one hop of a rank's keys and values (the same bytes, the same neighbours, nothing
//     computing), times the hops each call makes: forward cp - 1, backward cp - 1 of keys and values and cp
//     of their gradients; the share of that time hidden = 1 - blocked / alone;
//   - the replay of the ring's schedule from each step's measured compute c_s and the hop time h: forward
//     sum over steps of max(c_s, h) (the last step has no transfer); backward, step s waits for the
//     previous step's gradient hop and its own key/value hop after its compute, max(c_s, h), and the last
//     gradient hop is exposed, + h; plus the packing outside the steps.
//
// What a CPU can show: MPI over shared memory copies a message inside the calls that wait for it (no copy
// engine), so a "hidden" transfer still costs the receiver the copy; the blocked time measured is what the
// overlap left. On GPUs NCCL moves blocks while the attention kernel runs (bench/gpu).
#include <fmt/format.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/parallel/context_parallel.h"
#include "mpi_bench.h"

namespace forge {
namespace {

using bench::clock_type;
using bench::median;
using bench::seconds_since;
using parallel::ContextAttention;
using parallel::ContextAttentionStats;
using parallel::ContextSplit;

struct Options {
  int64_t seq = 8192, batch = 1, heads = 8, kv_heads = 2, head_dim = 64;
  int threads = 1, reps = 5;
  std::string json;
};

// The options (CLI11, as the forge command line); a bad one is one line and a non-zero exit.
Options parse(int argc, char** argv) {
  Options o;
  CLI::App app(
      "One causal GQA attention layer, forward + backward: one rank on the whole sequence against the ring "
      "and the all-to-all over the ranks of mpirun -np CP, with the ring's blocked time, its transfers alone "
      "and the replay of its schedule",
      "forge_cp_bench");
  std::vector<std::pair<const char*, int64_t*>> counts;
  auto count = [&](const char* name, int64_t* value, const char* what) {
    app.add_option(name, *value, what)->capture_default_str();
    counts.emplace_back(name, value);
  };
  int64_t threads = o.threads, reps = o.reps;
  count("--seq", &o.seq, "tokens per sequence");
  count("--batch", &o.batch, "sequences");
  count("--heads", &o.heads, "query heads");
  count("--kv-heads", &o.kv_heads, "key/value heads");
  count("--head-dim", &o.head_dim, "dimensions per head");
  count("--threads", &threads, "OpenMP threads per rank");
  count("--reps", &reps, "repetitions (the median counts)");
  app.add_option("--json", o.json, "also write the numbers to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success&) {
    std::printf("%s", app.help().c_str());
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    fail("forge_cp_bench: {} (see --help)", e.what());
  }
  for (const auto& [name, value] : counts)
    if (*value < 1) fail("forge_cp_bench: {} takes a positive integer, not {}", name, *value);
  o.threads = static_cast<int>(threads), o.reps = static_cast<int>(reps);
  if (o.heads % o.kv_heads != 0)
    fail("forge_cp_bench: --heads {} is not a multiple of --kv-heads {}", o.heads, o.kv_heads);
  return o;
}

// q, k, v, dout of `tokens` tokens per sequence, and the buffers the layer writes.
struct Layer {
  int64_t batch, tokens, heads, kv_heads, head_dim;
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
  Layer(const Options& o, int64_t t)
      : batch(o.batch), tokens(t), heads(o.heads), kv_heads(o.kv_heads), head_dim(o.head_dim) {
    const auto rows = static_cast<size_t>(batch * tokens);
    q.resize(rows * heads * head_dim), k.resize(rows * kv_heads * head_dim), v.resize(k.size());
    dout.resize(q.size()), out.resize(q.size()), lse.resize(rows * heads);
    dq.resize(q.size()), dk.resize(k.size()), dv.resize(v.size());
  }
  ops::AttentionParams params() {
    ops::AttentionParams p;
    p.batch = batch, p.seq = tokens, p.heads = heads, p.kv_heads = kv_heads, p.head_dim = head_dim;
    p.q = q.data(), p.k = k.data(), p.v = v.data();
    p.q_stride = heads * head_dim, p.k_stride = kv_heads * head_dim, p.v_stride = p.k_stride;
    p.out = out.data(), p.out_stride = p.q_stride, p.lse = lse.data();
    p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    p.causal = true;
    p.dout = dout.data(), p.dout_stride = p.q_stride;
    p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
    p.dq_stride = p.q_stride, p.dk_stride = p.k_stride, p.dv_stride = p.v_stride;
    return p;
  }
};

struct Timing {
  double forward = 0, backward = 0;
  ContextAttentionStats forward_stats, backward_stats;  // of the median-forward / median-backward rep
  double total() const { return forward + backward; }
};

// The median over reps of forward and of backward, each rep's slowest rank (the layer ends when it does).
template <typename Forward, typename Backward>
Timing measure(comm::Communicator& world, int reps, Forward forward, Backward backward) {
  std::vector<double> f, b;
  std::vector<ContextAttentionStats> fs, bs;
  for (int r = 0; r < reps + 1; ++r) {  // the first rep warms up
    ContextAttentionStats s_f, s_b;
    world.barrier().wait();
    auto t0 = clock_type::now();
    forward(&s_f);
    double tf = comm::all_reduce_max(world, seconds_since(t0));
    world.barrier().wait();
    t0 = clock_type::now();
    backward(&s_b);
    double tb = comm::all_reduce_max(world, seconds_since(t0));
    if (r == 0) continue;
    f.push_back(tf), b.push_back(tb), fs.push_back(s_f), bs.push_back(s_b);
  }
  Timing t;
  t.forward = median(f), t.backward = median(b);
  const auto at_median = [](const std::vector<double>& v, double m) {
    return static_cast<size_t>(
        std::min_element(v.begin(), v.end(),
                         [m](double a, double b) { return std::abs(a - m) < std::abs(b - m); }) -
        v.begin());
  };
  t.forward_stats = fs[at_median(f, t.forward)], t.backward_stats = bs[at_median(b, t.backward)];
  return t;
}

// One ring hop of `count` floats (send to the next rank, receive from the previous), nothing computing: the
// median over reps, the slowest rank's.
double hop_seconds(comm::Communicator& world, int64_t count, int reps) {
  std::vector<float> send(static_cast<size_t>(count), 1.0f), recv(send.size());
  const int next = (world.rank() + 1) % world.size(),
            previous = (world.rank() + world.size() - 1) % world.size();
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    world.barrier().wait();
    const auto t0 = clock_type::now();
    comm::Request in = world.recv(recv.data(), count, comm::Type::f32, previous, 77);
    comm::Request out = world.send(send.data(), count, comm::Type::f32, next, 77);
    out.wait(), in.wait();
    const double t = comm::all_reduce_max(world, seconds_since(t0));
    if (r > 0) times.push_back(t);
  }
  return median(times);
}

// The ring's schedule replayed from each step's compute and the hop time (see the header comment).
double replay_forward(const ContextAttentionStats& s, double hop) {
  double t = 0, steps = 0;
  for (size_t i = 0; i < s.step_compute.size(); ++i) {
    const bool transfer = i + 1 < s.step_compute.size();
    t += transfer ? std::max(s.step_compute[i], hop) : s.step_compute[i];
    steps += s.step_compute[i];
  }
  return t + (s.compute_seconds - steps);
}
double replay_backward(const ContextAttentionStats& s, double hop) {
  double t = 0, steps = 0;
  const size_t n = s.step_compute.size();
  for (size_t i = 0; i < n; ++i) {
    const bool kv = i + 1 < n, gradient = i > 0;
    t += kv || gradient ? std::max(s.step_compute[i], hop) : s.step_compute[i];
    steps += s.step_compute[i];
  }
  return t + hop + (s.compute_seconds - steps);
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  comm::Communicator& world = comm::world();
  const int cp = world.size();
  const bool root = world.rank() == 0;
  omp_set_num_threads(o.threads);
  const ContextSplit split = ContextSplit::make(cp, world.rank(), o.seq);

  // The whole layer (the same on every rank), and this rank's tokens of it.
  Layer whole(o, o.seq), local(o, split.local());
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* x : {&whole.q, &whole.k, &whole.v, &whole.dout})
    for (float& value : *x) value = normal(rng);
  split.take_local(whole.q.data(), local.q.data(), o.batch, o.heads * o.head_dim);
  split.take_local(whole.k.data(), local.k.data(), o.batch, o.kv_heads * o.head_dim);
  split.take_local(whole.v.data(), local.v.data(), o.batch, o.kv_heads * o.head_dim);
  split.take_local(whole.dout.data(), local.dout.data(), o.batch, o.heads * o.head_dim);

  // 1. One rank (rank 0; the others wait at the barriers).
  const ops::AttentionParams all = whole.params();
  const Timing one = measure(
      world, o.reps,
      [&](ContextAttentionStats*) {
        if (root) ops::attention_forward(all);
      },
      [&](ContextAttentionStats*) {
        if (root) ops::attention_backward(all);
      });

  // 2. The ring, and 3. the all-to-all where the heads divide.
  const ops::AttentionParams mine = local.params();
  auto context = [&](ContextAttention mode) {
    return measure(
        world, o.reps,
        [&](ContextAttentionStats* s) { parallel::context_attention_forward(world, split, mode, mine, s); },
        [&](ContextAttentionStats* s) { parallel::context_attention_backward(world, split, mode, mine, s); });
  };
  const Timing ring = context(ContextAttention::ring);
  const bool a2a_fits = o.heads % cp == 0 && o.kv_heads % cp == 0;
  const Timing a2a = a2a_fits ? context(ContextAttention::all_to_all) : Timing{};

  // The ring's transfers alone and its replay.
  const int64_t kv_floats = o.batch * split.local() * 2 * o.kv_heads * o.head_dim;
  const double hop = hop_seconds(world, kv_floats, o.reps);
  const double alone_f = (cp - 1) * hop, alone_b = (2 * cp - 1) * hop;
  // A rank blocked in a wait either waits for its neighbour to finish the step's compute (skew: the ranks'
  // blocks differ a little) or for the bytes to move. Skew = each step's slowest compute over the ranks less
  // this rank's; transfer = blocked - skew. Every rank's, the largest (the layer ends with the slowest).
  const auto split_blocked = [&](const ContextAttentionStats& s) {
    const int64_t steps = static_cast<int64_t>(s.step_compute.size());
    std::vector<double> all(static_cast<size_t>(steps * cp));
    world.all_gather(s.step_compute.data(), all.data(), steps, comm::Type::f64).wait();
    double skew = 0;
    for (int64_t i = 0; i < steps; ++i) {
      double slowest = 0;
      for (int r = 0; r < cp; ++r) slowest = std::max(slowest, all[r * steps + i]);
      skew += slowest - s.step_compute[i];
    }
    const double transfer = std::max(0.0, s.wait_seconds - skew);
    return std::pair{comm::all_reduce_max(world, skew), comm::all_reduce_max(world, transfer)};
  };
  const auto [skew_f, exposed_f] = split_blocked(ring.forward_stats);
  const auto [skew_b, exposed_b] = split_blocked(ring.backward_stats);
  const double replay_f = comm::all_reduce_max(world, replay_forward(ring.forward_stats, hop)),
               replay_b = comm::all_reduce_max(world, replay_backward(ring.backward_stats, hop));
  const double hidden = std::max(0.0, 1 - (exposed_f + exposed_b) / (alone_f + alone_b));

  if (root) {
    std::printf(
        "attention forward + backward: batch %lld x seq %lld, %lld heads (%lld kv) x %lld, causal; cp %d, "
        "%d thread%s per rank; median of %d\n",
        static_cast<long long>(o.batch), static_cast<long long>(o.seq), static_cast<long long>(o.heads),
        static_cast<long long>(o.kv_heads), static_cast<long long>(o.head_dim), cp, o.threads,
        o.threads == 1 ? "" : "s", o.reps);
    std::printf("  %-34s %9s %9s %9s %9s\n", "", "fwd ms", "bwd ms", "total ms", "vs one");
    auto row = [&](const char* name, double f, double b) {
      std::printf("  %-34s %9.2f %9.2f %9.2f %8.2fx\n", name, 1e3 * f, 1e3 * b, 1e3 * (f + b),
                  f + b > 0 ? one.total() / (f + b) : 0.0);
    };
    row("one rank, whole sequence", one.forward, one.backward);
    row(fmt::format("cp {} ring (p2p)", cp).c_str(), ring.forward, ring.backward);
    row("  replay of the ring", replay_f, replay_b);
    if (a2a_fits) row(fmt::format("cp {} all-to-all (a2a)", cp).c_str(), a2a.forward, a2a.backward);
    std::printf(
        "  ring transfers: %.2f MiB per hop, %.3f ms per hop alone, %.2f + %.2f ms per call (fwd + bwd)\n"
        "  ring blocked: waiting for the slower rank %.2f + %.2f ms, for transfers %.2f + %.2f ms: %.0f%% of "
        "the transfer time hidden under compute\n",
        static_cast<double>(kv_floats) * 4 / 1048576.0, 1e3 * hop, 1e3 * alone_f, 1e3 * alone_b, 1e3 * skew_f,
        1e3 * skew_b, 1e3 * exposed_f, 1e3 * exposed_b, 100 * hidden);
    std::printf("  replay error: %+.1f%% (forward + backward, against the measured ring)\n",
                100 * ((replay_f + replay_b) / ring.total() - 1));
  }
  if (root && !o.json.empty()) {
    const nlohmann::json j = {{"seq", o.seq},
                              {"batch", o.batch},
                              {"heads", o.heads},
                              {"kv_heads", o.kv_heads},
                              {"head_dim", o.head_dim},
                              {"cp", cp},
                              {"threads", o.threads},
                              {"one_rank_s", {one.forward, one.backward}},
                              {"ring_s", {ring.forward, ring.backward}},
                              {"ring_replay_s", {replay_f, replay_b}},
                              {"a2a_s", {a2a.forward, a2a.backward}},
                              {"hop_s", hop},
                              {"ring_skew_s", {skew_f, skew_b}},
                              {"ring_exposed_transfer_s", {exposed_f, exposed_b}},
                              {"ring_hidden_share", hidden}};
    std::ofstream(o.json) << j.dump(2) << "\n";
  }
  comm::finalize();
  return 0;
}

}  // namespace
}  // namespace forge

int main(int argc, char** argv) { return forge::bench::run_mpi_bench(forge::run, argc, argv); }
