#include "forge/sim/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/core/fibers.h"
#include "forge/core/memory.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/fp8_context.h"
#include "forge/optim/adamw.h"
#include "forge/parallel/comm_expert_parallel.h"
#include "forge/parallel/comm_tensor_parallel.h"
#include "forge/parallel/context_parallel.h"
#include "forge/parallel/distributed_optimizer.h"
#include "forge/parallel/grad_buckets.h"
#include "forge/parallel/layout.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::sim {
namespace {

// Live bytes of the device's tensors now (and the peak counter restarted from there).
int64_t live_bytes(Device device) {
  if (device == Device::cpu) {
    reset_peak_memory();
    return memory_stats().live_bytes;
  }
  const DeviceMemory& m = device_memory(device);
  m.reset_peak();
  return m.peak_allocated();
}

int64_t peak_bytes(Device device) {
  return device == Device::cpu ? memory_stats().peak_bytes : device_memory(device).peak_allocated();
}

class Recorder {
 public:
  Recorder(Device device, std::shared_ptr<CommLog> log) : device_(device), log_(std::move(log)) {}
  template <typename Fn>
  Phase run(Fn&& fn) {
    Phase p;
    const int64_t before = live_bytes(device_);
    const size_t first_event = log_->events.size();
    ops::profile_begin(device_);
    fn();
    const ops::OpProfile profile = ops::profile_end();
    p.transient_bytes = peak_bytes(device_) - before;
    p.kept_bytes = live_bytes(device_) - before;
    p.rows = profile.rows;
    p.wall_seconds = profile.wall_seconds;
    p.comm.assign(log_->events.begin() + static_cast<std::ptrdiff_t>(first_event), log_->events.end());
    return p;
  }

 private:
  Device device_;
  std::shared_ptr<CommLog> log_;
};

// The ops in `after` beyond those in `before` (two profile_counts of one profile: rows only grow, and new
// ones come last).
std::vector<ops::OpProfileRow> ran_between(const std::vector<ops::OpProfileRow>& before,
                                           const std::vector<ops::OpProfileRow>& after) {
  std::vector<ops::OpProfileRow> out;
  for (size_t i = 0; i < after.size(); ++i) {
    ops::OpProfileRow r = after[i];
    if (i < before.size()) r.calls -= before[i].calls, r.flops -= before[i].flops, r.bytes -= before[i].bytes;
    if (r.calls > 0) out.push_back(std::move(r));
  }
  return out;
}

// Expert parallelism whose row transfers note, on their comm event, the ops the rank ran between a transfer's
// start and its wait: what the overlap (ComputeOptions::ep_overlap) hides it under.
class WatchedExpertParallel final : public nn::ExpertParallel {
 public:
  WatchedExpertParallel(nn::ExpertParallel& inner, std::shared_ptr<CommLog> log)
      : inner_(inner), log_(std::move(log)) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void exchange_counts(const int64_t* send, int64_t* recv, int64_t n) override {
    inner_.exchange_counts(send, recv, n);
  }
  std::unique_ptr<Transfer> all_to_all_rows(const Tensor& send, std::span<const int64_t> send_rows,
                                            const Tensor& recv, std::span<const int64_t> recv_rows,
                                            int64_t cols) override {
    const size_t event = log_->events.size();
    std::unique_ptr<Transfer> t = inner_.all_to_all_rows(send, send_rows, recv, recv_rows, cols);
    if (log_->events.size() != event + 1) return t;
    return std::make_unique<Watched>(std::move(t), log_, event, ops::profile_counts());
  }

 private:
  class Watched final : public Transfer {
   public:
    Watched(std::unique_ptr<Transfer> inner, std::shared_ptr<CommLog> log, size_t event,
            std::vector<ops::OpProfileRow> at_start)
        : inner_(std::move(inner)), log_(std::move(log)), event_(event), at_start_(std::move(at_start)) {}
    void wait() override {
      inner_->wait();
      log_->events.at(event_).overlapped = ran_between(at_start_, ops::profile_counts());
    }
    void progress() override { inner_->progress(); }

