// Pipeline schedules measured against the replay (bench/parallel/run_pipeline.sh), under mpirun -np 2.
//
// For each schedule that runs on two ranks it builds this rank's stages of one LLaMA, then
//   1. times every chunk's F, fused B, I and W (and, where the schedule pairs them, the F&B pair: the F of
//      one micro-batch followed by the B of another, as the executor runs Op::forward_backward) apart from
//      any schedule, each the median of --reps repetitions after a warm-up, and the one-way time of one
//      activation between the two ranks (ping-pong); rank 0 gathers them into a pipeline::Costs;
//   2. runs the executor for whole steps (--warmup, then --steps), and takes the median step time (the
//      slowest rank, after a barrier) and each rank's busy time: the seconds spent inside the chunks'
//      compute, so that the measured bubble 1 - busy / step is idle time however it arose (waiting on a
//      message or on the schedule);
//   3. replays the schedule under the measured costs, and again under the medians of the chunks' own calls
//      within the steps (replay*), and prints measured beside predicted.
//
// The replay is the model every schedule choice rests on (forge plan schedule, docs/parallelism.md); this
// is where it meets a real run. What it cannot show on a CPU with one core per rank: DualPipe's F&B pair
// computes its two halves one after the other, so the pair can only hide the forward's send behind the
// backward, never compute behind compute.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/cpu_features.h"
#include "forge/core/error.h"
#include "forge/core/philox.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/model.h"
#include "forge/parallel/pipeline/executor.h"
#include "forge/parallel/pipeline/replay.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/train/pipeline_chunk.h"
#include "mpi_bench.h"

namespace forge {
namespace {

using bench::clock_type;
using models::LlamaConfig;

struct Options {
  std::vector<std::string> schedules = {"1f1b", "interleaved", "zb-h1", "zbv", "dualpipe", "dualpipev"};
  int micro_batches = 8;
  int64_t hidden = 256, layers = 8, seq = 128, batch = 1, vocab = 2048;
  std::string dtype = "auto";
  int threads = 1;  // per rank: one core each, the setting the replay's one-resource-per-rank model fits
  int reps = 5;     // cost repetitions (after one warm-up)
  int warmup = 1, steps = 5;
  std::string json;
};

[[noreturn]] void usage_and_exit() {
  std::printf(
      "usage: mpirun -np 2 forge_pipeline_bench [--schedules 1f1b,interleaved,zb-h1,zbv,dualpipe,dualpipev]\n"
      "         [--micro-batches 8] [--hidden 256] [--layers 8] [--seq 128] [--batch 1] [--vocab 2048]\n"
      "         [--dtype auto|fp32|bf16] [--threads 1] [--reps 5] [--warmup 1] [--steps 5] [--json FILE]\n");
  std::exit(0);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("forge_pipeline_bench: {} needs a value", arg);
      return argv[++i];
    };
    if (arg == "--schedules") {
      o.schedules = split_commas(next());
    } else if (arg == "--micro-batches") {
      o.micro_batches = std::stoi(next());
    } else if (arg == "--hidden") {
      o.hidden = std::stoll(next());
    } else if (arg == "--layers") {
      o.layers = std::stoll(next());
    } else if (arg == "--seq") {
      o.seq = std::stoll(next());
    } else if (arg == "--batch") {
      o.batch = std::stoll(next());
    } else if (arg == "--vocab") {
      o.vocab = std::stoll(next());
    } else if (arg == "--dtype") {
      o.dtype = next();
    } else if (arg == "--threads") {
      o.threads = std::stoi(next());
    } else if (arg == "--reps") {
      o.reps = std::stoi(next());
    } else if (arg == "--warmup") {
      o.warmup = std::stoi(next());
    } else if (arg == "--steps") {
      o.steps = std::stoi(next());
    } else if (arg == "--json") {
      o.json = next();
    } else if (arg == "--help" || arg == "-h") {
      usage_and_exit();
    } else {
      fail("forge_pipeline_bench: unknown argument '{}' (see --help)", arg);
    }
  }
  if (o.dtype != "auto" && o.dtype != "fp32" && o.dtype != "bf16")
    fail("forge_pipeline_bench: --dtype is auto, fp32 or bf16, not '{}'", o.dtype);
  if (o.hidden < 64 || o.hidden % 64 != 0) fail("forge_pipeline_bench: --hidden must be a multiple of 64");
  if (o.reps < 1 || o.steps < 1 || o.warmup < 0 || o.threads < 1 || o.micro_batches < 1)
    fail("forge_pipeline_bench: --reps, --steps, --threads and --micro-batches must be >= 1, --warmup >= 0");
  for (const std::string& s : o.schedules) try {
      (void)pipeline::schedule_kind(s);
    } catch (const Error& e) {
      fail("forge_pipeline_bench: --schedules: {}", e.what());
    }
  return o;
}

