// forge plan estimate | search | calibrate: the simulator (src/forge/sim, docs/simulator.md) on the command
// line. estimate: one strategy (a run's TOML and --set, as forge train takes them) in detail; search: every
// strategy of a model on a cluster for a global batch, ranked by predicted tokens/s; calibrate: this
// machine's op costs measured with forge's kernels, written as a hardware profile.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/memory.h"
#include "forge/kernels/ops.h"
#include "forge/parallel/context_parallel.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/sim/estimate.h"
#include "forge/sim/hardware.h"
#include "forge/sim/trace.h"
#include "forge/train/config.h"
#include "forge/train/plan.h"

namespace forge::cli {
using namespace forge::sim;
namespace {

struct ModelPlanOptions {
  // estimate
  std::string config_path;
  std::vector<std::string> overrides;
  int ranks = 0;
  int ops = 0;
  // search
  std::string model;
  int64_t global_batch = 0, seq_len = 0;
  int top = 10;
  std::string fp8 = "off";
  // both
  std::string cluster, hardware;
  int devices_per_node = 0, nodes = 0;
  // calibrate
  std::string out, micro_batches = "1,2,4", tps = "1,2", pps = "1", cps = "1",
                   recomputes = "none,selective,full", fp8s = "off";
  std::string name;
  double node_bandwidth_gbs = 0, node_latency_us = 0;
  int repeats = 3;
  std::string capacity_factors = "0";  // mixture-of-experts shapes: capacity factors (0: dropless)
  bool pad_to_capacity = false;
  // generate
  GenerationRequest generation;
};

// The comma-separated items of an option's value.
std::vector<std::string> items_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

std::vector<int64_t> int_list(const std::string& text, const char* option) {
  std::vector<int64_t> out;
  for (const std::string& item : items_of(text)) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1)
      fail("{} '{}': expected a comma-separated list of positive integers", option, text);
    out.push_back(v);
  }
  if (out.empty()) fail("{} is empty", option);
  return out;
}

std::vector<double> factor_list(const std::string& text, const char* option) {
  std::vector<double> out;
  for (const std::string& item : items_of(text)) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end || !(v >= 0) || v > 1e6)
      fail("{} '{}': expected a comma-separated list of numbers >= 0", option, text);
    out.push_back(v);
  }
  if (out.empty()) fail("{} is empty", option);
  return out;
}

std::vector<std::string> word_list(const std::string& text, const char* option,
                                   const std::set<std::string>& known) {
  std::vector<std::string> out;
  for (const std::string& item : items_of(text)) {
    if (!known.count(item)) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      fail("{} '{}': '{}' is not one of {}", option, text, item, names);
    }
    out.push_back(item);
  }
  return out;
}

constexpr int kGpusPerNode = 8;

Cluster cluster_of(const ModelPlanOptions& o, int default_devices) {
  if (!o.cluster.empty() && !o.hardware.empty()) fail("give --cluster or --hardware, not both");
  Cluster c;
  if (!o.cluster.empty()) {
    c = Cluster::read(o.cluster);
  } else {
    if (o.hardware.empty())
      fail("no hardware: give --cluster FILE or --hardware NAME|FILE (see forge plan --help)");
    c = Cluster::single_node(HardwareProfile::read(resolve_profile(o.hardware)), default_devices);
    // A GPU profile (no CPU threads) over more than eight GPUs: nodes of eight, as GPU servers come, their
    // links between nodes the profile's network (one node of 2048 GPUs would send everything over NVLink).
    // Nodes enough for the devices at the per-node count given.
    if (o.devices_per_node > 0)
      c.devices_per_node = o.devices_per_node;
    else if (c.hardware.threads == 0 && default_devices > kGpusPerNode)
      c.devices_per_node = kGpusPerNode;
    c.nodes = (std::max(1, default_devices) + c.devices_per_node - 1) / c.devices_per_node;
  }
  if (o.devices_per_node > 0) c.devices_per_node = o.devices_per_node;
  if (o.nodes > 0) c.nodes = o.nodes;
  return c;
}

