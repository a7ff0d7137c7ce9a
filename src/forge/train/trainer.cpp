// The training loop: when to log, evaluate, checkpoint, sample and stop. The setup (setup.h), the state
// (train_state.h) and the step (step.h) are apart from it.
#include "forge/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "forge/ckpt/async_save.h"
#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/sharded.h"
#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/core/fault_injection.h"
#include "forge/core/file_io.h"
#include "forge/core/memory.h"
#include "forge/kernels/profiler.h"
#include "forge/models/captions.h"
#include "forge/models/pretrained.h"
#include "forge/models/sampling.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/peak.h"
#include "forge/train/pipelining.h"
#include "forge/report/report.h"
#include "forge/train/resilience.h"
#include "forge/train/run_directory.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"
#include "forge/train/training_data.h"
#include "forge/train/training_run.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace fs = std::filesystem;
namespace {

// Which FP8 Linears' delayed-scaling state this rank writes to checkpoints (TrainState::fp8_saves): one
// rank of those holding each Linear. A stage's dense Linears: its tensor- and data-parallel rank 0; a routed
// expert's under expert parallelism: tensor-parallel and expert_dp rank 0 of the ep rank holding it; never
// DualPipe's mirrored copy (chunk 1 there), whose partner writes it as its own.
std::vector<char> fp8_linears_saved_here(const TrainSetup& s) {
  if (!s.fp8 || !s.fp8->delayed_group()) return {};
  const parallel::Layout& layout = s.layout;
  const bool tp0 = layout.coordinate(parallel::Dim::tp) == 0;
  const bool dense = tp0 && s.dp_group().rank() == 0,
             expert = tp0 && layout.coordinate(parallel::Dim::expert_dp) == 0;
  std::vector<char> saves(static_cast<size_t>(s.fp8->linears()));
  for (int l = 0; l < s.fp8->linears(); ++l) saves[l] = s.fp8->is_expert(l) ? expert : dense;
  if (s.mirror && !s.chunk_fp8_linears.empty())
    for (int64_t l = s.chunk_fp8_linears[0].second; l < s.fp8->linears(); ++l) saves[l] = 0;
  return saves;
}

struct HeldOut {
  LossSum loss;
  int64_t bytes = 0;  // bytes of text the predicted tokens stand for
  bool interrupted = false;
  double bits_per_byte() const { return bytes ? loss.sum / std::log(2.0) / static_cast<double>(bytes) : 0.0; }
};

// Loss over held-out windows [0, windows) in batches of the micro-batch size, with the byte count of the
// targets. Under data parallelism the batches are dealt round-robin over the dp replicas and the sums added
// up over dp (and cp: each context-parallel rank of a replica runs its slices of the replica's batch).
// Ctrl-C (the stop flag, agreed over `world` before each batch) ends it early with interrupted set.
// Under expert parallelism the replicas exchange tokens inside each forward, so a rank left without a batch
// in the last round runs one anyway (the first windows again) and discards its loss. Under pipeline
// parallelism (pipelining set) each batch runs through the stages and the loss, which the last stage
// computes, is summed over pp.
HeldOut evaluate(const TrainSetup& s, Pipelining* pipelining, int64_t windows, comm::Communicator& world) {
  const int64_t seq = s.seq, batch = s.micro, local_seq = s.local_seq();
  const bool every_rank_forwards = s.layout.ep() > 1;
  comm::Communicator& replicas = *s.groups.dp;
  std::vector<int32_t> ids(batch * seq), targets(batch * seq), local_ids(batch * local_seq),
      local_targets(batch * local_seq);
  std::vector<float> pixels;  // image-text data: the batch's images
  HeldOut total;
  ProgressBar progress("eval", windows);  // draws only on a terminal
  // Every rank runs the same number of rounds (some with no batch of their own), so that all of them take
  // each agreed stop decision.
  const int64_t per_round = batch * replicas.size();
  for (int64_t round = 0; round * per_round < windows; ++round) {
    double stop = Trainer::stop_flag().load() ? 1.0 : 0.0;
    if (world.size() > 1) stop = comm::all_reduce_max(world, stop);
    if (stop > 0) {
      Trainer::stop_flag().store(true);
      progress.finish();
      total.interrupted = true;
      return total;
    }
    const int64_t w = round * per_round + batch * replicas.rank();
    const bool mine = w < windows;
    if (!mine && !every_rank_forwards) continue;
    int64_t b = mine ? std::min(batch, windows - w) : std::min(batch, windows);
    const int64_t images = s.data->heldout_batch_images(mine ? w : 0, b, ids.data(), targets.data(), pixels);
    s.context_slice(ids.data(), local_ids.data(), b);
    s.context_slice(targets.data(), local_targets.data(), b);
    const MicroBatch mb{local_ids.data(), local_targets.data(), b, local_seq, 0.0f, pixels.data(), images};
    LossSum part = pipelining ? pipelining->forward_loss(mb) : s.model->forward(mb, Tensor(), nullptr).loss;
    if (!mine) continue;
    total.loss.sum += part.sum, total.loss.tokens += part.tokens;
    for (int64_t i = 0; i < b * local_seq; ++i)  // (targets without a loss, < 0, stand for no text)
      if (local_targets[i] >= 0) total.bytes += s.data->codec().byte_length(local_targets[i]);
    progress.update(w + b);
  }
  progress.finish();
  if (pipelining) {
    double sums[2] = {total.loss.sum, static_cast<double>(total.loss.tokens)};
    comm::all_reduce_sum(s.pp_group(), sums, 2);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
  }
  if (s.dp_group().size() > 1) {
    double sums[3] = {total.loss.sum, static_cast<double>(total.loss.tokens),
                      static_cast<double>(total.bytes)};
    comm::all_reduce_sum(s.dp_group(), sums, 3);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
    total.bytes = static_cast<int64_t>(sums[2]);
  }
  return total;
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

std::atomic<int> g_signal_count{0};
void on_signal(int) {
  if (g_signal_count.fetch_add(1) >= 1) std::_Exit(130);  // second Ctrl-C: leave now
  Trainer::stop_flag().store(true);
}

}  // namespace

namespace detail {

// Rank 0 holds the run's directories against other runs and decides where the run starts; every rank learns
// the outcome (or the refusal) from it.
void TrainingRun::decide_start() {
  std::string error;
  nlohmann::json shared;
  if (log_.leader()) {
    try {
      run_dir_lock_ = DirectoryLock(run_dir_, "log.run_dir");
      std::error_code ec;
      const fs::path relative = fs::relative(checkpoint_dir_, run_dir_, ec);
      if (ec || relative.empty() || *relative.begin() == "..")
        checkpoint_dir_lock_ = DirectoryLock(checkpoint_dir_, "checkpoint.dir");
      decision_ = decide_resume(c_);
      shared = {{"checkpoint", decision_.checkpoint.string()},
                {"note", decision_.note},
                {"own", decision_.from_own_directory}};
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const std::string message = error.empty() ? shared.dump() : "!" + error;
  const std::string outcome = world_.size() > 1 ? comm::all_gather_strings(world_, message)[0] : message;
  if (outcome.starts_with("!")) throw Error(outcome.substr(1));
  const nlohmann::json got = nlohmann::json::parse(outcome);
  decision_.checkpoint = got["checkpoint"].get<std::string>();
  decision_.note = got["note"].get<std::string>();
  decision_.from_own_directory = got["own"].get<bool>();
  if (!decision_.note.empty()) log_.say("%s\n", decision_.note.c_str());
}

void TrainingRun::open_metrics() {
  if (!log_.leader()) return;
  write_file_atomically(run_dir_ / "config.toml", c_.to_toml(), "run configuration");
  const bool resumed = !decision_.checkpoint.empty();
  if (resumed) trim_metrics(run_dir_, state_.step);
  metrics_.emplace(run_dir_, /*truncate=*/!resumed);
  if (resumed)
    metrics_->write(
        {{"event", "resume"}, {"step", state_.step}, {"checkpoint", decision_.checkpoint.string()}});
  for (const std::string& note : resume_notes_)
    metrics_->write({{"event", "checkpoint_invalid"}, {"step", state_.step}, {"note", note}});
}

void TrainingRun::print_banner() {
  const TrainSetup& s = *setup_;
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
      "%lld x dp "
      "%lld) | peak %s GEMM %.0f GFLOP/s (%s)\n",
      static_cast<double>(s.model_config->num_parameters()) / 1e6,
      (s.dtype_name + (c_.train.dtype == DtypeChoice::automatic ? " (auto)" : "")).c_str(),
      on_gpu ? (" on " + std::string(device_name(s.options.device))).c_str() : "", s.fp8_summary.c_str(),
      std::string(c_.train.recompute.name()).c_str(), static_cast<long long>(step_tokens_),
      static_cast<long long>(s.micro), static_cast<long long>(s.accum), static_cast<long long>(s.seq),
      static_cast<long long>(s.dp), s.options.fp8 && on_gpu ? "fp8" : s.dtype_name.c_str(), peak_gflops_,
      c_.log.peak_gflops > 0 ? "given"
      : on_gpu               ? "H100/H200 dense"
                             : "measured");
  if (world_.size() > 1) {
    log_.say("%s\n", s.layout.describe().c_str());
    if (!s.pipeline_summary.empty()) log_.say("%s\n", s.pipeline_summary.c_str());
    if (s.cp > 1)
      log_.say(
          "context parallel %lld: %lld of each sequence's %lld tokens per rank (chunks r and %lld - r of "
          "%lld), "
          "attention %s\n",
          static_cast<long long>(s.cp), static_cast<long long>(s.local_seq()), static_cast<long long>(s.seq),
          static_cast<long long>(2 * s.cp - 1), static_cast<long long>(2 * s.cp),
          c_.parallel.cp_comm == parallel::ContextAttention::all_to_all
              ? "all-to-all (heads scattered, sequences gathered)"
              : "ring (keys and values passed around, blocks merged by log-sum-exp)");
    log_.say(
        "tensor parallel %d%s | data parallel %lld%s: %zu gradient buckets of <= %.1f MiB, %s, overlap %s | "
        "optimizer state %.1f MiB per rank | %d OpenMP threads per rank\n",
        s.layout.tp(), c_.parallel.sequence_parallel ? " + sequence parallel" : "",
        static_cast<long long>(s.dp),
        s.cp > 1 ? fmt::format(" (gradients reduced over dp x cp = {} ranks)", s.dp_group().size()).c_str()
                 : "",
        s.buckets->buckets().size(), static_cast<double>(s.buckets->bucket_bytes()) / 1048576.0,
        c_.parallel.distributed_optimizer ? "reduce-scatter + ZeRO-1 (sharded Adam state)" : "all-reduce",
        c_.parallel.overlap_grad_reduce ? "on" : "off",
        static_cast<double>(s.optimizer->state_bytes()) / 1048576.0, omp_get_max_threads());
  }
  log_.say("%s\n", s.data->describe().c_str());
}

// Every rank must take the same decision to stop (Ctrl-C reaches ranks at different moments; clocks differ):
// the flags are agreed over the world.
// The same reduction tells whether every rank has written its shard of the save in flight, which then
// commits (the manifest last).
bool TrainingRun::stop_before_step(TrainResult& result) {
  double flags[3] = {
      Trainer::stop_flag().load() ? 1.0 : 0.0,
      c_.train.max_minutes > 0 && seconds_since(train_start_) > c_.train.max_minutes * 60 ? 1.0 : 0.0,
      async_save_ && !async_save_->written() ? 1.0 : 0.0};
  if (world_.size() > 1) world_.all_reduce(flags, 3, comm::Type::f64, comm::ReduceOp::max).wait();
  if (async_save_ && flags[2] == 0) commit_async_save();
  if (flags[0] > 0) {
    Trainer::stop_flag().store(true);
    return true;
  }
  if (flags[1] > 0) {
    log_.say("time limit of %.1f minutes reached at step %lld\n", c_.train.max_minutes,
             static_cast<long long>(state_.step));
    result.time_limit_reached = true;
    return true;
  }
  return false;
}

// One step, with its profile and (the first time) its activation memory. An anomaly rolls back (or ends the
// run with its account): then false.
bool TrainingRun::run_step(TrainResult& result) {
  TrainSetup& s = *setup_;
  const Device device = s.device;
  const bool first = state_.step == first_step_;
  // Activation memory: the host's allocations, or on a GPU its allocator's.
  if (first) s.on_gpu() ? device_memory(device).reset_peak() : reset_peak_memory();
  const int64_t live_before = s.on_gpu() ? device_memory(device).peak_allocated() : memory_stats().live_bytes;
  const bool profile_this_step = state_.step + 1 == c_.log.profile_step;  // steps are logged 1-based
  if (profile_this_step) ops::profile_begin(device);
  if (profile_this_step && pipelining_) pipelining_->measure_next_run();
  strike_before_step();
  StepResult r;
  std::string exception;
  try {
    r = train_step(s, state_, *schedule_, step_hooks_);
  } catch (const OutOfMemory& e) {
    // Not an anomaly a rollback could cure: the same step needs the same memory again.
    fail("step {}: {}", state_.step + 1, e.what());
  } catch (const std::exception& e) {
    // On one process a failed step can be abandoned and rolled back. Across processes the others are inside
    // the step's collectives: the error ends the job (forge's main aborts every rank at once), and a
    // restart (forge launch) resumes from the newest valid checkpoint.
    if (world_.size() > 1 || !c_.resilience.rollback) throw;
    s.model->params().cancel_grad_step();
    s.buckets->cancel_step();
    if (s.expert_buckets) s.expert_buckets->cancel_step();
    exception = e.what();
  }
  if (first && exception.empty()) {
    result.peak_activation_bytes =
        (s.on_gpu() ? device_memory(device).peak_allocated() : memory_stats().peak_bytes) - live_before;
    log_.say("peak activation memory %.1f MiB per micro-batch (recompute %s)\n",
             static_cast<double>(result.peak_activation_bytes) / 1048576.0,
             std::string(c_.train.recompute.name()).c_str());
  }
  if (!r.applied) {
    if (profile_this_step) ops::profile_end();
    const std::string cause = !exception.empty()      ? "an exception in the step: " + exception
                              : !r.data_error.empty() ? "the step's data could not be read: " + r.data_error
                              : !r.non_finite.empty() ? r.non_finite
                                                      : r.spike;
    roll_back(cause, result);
    return false;
  }
  detector_->accept(state_, r.loss, r.grad_norm);
  if (profile_this_step) {
    // This rank's ops; rank 0 reports (the ranks of a balanced layout run the same ops).
    const ops::OpProfile profile = ops::profile_end();
    log_.say("%s", ops::format_profile(profile).c_str());
    if (log_.leader())
      write_file_atomically(run_dir_ / "profile.json", ops::profile_json(profile) + "\n", "op profile");
    if (pipelining_) {
      // The step's measured pipeline timeline, one row per pp rank (of the first data-parallel replica).
      const PipelineTrace trace = gather_pipeline_trace(s.pp_group(), pipelining_->measured_spans());
      if (log_.leader()) {
        write_file_atomically(run_dir_ / "pipeline_trace.json", trace.json + "\n", "pipeline trace");
        std::string idle;
        for (size_t r = 0; r < trace.idle_fraction.size(); ++r)
          idle += fmt::format("{}{:.0f}%", r ? " | " : "", 100 * trace.idle_fraction[r]);
        log_.say(
            "pipeline timeline of step %lld: %s (chrome://tracing, ui.perfetto.dev) | idle per pp rank %s\n",
            static_cast<long long>(state_.step), (run_dir_ / "pipeline_trace.json").c_str(), idle.c_str());
      }
    }
  }
  result.losses.push_back(r.loss);
  result.grad_norms.push_back(r.grad_norm);
  interval_tokens_ += step_tokens_;
  interval_images_ += r.images;
  log_step(r, result);
  const int64_t step = state_.step;
  // A stable state: the rollback target. Past the latest anomaly it also ends that run of retries.
  if (c_.resilience.rollback && c_.resilience.snapshot_every > 0 &&
      step % c_.resilience.snapshot_every == 0) {
    take_snapshot();
    if (step > last_anomaly_step_) retries_ = 0, rollback_account_.clear();
  }
  write_heartbeat();
  return true;
}

void TrainingRun::log_step(const StepResult& r, TrainResult&) {
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
  if (setup_->data->has_images()) m.images_per_s = images_per_s;
  m.flops_per_s = m.tokens_per_s * flops_per_token_ + images_per_s * flops_per_image_;
  m.mfu = m.flops_per_s / (peak_gflops_ * 1e9);
  m.elapsed_s = seconds_since(start_time_);
  const double per_step = seconds_since(train_start_) / static_cast<double>(step - first_step_);
  m.eta_s = planned ? per_step * static_cast<double>(state_.total_steps - step) : -1;
  if (c_.train.max_minutes > 0)
    m.eta_s = std::min(m.eta_s, c_.train.max_minutes * 60 - seconds_since(train_start_));
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
  if (setup_->dp_group().size() > 1) record["dp_overlap"] = setup_->buckets->total_stats().overlap_ratio();
  // The allocator's peak since the first step, the largest over ranks (one scalar all-reduce per log line).
  const TrainSetup& s = *setup_;
  record["peak_memory_bytes"] = comm::all_reduce_max(
      world_,
      static_cast<double>(s.on_gpu() ? device_memory(s.device).peak_allocated() : memory_stats().peak_bytes));
  if (const fp8::DelayedScalingGroup* g = s.fp8 ? s.fp8->delayed_group() : nullptr)
    record["fp8"] = fp8_scale_fields(*g);
  for (const auto& [key, value] : balance.fields.items()) record[key] = value;
  if (m.images_per_s >= 0) record["images_per_s"] = m.images_per_s;
  write_metrics(record);
  interval_start_ = Clock::now();
  interval_tokens_ = 0, interval_images_ = 0;
}

// A periodic evaluation; false when Ctrl-C interrupted it (the next step's stop check saves and ends the
// run).
bool TrainingRun::evaluate_now() {
  TrainSetup& s = *setup_;
  HeldOut e = evaluate(s, pipelining_, std::min(heldout_windows_, c_.eval.batches * s.micro), world_);
  if (e.interrupted) return false;
  const double bpb = e.bits_per_byte();
  log_.say("eval step %lld | held-out loss %.4f | %.4f bits/byte\n", static_cast<long long>(state_.step),
           e.loss.mean(), bpb);
  write_metrics({{"step", state_.step}, {"eval_loss", e.loss.mean()}, {"eval_bits_per_byte", bpb}});
  return true;
}

// Time-budget mode: re-estimate the length from the average speed so far (after the first step, which pays
// one-time costs), keeping 3% of the budget for evaluations. The plan is frozen when the next step's LR would
// depend on it: at the end of warmup for cosine, at the start of the decay for WSD. Ranks agree on the most
// pessimistic estimate.
void TrainingRun::plan_length() {
  const int64_t step = state_.step;
  if (!plan_steps_ || state_.plan_frozen || step - first_step_ < 3) return;
  const double per_step =
      (seconds_since(train_start_) - first_step_seconds_) / static_cast<double>(step - first_step_ - 1);
  const double left = c_.train.max_minutes * 60 * 0.97 - seconds_since(train_start_);
  double planned = static_cast<double>(step + std::max<int64_t>(1, static_cast<int64_t>(left / per_step)));
  if (world_.size() > 1) planned = -comm::all_reduce_max(world_, -planned);
  setup_->schedule.total_steps = state_.total_steps = static_cast<int64_t>(planned);
  if (step + 1 >= setup_->schedule.decay_begins()) {
    state_.plan_frozen = true;
    log_.say("time budget %.3g minutes: planned %lld steps (%.3f s/step so far)\n", c_.train.max_minutes,
             static_cast<long long>(state_.total_steps), per_step);
  }
}

TrainResult TrainingRun::run() {
  // Before anything is set up or written: a fault spec that does not parse is bad input.
  faults_ = FaultPlan::for_run(c_.resilience.inject, "resilience.inject");
  setup_ = std::make_unique<TrainSetup>(c_, world_);
  TrainSetup& s = *setup_;
  if (s.init_source) log_.say("initialised from %s\n", s.init_source->dir.c_str());
  if (s.pipeline) {
    auto p = std::make_unique<Pipelining>(*s.pipeline, s.pp_rank, s.pp_group(), *s.pp_links, s.chunks(),
                                          s.stage_rows, c_.parallel.sequence_parallel ? s.layout.tp() : 1,
                                          s.mirror_grads(), s.chunk_params);
    p->tie(s.tied_grads(), s.tied_param);
    pipelining_ = p.get();
    schedule_ = std::move(p);
  } else {
    // Expert parallelism with its overlap: the step's micro-batches in overlapped pairs (1F1B on one stage),
    // each one's all-to-alls under the other's compute.
    const bool paired = s.layout.ep() > 1 && c_.parallel.ep_overlap && s.accum > 1;
    schedule_ =
        std::make_unique<NoPipelining>(paired ? NoPipelining::Order::paired : NoPipelining::Order::fused);
  }
  state_.params = &s.model->params();
  state_.optimizer = s.optimizer.get();
  state_.fp8 = s.fp8.get();
  state_.fp8_saves = fp8_linears_saved_here(s);
  state_.samples_per_step = s.micro * s.accum * s.dp;
  // Time-budget mode (steps = 0): the schedule's length is planned once, from the measured speed of the first
  // steps (which are all in warmup, where the LR does not depend on the length).
  plan_steps_ = c_.train.steps == 0;
  state_.total_steps = c_.train.steps;
  if (plan_steps_) s.schedule.total_steps = state_.total_steps = std::numeric_limits<int32_t>::max();
  state_.plan_frozen = !plan_steps_;
  heldout_windows_ = s.data->heldout_windows();
  step_tokens_ = c_.tokens_per_step() * s.dp;  // micro x accum sequences on each of the dp replicas

  run_dir_ = c_.log.run_dir;
  checkpoint_dir_ = c_.checkpoint_dir();
  decide_start();
  if (!decision_.checkpoint.empty()) resume();
  open_metrics();
  print_banner();
  predict();
  // The tokenizer travels inside each checkpoint (listed and checksummed in its manifest), so that `forge
  // generate`, `forge convert` and a resume find it.
  if (const Tokenizer* t = s.data->codec().tokenizer()) {
    std::string text = t->json_text();
    if (text.empty() || text.back() != '\n') text += '\n';
    checkpoint_files_.push_back({"tokenizer.json", std::move(text)});
  }
  // And the image processor, for `forge generate --image`.
  if (std::string processor = s.data->image_processor_json(); !processor.empty())
    checkpoint_files_.push_back({"preprocessor_config.json", std::move(processor)});

  if (!faults_.empty()) {
    std::string list;
    for (const Fault& f : faults_.faults()) list += (list.empty() ? "" : ", ") + FaultPlan::describe(f);
    log_.say("fault injection: %s\n", list.c_str());
  }
  detector_.emplace(c_.resilience, c_.train.warmup);
  build_step_hooks();

  TrainResult result;
  train_start_ = interval_start_ = Clock::now();
  first_step_ = state_.step;
  // The first stable state: what a rollback before the first periodic snapshot restores.
  if (c_.resilience.rollback && c_.resilience.snapshot_every > 0) take_snapshot();
  // The host buffer background saves copy into, allocated (and faulted in) now rather than in the step of
  // the first save: the weights and both moments bound what a rank saves (the FP8 state, if any, grows it
  // once).
  if (c_.checkpoint.every > 0 && c_.checkpoint.async)
    async_buffer_.resize(
        static_cast<size_t>(state_.params->params().numel() + 2 * s.optimizer->exp_avg().numel()));
  while (state_.step < state_.total_steps) {
    if (stop_before_step(result)) break;
    // The allocator's peak from the second step on (the first allocates what stays): the run's steady peak.
    if (prediction_ && state_.step == first_step_ + 1)
      s.on_gpu() ? device_memory(s.device).reset_peak() : reset_peak_memory();
    const auto step_start = Clock::now();
    if (!run_step(result)) continue;  // rolled back
    step_seconds_.push_back(seconds_since(step_start));
    const int64_t step = state_.step;
    const bool last = step == state_.total_steps;
    if (c_.eval.every > 0 && step % c_.eval.every == 0 && !last && !evaluate_now()) continue;
    if (c_.checkpoint.every > 0 && step % c_.checkpoint.every == 0 && !last)
      save("periodic", c_.checkpoint.async);
    plan_length();
    if (step == first_step_ + 1) first_step_seconds_ = seconds_since(train_start_);
    if (hooks_.on_step) hooks_.on_step(step);
    if (hooks_.on_state) {
      if (async_save_) async_save_->detach();  // the hook may change the state
      hooks_.on_state(state_);
    }
  }
  return finish(std::move(result));
}

TrainResult TrainingRun::finish(TrainResult result) {
  TrainSetup& s = *setup_;
  result.steps_done = state_.step;
  compare_with_prediction();
  if (fp8::DelayedScalingGroup* g = s.fp8 ? s.fp8->delayed_group() : nullptr)
    result.fp8_scales.assign(g->scales().begin(), g->scales().end());
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
  if (snapshot_seconds_.size() > 1) {
    // The median: the first snapshots also allocate (and fault in) their buffers.
    std::vector<double> sorted = snapshot_seconds_;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    log_.say(
        "resilience: %zu in-memory snapshots of %.1f MiB each (host memory held: %.1f MiB), %.1f ms each "
        "(median; the first, which allocates, %.1f ms); %lld rollbacks\n",
        snapshot_seconds_.size(),
        static_cast<double>(snapshots_.bytes()) / static_cast<double>(snapshots_.size()) / 1048576.0,
        static_cast<double>(snapshots_.bytes()) / 1048576.0, 1e3 * median, 1e3 * snapshot_seconds_[0],
        static_cast<long long>(result.rollbacks));
    write_metrics({{"event", "snapshots"},
                   {"step", state_.step},
                   {"count", snapshot_seconds_.size()},
                   {"seconds_median", median},
                   {"seconds_first", snapshot_seconds_[0]},
                   {"host_bytes", snapshots_.bytes()}});
  }
  if (Trainer::stop_flag().load()) {
    log_.say("interrupted at step %lld: saving a checkpoint\n", static_cast<long long>(state_.step));
    save("interrupted");
    write_report();
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  // The final checkpoint first: a Ctrl-C (or a crash) during the evaluation or the sample loses nothing.
  save("final");
  HeldOut e = evaluate(s, pipelining_, heldout_windows_, world_);
  if (e.interrupted) {
    log_.say("interrupted during the final evaluation (the checkpoint of step %lld is saved)\n",
             static_cast<long long>(state_.step));
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  result.heldout_loss = e.loss.mean();
  result.heldout_bits_per_byte = e.bits_per_byte();
  log_.say(
      "final held-out loss %.4f nats/token = %.4f bits per byte (%lld tokens, %lld bytes; %.1f s total)\n",
      result.heldout_loss, result.heldout_bits_per_byte, static_cast<long long>(e.loss.tokens),
      static_cast<long long>(e.bytes), seconds_since(start_time_));
  write_metrics({{"step", state_.step},
                 {"eval_loss", result.heldout_loss},
                 {"eval_bits_per_byte", result.heldout_bits_per_byte},
                 {"final", true}});
  write_report();
  if (c_.sample.tokens > 0 && log_.leader()) sample(result);
  if (c_.sample.captions > 0 && log_.leader() && !result.interrupted) caption(result);
  return result;
}

void TrainingRun::write_report() {
  if (!c_.log.report || !log_.leader() || !metrics_) return;
  // The run is trained and saved by now: a report that cannot be written is a warning, not a failed run.
  try {
    const fs::path output = run_dir_ / "report.html";
    report::write_report(report::read_runs({run_dir_}), output);
    log_.say("report: %s (forge report %s)\n", output.c_str(), run_dir_.c_str());
  } catch (const std::exception& e) {
    log_.say("warning: the report was not written: %s\n", e.what());
  }
}

// Generation runs on one process: a model split over tp, pp, ep or cp ranks is read back whole from the
// final checkpoint (onto this rank's device) into `whole`.
Model& TrainingRun::generation_model(std::unique_ptr<Model>& whole) {
  TrainSetup& s = *setup_;
  if (s.layout.tp() == 1 && s.layout.pp() == 1 && s.layout.ep() == 1 && s.layout.cp() == 1) return *s.model;
  if (!whole) {
    nn::ComputeOptions single;
    single.gemm_dtype = s.options.gemm_dtype;
    single.device = s.options.device;
    whole = load_pretrained_model(checkpoint_dir_, single);
  }
  return *whole;
}

void TrainingRun::caption(TrainResult& result) {
  TrainSetup& s = *setup_;
  const TrainingData& data = *s.data;
  const int64_t n = std::min(c_.sample.captions, data.heldout_windows());
  const TextCodec& codec = data.codec();
  std::unique_ptr<Model> whole;
  Model& model = generation_model(whole);
  std::vector<int32_t> ids(static_cast<size_t>(s.seq)), targets(static_cast<size_t>(s.seq));
  std::vector<float> pixels;
  models::CaptionScore score;
  const auto start = Clock::now();
  for (int64_t i = 0; i < n && !Trainer::stop_flag().load(); ++i) {
    const int64_t images = data.heldout_batch_images(i, 1, ids.data(), targets.data(), pixels);
    score.add(model, i, ids.data(), targets.data(), s.seq, pixels.data(), images);
  }
  if (score.count() == 0) {
    log_.say("captions: none of the %lld held-out samples has an answer to compare\n",
             static_cast<long long>(n));
    return;
  }
  result.captions = score.count(), result.captions_exact = score.exact();
  result.caption_token_accuracy = score.token_accuracy();
  const models::CaptionDecode decode = [&](std::span<const int32_t> ids) { return codec.decode(ids); };
  log_.say("%s\n", models::caption_summary("held-out captions", score, seconds_since(start)).c_str());
  for (const std::string& line : models::caption_lines(score, decode, 4)) log_.say("%s\n", line.c_str());
  write_metrics({{"event", "captions"},
                 {"step", state_.step},
                 {"count", score.count()},
                 {"exact", score.exact()},
                 {"token_accuracy", score.token_accuracy()},
                 {"examples", models::caption_examples_json(score, decode)}});
  if (Trainer::stop_flag().load()) {
    result.interrupted = true;
    Trainer::stop_flag().store(false);
  }
}

void TrainingRun::sample(TrainResult& result) {
  TrainSetup& s = *setup_;
  SamplingOptions so;
  so.max_new_tokens = c_.sample.tokens, so.context = s.seq, so.temperature = c_.sample.temperature;
  so.top_k = c_.sample.top_k, so.seed = c_.sample.seed;
  const TextCodec& codec = s.data->codec();
  std::vector<int32_t> prompt = codec.encode(c_.sample.prompt.empty() ? std::string("\n") : c_.sample.prompt);
  std::unique_ptr<Model> whole;
  std::vector<int32_t> out = generate(generation_model(whole), prompt, so);
  result.sample = c_.sample.prompt + codec.decode(out);
  if (Trainer::stop_flag().load()) {  // Ctrl-C while sampling: the run still ends as interrupted (exit 130)
    result.interrupted = true;
    Trainer::stop_flag().store(false);
  }
  log_.say("--- sample (temperature %.2f, top-k %lld) ---\n%s\n---\n", c_.sample.temperature,
           static_cast<long long>(c_.sample.top_k), result.sample.c_str());
}

}  // namespace detail

std::atomic<bool>& Trainer::stop_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

void install_stop_signal_handlers() {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
}

Trainer::Trainer(TrainConfig config, comm::Communicator* world) : config_(std::move(config)), world_(world) {
  config_.validate();
}

TrainResult Trainer::run() {
  comm::Communicator& world = world_ ? *world_ : comm::world();
  detail::TrainingRun run(config_, world, hooks_);
  return run.run();
}

}  // namespace forge::train