// The default model's proportions (ffn 2.75 x hidden, heads of 64, two queries per kv head), sized by
// hidden and layers. At hidden 256, 8 layers, seq 128 one stage's F takes some 10-50 ms on one core: long
// enough that per-action overheads and timer noise are small, short enough for the whole bench to run in a
// couple of minutes.
LlamaConfig bench_config(const Options& o) {
  LlamaConfig c;
  c.hidden_size = o.hidden, c.intermediate_size = (o.hidden * 11 / 4 + 63) / 64 * 64;
  c.num_hidden_layers = o.layers, c.head_dim = 64;
  c.num_attention_heads = o.hidden / 64, c.num_key_value_heads = std::max<int64_t>(1, o.hidden / 128);
  c.vocab_size = o.vocab, c.max_position_embeddings = o.seq, c.rms_norm_eps = 1e-5;
  c.validate("forge_pipeline_bench");
  return c;
}

struct Batches {
  std::vector<std::vector<int32_t>> ids, targets;
  int64_t batch = 0, seq = 0;
  float grad_scale = 0;
  models::MicroBatch operator()(int m) const {
    return {ids[m].data(), targets[m].data(), batch, seq, grad_scale};
  }
};

Batches make_batches(int count, int64_t batch, int64_t seq, int64_t vocab) {
  Batches b;
  b.batch = batch, b.seq = seq;
  b.ids.resize(count), b.targets.resize(count);
  for (int m = 0; m < count; ++m)
    for (int64_t i = 0; i < batch * seq; ++i) {
      const auto bits = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(m), 0, 0}, {11, 0});
      b.ids[m].push_back(static_cast<int32_t>(bits[0] % vocab));
      b.targets[m].push_back(static_cast<int32_t>(bits[1] % vocab));
    }
  b.grad_scale = 1.0f / static_cast<float>(count * batch * seq);
  return b;
}

// A model chunk that adds up the time spent in its compute: the rank's busy time within a step, free of the
// waits for messages that the executor's own per-action times (measured()) include, since a compute action
// waits for its input inside it.
class TimedChunk final : public pipeline::Chunk {
 public:
  explicit TimedChunk(train::ModelChunk& inner) : inner_(inner) {}
  Shape activation_shape() const override { return inner_.activation_shape(); }
  Device device() const override { return inner_.device(); }
  Tensor forward(int m, const Tensor& input) override {
    return timed(kF, [&] { return inner_.forward(m, input); });
  }
  Tensor backward_input(int m, const Tensor& doutput) override {
    return timed(kI, [&] { return inner_.backward_input(m, doutput); });
  }
  void backward_weight(int m) override {
    timed(kW, [&] {
      inner_.backward_weight(m);
      return Tensor();
    });
  }
  Tensor backward(int m, const Tensor& doutput) override {
    return timed(kB, [&] { return inner_.backward(m, doutput); });
  }
  int live_micro_batches() const override { return inner_.live_micro_batches(); }

  static constexpr int kF = 0, kB = 1, kI = 2, kW = 3;
  double busy = 0;               // this step
  std::vector<double> calls[4];  // [kind]: every call's seconds since the last clear (the timed steps)

 private:
  template <class F>
  Tensor timed(int kind, F&& f) {
    const auto t0 = clock_type::now();
    Tensor out = f();
    const double t = std::chrono::duration<double>(clock_type::now() - t0).count();
    busy += t, calls[kind].push_back(t);
    return out;
  }
  train::ModelChunk& inner_;
};

using bench::median;
using bench::seconds_since;

// Small deterministic values of the activation's shape: a stand-in for the previous stage's output or the
// next stage's gradient when a chunk is timed apart from its neighbours.
Tensor filler(const Shape& shape, float scale, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto bits = philox4x32_10({static_cast<uint32_t>(i), seed, 0, 0}, {3, 0});
    p[i] = scale * (static_cast<float>(bits[0] >> 8) / 16777216.0f - 0.5f);
  }
  return t;
}