   private:
    std::unique_ptr<Transfer> inner_;
    std::shared_ptr<CommLog> log_;
    size_t event_;
    std::vector<ops::OpProfileRow> at_start_;
  };
  nn::ExpertParallel& inner_;
  std::shared_ptr<CommLog> log_;
};

// Context parallelism on a traced rank: the attention across the group runs its blocks as the ring or the
// all-to-all does (their ops, at their shapes, on the rank's device) and notes the transfers on the cp group.
// Ring: per step, the blocks this rank computes (step 0: the diagonal chunks, causal, and the late chunk's
// queries over the early chunk's keys; each later step two chunk-by-chunk blocks), and the key/value hop to
// the next rank in flight meanwhile (its event notes the step's ops, which hide it); backward the same
// blocks' backward, the key/value hops and the gradient hops (each hidden under the next step, the last one
// under nothing). The blocks read and write the rank's own tensors in place of the visiting ones (the same
// shapes: nothing is read back). All-to-all: the exchanges (blocking) and one whole-sequence attention over
// heads / cp heads, on buffers of that size. MoE's and MTP's small exchanges are noted as they are.
class TracedContextParallel final : public nn::ContextParallel {
 public:
  TracedContextParallel(comm::Communicator& group, bool ring, Device device, std::shared_ptr<CommLog> log)
      : group_(group), ring_(ring), device_(device), log_(std::move(log)) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  void attention_forward(const ops::AttentionParams& p) override { run(p, false); }
  void attention_backward(const ops::AttentionParams& p) override { run(p, true); }
  void all_reduce_sum(float* values, int64_t n) override {
    group_.all_reduce(values, n, comm::Type::f32, comm::ReduceOp::sum).wait();
  }
  void shift_tokens(const int32_t* local, int32_t* out, int64_t batch, int64_t local_seq, int64_t,
                    int32_t) override {
    group_.all_gather(local, nullptr, batch * local_seq, comm::Type::i32).wait();
    std::copy_n(local, batch * local_seq, out);
  }

 private:
  // Sends `count` elements of `type` to the next rank while `compute` runs; the event notes the ops it ran.
  template <typename Compute>
  void hop(int64_t count, comm::Type type, Compute compute) {
    const size_t event = log_->events.size();
    const std::vector<ops::OpProfileRow> before = ops::profile_counts();
    group_.send(nullptr, count, type, (rank() + 1) % size(), 0);
    compute();
    if (log_->events.size() > event)
      log_->events[event].overlapped = ran_between(before, ops::profile_counts());
  }

