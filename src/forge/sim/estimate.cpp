#include "forge/sim/estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "forge/core/error.h"
#include "forge/parallel/layout.h"
#include "forge/parallel/pipeline/replay.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::sim {
namespace {

std::string trace_key(const Strategy& s, int pp_rank) {
  return fmt::format(
      "{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", s.cp,
      static_cast<int>(s.cp_comm), s.tp, s.pp, s.dp, s.ep, s.ep_overlap, s.vpp, static_cast<int>(s.schedule),
      s.pp_layers, s.sequence_parallel, s.distributed_optimizer, s.optimizer_offload, s.overlap_grad_reduce,
      s.bucket_mb, s.grad_reduce_in_bf16, s.micro_batch, s.grad_accum, s.seq, static_cast<int>(s.recompute),
      s.recompute_layers, s.recompute_modules, dtype_name(s.dtype), s.fp8_recipe,
      dtype_name(s.activation_dtype), s.fp32_residual, s.moe_capacity_factor, s.moe_pad_to_capacity,
      s.vocab_divisible_by, pp_rank);
}

parallel::Dim dim_of(const std::string& group) {
  if (group == "tp") return parallel::Dim::tp;
  if (group == "cp") return parallel::Dim::cp;
  if (group == "dp") return parallel::Dim::dp_cp;
  if (group == "ep") return parallel::Dim::ep;
  if (group == "expert_dp") return parallel::Dim::expert_dp;
  if (group == "pp" || group == "pp_mirror" || group == "pp_tied_embedding") return parallel::Dim::pp;
  return parallel::Dim::model_parallel;
}

// Costs a rank's phases on the cluster: the ops by the profile, each group's messages over its link.
class RankCoster {
 public:
  RankCoster(const Cluster& cluster, const Strategy& s, int pp_rank)
      : cluster_(cluster), layout_({s.tp, s.pp, s.dp, s.cp, s.ep}, s.world(), 0) {
    rank_ = layout_.rank_of(0, 0, 0, pp_rank);
  }
  const Link& link(const std::string& group) const {
    return cluster_.link(layout_.group_ranks_of(rank_, dim_of(group)));
  }
  double comm(const CommEvent& e) const { return comm_seconds(e, link(e.group)); }
  double ops(const Phase& p) const { return cluster_.hardware.rows_seconds(p.rows); }
  // Ops plus the collectives the phase waits for (all but the data-parallel reductions, which overlap). An
  // expert all-to-all with ops run while it was in flight hides under them, all but the link's host share;
  // what is left of those on the path adds to *ep_path.
  double critical(const Phase& p, TimeEstimate* t = nullptr, double* ep_path = nullptr) const {
    double total = ops(p);
    for (const CommEvent& e : p.comm) {
      if (e.group == "dp" || e.group == "expert_dp") continue;
      double c = comm(e);
      if (!e.overlapped.empty())
        c = std::max(link(e.group).host_share * c, c - cluster_.hardware.rows_seconds(e.overlapped));
      total += c;
      if (t && e.group == "tp") t->tp_comm += c;
      if (t && e.group == "ep") t->ep_comm += c;
      if (t && e.group == "cp") t->cp_comm += c;
      if (ep_path && e.group == "ep") *ep_path += c;
    }
    return total;
  }