// This rank's chunks of one schedule, built as the pipeline test builds them.
struct Stages {
  std::vector<std::unique_ptr<models::Model>> models;
  std::vector<std::unique_ptr<train::ModelChunk>> chunks;
  std::vector<std::unique_ptr<TimedChunk>> timed;
};

Stages build_stages(const pipeline::Placement& p, int rank, const LlamaConfig& config,
                    const nn::ComputeOptions& options, const Batches& batches, int64_t rows) {
  Stages s;
  for (int c = 0; c < p.chunks; ++c) {
    const models::StageSpec spec =
        models::StageSpec::split(config.num_hidden_layers, p.stages, p.stage(rank, c));
    s.models.push_back(models::build_model(config, options, spec, 0.02f));
    s.models.back()->initialize(5);
    s.chunks.push_back(std::make_unique<train::ModelChunk>(*s.models.back(), batches, rows));
    s.timed.push_back(std::make_unique<TimedChunk>(*s.chunks.back()));
  }
  return s;
}

// What one chunk costs, timed apart: F, fused B, I, W, and the F&B pair with this chunk's F (pair < 0: the
// schedule pairs this chunk's F with no B). apart = F + B of the pair's two halves timed alone.
struct ChunkCosts {
  double forward = 0, backward = 0, backward_input = 0, backward_weight = 0;
  double pair = -1, apart = -1;
};

// The chunk whose B the schedule most often pairs with this chunk's F on this rank, or -1.
int pair_partner(const pipeline::Schedule& schedule, int rank, int chunk) {
  std::map<int, int> count;
  for (const pipeline::Action& a : schedule.actions[rank])
    if (a.op == pipeline::Op::forward_backward && a.chunk == chunk) ++count[a.chunk_b];
  int best = -1, most = 0;
  for (auto [c, n] : count)
    if (n > most) best = c, most = n;
  return best;
}

ChunkCosts time_chunk(Stages& s, const pipeline::Placement& p, int rank, int c, int partner, int reps) {
  train::ModelChunk& chunk = *s.chunks[c];
  const Shape shape = chunk.activation_shape();
  auto input_of = [&](int cc) { return p.is_first_stage(rank, cc) ? Tensor() : filler(shape, 2.0f, 1); };
  auto dout_of = [&](int cc) { return p.is_last_stage(rank, cc) ? Tensor() : filler(shape, 1e-3f, 2); };
  const Tensor input = input_of(c), doutput = dout_of(c);
  auto timed = [](auto&& f) {
    const auto t0 = clock_type::now();
    f();
    return seconds_since(t0);
  };
  std::vector<double> f, b, i, w, pair, pb;
  for (int r = 0; r < reps + 1; ++r) {  // the first repetition is the warm-up
    const double f0 = timed([&] { chunk.forward(0, input); });
    const double b0 = timed([&] { chunk.backward(0, doutput); });
    const double f1 = timed([&] { chunk.forward(1, input); });
    const double i1 = timed([&] { chunk.backward_input(1, doutput); });
    const double w1 = timed([&] { chunk.backward_weight(1); });
    double pr = -1, pbr = -1;
    if (partner >= 0) {
      // As the executor runs the pair: F of micro-batch 3 on this chunk, then B of micro-batch 2 (whose F
      // ran earlier) on the partner. The B alone is timed too, since the partner's B differs from ours.
      train::ModelChunk& other = *s.chunks[partner];
      const Tensor other_in = input_of(partner), other_dout = dout_of(partner);
      other.forward(2, other_in);
      pr = timed([&] {
        chunk.forward(3, input);
        other.backward(2, other_dout);
      });
      chunk.backward(3, doutput);
      other.forward(2, other_in);
      pbr = timed([&] { other.backward(2, other_dout); });
    }
    if (r == 0) continue;
    f.push_back(f0), f.push_back(f1), b.push_back(b0), i.push_back(i1), w.push_back(w1);
    if (partner >= 0) pair.push_back(pr), pb.push_back(pbr);
  }
  ChunkCosts out;
  out.forward = median(f), out.backward = median(b), out.backward_input = median(i);
  out.backward_weight = median(w);
  if (partner >= 0) out.pair = median(pair), out.apart = out.forward + median(pb);
  for (auto& ch : s.chunks) ch->reset_loss();
  for (auto& m : s.models) m->params().zero_grads();
  return out;
}