  void run(const ops::AttentionParams& p, bool backward) {
    const int n = size();
    const int64_t local = p.seq, chunk = local / 2, v_dim = p.v_head_dim > 0 ? p.v_head_dim : p.head_dim;
    if (!ring_) return all_to_all(p, backward, v_dim);
    // The keys and values (and their gradients) travel in the attention's dtype.
    const comm::Type type = comm::type_of(p.dtype());
    const int64_t kv = p.batch * local * p.kv_heads * (p.head_dim + v_dim);
    // The ring's working buffers, alive through the call (parallel/context_parallel.cpp): its fp32 copies of
    // q, out and the log-sum-exp (and dout, dq) by halves, the travelling keys and values (two blocks;
    // backward four, with the gradients gathering, and this rank's fp32 share of them), their fp32 copy the
    // blocks read when they travel in bf16, a block's partial result (backward: its gradients).
    const int64_t q = p.batch * local * p.heads * p.head_dim, out = p.batch * local * p.heads * v_dim,
                  lse = p.batch * p.heads * local;
    const int64_t element = static_cast<int64_t>(dtype_size(p.dtype())), widened = element < 4 ? kv : 0;
    const int64_t fp32 = backward ? q + 2 * out + lse + q + kv + widened + q / 2 + kv / 2
                                  : q + out + lse + widened + out / 2 + lse / 2;
    const int64_t travelling = (backward ? 4 : 2) * kv * element;
    const Tensor buffers = Tensor::empty({fp32 + (travelling + 3) / 4}, DType::f32, device_);
    // One chunk-by-chunk block of local half qh over half kh (causal on the diagonal), per sequence.
    auto block = [&](int qh, int kh, bool causal) {
      for (int64_t b = 0; b < p.batch; ++b) {
        ops::AttentionParams a = p;
        a.batch = 1, a.seq = chunk, a.kv_seq = chunk, a.causal = causal;
        a.q = p.q + (b * local + qh * chunk) * p.q_stride;
        a.k = p.k + (b * local + kh * chunk) * p.k_stride, a.v = p.v + (b * local + kh * chunk) * p.v_stride;
        a.out = p.out + (b * local + qh * chunk) * p.out_stride;
        a.lse = p.lse + (b * p.heads) * local + qh * chunk;
        if (backward) {
          a.dout = p.dout + (b * local + qh * chunk) * p.dout_stride;
          a.dq = p.dq + (b * local + qh * chunk) * p.dq_stride;
          a.dk = p.dk + (b * local + kh * chunk) * p.dk_stride,
          a.dv = p.dv + (b * local + kh * chunk) * p.dv_stride;
          ops::attention_backward(a, device_);
        } else {
          ops::attention_forward(a, device_);
        }
      }
    };
    size_t gradient = 0;  // backward: the gradient hop in flight (its event), and the ops at its start
    std::vector<ops::OpProfileRow> gradient_start;
    for (int step = 0; step < n; ++step) {
      auto compute = [&] {
        if (step == 0) {
          block(0, 0, true), block(1, 0, false), block(1, 1, true);
        } else {
          block(1, 0, false), block(1, 1, false);
        }
      };
      if (step + 1 < n)
        hop(kv, type, compute);
      else
        compute();
      if (!backward) continue;
      // The previous step's key/value gradients travelled under this step; this step's go on to the next
      // rank, under the next step (the last one's under nothing).
      if (step > 0 && gradient < log_->events.size())
        log_->events[gradient].overlapped = ran_between(gradient_start, ops::profile_counts());
      gradient = log_->events.size(), gradient_start = ops::profile_counts();
      group_.send(nullptr, kv, type, (rank() + 1) % n, 0);
    }
  }

  void all_to_all(const ops::AttentionParams& p, bool backward, int64_t v_dim) {
    const int n = size();
    const int64_t hq = p.heads / n, hk = p.kv_heads / n, seq = p.seq * n, rows = p.batch * p.seq;
    // Everything travels in the attention's dtype but the log-sum-exp (fp32).
    const DType dtype = p.dtype();
    auto exchange = [&](int64_t cols, DType type = DType::f32) {
      group_.all_to_all(nullptr, nullptr, rows * cols, comm::type_of(type)).wait();
    };
    {  // an exchange's send and receive buffers, each the size of the rank's q (the largest)
      const Tensor in_flight = Tensor::empty({2 * rows * p.heads * p.head_dim}, dtype, device_);
      exchange(hq * p.head_dim, dtype), exchange(hk * p.head_dim, dtype),
          exchange(hk * v_dim, dtype);  // q, k, v gathered
    }
    if (backward) exchange(hq * v_dim, dtype), exchange(hq * v_dim, dtype), exchange(hq);  // dout, out, lse
    auto buffer = [&](int64_t cols, DType type) {
      return Tensor::zeros({p.batch * seq, cols}, type, device_);
    };
    Tensor q = buffer(hq * p.head_dim, dtype), k = buffer(hk * p.head_dim, dtype),
           v = buffer(hk * v_dim, dtype), out = buffer(hq * v_dim, dtype), lse = buffer(hq, DType::f32);
    ops::AttentionParams a;
    a.batch = p.batch, a.seq = seq, a.heads = hq, a.kv_heads = hk, a.head_dim = p.head_dim,
    a.v_head_dim = v_dim;
    a.q = q.elements(), a.k = k.elements(), a.v = v.elements(), a.out = out.elements(), a.lse = lse.f32();
    a.q_stride = hq * p.head_dim, a.k_stride = hk * p.head_dim, a.v_stride = hk * v_dim,
    a.out_stride = hq * v_dim;
    a.scale = p.scale, a.causal = true;
    if (!backward) {
      ops::attention_forward(a, device_);
      exchange(hq * v_dim, dtype), exchange(hq);  // out, lse back
      return;
    }
    Tensor dout = buffer(hq * v_dim, dtype), dq = buffer(hq * p.head_dim, dtype),
           dk = buffer(hk * p.head_dim, dtype), dv = buffer(hk * v_dim, dtype);
    a.dout = dout.elements(), a.dout_stride = hq * v_dim, a.dq = dq.elements(), a.dk = dk.elements(),
    a.dv = dv.elements();
    a.dq_stride = a.q_stride, a.dk_stride = a.k_stride, a.dv_stride = a.v_stride;
    ops::attention_backward(a, device_);
    exchange(hq * p.head_dim, dtype), exchange(hk * p.head_dim, dtype),
        exchange(hk * v_dim, dtype);  // dq, dk, dv back
  }