int run_estimate(const ModelPlanOptions& o) {
  train::TrainConfig config =
      o.config_path.empty() ? train::TrainConfig{} : train::TrainConfig::from_toml_file(o.config_path);
  for (const auto& assignment : o.overrides) config.apply_override(assignment);
  // A GPU profile (one measured without CPU threads) plans a GPU run: train.dtype = auto is bf16 whatever
  // this machine's CPU would pick for itself, and train.device is cuda unless given.
  if (cluster_of(o, 1).hardware.threads == 0) {
    if (config.train.dtype == train::DtypeChoice::automatic) config.train.dtype = train::DtypeChoice::bf16;
    if (!config.origins.count("train.device")) config.train.device = "cuda";
  }
  config.validate();
  const parallel::LayoutSpec l = config.layout_spec();
  const int ranks = o.ranks > 0 ? o.ranks : l.tp * l.cp * l.pp * std::max(1, l.dp);
  Cluster cluster = cluster_of(o, ranks);
  const Strategy s = train::strategy_of(config, ranks);
  const std::unique_ptr<models::ModelConfig> model = models::read_model_config(config.model.config);
  Simulator sim(*model, std::move(cluster));
  const auto start = std::chrono::steady_clock::now();
  const Estimate e = sim.estimate(s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("model: %s (%s, %.3g parameters)\n", config.model.config.c_str(), model->architecture().c_str(),
              static_cast<double>(model->num_parameters()));
  std::fputs(format_estimate(e, sim).c_str(), stdout);
  if (o.ops > 0) {
    // pp rank 0's ops over one step: the first micro-batch, the others, the update.
    const RankTrace& t = *sim.last_traces().at(0);
    Phase merged;
    auto add = [&](const Phase& p, double times) {
      for (ops::OpProfileRow r : p.rows) {
        r.calls = static_cast<int64_t>(std::llround(static_cast<double>(r.calls) * times));
        r.flops *= times, r.bytes *= times;
        merged.rows.push_back(r);
      }
    };
    for (const ChunkTrace& c : t.chunks) {
      add(c.forward_first, 1), add(c.forward, static_cast<double>(s.grad_accum - 1));
      add(c.backward, static_cast<double>(s.grad_accum));
    }
    add(t.step_begin, 1), add(t.step_end, 1);
    std::vector<ops::OpProfileRow> per_step = merge_rows({&merged});
    for (ops::OpProfileRow& r : per_step) r.seconds = sim.cluster().hardware.row_seconds(r);
    std::sort(per_step.begin(), per_step.end(),
              [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
    std::printf("\npredicted ops of pp rank 0 per step (the %d most costly):\n%10s %7s  %-30s %s\n", o.ops,
                "ms", "calls", "op", "detail");
    for (size_t i = 0; i < per_step.size() && static_cast<int>(i) < o.ops; ++i)
      std::printf("%10.3f %7lld  %-30s %s\n", 1e3 * per_step[i].seconds,
                  static_cast<long long>(per_step[i].calls), per_step[i].op.c_str(),
                  per_step[i].detail.c_str());
  }
  std::printf("(%lld rank traces in %.2f s)\n", static_cast<long long>(sim.traces_run()), seconds);
  return e.fits ? 0 : 2;
}

int run_generation(const ModelPlanOptions& o) {
  const std::unique_ptr<models::ModelConfig> model = models::read_model_config(o.model);
  Simulator sim(*model, cluster_of(o, 1));
  const GenerationEstimate e = sim.estimate_generation(o.generation);
  std::printf("model: %s (%s, %.3g parameters)\n", o.model.c_str(), model->architecture().c_str(),
              static_cast<double>(model->num_parameters()));
  std::fputs(format_generation(e, sim).c_str(), stdout);
  return e.fits ? 0 : 2;
}

// Every divisor of n.
std::vector<int> divisors(int64_t n) {
  std::vector<int> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(static_cast<int>(d));
  return out;
}

int run_search(const ModelPlanOptions& o) {
  if (o.global_batch < 1) fail("--global-batch must be >= 1 (sequences per optimizer step)");
  if (o.seq_len < 1) fail("--seq-len must be >= 1");
  const std::unique_ptr<models::ModelConfig> model = models::read_model_config(o.model);
  const models::ModelShape shape = model->shape();
  const Cluster cluster = cluster_of(o, o.ranks > 0 ? o.ranks : 1);
  const int ranks = o.ranks > 0 ? o.ranks : cluster.devices();
  if (ranks > cluster.devices())
    fail("--ranks {} exceeds the cluster's {} devices", ranks, cluster.devices());
  if (o.seq_len > shape.max_positions)
    fail("--seq-len {} exceeds max_position_embeddings {} of {}", o.seq_len, shape.max_positions, o.model);
  Simulator sim(*model, cluster);
  const int64_t experts = model->routed_experts();
  std::optional<nn::Fp8Options> fp8;
  if (o.fp8 != "off") {
    train::TrainConfig c;
    c.fp8.recipe = o.fp8;
    c.validate();
    fp8 = c.fp8_options();
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<Estimate> fitting;
  int64_t tried = 0, refused = 0, too_big = 0;
  // A long search says how far it is, on stderr, every 10 seconds.
  auto last_progress = start;
  auto progress = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_progress < std::chrono::seconds(10)) return;
    last_progress = now;
    std::fprintf(stderr, "search: %lld strategies tried (%lld rank traces), %zu fit so far, %.0f s\n",
                 static_cast<long long>(tried), static_cast<long long>(sim.traces_run()), fitting.size(),
                 std::chrono::duration<double>(now - start).count());
  };
  Estimate smallest;
  smallest.memory.total = -1;
  const bool offload_possible = cluster.hardware.host_link_gbs > 0;
  for (int tp : divisors(ranks)) {
    if (shape.heads % tp || shape.ffn % tp || (shape.kv_heads % tp && tp % shape.kv_heads)) continue;
    for (int cp : divisors(ranks / tp)) {
      // Context parallelism: two chunks of every sequence per rank; all-to-all where the heads divide.
      using parallel::ContextAttention;
      auto splits = [&](ContextAttention comm) {
        return parallel::context_split_problem(cp, comm, o.seq_len, shape.heads / tp,
                                               std::max<int64_t>(1, shape.kv_heads / tp))
            .none();
      };
      if (!splits(ContextAttention::ring)) continue;
      std::vector<ContextAttention> cp_comms{ContextAttention::ring};
      if (cp > 1 && splits(ContextAttention::all_to_all)) cp_comms.push_back(ContextAttention::all_to_all);
      for (ContextAttention cp_comm : cp_comms)
        for (int pp : divisors(ranks / tp / cp)) {
          if (pp > shape.layers) continue;
          const int dp = ranks / tp / cp / pp;
          if (o.global_batch % dp) continue;
          using pipeline::ScheduleKind;
          std::vector<std::pair<ScheduleKind, int>> schedules{{ScheduleKind::one_f_one_b, 1}};
          if (pp > 1)
            schedules = {{ScheduleKind::one_f_one_b, 1}, {ScheduleKind::interleaved, 2},
                         {ScheduleKind::interleaved, 4}, {ScheduleKind::zb_h1, 1},
                         {ScheduleKind::zbv, 1},         {ScheduleKind::dualpipe, 1},
                         {ScheduleKind::dualpipev, 1}};
          // Expert parallelism (MoE models): every divisor of dp x cp that divides the routed experts.
          std::vector<int> eps{1};
          for (int ep : divisors(static_cast<int64_t>(dp) * cp))
            if (ep > 1 && experts > 0 && experts % ep == 0) eps.push_back(ep);
          for (int64_t mb : {1, 2, 4, 8}) {
            if ((o.global_batch / dp) % mb) continue;
            const int64_t accum = o.global_batch / dp / mb;
            for (int ep : eps)
              for (const auto& [schedule, vpp] : schedules)
                for (nn::Recompute recompute :
                     {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full})
                  for (bool zero : {false, true}) {
                    if (zero && dp == 1) continue;
                    Strategy s;
                    s.tp = tp, s.pp = pp, s.dp = dp, s.schedule = schedule, s.vpp = vpp, s.ep = ep;
                    s.cp = cp, s.cp_comm = cp_comm;
                    s.sequence_parallel = tp > 1 && (o.seq_len / cp) % tp == 0;
                    s.distributed_optimizer = zero;
                    s.micro_batch = mb, s.grad_accum = accum, s.seq = o.seq_len, s.recompute = recompute;
                    s.fp8 = fp8, s.fp8_recipe = o.fp8;
                    if (pp > 1 &&
                        !pipeline::schedule_refusal({schedule, pp, static_cast<int>(accum), vpp}).empty())
                      continue;
                    if (pp > 1) {
                      const int stages = pipeline::stage_count({schedule, pp, static_cast<int>(accum), vpp});
                      if (stages > shape.layers) continue;
                      // Stages that do not divide the layers take them as evenly as possible.
                      if (shape.layers % stages != 0)
                        s.pp_layers = pipeline::uneven_layer_counts(shape.layers, stages);
                    }
                    ++tried;
                    progress();
                    Estimate e;
                    try {
                      e = sim.estimate(s);
                    } catch (const Error&) {
                      ++refused;
                      continue;
                    }
                    // Optimizer offload only adds time and only saves device memory: tried where the
                    // strategy does not fit without it (on hardware with a host behind each device).
                    if (!e.fits && offload_possible) {
                      s.optimizer_offload = true;
                      ++tried;
                      Estimate offloaded = sim.estimate(s);
                      if (offloaded.fits || offloaded.memory.total < e.memory.total) e = std::move(offloaded);
                    }
                    if (!e.fits) {
                      ++too_big;
                      if (smallest.memory.total < 0 || e.memory.total < smallest.memory.total) smallest = e;
                      continue;
                    }
                    fitting.push_back(e);
                  }
          }
        }
    }
  }
  // Block recompute: the fastest full-recompute strategies again, recomputing as few layers of each stage as
  // still fit (fewer recomputed layers, less time), found by bisection: memory only falls as the count grows.
  const auto faster = [](const Estimate& a, const Estimate& b) {
    return a.time.tokens_per_s > b.time.tokens_per_s;
  };
  std::sort(fitting.begin(), fitting.end(), faster);
  const size_t found = fitting.size();
  for (size_t i = 0, refined = 0; i < found && static_cast<int>(refined) < o.top; ++i) {
    Strategy s = fitting[i].strategy;
    if (s.recompute != nn::Recompute::full) continue;
    ++refined;
    const int64_t stages =
        s.pp > 1 ? pipeline::stage_count({s.schedule, s.pp, static_cast<int>(s.grad_accum), s.vpp}) : 1;
    int64_t lo = 1, hi = (shape.layers + stages - 1) / stages - 1;
    std::optional<Estimate> fewest;
    while (lo <= hi) {
      s.recompute_layers = (lo + hi) / 2;
      ++tried;
      progress();
      Estimate e = sim.estimate(s);
      if (e.fits)
        hi = s.recompute_layers - 1, fewest = std::move(e);
      else
        lo = s.recompute_layers + 1;
    }
    if (fewest) fitting.push_back(std::move(*fewest));
  }
  // Fine-grained recompute: the fastest full-recompute strategies again with selective recompute of every
  // module (the attention core, the activations, the norms' outputs, MLA's up-projections), which recomputes
  // little but drops most of a layer's activations.
  constexpr uint32_t kEveryModule = nn::kDefaultRecomputeModules | nn::module_bit(nn::RecomputeModule::norm) |
                                    nn::module_bit(nn::RecomputeModule::mla_up_proj);
  for (size_t i = 0, refined = 0; i < found && static_cast<int>(refined) < o.top; ++i) {
    Strategy s = fitting[i].strategy;
    if (s.recompute != nn::Recompute::full || s.recompute_layers > 0) continue;
    ++refined;
    s.recompute = nn::Recompute::selective, s.recompute_modules = kEveryModule;
    ++tried;
    progress();
    Estimate e = sim.estimate(s);
    if (e.fits) fitting.push_back(std::move(e));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("search: %s on %d x %s (%s), global batch %lld x %lld tokens\n", o.model.c_str(), ranks,
              cluster.hardware.name.c_str(), cluster.hardware.kind.c_str(),
              static_cast<long long>(o.global_batch), static_cast<long long>(o.seq_len));
  std::printf(
      "%lld strategies in %.1f s (%lld rank traces): %zu fit, %lld do not fit in %.1f GiB, %lld refused\n",
      static_cast<long long>(tried), seconds, static_cast<long long>(sim.traces_run()), fitting.size(),
      static_cast<long long>(too_big), cluster.hardware.memory_gib, static_cast<long long>(refused));
  if (fitting.empty()) {
    if (smallest.memory.total >= 0)
      fail("no strategy fits; the smallest, {}, {}", smallest.strategy.describe(), smallest.over);
    fail("no strategy runs this model on {} ranks", ranks);
  }
  std::sort(fitting.begin(), fitting.end(), faster);
  std::printf("\n%4s  %-46s %11s %9s %10s %8s %9s %6s\n", "rank", "strategy", "tokens/s", "step ms", "memory",
              "bubble", "exp.comm", "MFU");
  for (size_t i = 0; i < fitting.size() && static_cast<int>(i) < o.top; ++i) {
    const Estimate& e = fitting[i];
    const double exposed =
        e.time.tp_comm + e.time.ep_comm + e.time.cp_comm + e.time.pp_comm + e.time.dp_exposed;
    std::printf("%4zu  %-46s %11.0f %9.2f %10s %7.1f%% %8.2fms %5.1f%%\n", i + 1,
                e.strategy.describe().c_str(), e.time.tokens_per_s, 1e3 * e.time.step,
                human_bytes(e.memory.total).c_str(), 100 * e.time.bubble / e.time.step, 1e3 * exposed,
                100 * e.time.mfu);
  }
  std::printf("\ntrain with the best: forge train --set model.config=%s --set data.seq_len=%lld %s\n",
              o.model.c_str(), static_cast<long long>(o.seq_len), fitting[0].strategy.set_line().c_str());
  return 0;
}

// This machine's costs: the model's ops at the strategies' shapes, run for real (sim/trace.h's measured
// mode) and timed; each op costs the median of its samples over `repeats` rounds.
// The share of a non-blocking all-reduce of `bytes` (alone: `alone_seconds`) that the computing thread spends
// on it. GEMMs run alone, then again with the all-reduce in flight and tested between them (as the trainer
// polls its gradient buckets between ops); what the second takes beyond the first, over the all-reduce's own
// time, is the share (0: fully hidden, 1: MPI did all of it on this thread). The median of several rounds,
// averaged over the ranks.
double host_share(comm::Communicator& world, int64_t bytes, double alone_seconds) {
  constexpr int64_t kSide = 256;
  std::vector<float> a(kSide * kSide, 0.5f), b(kSide * kSide, 0.25f), c(kSide * kSide, 0.0f);
  ops::GemmParams g;
  g.m = g.n = g.k = kSide, g.a = a.data(), g.lda = kSide, g.b = b.data(), g.ldb = kSide, g.trans_b = true;
  g.c = c.data(), g.ldc = kSide;
  std::vector<float> buffer(static_cast<size_t>(bytes / 4), 1.0f);
  auto seconds_of = [](auto&& work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // Enough GEMMs to take about three times the all-reduce, so that it can hide entirely.
  const double one_gemm = seconds_of([&] {
                            for (int i = 0; i < 8; ++i) ops::gemm(g);
                          }) /
                          8;
  const int gemms = static_cast<int>(
      comm::all_reduce_max(world, std::clamp(3 * alone_seconds / std::max(1e-9, one_gemm), 8.0, 1e5)));
  std::vector<double> alone, together;
  for (int r = 0; r < 7; ++r) {
    world.barrier().wait();
    alone.push_back(seconds_of([&] {
      for (int i = 0; i < gemms; ++i) ops::gemm(g);
    }));
    world.barrier().wait();
    together.push_back(seconds_of([&] {
      comm::Request request = world.all_reduce(buffer.data(), static_cast<int64_t>(buffer.size()),
                                               comm::Type::f32, comm::ReduceOp::sum);
      for (int i = 0; i < gemms; ++i) {
        ops::gemm(g);
        request.test();
      }
      request.wait();
    }));
  }
  std::sort(alone.begin(), alone.end()), std::sort(together.begin(), together.end());
  const double extra = together[together.size() / 2] - alone[alone.size() / 2];
  const double share = std::clamp(extra / std::max(1e-9, alone_seconds), 0.0, 1.0);
  return comm::all_reduce_sum(world, share) / world.size();
}

int run_calibrate(const ModelPlanOptions& o) {
  if (o.out.empty()) fail("--out FILE is required");
  if (o.seq_len < 1) fail("--seq-len must be >= 1");
  const std::unique_ptr<models::ModelConfig> model = models::read_model_config(o.model);
  const std::vector<int64_t> mbs = int_list(o.micro_batches, "--micro-batch"), tps = int_list(o.tps, "--tp"),
                             pps = int_list(o.pps, "--pp"), cps = int_list(o.cps, "--cp");
  // Under mpirun every rank measures at once, as the ranks of a run on this machine compute at once (sharing
  // its cores, caches and memory bandwidth); then the ranks time collectives between them. Rank 0 writes.
  comm::Communicator& world = comm::world();
  std::vector<nn::Recompute> recomputes;
  for (const std::string& word : word_list(o.recomputes, "--recompute", {"none", "selective", "full"}))
    recomputes.push_back(nn::recompute_from_name(word));
  const std::vector<std::string> fp8s = word_list(o.fp8s, "--fp8", {"off", "delayed", "current", "block"});
  HardwareProfile h;
  const int threads = omp_get_max_threads();
  h.name = o.name.empty() ? fmt::format("cpu ({} thread{} per rank, {} rank{} at once)", threads,
                                        threads == 1 ? "" : "s", world.size(), world.size() == 1 ? "" : "s")
                          : o.name;
  h.kind = "measured";
  h.threads = threads;
  h.notes = fmt::format(
      "forge plan calibrate --model {} --seq-len {} --micro-batch {} --tp {} --pp {}{} --recompute {} --fp8 "
      "{}{}{}",
      o.model, o.seq_len, o.micro_batches, o.tps, o.pps, o.cps == "1" ? "" : " --cp " + o.cps, o.recomputes,
      o.fp8s,
      o.capacity_factors == "0" ? ""
                                : fmt::format(" --capacity-factor {}{}", o.capacity_factors,
                                              o.pad_to_capacity ? " --pad-to-capacity" : ""),
      world.size() > 1 ? fmt::format(" under mpirun -np {}", world.size()) : "");
  h.memory_gib = static_cast<double>(host_memory_bytes()) / 1073741824.0;
  h.node = {o.node_bandwidth_gbs > 0 ? o.node_bandwidth_gbs : 5.0,
            o.node_latency_us > 0 ? o.node_latency_us : 5.0};
  h.network = h.node;
  // The host's time between the ops (tensor bookkeeping, routing decisions, allocation) is measured too: each
  // phase's wall time less its ops' times, over the op calls; the least of the rounds per configuration.
  const std::vector<double> factors = factor_list(o.capacity_factors, "--capacity-factor");
  // Every configuration (and pp rank) to measure.
  struct Config {
    Strategy strategy;
    int pp_rank = 0;
  };
  std::vector<Config> configs;
  for (double factor : factors)
    for (const std::string& recipe : fp8s)
      for (int64_t tp : tps)
        for (int64_t cp : cps)
          for (int64_t pp : pps)
            for (int64_t mb : mbs)
              for (nn::Recompute rc : recomputes)
                for (int pp_rank = 0; pp_rank < pp; ++pp_rank) {
                  Strategy s;
                  s.tp = static_cast<int>(tp), s.dp = 1, s.micro_batch = mb, s.seq = o.seq_len,
                  s.recompute = rc;
                  s.cp = static_cast<int>(cp);
                  s.pp = static_cast<int>(pp), s.grad_accum = 2 * pp;
                  s.sequence_parallel = tp > 1 && (o.seq_len / cp) % tp == 0;
                  s.moe_capacity_factor = factor, s.moe_pad_to_capacity = factor > 0 && o.pad_to_capacity;
                  if (recipe != "off") {
                    train::TrainConfig c;
                    c.fp8.recipe = recipe;
                    c.validate();
                    s.fp8 = c.fp8_options(), s.fp8_recipe = recipe;
                  }
                  configs.push_back({s, pp_rank});
                }
  // Rounds over all of them rather than repeats back to back: a shared machine has slow spells that last
  // seconds to minutes, which repeats back to back would share. Each op and shape costs the median of its
  // calls' times over every round and configuration (the typical cost, as a run's median step is: the
  // fastest of many samples would be an optimist's), and each configuration's host work its median round.
  struct Samples {
    ops::OpProfileRow row;         // one call's FLOPs and bytes
    std::vector<double> per_call;  // seconds, one per traced row
  };
  std::map<std::string, Samples> samples;
  std::vector<std::vector<double>> gaps(configs.size());
  std::vector<double> calls(configs.size(), 0);
  TraceOptions t;
  t.device = Device::cpu;
  for (int r = 0; r < std::max(1, o.repeats); ++r)
    for (size_t i = 0; i < configs.size(); ++i) {
      const Config& config = configs[i];
      // In step with the other ranks: a rank measuring while the others have not started (or have finished)
      // would time kernels on a machine to itself, and its samples would be a quiet machine's.
      world.barrier().wait();
      const RankTrace trace = trace_rank(*model, config.strategy, config.pp_rank, t);
      double gap = 0;
      calls[i] = 0;
      for (const Phase* phase : trace.phases()) {
        gap += phase->wall_seconds;
        for (const ops::OpProfileRow& row : phase->rows)
          gap -= row.seconds, calls[i] += static_cast<double>(row.calls);
      }
      gaps[i].push_back(std::max(0.0, gap));
      for (const ops::OpProfileRow& row : merge_rows(trace.phases())) {
        if (row.calls <= 0) continue;
        const double n = static_cast<double>(row.calls);
        Samples& s = samples[row.op + "|" + row.detail];
        if (s.per_call.empty()) s.row = {row.op, row.detail, 1, 0, row.flops / n, row.bytes / n};
        s.per_call.push_back(row.seconds / n);
      }
      if (world.rank() == 0)
        std::fprintf(stderr, "calibrate: round %d of %d: %s%s measured\n", r + 1, std::max(1, o.repeats),
                     config.strategy.describe().c_str(),
                     config.strategy.pp > 1 ? fmt::format(" (pp rank {})", config.pp_rank).c_str() : "");
    }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  std::vector<ops::OpProfileRow> all;
  for (auto& [key, s] : samples) {
    s.row.seconds = median(s.per_call);
    all.push_back(s.row);
    h.measured[key] = s.row.seconds;
  }
  double gap_seconds = 0, gap_calls = 0;
  for (size_t i = 0; i < configs.size(); ++i) gap_seconds += median(gaps[i]), gap_calls += calls[i];
  const int runs = static_cast<int>(configs.size());
  // The fallback curves, for shapes not measured: GEMM throughput by the FLOPs of one call (medians per
  // quarter decade), the attention's share of the GEMM peak, the memory-bound ops' bandwidth.
  std::map<int, std::vector<double>> rates;  // quarter decade -> GFLOP/s
  std::vector<double> bandwidths, attention;
  double peak = 0;
  for (const ops::OpProfileRow& r : all) {
    if (r.seconds <= 0 || r.calls <= 0) continue;
    const double rate = r.flops / r.seconds;
    if (r.flops > 0 && r.op.rfind("attention", 0) == 0) {
      attention.push_back(rate);
    } else if (r.flops > 0 && r.detail.rfind("bf16", 0) == 0) {
      rates[static_cast<int>(std::floor(4 * std::log10(r.flops / static_cast<double>(r.calls))))].push_back(
          rate);
      peak = std::max(peak, rate);
    } else if (r.flops <= 0 && r.bytes > 0) {
      bandwidths.push_back(r.bytes / r.seconds);
    }
  }
  if (peak <= 0)
    fail(
        "calibrate: no bf16 GEMM was measured (is the CPU without native bf16? then the profile would need "
        "fp32)");
  h.bf16_tflops = peak / 1e12, h.fp32_tflops = h.bf16_tflops / 2, h.fp8_tflops = h.bf16_tflops;
  for (auto& [bucket, v] : rates)
    h.gemm_efficiency.push_back({(bucket + 0.5) / 4.0, std::min(1.0, median(v) / peak)});
  h.attention_efficiency = std::clamp(median(attention) / peak, 1e-4, 1.0);
  h.memory_bandwidth_gbs = std::max(1e-3, median(bandwidths) / 1e9);
  h.op_overhead_us = gap_calls > 0 ? 1e6 * gap_seconds / gap_calls : 0;
  if (world.size() > 1) {
    // A ring all-reduce of B bytes takes 2 (n-1) latencies plus 2 (n-1)/n B over the bus bandwidth: the
    // latency from a small message, the bandwidth from a large one (the fastest of several each).
    const double n = world.size();
    auto time_all_reduce = [&](int64_t bytes, bool blocking = true) {
      std::vector<float> buffer(static_cast<size_t>(bytes / 4), 1.0f);
      double best = 1e300;
      for (int r = 0; r < 8; ++r) {
        world.barrier().wait();
        const auto start = std::chrono::steady_clock::now();
        if (blocking)
          world.all_reduce_blocking(buffer.data(), static_cast<int64_t>(buffer.size()), comm::Type::f32,
                                    comm::ReduceOp::sum);
        else
          world
              .all_reduce(buffer.data(), static_cast<int64_t>(buffer.size()), comm::Type::f32,
                          comm::ReduceOp::sum)
              .wait();
        best =
            std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return comm::all_reduce_max(world, best);
    };
    const double small = time_all_reduce(4096), large = time_all_reduce(int64_t{32} << 20),
                 large_async = time_all_reduce(int64_t{32} << 20, false);
    if (o.node_latency_us <= 0) h.node.latency_us = 1e6 * small / (2 * (n - 1));
    if (o.node_bandwidth_gbs <= 0)
      h.node.bandwidth_gbs =
          2 * (n - 1) / n * static_cast<double>(int64_t{32} << 20) / std::max(1e-9, large - small) / 1e9;
    h.node.async_bandwidth_gbs =
        2 * (n - 1) / n * static_cast<double>(int64_t{32} << 20) / std::max(1e-9, large_async - small) / 1e9;
    h.node.host_share = host_share(world, int64_t{32} << 20, large_async);
    h.network = h.node;
  }
  if (world.rank() != 0) return 0;
  write_file_atomically(o.out, h.to_toml(), "hardware profile");
  std::printf(
      "calibrated %d configurations, %zu op shapes: bf16 GEMM peak %.3f TFLOP/s, attention %.0f%% of it, "
      "memory-bound ops %.1f GB/s, %.1f us of host work per op call, link %.2f GB/s and %.1f us (%.0f%% of "
      "an overlapped all-reduce taken from the compute) -> %s\n",
      runs, h.measured.size(), h.bf16_tflops, 100 * h.attention_efficiency, h.memory_bandwidth_gbs,
      h.op_overhead_us, h.node.bandwidth_gbs, h.node.latency_us, 100 * h.node.host_share, o.out.c_str());
  return 0;
}

void add_hardware_options(CLI::App* app, ModelPlanOptions& o) {
  app->add_option(
         "--cluster", o.cluster,
         "cluster description (TOML: [cluster] hardware, devices_per_node, nodes; optional [link.node] and "
         "[link.network] bandwidth_gbs, latency_us)")
      ->type_name("FILE");
  app->add_option("--hardware", o.hardware,
                  "a hardware profile instead of a cluster: a shipped one (h100, h200, a100, b200) or a file "
                  "(forge plan calibrate writes one); one node, or nodes of 8 for more than 8 GPUs")
      ->type_name("NAME|FILE");
  app->add_option("--devices-per-node", o.devices_per_node, "override the cluster's devices per node")
      ->type_name("N");
  app->add_option("--nodes", o.nodes, "override the cluster's node count")->type_name("N");
}

}  // namespace

void add_plan_model_subcommands(CLI::App* plan,
                                std::vector<std::pair<CLI::App*, std::function<int()>>>& runners) {
  auto o = std::make_shared<ModelPlanOptions>();
  auto* estimate = plan->add_subcommand(
      "estimate", "Predict the memory per device and the time per step of one run's strategy, part by part");
  estimate->add_option("-c,--config", o->config_path, "TOML run configuration, as forge train takes it")
      ->check(CLI::ExistingFile);
  estimate->add_option("--set", o->overrides, "override one setting, section.key=value (repeatable)");
  estimate->add_option("--ranks", o->ranks, "world size (default tp x pp x dp of the settings)")
      ->type_name("N");
  estimate->add_option("--ops", o->ops, "also list the N most costly ops of a step (pp rank 0), as predicted")
      ->type_name("N");
  add_hardware_options(estimate, *o);
  estimate->footer(
      "Exit status 2 when the strategy does not fit in the devices' memory (the line says by how much and "
      "what "
      "dominates). Example: forge plan estimate --hardware h100 --set model.config=llama3-8b.json --set "
      "data.seq_len=8192 --set parallel.tp=2 --set parallel.dp=4 --ranks 8");
  runners.push_back({estimate, [o] { return run_estimate(*o); }});

  auto* search = plan->add_subcommand(
      "search",
      "Enumerate the strategies of a model on a cluster, drop those that do not fit, rank the rest");
  search->add_option("--model", o->model, "Hugging Face config.json")->required()->check(CLI::ExistingFile);
  search->add_option("--global-batch", o->global_batch, "sequences per optimizer step")->required();
  search->add_option("--seq-len", o->seq_len, "tokens per sequence")->required();
  search->add_option("--ranks", o->ranks, "ranks to use (default: every device of the cluster)")
      ->type_name("N");
  search->add_option("--top", o->top, "strategies to print")->capture_default_str();
  search->add_option("--fp8", o->fp8, "FP8 recipe of every strategy: off, delayed, current or block")
      ->capture_default_str();
  add_hardware_options(search, *o);
  search->footer(
      "Tries tp, cp and pp over the divisors of the ranks (dp takes the rest), every pipeline schedule "
      "(interleaved with 2 and 4 chunks per rank; stages that do not divide the layers placed unevenly), "
      "expert parallelism over the divisors of dp x cp that "
      "divide "
      "a MoE model's routed experts, micro-batches of 1, 2, 4, 8, recompute none/selective/full, ZeRO-1 on "
      "and off, sequence parallelism with tp, and optimizer offload (train.optimizer_offload) where a "
      "strategy does not fit without it and the hardware profile describes the host behind each device; "
      "then the fastest full-recompute strategies again with the "
      "fewest recomputed layers per stage that fit (train.recompute_layers), and with selective recompute of "
      "every module (train.recompute_modules). Prints the best by predicted "
      "tokens/s with memory per device, pipeline bubble, exposed communication and MFU, and the --set line "
      "to train with the best.");
  runners.push_back({search, [o] { return run_search(*o); }});

  auto* generate = plan->add_subcommand(
      "generate",
      "Predict the memory and time of generation on one device: weights, KV cache, prefill, decode");
  generate->add_option("--model", o->model, "Hugging Face config.json")->required()->check(CLI::ExistingFile);
  generate->add_option("--prompt", o->generation.prompt, "tokens per prompt")->capture_default_str();
  generate->add_option("--new-tokens", o->generation.new_tokens, "tokens generated per sequence")
      ->capture_default_str();
  generate->add_option("--batch", o->generation.batch, "sequences generated together")->capture_default_str();
  generate
      ->add_option("--dtype", o->generation.dtype, "GEMM operands, as forge generate --dtype: bf16 or fp32")
      ->capture_default_str();
  add_hardware_options(generate, *o);
  generate->footer(
      "Runs forge generate's own model, KV cache, prefill and one-token steps on the dry device (a CPU "
      "profile: shaped as the CPU kernels run them). Exit status 2 when it does not fit in the device's "
      "memory. Example: forge plan generate --model llama3-8b.json --hardware h100 --prompt 2048 "
      "--new-tokens 512");
  runners.push_back({generate, [o] { return run_generation(*o); }});

  auto* calibrate = plan->add_subcommand(
      "calibrate",
      "Measure this machine's op costs at a model's shapes with forge's own kernels; write a profile");
  calibrate->add_option("--model", o->model, "Hugging Face config.json")
      ->required()
      ->check(CLI::ExistingFile);
  calibrate->add_option("--seq-len", o->seq_len, "tokens per sequence")->required();
  calibrate->add_option("--micro-batch", o->micro_batches, "micro-batch sizes to measure")
      ->capture_default_str();
  calibrate->add_option("--tp", o->tps, "tensor-parallel sizes whose shapes to measure")
      ->capture_default_str();
  calibrate->add_option("--pp", o->pps, "pipeline sizes whose stages to measure (each pp rank's chunk)")
      ->capture_default_str();
  calibrate
      ->add_option("--cp", o->cps,
                   "context-parallel sizes whose shapes to measure (each rank's chunks and attention blocks)")
      ->capture_default_str();
  calibrate->add_option("--recompute", o->recomputes, "recompute policies to measure")->capture_default_str();
  calibrate->add_option("--fp8", o->fp8s, "FP8 recipes to measure (off, delayed, current, block)")
      ->capture_default_str();
  calibrate
      ->add_option("--capacity-factor", o->capacity_factors,
                   "mixture-of-experts capacity factors whose expert shapes to measure (0: dropless)")
      ->capture_default_str();
  calibrate->add_flag(
      "--pad-to-capacity", o->pad_to_capacity,
      "with a capacity factor: every expert's rows padded to its capacity (moe.pad_to_capacity)");
  calibrate->add_option("--out", o->out, "the profile to write (TOML)")->required();
  calibrate->add_option("--name", o->name, "the profile's name");
  calibrate
      ->add_option("--link-bandwidth-gbs", o->node_bandwidth_gbs, "bandwidth between ranks on this machine")
      ->capture_default_str();
  calibrate->add_option("--link-latency-us", o->node_latency_us, "latency between ranks on this machine")
      ->capture_default_str();
  calibrate
      ->add_option("--repeats", o->repeats,
                   "rounds over every configuration (each op costs the median of its calls)")
      ->capture_default_str();
  calibrate->footer(
      "Run it as the ranks will run: mpirun -np 2 -x OMP_NUM_THREADS=1 forge plan calibrate ... for 2 ranks "
      "on 2 "
      "cores (every rank measures at once, then the link between them is timed). Every op of a "
      "training step (F, B, I, W, the update) is run and timed at the model's shapes under each listed tp, "
      "micro-batch, recompute and FP8 choice; the profile keeps each op's time per call and fits a GEMM "
      "efficiency curve, the attention's share and the memory bandwidth for other shapes.");
  runners.push_back({calibrate, [o] { return run_calibrate(*o); }});
}

}  // namespace forge::cli