// One-way time of one activation between ranks 0 and 1 (half the median round trip), and the time a
// non-blocking send takes to post (what it occupies the sending rank), each the median of `reps` after a
// warm-up.
struct SendCosts {
  double one_way = 0, post = 0;
};

SendCosts time_send(comm::Communicator& world, const Shape& shape, int reps) {
  constexpr int kTag = 7;  // apart from the executor's two channel tags
  Tensor buf = filler(shape, 1.0f, 4);
  const int64_t n = buf.numel();
  std::vector<double> trips, posts;
  world.barrier().wait();
  for (int r = 0; r < reps + 2; ++r) {  // the first two are the warm-up
    const auto t0 = clock_type::now();
    double post = 0;
    if (world.rank() == 0) {
      comm::Request s = world.send(buf.raw(), n, comm::Type::f32, 1, kTag);
      post = seconds_since(t0);
      s.wait();
      world.recv(buf.raw(), n, comm::Type::f32, 1, kTag).wait();
    } else if (world.rank() == 1) {
      world.recv(buf.raw(), n, comm::Type::f32, 0, kTag).wait();
      world.send(buf.raw(), n, comm::Type::f32, 0, kTag).wait();
    }
    if (r >= 2) trips.push_back(seconds_since(t0)), posts.push_back(post);
  }
  SendCosts out;
  out.one_way = median(trips) / 2, out.post = median(posts);
  double v[2] = {world.rank() == 0 ? out.one_way : 0, world.rank() == 0 ? out.post : 0};
  comm::all_reduce_sum(world, v, 2);  // rank 0's, on every rank
  out.one_way = v[0], out.post = v[1];
  return out;
}

// One chunk's F, B, I, W and F&B pair in seconds; < 0 where not measured.
using StageFields = std::array<double, 5>;

// Every rank's per-chunk costs as one Costs with an entry per stage, on every rank. Each stage's entry is
// the mean over the chunks that compute it: one, or with DualPipe's mirrored copies one on each rank. A
// field nobody measured keeps the replay's meaning of < 0 (B = I + W, F&B = F + B); F, I or W unmeasured
// (1F1B runs no I or W) are 0, which no action of that schedule reads.
pipeline::Costs gather_costs(comm::Communicator& world, const pipeline::Placement& p,
                             const std::vector<StageFields>& per_chunk, const SendCosts& send) {
  constexpr int kFields = std::tuple_size_v<StageFields>;
  std::vector<double> sums(static_cast<size_t>(p.stages) * kFields * 2, 0.0);  // [stage][sum..., count...]
  for (int c = 0; c < p.chunks; ++c) {
    double* at = sums.data() + static_cast<size_t>(p.stage(world.rank(), c)) * kFields * 2;
    for (int k = 0; k < kFields; ++k)
      if (per_chunk[c][k] >= 0) at[k] += per_chunk[c][k], at[kFields + k] += 1;
  }
  comm::all_reduce_sum(world, sums.data(), static_cast<int64_t>(sums.size()));
  pipeline::Costs costs;
  costs.send = send.post;
  costs.latency = std::max(0.0, send.one_way - send.post);
  for (int st = 0; st < p.stages; ++st) {
    const double* at = sums.data() + static_cast<size_t>(st) * kFields * 2;
    auto mean = [&](int k, double none) { return at[kFields + k] > 0 ? at[k] / at[kFields + k] : none; };
    pipeline::StageCosts sc;
    sc.forward = mean(0, 0), sc.backward = mean(1, -1), sc.backward_input = mean(2, 0);
    sc.backward_weight = mean(3, 0), sc.forward_backward = mean(4, -1);
    costs.per_stage.push_back(sc);
  }
  return costs;
}

struct Result {
  std::string name;
  double step = 0, replay_makespan = 0, bubble = 0, replay_bubble = 0;
  double bubble_actions = 0;  // from the executor's per-action times (their compute actions include waits)
  int peak_activations = 0, executor_peak_held = 0;
  std::vector<double> rank_busy, rank_bubble;
  pipeline::Costs costs;                 // timed apart (1.)
  pipeline::Costs step_costs;            // the medians of the chunks' calls within the timed steps
  double replay_step_costs = 0;          // the replay under step_costs
  double pair = -1, apart = -1;          // averaged over the ranks' paired chunks
  double replay_bubble_no_overlap = -1;  // with F&B = F + B (the pair schedules)
  double replay_makespan_no_overlap = -1;
};