  comm::Communicator& group_;
  bool ring_;
  Device device_;
  std::shared_ptr<CommLog> log_;
};

// A dry run's device, unless one is open already (or the trace is measured, on the CPU). A GPU's peak counts
// the caching allocator's blocks; a CPU-shaped trace stands for exact host memory.
void open_dry_device(const TraceOptions& options, std::optional<EmulatedDevice>& emulation) {
  if (options.device == Device::cpu || EmulatedDevice::check_only()) return;
  emulation.emplace(EmulatedDevice::Mode::check_only);
  EmulatedDevice::count_rounded(options.shaped_for != Device::cpu);
}

// Token ids spread over the vocabulary (mixture-of-experts routing on a measured run depends on them).
std::vector<int32_t> spread_ids(int64_t count, int64_t vocab, int64_t salt) {
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((static_cast<uint64_t>(i + salt) * 2654435761u >> 7) %
                                                       static_cast<uint64_t>(vocab));
  return ids;
}

}  // namespace

std::vector<const Phase*> RankTrace::phases() const {
  std::vector<const Phase*> out{&step_begin, &step_end};
  for (const ChunkTrace& c : chunks)
    for (const Phase* p : {&c.forward_first, &c.forward, &c.backward, &c.backward_input, &c.backward_weight})
      out.push_back(p);
  return out;
}

std::vector<ops::OpProfileRow> merge_rows(const std::vector<const Phase*>& phases) {
  std::map<std::pair<std::string, std::string>, ops::OpProfileRow> merged;
  for (const Phase* p : phases)
    for (const ops::OpProfileRow& r : p->rows) {
      ops::OpProfileRow& m = merged[{r.op, r.detail}];
      if (m.op.empty()) m.op = r.op, m.detail = r.detail;
      m.calls += r.calls, m.seconds += r.seconds, m.flops += r.flops, m.bytes += r.bytes;
    }
  std::vector<ops::OpProfileRow> out;
  for (auto& [key, row] : merged) out.push_back(std::move(row));
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  return out;
}