 private:
  const Cluster& cluster_;
  parallel::Layout layout_;
  int rank_ = 0;
};

// Memory at the peak of a rank under the replayed schedule: every chunk's activations held from the start
// of its forward to the end of its backward, plus the transient of the action running then. Split in two,
// B frees at its end what only the input gradients read, and W the rest.
struct Held {
  int64_t bytes = 0, transient = 0;
  int in_flight = 0;
};

Held peak_held(const pipeline::Schedule& schedule, const pipeline::Replay& replay, int rank,
               const RankTrace& t) {
  const std::vector<pipeline::Action>& list = schedule.actions[static_cast<size_t>(rank)];
  struct Event {
    double time;
    int order;  // frees before allocations at the same instant
    int64_t delta;
    int count;
    int64_t transient;
  };
  std::vector<Event> events;
  for (size_t i = 0; i < list.size(); ++i) {
    const pipeline::Action& a = list[i];
    const pipeline::Timed& when = replay.ranks[static_cast<size_t>(rank)].times[i];
    auto chunk_of = [&](int c) -> const ChunkTrace& { return t.chunks.at(static_cast<size_t>(c)); };
    auto forward = [&](int c) {
      events.push_back({when.start, 1, chunk_of(c).activation_bytes, 1,
                        chunk_of(c).forward.transient_bytes - chunk_of(c).activation_bytes});
    };
    // B's kept bytes are what it freed (negative); W frees what is left.
    const auto freed_by_b = [&](int c) {
      return std::min<int64_t>(0, chunk_of(c).backward_input.kept_bytes);
    };
    auto release = [&](int c, int64_t transient, int64_t bytes, int count) {
      events.push_back({when.start, 1, 0, 0, transient});
      events.push_back({when.end, 0, -bytes, -count, 0});
    };
    switch (a.op) {
      case pipeline::Op::forward:
        forward(a.chunk);
        break;
      case pipeline::Op::backward:
        release(a.chunk, chunk_of(a.chunk).backward.transient_bytes, chunk_of(a.chunk).activation_bytes, 1);
        break;
      case pipeline::Op::backward_input:
        release(a.chunk, chunk_of(a.chunk).backward_input.transient_bytes, -freed_by_b(a.chunk), 0);
        break;
      case pipeline::Op::backward_weight:
        release(a.chunk, chunk_of(a.chunk).backward_weight.transient_bytes,
                chunk_of(a.chunk).activation_bytes + freed_by_b(a.chunk), 1);
        break;
      case pipeline::Op::forward_backward:
        forward(a.chunk);
        release(a.chunk_b, chunk_of(a.chunk_b).backward.transient_bytes, chunk_of(a.chunk_b).activation_bytes,
                1);
        break;
      default:
        break;
    }
  }
  std::stable_sort(events.begin(), events.end(), [](const Event& x, const Event& y) {
    return x.time != y.time ? x.time < y.time : x.order < y.order;
  });
  Held best, now;
  for (const Event& e : events) {
    now.bytes += e.delta, now.in_flight += e.count;
    const int64_t total = now.bytes + std::max<int64_t>(0, e.transient);
    if (total > best.bytes + best.transient)
      best = {now.bytes, std::max<int64_t>(0, e.transient), now.in_flight};
  }
  return best;
}

}  // namespace

// "" when `total` bytes fit in a device of h; else by how much they do not, and what dominates.
// The offloaded update: gradients down, the host's update, weights up, pipelined over the chunks (each
// stage of a chunk overlaps the other stages of its neighbours; the link carries both directions at once):
// the slowest stage's total, plus one chunk's worth of the other two filling and draining the pipeline.
static double offload_seconds(const HardwareProfile& hw, const RankTrace& rt) {
  const double down = static_cast<double>(rt.offload_down_bytes) / (hw.host_link_gbs * 1e9);
  const double up = static_cast<double>(rt.offload_up_bytes) / (hw.host_link_gbs * 1e9);
  const double update =
      28.0 * static_cast<double>(rt.offload_update_elements) / (hw.host_memory_bandwidth_gbs * 1e9);
  const double slowest = std::max({down, up, update});
  return slowest +
         (down + up + update - slowest) / static_cast<double>(std::max<int64_t>(1, rt.offload_chunks));
}