Result run_schedule(const std::string& name, const Options& o, const LlamaConfig& config,
                    const nn::ComputeOptions& options, const SendCosts& send) {
  comm::Communicator& world = comm::world();
  const int ranks = world.size(), rank = world.rank();
  const pipeline::ScheduleKind kind = pipeline::schedule_kind(name);
  const pipeline::ScheduleRequest request{kind, ranks, o.micro_batches,
                                          kind == pipeline::ScheduleKind::interleaved ? 2 : 1};
  const pipeline::Schedule schedule = pipeline::make_schedule(request);
  const pipeline::Placement& p = schedule.placement;
  const Batches batches = make_batches(o.micro_batches, o.batch, o.seq, config.vocab_size);
  Stages s = build_stages(p, rank, config, options, batches, o.batch * o.seq);

  // 1. Per-action costs.
  std::vector<StageFields> mine(static_cast<size_t>(p.chunks));
  double pair_totals[3] = {0, 0, 0};  // pair, F + B apart, pairs
  for (int c = 0; c < p.chunks; ++c) {
    const int partner = pair_partner(schedule, rank, c);
    const ChunkCosts cc = time_chunk(s, p, rank, c, partner, o.reps);
    mine[c] = {cc.forward, cc.backward, cc.backward_input, cc.backward_weight, cc.pair};
    if (cc.pair >= 0) pair_totals[0] += cc.pair, pair_totals[1] += cc.apart, pair_totals[2] += 1;
  }
  comm::all_reduce_sum(world, pair_totals, 3);
  Result res;
  res.name = name;
  res.costs = gather_costs(world, p, mine, send);
  if (pair_totals[2] > 0)
    res.pair = pair_totals[0] / pair_totals[2], res.apart = pair_totals[1] / pair_totals[2];

  // 2. Whole steps.
  std::vector<pipeline::Chunk*> ptrs;
  for (auto& t : s.timed) ptrs.push_back(t.get());
  const pipeline::Links links(world);
  pipeline::Executor executor(schedule, rank, ptrs, links);
  std::vector<double> steps, busy, busy_actions;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    for (int c = 0; c < p.chunks; ++c) {
      s.models[c]->params().zero_grads();
      s.models[c]->params().begin_grad_step(static_cast<int>(p.micro_batches_of(rank, c).size()));
      s.chunks[c]->reset_loss();
      s.timed[c]->busy = 0;
    }
    world.barrier().wait();
    const auto t0 = clock_type::now();
    executor.run(/*measure=*/true);
    const double mine = seconds_since(t0);
    const double step = comm::all_reduce_max(world, mine);
    if (i < o.warmup) {
      for (auto& t : s.timed)
        for (auto& v : t->calls) v.clear();
      continue;
    }
    steps.push_back(step);
    double b = 0;
    for (auto& t : s.timed) b += t->busy;
    busy.push_back(b);
    double ba = 0;
    const std::vector<pipeline::Action>& list = schedule.actions[rank];
    for (size_t k = 0; k < list.size(); ++k)
      if (pipeline::is_compute(list[k].op)) ba += executor.measured()[k].end - executor.measured()[k].start;
    busy_actions.push_back(ba);
  }
  res.step = median(steps);
  std::vector<StageFields> in_step(static_cast<size_t>(p.chunks));
  for (int c = 0; c < p.chunks; ++c) {
    const TimedChunk& t = *s.timed[c];
    for (int k = 0; k < 4; ++k) in_step[c][k] = t.calls[k].empty() ? -1 : median(t.calls[k]);
    in_step[c][4] = -1;  // in a step the pair's halves are the chunks' F and B calls
  }
  res.step_costs = gather_costs(world, p, in_step, send);
  res.executor_peak_held = static_cast<int>(comm::all_reduce_max(world, executor.peak_held_tensors()));
  std::vector<double> per_rank(static_cast<size_t>(ranks) * 2, 0.0);
  per_rank[rank] = median(busy), per_rank[ranks + rank] = median(busy_actions);
  comm::all_reduce_sum(world, per_rank.data(), static_cast<int64_t>(per_rank.size()));
  double bubble_sum = 0, bubble_actions_sum = 0;
  for (int r = 0; r < ranks; ++r) {
    res.rank_busy.push_back(per_rank[r]);
    res.rank_bubble.push_back(1 - per_rank[r] / res.step);
    bubble_sum += res.rank_bubble.back();
    bubble_actions_sum += 1 - per_rank[ranks + r] / res.step;
  }
  res.bubble = bubble_sum / ranks, res.bubble_actions = bubble_actions_sum / ranks;

  // 3. The prediction (every rank computes it; only rank 0 prints).
  const pipeline::Replay predicted = pipeline::replay(schedule, res.costs);
  res.replay_makespan = predicted.makespan;
  res.replay_bubble = predicted.bubble_fraction();
  res.peak_activations = predicted.max_peak_activations();
  res.replay_step_costs = pipeline::replay(schedule, res.step_costs).makespan;
  if (res.pair >= 0) {
    pipeline::Costs no_overlap = res.costs;
    for (pipeline::StageCosts& sc : no_overlap.per_stage) sc.forward_backward = -1;
    const pipeline::Replay r = pipeline::replay(schedule, no_overlap);
    res.replay_bubble_no_overlap = r.bubble_fraction(), res.replay_makespan_no_overlap = r.makespan;
  }
  return res;
}