RankTrace trace_rank(const models::ModelConfig& config, const Strategy& s, int pp_rank,
                     const TraceOptions& options) {
  const Device device = options.device;
  std::optional<EmulatedDevice> emulation;
  open_dry_device(options, emulation);

  const models::ModelShape shape = config.shape();
  const parallel::LayoutSpec spec{s.tp, s.pp, s.dp, s.cp, s.ep};
  const parallel::Layout probe(spec, s.world(), 0);
  const parallel::Layout layout(spec, s.world(), probe.rank_of(0, 0, 0, pp_rank));
  const parallel::ContextSplitProblem split = parallel::context_split_problem(
      s.cp, s.cp_comm, s.seq, shape.heads / s.tp, std::max<int64_t>(1, shape.kv_heads / s.tp));
  if (!split.none()) fail("{}", split.problem);
  parallel::validate_model_fit(
      layout, {shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.layers},
      s.vocab_divisible_by);
  if (s.sequence_parallel && s.tp > 1 && (s.seq / s.cp) % s.tp != 0)
    fail(
        "parallel.sequence_parallel: data.seq_len = {} / parallel.cp = {} must be a multiple of parallel.tp "
        "= {}",
        s.seq, s.cp, s.tp);
  if (s.ep > 1) {
    const int64_t experts = config.routed_experts();
    if (experts <= 0 || experts % s.ep != 0)
      fail("parallel.ep = {} does not divide the {} routed experts of {}", s.ep, experts, config.source());
  }

  auto log = std::make_shared<CommLog>();
  auto group = [&](const char* name, parallel::Dim dim) {
    return make_dry_communicator({name, layout.size(dim), layout.coordinate(dim)}, log);
  };
  std::unique_ptr<comm::Communicator> tp = group("tp", parallel::Dim::tp),
                                      dp = group("dp", parallel::Dim::dp_cp),
                                      ep = group("ep", parallel::Dim::ep),
                                      expert_dp = group("expert_dp", parallel::Dim::expert_dp),
                                      model_parallel = group("model_parallel", parallel::Dim::model_parallel),
                                      cp = group("cp", parallel::Dim::cp);

  nn::ComputeOptions o;
  o.device = device;
  o.shaped_for = options.shaped_for;
  o.gemm_dtype = s.dtype;
  o.activation_dtype = s.dtype == DType::bf16 ? s.activation_dtype : DType::f32;
  o.residual_dtype = s.fp32_residual ? DType::f32 : o.activation_dtype;  // TrainConfig's rule
  o.recompute = s.recompute;
  o.recompute_layers = s.recompute_layers;
  o.recompute_modules = s.recompute_modules;
  o.vocab_divisible_by = s.vocab_divisible_by;
  const bool on_device = device != Device::cpu;
  parallel::CommTensorParallel tensor_parallel(tp.get(), s.sequence_parallel, on_device ? tp.get() : nullptr);
  if (s.tp > 1) o.tp = &tensor_parallel;
  std::optional<parallel::CommExpertParallel> expert_parallel;
  std::optional<WatchedExpertParallel> watched_expert_parallel;
  if (s.ep > 1) {
    expert_parallel.emplace(ep.get(), on_device ? ep.get() : nullptr);
    o.ep = &watched_expert_parallel.emplace(*expert_parallel, log);
    o.ep_overlap = s.ep_overlap;
  }
  o.moe_capacity_factor = s.moe_capacity_factor;
  o.moe_pad_to_capacity = s.moe_pad_to_capacity;
  std::optional<TracedContextParallel> context_parallel;
  if (s.cp > 1)
    o.cp = &context_parallel.emplace(*cp, s.cp_comm == parallel::ContextAttention::ring, device, log);
  std::unique_ptr<nn::Fp8Context> fp8;
  if (s.fp8) {
    fp8 = std::make_unique<nn::Fp8Context>(*s.fp8);
    o.fp8 = fp8.get();
  }

  // The chunks this rank holds.
  RankTrace trace;
  trace.pp_rank = pp_rank;
  std::vector<int> stages{0};
  std::vector<models::StageSpec> specs{models::StageSpec::whole()};
  int micro_batches_per_chunk = 2;
  // DualPipe's mirrored copies, and tied embeddings (or MTP's reads of the embedding) with the first and the
  // last stage on two ranks: their gradients are summed over a pair after the schedule
  // (train/pipelining.cpp), and the data-parallel buckets then reduce after it rather than under backward
  // (train/setup.cpp).
  bool mirrored = false, tied_across = false;
  if (s.pp > 1) {
    const pipeline::Schedule schedule = pipeline::make_schedule(
        {s.schedule, s.pp, static_cast<int>(s.grad_accum), s.vpp, s.ep > 1 && s.ep_overlap});
    const pipeline::Placement& p = schedule.placement;
    mirrored = p.mirrored;
    const nlohmann::json json = config.to_json();
    const bool tied =
        json.value("tie_word_embeddings", false) ||
        (json.contains("num_nextn_predict_layers") && json["num_nextn_predict_layers"].is_number() &&
         json["num_nextn_predict_layers"].get<int64_t>() > 0);
    const int first = p.locate(0, 0).rank, last = p.locate(0, p.stages - 1).rank;
    tied_across = tied && first != last && (pp_rank == first || pp_rank == last);
    const std::vector<int64_t> counts = pipeline::stage_layer_counts(
        shape.layers, p.stages, s.pp_layers,
        fmt::format("{} stages of schedule {}", p.stages, pipeline::schedule_name(s.schedule)));
    stages.clear(), specs.clear();
    for (int chunk = 0; chunk < p.chunks; ++chunk) {
      const int mine = p.stage(pp_rank, chunk);
      stages.push_back(mine), specs.push_back(models::StageSpec::of_counts(counts, mine));
    }
  }

  const int64_t live_at_start = live_bytes(device);
  std::vector<std::unique_ptr<models::Model>> models;
  std::unique_ptr<ParameterStore> shared;
  if (specs.size() == 1) {
    models.push_back(models::build_model(config, o, specs[0], 0.02f, true));
  } else {
    shared = std::make_unique<ParameterStore>();
    for (const models::StageSpec& c : specs)
      models.push_back(models::build_model(config, o, c, 0.02f, true, shared.get()));
    shared->allocate(o.gemm_dtype == DType::bf16, true, device);
    if (fp8) fp8->seal();
  }
  ParameterStore& store = models[0]->params();
  if (!on_device) models[0]->initialize(1234);
  trace.parameters = store.numel();
  trace.weights_bytes = live_bytes(device) - live_at_start;

  parallel::BucketOptions bucket_options;
  bucket_options.bucket_bytes =
      parallel::bucket_bytes_of(s.bucket_mb, options.shaped_for != Device::cpu, s.dp);
  bucket_options.shard = s.distributed_optimizer;
  bucket_options.reduce_dtype = s.grad_reduce_in_bf16 ? DType::bf16 : DType::f32;
  bucket_options.overlap = s.overlap_grad_reduce && s.dp > 1 && !mirrored && !tied_across;
  parallel::GradBuckets buckets(&store, dp.get(), bucket_options);
  std::vector<parallel::OptimizerGroup> groups{{&buckets, dp.get()}};
  std::unique_ptr<parallel::GradBuckets> expert_buckets;
  if (s.ep > 1) {
    parallel::BucketOptions expert_options = bucket_options;
    expert_options.group = "experts";
    expert_options.overlap = bucket_options.overlap && layout.expert_dp() > 1;
    expert_buckets = std::make_unique<parallel::GradBuckets>(&store, expert_dp.get(), expert_options);
    groups.push_back({expert_buckets.get(), expert_dp.get(), ep.get()});
  }
  parallel::DistributedAdamW optimizer(
      &store, optim::AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f}, groups, model_parallel.get(),
      s.optimizer_offload ? parallel::OptimizerOffload::host : parallel::OptimizerOffload::none);
  trace.host_bytes = optimizer.host_bytes();
  trace.offload_down_bytes = optimizer.offload_down_bytes();
  trace.offload_up_bytes = optimizer.offload_up_bytes();
  trace.offload_chunks = optimizer.offload_chunks();
  trace.offload_update_elements = optimizer.offloaded() ? optimizer.moment_numel() : 0;
  // Sharded masters: the store's fp32 weights moved into the optimizer's shards (its state, counted there).
  if (optimizer.holds_masters())
    trace.weights_bytes -= (store.numel() - store.params().numel()) * static_cast<int64_t>(sizeof(float));

  Recorder recorder(device, log);
  auto pair = [&](const char* name) { return make_dry_communicator({name, 2, 0}, log); };
  const int64_t micro = s.micro_batch, seq = s.seq / s.cp;  // this rank's tokens of each sequence
  const int64_t rows = micro * seq / (s.sequence_parallel && s.tp > 1 ? s.tp : 1);
  const std::vector<int32_t> ids0 = spread_ids(micro * seq, shape.vocab, 0),
                             ids1 = spread_ids(micro * seq, shape.vocab, 7);
  const float grad_scale = 1.0f / static_cast<float>(micro * s.seq * s.grad_accum * s.dp);
  const models::MicroBatch mb0{ids0.data(), ids1.data(), micro, seq, grad_scale};
  const models::MicroBatch mb1{ids1.data(), ids0.data(), micro, seq, grad_scale};
  const size_t n = models.size();
  trace.chunks.resize(n);
  for (size_t c = 0; c < n; ++c) trace.chunks[c].stage = stages[c], trace.chunks[c].spec = specs[c];

  // One step. Measured, it runs twice and the second counts: the first pays what a training run pays once
  // (fresh buffers faulted in, the optimizer state allocated), which would read as slow kernels.
  auto one_step = [&] {
    trace.step_begin = recorder.run([&] { store.zero_grads(); });
    store.begin_grad_step(micro_batches_per_chunk);
    buckets.begin_step();
    if (expert_buckets) expert_buckets->begin_step();
    models::TrainStepSettings settings;
    settings.balance_scale = 1e-4f / static_cast<float>(micro * s.grad_accum * s.dp);
    settings.mtp_weight = 0.3f;
    for (auto& m : models) m->begin_train_step(settings);

    // Runs micro-batch mb through the chunks in stage order (each chunk fed a fresh input of its shape: the
    // previous stage may live on another rank), keeping each chunk's activations.
    std::vector<std::unique_ptr<models::StageActivations>> saved(n);
    std::vector<size_t> order(n);
    for (size_t c = 0; c < n; ++c) order[c] = c;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return stages[a] < stages[b]; });
    auto input_of = [&](size_t c) {
      return specs[c].pre_process ? Tensor() : Tensor::zeros({rows, shape.hidden}, DType::f32, device);
    };
    auto gradient_of = [&](size_t c) {
      return specs[c].post_process ? Tensor() : Tensor::zeros({rows, shape.hidden}, DType::f32, device);
    };
    auto forward = [&](const models::MicroBatch& mb, bool first) {
      for (size_t c : order) {
        ChunkTrace& t = trace.chunks[c];
        // The received input and output gradient are allocated inside the phase, as the receive does: what
        // the chunk keeps of them counts.
        Phase p = recorder.run([&] {
          const models::StageOutput out = models[c]->forward(mb, input_of(c), &saved[c]);
          t.output_bytes = out.hidden.defined() ? static_cast<int64_t>(out.hidden.bytes()) : 0;
        });
        (first ? t.forward_first : t.forward) = std::move(p);
      }
    };
    forward(mb0, true);
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      trace.chunks[*it].backward =
          recorder.run([&] { models[*it]->backward(gradient_of(*it), *saved[*it]); });
      saved[*it].reset();
    }
    forward(mb1, false);
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      trace.chunks[*it].backward_input =
          recorder.run([&] { models[*it]->backward_input(gradient_of(*it), *saved[*it]); });
    }
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      trace.chunks[*it].backward_weight = recorder.run([&] { models[*it]->backward_weight(*saved[*it]); });
      saved[*it].reset();
    }
    for (ChunkTrace& t : trace.chunks) t.activation_bytes = t.forward.kept_bytes;

    const int64_t before_update = live_bytes(device);
    trace.step_end = recorder.run([&] {
      if (mirrored) comm::all_reduce_sum(*pair("pp_mirror"), store.grads().f32(), store.grads().numel());
      if (tied_across) {
        const int id = store.find("model.embed_tokens.weight");
        if (id >= 0)
          comm::all_reduce_sum(*pair("pp_tied_embedding"), store.grad(id).f32(), store.grad(id).numel());
      }
      buckets.finish();
      if (expert_buckets) expert_buckets->finish();
      const double norm = optimizer.grad_norm();
      // The trainer's finiteness check of every local gradient (train/step.cpp).
      Tensor device_sum;
      double host_sum = 0;
      if (on_device) device_sum = Tensor::zeros({2}, DType::f32, device);
      ops::sum_squares_accumulate(store.grads().f32(), store.grads().numel(),
                                  device_sum.defined() ? static_cast<double*>(device_sum.raw()) : &host_sum,
                                  device);
      optimizer.step(1e-4f, std::isfinite(norm) && norm > 1 ? static_cast<float>(1 / norm) : 1.0f);
      if (fp8) {
        (void)fp8->step_amaxes();
        fp8->end_step();
      }
    });
    trace.optimizer_bytes = live_bytes(device) - before_update;
    trace.static_bytes = live_bytes(device) - live_at_start;
  };
  one_step();
  if (!on_device) {
    const int64_t optimizer_bytes = trace.optimizer_bytes, static_bytes = trace.static_bytes;
    one_step();
    trace.optimizer_bytes = optimizer_bytes, trace.static_bytes = static_bytes;
  }
  // Expert parallelism's overlapped pairs on one stage (train::NoPipelining's paired order): F0, then F1 and
  // B0 taking turns at the token transfers, then B1. What they hold at once depends on how the two
  // interleave, so they run as the executor runs them (core/fibers.h), for the peak only, outside any step
  // (nothing reduces; the gradients are zeroed after).
  if (n == 1 && s.pp == 1 && s.ep > 1 && s.ep_overlap && s.grad_accum > 1) {
    std::unique_ptr<models::StageActivations> a0, a1;
    const int64_t before = live_bytes(device);
    (void)models[0]->forward(mb0, Tensor(), &a0);
    run_interleaved([&] { (void)models[0]->forward(mb1, Tensor(), &a1); },
                    [&] {
                      (void)models[0]->backward(Tensor(), *a0);
                      a0.reset();
                    });
    trace.chunks[0].paired_peak_bytes = peak_bytes(device) - before;
    (void)models[0]->backward(Tensor(), *a1);
    a1.reset();
    store.zero_grads();
  }
  return trace;
}