static std::string over_memory(const HardwareProfile& h, int64_t total, const std::string& where,
                               const std::string& dominant) {
  const int64_t capacity = static_cast<int64_t>(h.memory_gib * 1073741824.0);
  if (total <= capacity) return "";
  return fmt::format("needs {}{}, {} over the {} of a {} (most of it {})", human_bytes(total), where,
                     human_bytes(total - capacity), human_bytes(capacity), h.name, dominant);
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (std::fabs(b) >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (std::fabs(b) >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", b / 1024.0);
}

std::string MemoryEstimate::dominant() const {
  const std::pair<int64_t, const char*> parts[] = {{weights, "parameters and gradients"},
                                                   {optimizer, "optimizer state"},
                                                   {activations, "activations"},
                                                   {transient, "the largest transient"}};
  return std::max_element(std::begin(parts), std::end(parts))->second;
}

Simulator::Simulator(const models::ModelConfig& config, Cluster cluster, TraceOptions options)
    : config_(config.clone()), cluster_(std::move(cluster)), options_(options) {
  // A CPU profile predicts a CPU run: the dry trace takes the shapes forge's CPU kernels use.
  if (cluster_.hardware.threads > 0 && !options_.shaped_for) options_.shaped_for = Device::cpu;
}

const RankTrace& Simulator::trace(const Strategy& s, int pp_rank) {
  std::unique_ptr<RankTrace>& slot = cache_[trace_key(s, pp_rank)];
  if (!slot) {
    slot = std::make_unique<RankTrace>(trace_rank(*config_, s, pp_rank, options_));
    ++traces_run_;
  }
  return *slot;
}

Estimate Simulator::estimate(const Strategy& s) {
  if (s.world() > cluster_.devices())
    fail("strategy {} needs {} ranks; the cluster ({}) has {}", s.describe(), s.world(), cluster_.source,
         cluster_.devices());
  if (s.micro_batch < 1 || s.grad_accum < 1 || s.seq < 1)
    fail("strategy {}: micro-batch, micro-batches per step and sequence length must be >= 1", s.describe());
  const HardwareProfile& hw = cluster_.hardware;
  if (s.optimizer_offload && hw.host_link_gbs <= 0)
    fail(
        "strategy {}: optimizer offload needs the host behind each device (host_link_gbs, "
        "host_memory_bandwidth_gbs, host_memory_gib), which {} ({}) does not describe",
        s.describe(), hw.name, hw.source.empty() ? "built in" : hw.source);
  if (s.optimizer_offload && s.dtype != DType::bf16)
    fail("strategy {}: optimizer offload needs bf16 GEMMs (the device keeps bf16 weights)", s.describe());
  Estimate e;
  e.strategy = s;
  TimeEstimate& t = e.time;
  last_.clear();
  // The cache is bounded: a search of thousands of strategies re-uses few traces, and each can take
  // megabytes (every one kept, a 70B search outgrew 24 GB). Emptied between estimates, never during one.
  if (cache_.size() >= kMaxCachedTraces) cache_.clear();
  for (int r = 0; r < s.pp; ++r) last_.push_back(&trace(s, r));

  // Per-stage action costs, and each rank's work outside the schedule.
  std::unique_ptr<pipeline::Schedule> schedule;
  pipeline::Costs costs;
  int stages = 1;
  if (s.pp > 1) {
    schedule = std::make_unique<pipeline::Schedule>(pipeline::make_schedule(
        {s.schedule, s.pp, static_cast<int>(s.grad_accum), s.vpp, s.ep > 1 && s.ep_overlap}));
    stages = schedule->placement.stages;
  }
  costs.per_stage.assign(static_cast<size_t>(stages), {});
  std::vector<double> before(static_cast<size_t>(s.pp)), after(static_cast<size_t>(s.pp)),
      dp_exposed(static_cast<size_t>(s.pp)), dp_total(static_cast<size_t>(s.pp)),
      updates(static_cast<size_t>(s.pp)), offloads(static_cast<size_t>(s.pp));
  std::vector<TimeEstimate> comm_of(static_cast<size_t>(s.pp));
  double send = 0, latency = 0;
  for (int r = 0; r < s.pp; ++r) {
    const RankTrace& rt = *last_[static_cast<size_t>(r)];
    RankCoster cost(cluster_, s, r);
    TimeEstimate& mine = comm_of[static_cast<size_t>(r)];
    // Overlapped F&B pairs (the executor interleaves a pair's halves only under expert parallelism's
    // overlap).
    if (s.ep > 1 && s.ep_overlap)
      costs.pair_host_share = std::max(costs.pair_host_share, cost.link("ep").host_share);
    double last_backward = 0;
    for (const ChunkTrace& c : rt.chunks) {
      TimeEstimate per_micro_batch;
      pipeline::StageCosts& sc = costs.per_stage.at(static_cast<size_t>(c.stage));
      sc.forward = cost.critical(c.forward, &per_micro_batch, &sc.forward_comm);
      sc.backward = cost.critical(c.backward, &per_micro_batch, &sc.backward_comm);
      sc.backward_input = cost.critical(c.backward_input);
      sc.backward_weight = cost.critical(c.backward_weight);
      const double micro_batches =
          static_cast<double>(s.grad_accum) / (schedule && schedule->placement.mirrored ? 2 : 1);
      mine.tp_comm += per_micro_batch.tp_comm * micro_batches;
      mine.ep_comm += per_micro_batch.ep_comm * micro_batches;
      mine.cp_comm += per_micro_batch.cp_comm * micro_batches;
      before[static_cast<size_t>(r)] += std::max(0.0, cost.critical(c.forward_first) - sc.forward);
      last_backward += sc.backward;
      if (c.output_bytes > 0 && s.pp > 1) {
        const Link& l = cost.link("pp");
        send = std::max(send, static_cast<double>(c.output_bytes) / (l.bandwidth_gbs * 1e9));
        latency = std::max(latency, l.latency_us * 1e-6);
      }
    }
    before[static_cast<size_t>(r)] += cost.critical(rt.step_begin);
    // Data-parallel buckets launched under the last micro-batch's backward: each when ready (spread over
    // that backward by bytes), one after another on the link; what runs past its end is exposed. The link's
    // host share of each bucket (MPI's copies and sums on the rank's own thread) lengthens that backward.
    std::vector<std::pair<int64_t, double>> buckets;  // (bytes, seconds)
    double host_stall = 0;
    for (const ChunkTrace& c : rt.chunks)
      for (const Phase* p : {&c.backward_input, &c.backward_weight})
        for (const CommEvent& ev : p->comm)
          if (ev.group == "dp" || ev.group == "expert_dp") {
            buckets.push_back({ev.bytes, cost.comm(ev)});
            host_stall += cost.link(ev.group).host_share * buckets.back().second;
          }
    int64_t total_bytes = 0;
    for (const auto& b : buckets) total_bytes += b.first;
    const double backward_end = last_backward + host_stall;
    double link_free = 0, ready_bytes = 0;
    for (const auto& [bytes, seconds] : buckets) {
      ready_bytes += static_cast<double>(bytes);
      const double ready =
          total_bytes > 0 ? backward_end * ready_bytes / static_cast<double>(total_bytes) : 0;
      link_free = std::max(link_free, ready) + seconds;
      dp_total[static_cast<size_t>(r)] += seconds;
    }
    dp_exposed[static_cast<size_t>(r)] = host_stall + std::max(0.0, link_free - backward_end);
    // The update: the rest of the reductions, the norm, the AdamW step, ZeRO-1's all-gather.
    double end_comm = 0;
    for (const CommEvent& ev : rt.step_end.comm) {
      const double c = cost.comm(ev);
      end_comm += c;
      if (ev.group == "dp" || ev.group == "expert_dp")
        dp_total[static_cast<size_t>(r)] += c, dp_exposed[static_cast<size_t>(r)] += c;
    }
    updates[static_cast<size_t>(r)] = cost.ops(rt.step_end);
    if (rt.offload_update_elements > 0) offloads[static_cast<size_t>(r)] = offload_seconds(hw, rt);
    after[static_cast<size_t>(r)] =
        updates[static_cast<size_t>(r)] + offloads[static_cast<size_t>(r)] + end_comm;
  }

  // The schedule: replayed on the same action lists the executor runs (one stage: F and B per micro-batch).
  double makespan = 0;
  std::vector<double> busy(static_cast<size_t>(s.pp));
  std::unique_ptr<pipeline::Replay> replay;
  if (schedule) {
    costs.send = send, costs.latency = latency;
    replay = std::make_unique<pipeline::Replay>(pipeline::replay(*schedule, costs));
    makespan = replay->makespan;
    for (int r = 0; r < s.pp; ++r) busy[static_cast<size_t>(r)] = replay->ranks[static_cast<size_t>(r)].busy;
    t.pp_comm = send * static_cast<double>(s.grad_accum) * static_cast<double>(stages - 1) / s.pp;
  } else {
    // Under expert parallelism's overlap the micro-batches run as 1F1B on one stage: F, then overlapped F&B
    // pairs, then B (train::NoPipelining's paired order); otherwise F and B each in turn.
    const pipeline::StageCosts& c = costs.per_stage[0];
    if (costs.pair_host_share >= 0 && s.grad_accum > 1)
      makespan = busy[0] = c.forward + c.backward +
                           static_cast<double>(s.grad_accum - 1) *
                               pipeline::overlapped_pair(c.forward, c.backward, c.forward_comm,
                                                         c.backward_comm, costs.pair_host_share);
    else
      makespan = busy[0] = static_cast<double>(s.grad_accum) * (c.forward + c.backward);
  }
  int worst = 0;
  for (int r = 0; r < s.pp; ++r) {
    const size_t i = static_cast<size_t>(r);
    const double step = before[i] + makespan + after[i] + dp_exposed[i];
    if (step > t.step) t.step = step, worst = r;
  }
  const size_t w = static_cast<size_t>(worst);
  t.compute = before[w] + busy[w] + updates[w];
  t.bubble = makespan - busy[w];
  t.tp_comm = comm_of[w].tp_comm, t.ep_comm = comm_of[w].ep_comm, t.cp_comm = comm_of[w].cp_comm;
  t.dp_comm = dp_total[w], t.dp_exposed = dp_exposed[w];
  t.optimizer = updates[w];
  t.offload = offloads[w];
  t.tokens_per_s = static_cast<double>(s.tokens_per_step()) / t.step;
  t.mfu = t.tokens_per_s * config_->flops_per_token(s.seq) /
          (static_cast<double>(s.world()) * cluster_.hardware.bf16_tflops * 1e12);

  // Memory: each rank's static state plus its peak of held activations and transients.
  for (int r = 0; r < s.pp; ++r) {
    const RankTrace& rt = *last_[static_cast<size_t>(r)];
    Held held;
    if (replay) {
      held = peak_held(*schedule, *replay, r, rt);
    } else {
      const ChunkTrace& c = rt.chunks[0];
      const int64_t f = c.forward_first.transient_bytes, b = c.activation_bytes + c.backward.transient_bytes;
      held = Held{c.activation_bytes, std::max(f, b) - c.activation_bytes, 1};
      if (c.paired_peak_bytes > 0) {  // overlapped pairs: two micro-batches in flight at their peak
        const int64_t peak = std::max({c.paired_peak_bytes, f, b});
        held.bytes = std::min(peak, 2 * c.activation_bytes);
        held.transient = peak - held.bytes, held.in_flight = 2;
      }
    }
    const int64_t update = rt.step_end.transient_bytes - std::max<int64_t>(0, rt.step_end.kept_bytes);
    MemoryEstimate m;
    m.weights = rt.weights_bytes, m.optimizer = rt.static_bytes - rt.weights_bytes;
    m.activations = held.bytes, m.transient = std::max(held.transient, update - held.bytes);
    m.in_flight = held.in_flight, m.pp_rank = r;
    m.total = m.weights + m.optimizer + m.activations + m.transient;
    m.host = rt.host_bytes;
    if (m.total > e.memory.total) e.memory = m;
  }
  e.over = over_memory(cluster_.hardware, e.memory.total,
                       fmt::format(" per device on pp rank {}", e.memory.pp_rank), e.memory.dominant());
  // The offloaded state must fit the device's share of its host.
  int64_t host = 0;
  for (const RankTrace* rt : last_) host = std::max(host, rt->host_bytes);
  const int64_t host_capacity = static_cast<int64_t>(hw.host_memory_gib * 1073741824.0);
  if (e.over.empty() && host > host_capacity)
    e.over = fmt::format(
        "the offloaded optimizer state needs {} of host memory per device, {} over the {} "
        "of host memory behind each {}",
        human_bytes(host), human_bytes(host - host_capacity), human_bytes(host_capacity), hw.name);
  e.fits = e.over.empty();
  return e;
}

GenerationEstimate Simulator::estimate_generation(const GenerationRequest& request) {
  const GenerationTrace t = trace_generation(*config_, request, options_);
  const HardwareProfile& h = cluster_.hardware;
  GenerationEstimate e;
  e.request = request;
  e.weights = t.weights_bytes, e.cache = t.cache_bytes;
  e.transient = std::max(t.prefill.transient_bytes, t.decode.transient_bytes);
  e.total = e.weights + e.cache + e.transient;
  e.prefill = h.rows_seconds(t.prefill.rows);
  e.decode_per_token = h.rows_seconds(t.decode.rows);
  e.total_seconds = e.prefill + static_cast<double>(request.new_tokens - 1) * e.decode_per_token;
  const std::pair<int64_t, const char*> parts[] = {
      {e.weights, "the weights"}, {e.cache, "the KV cache"}, {e.transient, "the prefill's activations"}};
  e.over = over_memory(h, e.total, "", std::max_element(std::begin(parts), std::end(parts))->second);
  e.fits = e.over.empty();
  return e;
}

std::string format_generation(const GenerationEstimate& e, const Simulator& sim) {
  const GenerationRequest& r = e.request;
  std::string out;
  out += fmt::format("generation: batch {}, prompt {} tokens, {} new tokens, {} weights\n", r.batch, r.prompt,
                     r.new_tokens, r.dtype);
  out += fmt::format("hardware: {} ({}), one device\n", sim.cluster().hardware.name,
                     sim.cluster().hardware.kind);
  out += fmt::format("memory: {}{}\n", human_bytes(e.total), e.fits ? "" : "  -- does not fit: " + e.over);
  out += fmt::format("  weights                  {:>12}\n", human_bytes(e.weights));
  out += fmt::format("  KV cache ({} positions) {:>12}\n", r.prompt + r.new_tokens - 1, human_bytes(e.cache));
  out += fmt::format("  largest transient        {:>12}\n", human_bytes(e.transient));
  const double tokens = static_cast<double>(r.batch);
  out += fmt::format(
      "time: {:.2f} ms | prefill {:.2f} ms ({:.0f} tokens/s) | decode {:.3f} ms per step ({:.1f} "
      "tokens/s)\n",
      1e3 * e.total_seconds, 1e3 * e.prefill,
      e.prefill > 0 ? tokens * static_cast<double>(r.prompt) / e.prefill : 0.0, 1e3 * e.decode_per_token,
      e.decode_per_token > 0 ? tokens / e.decode_per_token : 0.0);
  return out;
}

std::string format_estimate(const Estimate& e, const Simulator& sim) {
  const Strategy& s = e.strategy;
  const TimeEstimate& t = e.time;
  const MemoryEstimate& m = e.memory;
  std::string out;
  out += fmt::format("strategy: {} ({} ranks, {} tokens per step)\n", s.describe(), s.world(),
                     s.tokens_per_step());
  const DType activations = s.dtype == DType::bf16 ? s.activation_dtype : DType::f32;
  out += fmt::format("precision: {} GEMMs{}, {} activations, {} residual stream, {} gradient reductions\n",
                     dtype_name(s.dtype), s.fp8 ? " (fp8:" + s.fp8_recipe + ")" : "", dtype_name(activations),
                     dtype_name(s.fp32_residual ? DType::f32 : activations),
                     s.grad_reduce_in_bf16 ? "bf16" : "fp32");
  out += fmt::format("hardware: {} ({}), {} device(s) per node x {} node(s)\n", sim.cluster().hardware.name,
                     sim.cluster().hardware.kind, sim.cluster().devices_per_node, sim.cluster().nodes);
  out += fmt::format("memory per device (pp rank {}): {}{}\n", m.pp_rank, human_bytes(m.total),
                     e.fits ? "" : "  -- does not fit: " + e.over);
  out += fmt::format("  parameters, bf16 shadow, gradients  {:>12}\n", human_bytes(m.weights));
  out += fmt::format("  optimizer state (and FP8 state)     {:>12}\n", human_bytes(m.optimizer));
  if (s.optimizer_offload)
    out += fmt::format("  (offloaded: host memory per device  {:>12})\n", human_bytes(m.host));
  out +=
      fmt::format("  activations ({} in flight)          {:>12}\n", m.in_flight, human_bytes(m.activations));
  out += fmt::format("  largest transient                   {:>12}\n", human_bytes(m.transient));
  out += fmt::format("time per step: {:.2f} ms | {:.0f} tokens/s | MFU {:.1f}%\n", 1e3 * t.step,
                     t.tokens_per_s, 100 * t.mfu);
  out += fmt::format("  compute (busiest rank)   {:>10.2f} ms\n", 1e3 * t.compute);
  out += fmt::format("  pipeline bubble          {:>10.2f} ms\n", 1e3 * t.bubble);
  out += fmt::format("  tensor-parallel comm     {:>10.2f} ms (on the critical path)\n", 1e3 * t.tp_comm);
  if (s.ep > 1) out += fmt::format("  expert all-to-all        {:>10.2f} ms\n", 1e3 * t.ep_comm);
  if (s.cp > 1)
    out += fmt::format("  context-parallel comm    {:>10.2f} ms (not hidden by the attention)\n",
                       1e3 * t.cp_comm);
  if (s.pp > 1) out += fmt::format("  pipeline sends           {:>10.2f} ms\n", 1e3 * t.pp_comm);
  out += fmt::format("  data-parallel comm       {:>10.2f} ms ({:.2f} ms exposed)\n", 1e3 * t.dp_comm,
                     1e3 * t.dp_exposed);
  out += fmt::format("  optimizer update         {:>10.2f} ms\n", 1e3 * t.optimizer);
  if (s.optimizer_offload)
    out += fmt::format(
        "  optimizer offload        {:>10.2f} ms (gradients to the host, update there, weights back)\n",
        1e3 * t.offload);
  return out;
}

}  // namespace forge::sim