// ZB-V and DualPipeV replayed at unit costs (F = I = W = 1, F&B = F + B, no communication time): the
// schedules' shapes alone, free of any measurement.
struct Reference {
  double zbv_idle = 0, zbv_bubble = 0, dualpipev_idle = 0, dualpipev_bubble = 0;
  int replayed = 0;  // 2 when both schedules accept the request
};

Reference unit_cost_reference(int ranks, int micro_batches) {
  Reference r;
  for (const pipeline::ScheduleKind kind : {pipeline::ScheduleKind::zbv, pipeline::ScheduleKind::dualpipev}) {
    const pipeline::ScheduleRequest request{kind, ranks, micro_batches, 1};
    if (!pipeline::schedule_refusal(request).empty()) continue;
    const pipeline::Replay rep = pipeline::replay(pipeline::make_schedule(request));
    const double idle = rep.bubble_fraction() * rep.makespan;
    ++r.replayed;
    if (kind == pipeline::ScheduleKind::zbv)
      r.zbv_idle = idle, r.zbv_bubble = rep.bubble_fraction();
    else
      r.dualpipev_idle = idle, r.dualpipev_bubble = rep.bubble_fraction();
  }
  return r;
}

nlohmann::json costs_json(const pipeline::Costs& c) {
  nlohmann::json stages = nlohmann::json::array();
  for (const pipeline::StageCosts& s : c.per_stage)
    stages.push_back({{"forward_s", s.forward},
                      {"backward_s", s.backward},
                      {"backward_input_s", s.backward_input},
                      {"backward_weight_s", s.backward_weight},
                      {"forward_backward_s", s.forward_backward}});
  return {{"per_stage", stages}, {"send_s", c.send}, {"latency_s", c.latency}};
}