GenerationTrace trace_generation(const models::ModelConfig& config, const GenerationRequest& request,
                                 const TraceOptions& options) {
  const Device device = options.device;
  std::optional<EmulatedDevice> emulation;
  open_dry_device(options, emulation);
  const models::ModelShape shape = config.shape();
  if (request.batch < 1 || request.prompt < 1 || request.new_tokens < 1)
    fail("generation: batch {}, prompt {} and new tokens {} must each be at least 1", request.batch,
         request.prompt, request.new_tokens);
  // generate_sequence's cache: the prompt and every generated token but the last.
  const int64_t capacity = request.prompt + request.new_tokens - 1;
  if (capacity > shape.max_positions)
    fail("generation: a prompt of {} tokens and {} new ones need {} positions; {} has {}", request.prompt,
         request.new_tokens, capacity + 1, config.source(), shape.max_positions);
  nn::ComputeOptions o;
  o.device = device;
  o.shaped_for = options.shaped_for;
  o.gemm_dtype = dtype_from_name(request.dtype);
  if (o.gemm_dtype != DType::f32 && o.gemm_dtype != DType::bf16)
    fail("generation: dtype must be fp32 or bf16, got '{}'", request.dtype);
  o.recompute = nn::Recompute::none;

  GenerationTrace trace;
  auto log = std::make_shared<CommLog>();
  Recorder recorder(device, log);
  const int64_t live_at_start = live_bytes(device);
  std::unique_ptr<models::Model> model =
      models::build_model(config, o, models::StageSpec::whole(), 0.02f, /*with_grads=*/false);
  if (device == Device::cpu) model->initialize(1234);
  trace.weights_bytes = live_bytes(device) - live_at_start;
  nn::KvCache cache = model->make_cache(request.batch, capacity);
  trace.cache_bytes = static_cast<int64_t>(cache.bytes());
  const std::vector<int32_t> ids = spread_ids(request.batch * request.prompt, shape.vocab, 0);
  trace.prefill =
      recorder.run([&] { (void)model->forward_cached(ids.data(), request.batch, request.prompt, cache); });
  // One decoding step with half the new tokens cached already (positions only committed: their contents do
  // not change the cost).
  if (request.new_tokens > 1) {  // the last new token is sampled, never run
    cache.advance((request.new_tokens - 1) / 2);
    trace.decode = recorder.run([&] { (void)model->forward_cached(ids.data(), request.batch, 1, cache); });
  }
  return trace;
}

}  // namespace forge::sim
