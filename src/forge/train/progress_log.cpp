#include "forge/train/progress_log.h"

#include <omp.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/sim/hardware.h"
#include "forge/train/peak.h"
#include "forge/train/plan.h"

namespace forge::train {
namespace {

double seconds_since(ProgressLog::Clock::time_point t) {
  return std::chrono::duration<double>(ProgressLog::Clock::now() - t).count();
}

// The delayed recipe's scales for metrics.jsonl: per operand role, the smallest, median and largest over this
// rank's FP8 Linears ({"scale": {"input": {"min", "median", "max"}, "weight": ..., "grad_output": ...}}).
nlohmann::json fp8_scale_fields(const fp8::DelayedScalingGroup& group) {
  const std::span<const float> scales = group.scales();
  nlohmann::json roles = nlohmann::json::object();
  const char* names[] = {"input", "weight", "grad_output"};  // the group's slots: [linears][3]
  for (size_t role = 0; role < 3; ++role) {
    std::vector<double> values;
    for (size_t i = role; i < scales.size(); i += 3) values.push_back(scales[i]);
    if (values.empty()) continue;
    std::sort(values.begin(), values.end());
    roles[names[role]] = {
        {"min", values.front()}, {"median", values[values.size() / 2]}, {"max", values.back()}};
  }
  return {{"scale", roles}};
}

// The allocator's peak on this rank: its device's on a GPU, else the host's.
double peak_bytes(const TrainSetup& s) {
  return static_cast<double>(s.on_gpu() ? device_memory(s.device).peak_allocated()
                                        : memory_stats().peak_bytes);
}

}  // namespace

ProgressLog::ProgressLog(const TrainConfig& config, comm::Communicator& world, const RunLog& log,
                         RunRecords& records, const TrainSetup& setup, const TrainState& state,
                         Clock::time_point run_start)
    : c_(config),
      world_(world),
      log_(log),
      records_(records),
      setup_(setup),
      state_(state),
      run_start_(run_start),
      step_tokens_(config.tokens_per_step() * setup.dp) {}  // micro x accum sequences on each dp replica

void ProgressLog::banner() {
  const TrainSetup& s = setup_;
  const bool on_gpu = s.on_gpu();
  const std::vector<std::string> frozen = c_.frozen_parts();
  flops_per_token_ = s.model_config->trained_flops_per_token(s.seq, frozen);
  flops_per_image_ = s.model_config->trained_flops_per_image(frozen);
  // Every rank measures its share of the machine; the job's peak is their sum. On a GPU, the tensor cores'
  // dense peak of the precision that runs the Linears.
  const double rank_peak = c_.log.peak_gflops > 0 ? c_.log.peak_gflops / world_.size()
                           : on_gpu ? (s.options.fp8 ? kHopperFp8PeakGflops : kHopperBf16PeakGflops)
                                    : measure_gemm_peak_gflops(s.options.gemm_dtype);
  peak_gflops_ = comm::all_reduce_sum(world_, rank_peak);
  log_.say(
      "model %.2fM parameters | %s compute%s | fp8 %s | recompute %s | %lld-token batches (%lld x %lld x "
      "%lld x dp %lld) | peak %s GEMM %.0f GFLOP/s (%s)\n",
      static_cast<double>(s.model_config->num_parameters()) / 1e6,
      (s.dtype_name + (c_.train.dtype == DtypeChoice::automatic ? " (auto)" : "")).c_str(),
      on_gpu ? (" on " + std::string(device_name(s.options.device))).c_str() : "", s.fp8_summary.c_str(),
      c_.recompute_summary().c_str(), static_cast<long long>(step_tokens_), static_cast<long long>(s.micro),
      static_cast<long long>(s.accum), static_cast<long long>(s.seq), static_cast<long long>(s.dp),
      s.options.fp8 && on_gpu ? "fp8" : s.dtype_name.c_str(), peak_gflops_,
      c_.log.peak_gflops > 0 ? "given"
      : on_gpu               ? "H100/H200 dense"
                             : "measured");
  if (world_.size() > 1) {
    log_.say("%s\n", s.layout.describe().c_str());
    if (!s.pipeline_summary.empty()) log_.say("%s\n", s.pipeline_summary.c_str());
    if (s.cp > 1)
      log_.say(
          "context parallel %lld: %lld of each sequence's %lld tokens per rank (chunks r and %lld - r of "
          "%lld), attention %s\n",
          static_cast<long long>(s.cp), static_cast<long long>(s.local_seq()), static_cast<long long>(s.seq),
          static_cast<long long>(2 * s.cp - 1), static_cast<long long>(2 * s.cp),
          c_.parallel.cp_comm == parallel::ContextAttention::all_to_all
              ? "all-to-all (heads scattered, sequences gathered)"
              : "ring (keys and values passed around, blocks merged by log-sum-exp)");
    log_.say(
        "tensor parallel %d%s | data parallel %lld%s: %zu gradient buckets of <= %.1f MiB, %s, overlap %s | "
        "optimizer state %.1f MiB per rank%s | %d OpenMP threads per rank\n",
        s.layout.tp(), c_.parallel.sequence_parallel ? " + sequence parallel" : "",
        static_cast<long long>(s.dp),
        s.cp > 1 ? fmt::format(" (gradients reduced over dp x cp = {} ranks)", s.dp_group().size()).c_str()
                 : "",
        s.buckets->buckets().size(), static_cast<double>(s.buckets->bucket_bytes()) / 1048576.0,
        !c_.parallel.distributed_optimizer ? "all-reduce"
        : s.optimizer->holds_masters()
            ? "reduce-scatter + distributed optimizer (sharded Adam state and fp32 master weights)"
            : "reduce-scatter + ZeRO-1 (sharded Adam state)",
        c_.parallel.overlap_grad_reduce ? "on" : "off",
        static_cast<double>(s.optimizer->state_bytes()) / 1048576.0,
        s.optimizer->offloaded() ? " (offloaded: in host memory, updated there)" : "", omp_get_max_threads());
  }
  log_.say("%s\n", s.data->describe().c_str());
}

void ProgressLog::predict() {
  if (c_.log.hardware_profile.empty()) return;
  sim::HardwareProfile hardware = sim::HardwareProfile::read(sim::resolve_profile(c_.log.hardware_profile));
  // This machine's ranks on one node (a multi-node job: pass a cluster to forge plan estimate instead).
  sim::Simulator simulator(*setup_.model_config,
                           sim::Cluster::single_node(std::move(hardware), world_.size()));
  prediction_ = simulator.estimate(strategy_of(c_, world_.size()));
  const sim::Estimate& e = *prediction_;
  log_.say(
      "plan (%s, %s): predicted %.2f ms/step, %.0f tokens/s, %s per device (parameters %s, optimizer %s, "
      "activations %s, transient %s)\n",
      simulator.cluster().hardware.name.c_str(), simulator.cluster().hardware.kind.c_str(), 1e3 * e.time.step,
      e.time.tokens_per_s, sim::human_bytes(e.memory.total).c_str(),
      sim::human_bytes(e.memory.weights).c_str(), sim::human_bytes(e.memory.optimizer).c_str(),
      sim::human_bytes(e.memory.activations).c_str(), sim::human_bytes(e.memory.transient).c_str());
  if (!e.fits) log_.say("plan: warning: %s\n", e.over.c_str());
  const int threads = omp_get_max_threads();
  if (simulator.cluster().hardware.threads > 0 && simulator.cluster().hardware.threads != threads)
    log_.say(
        "plan: warning: %s was measured with %d thread%s per rank; this run has %d (calibrate with the "
        "run's)\n",
        c_.log.hardware_profile.c_str(), simulator.cluster().hardware.threads,
        simulator.cluster().hardware.threads == 1 ? "" : "s", threads);
  records_.write({{"event", "prediction"},
                  {"profile", c_.log.hardware_profile},
                  {"step_s", e.time.step},
                  {"tokens_per_s", e.time.tokens_per_s},
                  {"memory_bytes", e.memory.total}});
}

void ProgressLog::start() {
  start_ = interval_start_ = Clock::now();
  first_step_ = state_.step;
}

double ProgressLog::seconds_since_start() const { return seconds_since(start_); }

void ProgressLog::before_step() {
  if (prediction_ && state_.step == first_step_ + 1)
    setup_.on_gpu() ? device_memory(setup_.device).reset_peak() : reset_peak_memory();
}

void ProgressLog::rolled_back(int64_t restored_step) {
  if (restored_step < first_step_) first_step_ = restored_step;
  interval_start_ = Clock::now();
  interval_tokens_ = 0, interval_images_ = 0;
}

void ProgressLog::step(const StepResult& r, double seconds) {
  step_seconds_.push_back(seconds);
  interval_tokens_ += step_tokens_;
  interval_images_ += r.images;
  const int64_t step = state_.step;
  const bool last = step == state_.total_steps;
  if (step % c_.log.every != 0 && !last && step != first_step_ + 1) return;
  const double dt = seconds_since(interval_start_);
  StepLine m;
  const bool planned = state_.plan_frozen;
  m.step = step, m.total_steps = planned ? state_.total_steps : 0, m.loss = r.loss, m.lr = r.lr;
  m.grad_norm = r.grad_norm;
  m.tokens_per_s = static_cast<double>(interval_tokens_) / dt;
  const double images_per_s = static_cast<double>(interval_images_) / dt;
  if (setup_.data->has_images()) m.images_per_s = images_per_s;
  m.flops_per_s = m.tokens_per_s * flops_per_token_ + images_per_s * flops_per_image_;
  m.mfu = m.flops_per_s / (peak_gflops_ * 1e9);
  m.elapsed_s = seconds_since(run_start_);
  const double per_step = seconds_since(start_) / static_cast<double>(step - first_step_);
  m.eta_s = planned ? per_step * static_cast<double>(state_.total_steps - step) : -1;
  if (c_.train.max_minutes > 0)
    m.eta_s = std::min(m.eta_s, c_.train.max_minutes * 60 - seconds_since(start_));
  const int64_t load_every = c_.log.expert_load_every;
  const BalanceMetrics balance = balance_metrics(r, last || (load_every > 0 && step % load_every == 0));
  m.extra = balance.summary;
  log_.say("%s\n", format_step_line(m).c_str());
  nlohmann::json record = {{"step", step},
                           {"loss", r.loss},
                           {"lr", r.lr},
                           {"grad_norm", r.grad_norm},
                           {"tokens_per_s", m.tokens_per_s},
                           {"tflops", m.flops_per_s / 1e12},
                           {"mfu", m.mfu},
                           {"tokens", step * step_tokens_},
                           {"elapsed_s", m.elapsed_s}};
  if (setup_.dp_group().size() > 1) record["dp_overlap"] = setup_.buckets->total_stats().overlap_ratio();
  // The allocator's peak since the first step, the largest over ranks (one scalar all-reduce per log line).
  record["peak_memory_bytes"] = comm::all_reduce_max(world_, peak_bytes(setup_));
  if (const fp8::DelayedScalingGroup* g = setup_.fp8 ? setup_.fp8->delayed_group() : nullptr)
    record["fp8"] = fp8_scale_fields(*g);
  for (const auto& [key, value] : balance.fields.items()) record[key] = value;
  if (m.images_per_s >= 0) record["images_per_s"] = m.images_per_s;
  records_.write(record);
  interval_start_ = Clock::now();
  interval_tokens_ = 0, interval_images_ = 0;
}

void ProgressLog::compare_with_prediction() {
  if (!prediction_ || step_seconds_.size() < 2) return;
  // Steps after the first (which pays one-time costs), the median; the allocator's peak since the second, the
  // largest of the ranks' (the prediction is the most loaded rank's).
  std::vector<double> steady(step_seconds_.begin() + 1, step_seconds_.end());
  std::sort(steady.begin(), steady.end());
  const double measured = steady[steady.size() / 2];
  const auto peak = static_cast<int64_t>(comm::all_reduce_max(world_, peak_bytes(setup_)));
  const sim::Estimate& e = *prediction_;
  const double time_error = e.time.step / measured - 1;
  const double memory_error = static_cast<double>(e.memory.total) / static_cast<double>(peak) - 1;
  log_.say(
      "plan vs run: step %.2f ms predicted, %.2f ms measured (median of %zu steps; %+.1f%%) | peak memory %s "
      "predicted, %s measured (%+.1f%%)\n",
      1e3 * e.time.step, 1e3 * measured, steady.size(), 100 * time_error,
      sim::human_bytes(e.memory.total).c_str(), sim::human_bytes(peak).c_str(), 100 * memory_error);
  records_.write({{"event", "prediction_check"},
                  {"step_s_predicted", e.time.step},
                  {"step_s_measured", measured},
                  {"steps", steady.size()},
                  {"memory_bytes_predicted", e.memory.total},
                  {"memory_bytes_measured", peak}});
}

void ProgressLog::finish() {
  compare_with_prediction();
  const TrainSetup& s = setup_;
  if (s.dp_group().size() > 1 && state_.step > first_step_) {
    const parallel::GradReductionStats& st = s.buckets->total_stats();
    log_.say(
        "data-parallel gradient reduction: %.1f MiB per step, communication %.3f s, exposed %.3f s: %.0f%% "
        "overlapped with backward\n",
        static_cast<double>(st.bytes) / std::max<int64_t>(1, st.steps) / 1048576.0, st.communication_seconds,
        st.exposed_seconds, 100.0 * st.overlap_ratio());
  }
  if (s.context_parallel && state_.step > first_step_) {
    const parallel::ContextAttentionStats& st = s.context_parallel->stats();
    const double total = st.compute_seconds + st.wait_seconds;
    log_.say(
        "context-parallel attention (%s) over the run: %.1f MiB sent per rank, attention %.3f s, of which "
        "%.3f s (%.0f%%) blocked on transfers\n",
        c_.parallel.cp_comm == parallel::ContextAttention::all_to_all ? "all-to-all" : "ring",
        static_cast<double>(st.bytes_sent) / 1048576.0, total, st.wait_seconds,
        total > 0 ? 100 * st.wait_seconds / total : 0.0);
  }
}

}  // namespace forge::train