int run(int argc, char** argv) {
  comm::Communicator& world = comm::world(/*force_mpi=*/true);
  const Options o = parse(argc, argv);
  if (world.size() != 2) fail("forge_pipeline_bench: run under mpirun -np 2 (got {} ranks)", world.size());
  omp_set_num_threads(o.threads);
  const bool bf16 = o.dtype == "bf16" || (o.dtype == "auto" && cpu_has_native_bf16());
  nn::ComputeOptions options;
  options.gemm_dtype = bf16 ? DType::bf16 : DType::f32;
  const LlamaConfig config = bench_config(o);
  const bool root = world.rank() == 0;
  if (root) {
    std::printf(
        "# forge_pipeline_bench: 2 ranks x %d thread(s), LLaMA hidden %lld ffn %lld layers %lld heads "
        "%lld/%lld "
        "vocab %lld, micro-batch %lld x %lld tokens, %s%s, %d micro-batches; costs median of %d, steps "
        "median of "
        "%d after %d warm-up\n",
        o.threads, static_cast<long long>(config.hidden_size),
        static_cast<long long>(config.intermediate_size), static_cast<long long>(config.num_hidden_layers),
        static_cast<long long>(config.num_attention_heads),
        static_cast<long long>(config.num_key_value_heads), static_cast<long long>(config.vocab_size),
        static_cast<long long>(o.batch), static_cast<long long>(o.seq), bf16 ? "bf16" : "fp32",
        o.dtype == "auto" ? " (auto)" : "", o.micro_batches, o.reps, o.steps, o.warmup);
    std::fflush(stdout);
  }
  const SendCosts send = time_send(world, {o.batch * o.seq, config.hidden_size}, std::max(o.reps * 4, 20));

  std::vector<Result> results;
  for (const std::string& name : o.schedules) {
    const pipeline::ScheduleKind kind = pipeline::schedule_kind(name);
    const pipeline::ScheduleRequest request{kind, world.size(), o.micro_batches,
                                            kind == pipeline::ScheduleKind::interleaved ? 2 : 1};
    std::string refusal = pipeline::schedule_refusal(request);
    if (refusal.empty() && pipeline::stage_count(request) > config.num_hidden_layers)
      refusal =
          fmt::format("{} stages over {} layers", pipeline::stage_count(request), config.num_hidden_layers);
    if (!refusal.empty()) {
      if (root) std::printf("# %s: skipped, %s\n", name.c_str(), refusal.c_str());
      continue;
    }
    results.push_back(run_schedule(name, o, config, options, send));
    if (root) {
      const Result& r = results.back();
      std::printf("# %s done: step %.1f ms\n", name.c_str(), r.step * 1e3);
      std::fflush(stdout);
    }
  }

  if (root) {
    std::printf(
        "\nsend of one activation (%lld x %lld f32): one way %.3f ms (ping-pong), posting %.3f ms\n\n",
        static_cast<long long>(o.batch * o.seq), static_cast<long long>(config.hidden_size),
        send.one_way * 1e3, send.post * 1e3);
    std::printf("per-stage costs (ms, median apart from any schedule): F / B / I / W / F&B pair\n");
    for (const Result& r : results) {
      std::printf("  %-12s", r.name.c_str());
      for (size_t st = 0; st < r.costs.per_stage.size(); ++st) {
        const pipeline::StageCosts& c = r.costs.per_stage[st];
        std::printf(" | s%zu %.1f/%.1f/%.1f/%.1f", st, c.forward * 1e3, c.backward * 1e3,
                    c.backward_input * 1e3, c.backward_weight * 1e3);
        if (c.forward_backward >= 0) std::printf("/%.1f", c.forward_backward * 1e3);
      }
      std::printf("\n");
    }
    std::printf("\n%-12s %10s %10s %9s %9s %9s %9s %11s %9s\n", "schedule", "step ms", "replay ms",
                "meas/rep", "bubble%", "replay%", "peak act", "replay* ms", "meas/rep*");
    for (const Result& r : results)
      std::printf("%-12s %10.1f %10.1f %9.3f %9.1f %9.1f %9d %11.1f %9.3f\n", r.name.c_str(), r.step * 1e3,
                  r.replay_makespan * 1e3, r.step / r.replay_makespan, r.bubble * 100, r.replay_bubble * 100,
                  r.peak_activations, r.replay_step_costs * 1e3, r.step / r.replay_step_costs);
    std::printf(
        "(step: median over the steps of the slowest rank; bubble: 1 - time inside the chunks' compute / "
        "step, "
        "averaged over the ranks; replay: the same schedule replayed under the costs above; peak act: the "
        "most "
        "micro-batches' activations one rank holds, in the replay; replay*: replayed under the medians of "
        "the "
        "chunks' own calls within the timed steps instead, which separates an error of the costs timed apart "
        "from one of the replay's model of the schedule)\n");
    for (const Result& r : results) {
      if (r.pair < 0) continue;
      std::printf(
          "\n%s F&B pair (per pair, averaged over the ranks' paired chunks): %.2f ms for F of one "
          "micro-batch "
          "then B of another run back to back as one action, vs %.2f ms for the same F + B timed apart: "
          "ratio %.3f. Measured on one core per rank, with no message in between: the two halves compute one "
          "after the other, so no ratio below 1 is possible from compute; in a step the pair can only hide "
          "the forward's send behind the backward.\n",
          r.name.c_str(), r.pair * 1e3, r.apart * 1e3, r.pair / r.apart);
      std::printf("%s replay: %.1f ms with the measured pair, %.1f ms (bubble %.1f%%) with F&B = F + B\n",
                  r.name.c_str(), r.replay_makespan * 1e3, r.replay_makespan_no_overlap * 1e3,
                  r.replay_bubble_no_overlap * 100);
    }
    const auto find = [&](const std::string& n) -> const Result* {
      for (const Result& r : results)
        if (r.name == n) return &r;
      return nullptr;
    };
    // The reference fact (docs/parallelism.md): without a real overlap DualPipeV idles twice as long as
    // ZB-V, since its longer warm-up is paid for by the overlap alone. At unit costs it is exact; under the
    // measured costs it holds as far as F, I and W are even.
    const Reference ref = unit_cost_reference(world.size(), o.micro_batches);
    if (ref.replayed == 2)
      std::printf(
          "\nwithout a real overlap (F&B = F + B), unit costs F = I = W = 1: dualpipev idles %.2f per rank "
          "(bubble %.1f%%), zbv %.2f (%.1f%%): %.2fx\n",
          ref.dualpipev_idle, ref.dualpipev_bubble * 100, ref.zbv_idle, ref.zbv_bubble * 100,
          ref.zbv_idle > 0 ? ref.dualpipev_idle / ref.zbv_idle : 0.0);
    if (const Result* v = find("dualpipev"), *z = find("zbv"); v && z && v->replay_bubble_no_overlap >= 0) {
      const double v_idle = v->replay_bubble_no_overlap * v->replay_makespan_no_overlap;
      const double z_idle = z->replay_bubble * z->replay_makespan;
      std::printf(
          "the same under the measured costs: dualpipev idles %.1f ms per rank (bubble %.1f%%), zbv %.1f ms "
          "(%.1f%%): %.2fx\n",
          v_idle * 1e3, v->replay_bubble_no_overlap * 100, z_idle * 1e3, z->replay_bubble * 100,
          z_idle > 0 ? v_idle / z_idle : 0.0);
    }
    std::fflush(stdout);

    if (!o.json.empty()) {
      nlohmann::json j;
      j["config"] = {{"ranks", world.size()},
                     {"threads_per_rank", o.threads},
                     {"dtype", bf16 ? "bf16" : "fp32"},
                     {"model", config.to_json()},
                     {"batch", o.batch},
                     {"seq", o.seq},
                     {"micro_batches", o.micro_batches},
                     {"reps", o.reps},
                     {"warmup", o.warmup},
                     {"steps", o.steps}};
      j["send"] = {{"one_way_s", send.one_way}, {"post_s", send.post}};
      j["unit_cost_reference"] = {{"zbv_idle", ref.zbv_idle},
                                  {"zbv_bubble", ref.zbv_bubble},
                                  {"dualpipev_idle_no_overlap", ref.dualpipev_idle},
                                  {"dualpipev_bubble_no_overlap", ref.dualpipev_bubble}};
      j["schedules"] = nlohmann::json::array();
      for (const Result& r : results) {
        nlohmann::json s = {{"name", r.name},
                            {"step_s", r.step},
                            {"replay_s", r.replay_makespan},
                            {"measured_over_replay", r.step / r.replay_makespan},
                            {"bubble", r.bubble},
                            {"bubble_from_action_times", r.bubble_actions},
                            {"replay_bubble", r.replay_bubble},
                            {"peak_activations_replay", r.peak_activations},
                            {"executor_peak_held_tensors", r.executor_peak_held},
                            {"rank_busy_s", r.rank_busy},
                            {"rank_bubble", r.rank_bubble},
                            {"costs", costs_json(r.costs)},
                            {"replay_s_step_costs", r.replay_step_costs},
                            {"step_costs", costs_json(r.step_costs)}};
        if (r.pair >= 0) {
          s["pair_s"] = r.pair, s["pair_apart_s"] = r.apart, s["pair_over_apart"] = r.pair / r.apart;
          s["replay_s_no_overlap"] = r.replay_makespan_no_overlap;
          s["replay_bubble_no_overlap"] = r.replay_bubble_no_overlap;
        }
        j["schedules"].push_back(s);
      }
      std::ofstream out(o.json);
      if (!out) fail("forge_pipeline_bench: cannot write --json {}", o.json);
      out << j.dump(2) << "\n";
      std::printf("wrote %s\n", o.json.c_str());
    }
  }
  comm::finalize();
  return 0;
}

}  // namespace
}  // namespace forge

int main(int argc, char** argv) { return forge::bench::run_mpi_bench(forge::run, argc, argv); }
