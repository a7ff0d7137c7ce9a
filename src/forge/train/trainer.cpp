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
#include "forge/models/pretrained.h"
#include "forge/models/sampling.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/peak.h"
#include "forge/train/pipelining.h"
#include "forge/train/resilience.h"
#include "forge/train/run_directory.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"
#include "forge/train/training_data.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Which FP8 Linears' delayed-scaling state this rank writes to checkpoints (TrainState::fp8_saves): one
// rank of those holding each Linear. A stage's dense Linears: its tensor- and data-parallel rank 0; a routed
// expert's under expert parallelism: tensor-parallel and expert_dp rank 0 of the ep rank holding it; never
// DualPipe's mirrored copy (chunk 1 there), whose partner writes it as its own.
std::vector<char> fp8_linears_saved_here(const TrainSetup& s) {
  if (!s.fp8 || !s.fp8->delayed_group()) return {};
  const parallel::Layout& layout = s.layout;
  const bool tp0 = layout.coordinate(parallel::Dim::tp) == 0;
  const bool dense = tp0 && s.dp_rank == 0, expert = tp0 && layout.coordinate(parallel::Dim::expert_dp) == 0;
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

// Loss over held-out windows [0, windows) in batches of `batch`, with the byte count of the targets. Under
// data parallelism the batches are dealt round-robin over the dp ranks and the sums added up over dp.
// Ctrl-C (the stop flag, agreed over `world` before each batch) ends it early with interrupted set.
// Under expert parallelism (every_rank_forwards) the replicas exchange tokens inside each forward, so a rank
// left without a batch in the last round runs one anyway (the first windows again) and discards its loss.
// Under pipeline parallelism (pipelining set) each batch runs through the stages and the loss, which the
// last stage computes, is summed over pp.
HeldOut evaluate(Model& model, Pipelining* pipelining, const TrainingData& data, int64_t seq, int64_t batch,
                 int64_t windows, comm::Communicator& dp, comm::Communicator& pp, comm::Communicator& world,
                 bool every_rank_forwards) {
  std::vector<int32_t> ids(batch * seq), targets(batch * seq);
  HeldOut total;
  ProgressBar progress("eval", windows);  // draws only on a terminal
  // Every rank runs the same number of rounds (some with no batch of their own), so that all of them take
  // each agreed stop decision.
  const int64_t per_round = batch * dp.size();
  for (int64_t round = 0; round * per_round < windows; ++round) {
    double stop = Trainer::stop_flag().load() ? 1.0 : 0.0;
    if (world.size() > 1) stop = comm::all_reduce_max(world, stop);
    if (stop > 0) {
      Trainer::stop_flag().store(true);
      progress.finish();
      total.interrupted = true;
      return total;
    }
    const int64_t w = round * per_round + batch * dp.rank();
    const bool mine = w < windows;
    if (!mine && !every_rank_forwards) continue;
    int64_t b = mine ? std::min(batch, windows - w) : std::min(batch, windows);
    data.heldout_batch(mine ? w : 0, b, ids.data(), targets.data());
    LossSum part = pipelining ? pipelining->forward_loss({ids.data(), targets.data(), b, seq, 0.0f})
                              : model.forward_loss(ids.data(), targets.data(), b, seq);
    if (!mine) continue;
    total.loss.sum += part.sum, total.loss.tokens += part.tokens;
    for (int64_t i = 0; i < b * seq; ++i) total.bytes += data.codec().byte_length(targets[i]);
    progress.update(w + b);
  }
  progress.finish();
  if (pipelining) {
    double sums[2] = {total.loss.sum, static_cast<double>(total.loss.tokens)};
    comm::all_reduce_sum(pp, sums, 2);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
  }
  if (dp.size() > 1) {
    double sums[3] = {total.loss.sum, static_cast<double>(total.loss.tokens),
                      static_cast<double>(total.bytes)};
    comm::all_reduce_sum(dp, sums, 3);
    total.loss.sum = sums[0], total.loss.tokens = static_cast<int64_t>(sums[1]);
    total.bytes = static_cast<int64_t>(sums[2]);
  }
  return total;
}

// printf on the first rank only: every rank runs the same loop, one of them tells the user.
bool g_leader = true;
__attribute__((format(printf, 1, 2))) void say(const char* format, ...) {
  if (!g_leader) return;
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
  std::fflush(stdout);
}

// Samples (sequences) a checkpoint's run had consumed: recorded since samples_seen was; older checkpoints
// recorded tokens, which give it when the sequence length is the same.
int64_t samples_seen_of(const CheckpointState& state, int64_t seq) {
  if (state.extra.contains("samples_seen")) return state.extra["samples_seen"].get<int64_t>();
  const int64_t tokens = state.extra.value("tokens_seen", int64_t{0});
  return tokens / seq;
}

// Refuses a checkpoint this run cannot continue exactly: another model, tokenizer or sequence length,
// weights without optimizer state. Each refusal is one line naming the checkpoint and what differs.
void check_resumable(const CheckpointState& state, const fs::path& dir, const std::vector<std::string>& names,
                     const ModelConfig& model_config, const std::string& model_source, const TextCodec& codec,
                     const TrainConfig& c) {
  const std::string where = dir.string();
  std::unique_ptr<ModelConfig> saved;
  try {
    saved = parse_model_config(state.model_config, where + " (manifest.json model_config)");
  } catch (const Error& e) {
    fail("checkpoint {} cannot be resumed: its model config is unreadable: {}", where, e.what());
  }
  if (!saved->same_as(model_config))
    fail("checkpoint {} was trained with a different model config than {} (saved: {})", where, model_source,
         state.model_config.dump());
  if (std::none_of(names.begin(), names.end(),
                   [](const std::string& n) { return n.starts_with("exp_avg."); }))
    fail(
        "checkpoint {} holds weights only, no optimizer state (as forge convert --to forge writes), so it "
        "cannot "
        "be resumed; start a new run from its weights with --set model.init_from={}",
        where, where);
  // The tokenizer by content, never by path: the same file elsewhere is the same tokenizer, another file at
  // the same path is not.
  std::string saved_tokenizer;
  if (state.extra.contains("tokenizer_fingerprint")) {
    saved_tokenizer = state.extra["tokenizer_fingerprint"].get<std::string>();
  } else if (fs::exists(dir / "tokenizer.json")) {
    saved_tokenizer =
        TextCodec::from_tokenizer(Tokenizer::from_file(dir / "tokenizer.json"), "").fingerprint();
  } else if (state.extra.contains("tokenizer")) {
    saved_tokenizer = TextCodec::bytes().fingerprint();  // saved without tokenizer.json: byte-level
  }
  if (!saved_tokenizer.empty() && saved_tokenizer != codec.fingerprint())
    fail(
        "checkpoint {} was trained with another tokenizer ({}) than this run's {} ({}); resuming would feed "
        "it "
        "other token ids",
        where, state.extra.value("tokenizer", std::string("unknown")), codec.description(),
        codec.fingerprint());
  // Samples are windows of seq_len tokens: another length has no sample at which to continue.
  const int64_t saved_seq = state.extra.value("seq_len", int64_t{0});
  if (saved_seq > 0 && saved_seq != c.data.seq_len)
    fail(
        "checkpoint {} was trained with data.seq_len = {}, this run has {}: resuming would skip or repeat "
        "data; "
        "keep data.seq_len = {} (micro_batch, grad_accum and the world size may change)",
        where, saved_seq, c.data.seq_len, saved_seq);
  if (saved_seq == 0 && !state.extra.contains("samples_seen") &&
      state.extra.value("tokens_seen", int64_t{0}) % c.data.seq_len != 0)
    fail(
        "checkpoint {} saw {} tokens, not a whole number of data.seq_len = {} sequences: it was trained with "
        "another sequence length",
        where, state.extra.value("tokens_seen", int64_t{0}), c.data.seq_len);
}

std::atomic<int> g_signal_count{0};
void on_signal(int) {
  if (g_signal_count.fetch_add(1) >= 1) std::_Exit(130);  // second Ctrl-C: leave now
  Trainer::stop_flag().store(true);
}

// One run of the loop: the setup, the state, and what the loop decides with them.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& c, comm::Communicator& world, const TrainerHooks& hooks)
      : c_(c), world_(world), hooks_(hooks), start_time_(Clock::now()) {}
  TrainResult run();

 private:
  void decide_start();
  void resume();
  void open_metrics();
  void print_banner();
  // A failed periodic save is reported and training goes on (the previous checkpoint stays the newest); a
  // final or Ctrl-C save's error ends the run. background: written by AsyncCheckpointSave.
  void save(const char* why, bool background = false);
  void commit_async_save();  // collective: waits for the save in flight and commits it
  void after_commit(int64_t step, const std::string& dir, const char* why, double seconds,
                    double blocked_seconds);
  CheckpointState load_state(const fs::path& dir);
  void build_step_hooks();
  void strike_before_step();
  void roll_back(const std::string& cause, TrainResult& result);
  void write_heartbeat();
  void take_snapshot() {
    const auto start = Clock::now();
    snapshots_.take(state_);
    snapshot_seconds_ += seconds_since(start);
    ++snapshots_taken_;
  }
  void write_metrics(const nlohmann::json& record) {
    if (metrics_) metrics_->write(record);
  }
  bool stop_before_step(TrainResult& result);
  bool run_step(TrainResult& result);
  void log_step(const StepResult& r, TrainResult& result);
  bool evaluate_now();
  void plan_length();
  TrainResult finish(TrainResult result);
  void sample(TrainResult& result);

  const TrainConfig& c_;
  comm::Communicator& world_;
  const TrainerHooks& hooks_;
  const Clock::time_point start_time_;
  std::unique_ptr<TrainSetup> setup_;
  TrainState state_;
  std::unique_ptr<Schedule> schedule_;  // NoPipelining, or Pipelining under pp > 1
  Pipelining* pipelining_ = nullptr;    // schedule_ when it pipelines
  fs::path run_dir_, checkpoint_dir_;
  DirectoryLock run_dir_lock_, checkpoint_dir_lock_;
  ResumeDecision decision_;
  // The step whose checkpoint is already committed in checkpoint_dir (-1: none), so that saving it again
  // (Ctrl-C right after a resume) is skipped.
  int64_t committed_step_ = -1;
  std::optional<MetricsWriter> metrics_;
  std::vector<NamedFile> checkpoint_files_;
  double flops_per_token_ = 0, peak_gflops_ = 0;
  int64_t step_tokens_ = 0, heldout_windows_ = 0;
  bool plan_steps_ = false;
  Clock::time_point train_start_, interval_start_;
  int64_t interval_tokens_ = 0, first_step_ = 0;
  double first_step_seconds_ = 0;
  // Resilience (resilience.h, faults.h).
  FaultPlan faults_;
  std::optional<SpikeDetector> detector_;
  SnapshotRing snapshots_;
  double snapshot_seconds_ = 0;  // spent taking in-memory snapshots (the training thread waits)
  int64_t snapshots_taken_ = 0;
  StepHooks step_hooks_;
  int64_t retries_ = 0;                        // rollbacks since the last stable state past an anomaly
  int64_t last_anomaly_step_ = 0;              // the step of the latest anomaly (0: none)
  std::vector<std::string> rollback_account_;  // one entry per rollback of the current run of retries
  std::vector<std::string> resume_notes_;      // damaged checkpoints resume skipped, for metrics.jsonl
  // The periodic save being written in the background (at most one), and why it was taken; the host copy it
  // writes from, kept between saves (declared first: it outlives the save).
  std::vector<float> async_buffer_;
  std::unique_ptr<AsyncCheckpointSave> async_save_;
  std::string async_reason_;
  Clock::time_point async_started_;
};

// Rank 0 holds the run's directories against other runs and decides where the run starts; every rank learns
// the outcome (or the refusal) from it.
void TrainingRun::decide_start() {
  std::string error;
  nlohmann::json shared;
  if (g_leader) {
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
  if (!decision_.note.empty()) say("%s\n", decision_.note.c_str());
}

// Loads the checkpoint folder `dir` into the state (collective). Returns its manifest state.
CheckpointState TrainingRun::load_state(const fs::path& from) {
  // The load below verifies the checksum of each file it reads; here only the manifest matters.
  CheckpointState saved = read_checkpoint_manifest(from.string(), /*verify_files=*/false);
  const std::vector<std::string> names = checkpoint_tensor_names(from.string());
  TrainState::Fp8Format fp8_saved = TrainState::fp8_format_of(names);
  const bool delayed = setup_->fp8 && setup_->fp8->delayed_group();
  if (delayed && fp8_saved == TrainState::Fp8Format::whole && setup_->layout.pp() > 1) {
    say("the checkpoint's FP8 scaling state is in the single-array format of older versions, which only a "
        "one-stage layout reads: delayed scaling starts from fresh amax histories\n");
    fp8_saved = TrainState::Fp8Format::none;
  } else if (delayed && fp8_saved == TrainState::Fp8Format::none) {
    say("the checkpoint holds no FP8 scaling state: delayed scaling starts from fresh amax histories\n");
  }
  std::vector<ShardPiece> pieces = state_.pieces_to_load(fp8_saved);
  saved = load_sharded_checkpoint(from.string(), world_, pieces);
  state_.finish_load(fp8_saved);
  setup_->optimizer->set_steps_taken(saved.optimizer_steps >= 0 ? saved.optimizer_steps : saved.step);
  state_.step = state_.base_step = saved.step;
  state_.base_samples = samples_seen_of(saved, setup_->seq);
  if (plan_steps_ && saved.extra.contains("planned_steps"))
    setup_->schedule.total_steps = state_.total_steps = saved.extra["planned_steps"].get<int64_t>();
  // What resilience carries (absent from older checkpoints: defaults).
  state_.lr_scale = saved.extra.value("lr_scale", 1.0);
  state_.lr_scale_until = saved.extra.value("lr_scale_until", int64_t{0});
  state_.recent_losses = saved.extra.value("recent_losses", std::vector<double>{});
  state_.recent_grad_norms = saved.extra.value("recent_grad_norms", std::vector<double>{});
  return saved;
}

// Resumes from the decided checkpoint. Under resume = auto a checkpoint that does not load (a flipped byte,
// a truncated shard, a NaN written by a failing disk) is reported and skipped for the next older complete
// one; never used, never deleted (the next save prunes it as another timeline).
void TrainingRun::resume() {
  std::vector<fs::path> candidates = {decision_.checkpoint};
  if (decision_.from_own_directory && c_.checkpoint.resume == "auto") {
    const int64_t newest = read_checkpoint_manifest(decision_.checkpoint.string(), false).step;
    for (const std::string& dir : complete_checkpoints(checkpoint_dir_.string()))
      if (read_checkpoint_manifest(dir, false).step < newest) candidates.push_back(dir);
  }
  CheckpointState saved;
  fs::path from;
  for (size_t i = 0; i < candidates.size(); ++i) {
    // A checkpoint of another run (model, tokenizer, sequence length) is refused, not skipped.
    check_resumable(read_checkpoint_manifest(candidates[i].string(), /*verify_files=*/false), candidates[i],
                    checkpoint_tensor_names(candidates[i].string()), *setup_->model_config,
                    setup_->model_source, setup_->data->codec(), c_);
    try {
      saved = load_state(candidates[i]);
      from = candidates[i];
      break;
    } catch (const Error& e) {
      if (i + 1 == candidates.size()) throw;
      const std::string note = fmt::format("checkpoint {} does not load ({}): skipped, trying {}",
                                           candidates[i].string(), e.what(), candidates[i + 1].string());
      say("%s\n", note.c_str());
      resume_notes_.push_back(note);
    }
  }
  decision_.checkpoint = from;
  if (decision_.from_own_directory) committed_step_ = state_.step;
  const int64_t saved_per_step = saved.extra.value("samples_per_step", int64_t{0});
  say("resumed from %s at step %lld (sample %lld%s)\n", from.c_str(), static_cast<long long>(state_.step),
      static_cast<long long>(state_.base_samples),
      saved_per_step > 0 && saved_per_step != state_.samples_per_step
          ? fmt::format("; {} sequences per step now, {} before", state_.samples_per_step, saved_per_step)
                .c_str()
          : "");
}

void TrainingRun::open_metrics() {
  if (!g_leader) return;
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
  flops_per_token_ = s.model_config->flops_per_token(s.seq);
  // Every rank measures its share of the machine; the job's peak is their sum. On a GPU, the tensor cores'
  // dense peak of the precision that runs the Linears.
  const double rank_peak = c_.log.peak_gflops > 0 ? c_.log.peak_gflops / world_.size()
                           : on_gpu ? (s.options.fp8 ? kHopperFp8PeakGflops : kHopperBf16PeakGflops)
                                    : measure_gemm_peak_gflops(s.options.gemm_dtype);
  peak_gflops_ = comm::all_reduce_sum(world_, rank_peak);
  say("model %.2fM parameters | %s compute%s | fp8 %s | recompute %s | %lld-token batches (%lld x %lld x "
      "%lld x dp "
      "%lld) | peak %s GEMM %.0f GFLOP/s (%s)\n",
      static_cast<double>(s.model_config->num_parameters()) / 1e6,
      (s.dtype_name + (c_.train.dtype == "auto" ? " (auto)" : "")).c_str(),
      on_gpu ? (" on " + std::string(device_name(s.options.device))).c_str() : "", s.fp8_summary.c_str(),
      c_.train.recompute.c_str(), static_cast<long long>(step_tokens_), static_cast<long long>(s.micro),
      static_cast<long long>(s.accum), static_cast<long long>(s.seq), static_cast<long long>(s.dp),
      s.options.fp8 && on_gpu ? "fp8" : s.dtype_name.c_str(), peak_gflops_,
      c_.log.peak_gflops > 0 ? "given"
      : on_gpu               ? "H100/H200 dense"
                             : "measured");
  if (world_.size() > 1) {
    say("%s\n", s.layout.describe().c_str());
    if (!s.pipeline_summary.empty()) say("%s\n", s.pipeline_summary.c_str());
    say("tensor parallel %d%s | data parallel %lld: %zu gradient buckets of <= %.1f MiB, %s, overlap %s | "
        "optimizer state %.1f MiB per rank | %d OpenMP threads per rank\n",
        s.layout.tp(), c_.parallel.sequence_parallel ? " + sequence parallel" : "",
        static_cast<long long>(s.dp), s.buckets->buckets().size(), c_.parallel.bucket_mb,
        c_.parallel.distributed_optimizer ? "reduce-scatter + ZeRO-1 (sharded Adam state)" : "all-reduce",
        c_.parallel.overlap_grad_reduce ? "on" : "off",
        static_cast<double>(s.optimizer->state_bytes()) / 1048576.0, omp_get_max_threads());
  }
  say("%s\n", s.data->describe().c_str());
}

void TrainingRun::save(const char* why, bool background) {
  // At most one save in flight: the previous one commits first (which may be this very step's).
  const bool was_in_flight = async_save_ != nullptr;
  if (async_save_) commit_async_save();
  if (state_.step == committed_step_) {
    if (!was_in_flight)
      say("checkpoint of step %lld is already saved in %s\n", static_cast<long long>(state_.step),
          checkpoint_dir_.c_str());
    return;
  }
  const TrainSetup& s = *setup_;
  const parallel::Layout& layout = s.layout;
  const TextCodec& codec = s.data->codec();
  CheckpointState saved;
  saved.step = state_.step;
  saved.optimizer_steps = s.optimizer->steps_taken();
  saved.layout = {{"tp", layout.tp()},
                  {"dp", layout.dp()},
                  {"pp", layout.pp()},
                  {"cp", layout.cp()},
                  {"ep", layout.ep()},
                  {"sequence_parallel", c_.parallel.sequence_parallel},
                  {"distributed_optimizer", c_.parallel.distributed_optimizer}};
  saved.model_config = s.model_config->to_json();
  const int64_t samples = state_.samples_seen();
  saved.extra = {{"tokens_seen", samples * s.seq},
                 {"samples_seen", samples},
                 {"samples_per_step", state_.samples_per_step},
                 {"seq_len", s.seq},
                 {"reason", why},
                 {"tokenizer", codec.description()},
                 {"tokenizer_fingerprint", codec.fingerprint()},
                 {"recent_losses", state_.recent_losses},
                 {"recent_grad_norms", state_.recent_grad_norms}};
  if (state_.lr_scale_until > state_.step)
    saved.extra["lr_scale"] = state_.lr_scale, saved.extra["lr_scale_until"] = state_.lr_scale_until;
  if (plan_steps_) saved.extra["planned_steps"] = state_.total_steps;
  if (faults_.take(FaultKind::disk_full, state_.step, world_.rank()))
    arm_fail_point("save.write_shard",
                   fmt::format("cannot write the checkpoint shard of step {}: No space left on device (fault "
                               "injection: disk_full)",
                               state_.step));
  const std::vector<ShardPiece> pieces = state_.pieces_to_save(world_.rank());
  CheckpointSaveOptions options;
  options.keep_last = c_.checkpoint.keep_last;
  options.files = checkpoint_files_;
  const auto save_start = Clock::now();
  const bool periodic = std::string_view(why) == "periodic";
  try {
    if (background) {
      async_save_ = std::make_unique<AsyncCheckpointSave>(checkpoint_dir_.string(), world_, pieces, saved,
                                                          options, &async_buffer_);
      state_.finish_save();
      async_reason_ = why;
      async_started_ = save_start;
      return;
    }
    const std::string dir = save_checkpoint_step(checkpoint_dir_.string(), world_, pieces, saved, options);
    state_.finish_save();
    const double seconds = seconds_since(save_start);
    after_commit(state_.step, dir, why, seconds, seconds);
  } catch (const Error& e) {
    state_.finish_save();
    if (!periodic) throw;
    // The previous checkpoint is untouched (the save's staging folder is gone): training goes on.
    say("checkpoint of step %lld failed: %s; training goes on (%s)\n", static_cast<long long>(state_.step),
        e.what(),
        committed_step_ >= 0 ? fmt::format("the newest checkpoint is still step {}", committed_step_).c_str()
                             : "no checkpoint of this run is saved yet");
    write_metrics(
        {{"event", "checkpoint_failed"}, {"step", state_.step}, {"reason", why}, {"error", e.what()}});
  }
}

void TrainingRun::commit_async_save() {
  std::unique_ptr<AsyncCheckpointSave> save = std::move(async_save_);
  if (!save) return;
  const double blocked = save->copy_seconds();
  try {
    const std::string dir = save->finish();
    after_commit(save->step(), dir, async_reason_.c_str(), seconds_since(async_started_), blocked);
  } catch (const Error& e) {
    say("checkpoint of step %lld failed: %s; training goes on (%s)\n", static_cast<long long>(save->step()),
        e.what(),
        committed_step_ >= 0 ? fmt::format("the newest checkpoint is still step {}", committed_step_).c_str()
                             : "no checkpoint of this run is saved yet");
    write_metrics({{"event", "checkpoint_failed"},
                   {"step", save->step()},
                   {"reason", async_reason_},
                   {"error", e.what()}});
  }
}

// A committed checkpoint: the log line, the metrics record, the hook, and the checkpoint faults of drills.
void TrainingRun::after_commit(int64_t step, const std::string& dir, const char* why, double seconds,
                               double blocked_seconds) {
  committed_step_ = step;
  const bool background = blocked_seconds < seconds;
  if (background)
    say("checkpoint saved to %s (step %lld, %s, %.2f s in the background, the step blocked %.3f s)\n",
        dir.c_str(), static_cast<long long>(step), why, seconds, blocked_seconds);
  else
    say("checkpoint saved to %s (step %lld, %s, %.2f s)\n", dir.c_str(), static_cast<long long>(step), why,
        seconds);
  nlohmann::json record = {
      {"event", "checkpoint"}, {"step", step}, {"reason", why}, {"dir", dir}, {"seconds", seconds}};
  if (background) record["blocked_s"] = blocked_seconds;
  write_metrics(record);
  for (FaultKind kind : {FaultKind::corrupt_checkpoint, FaultKind::truncate_checkpoint})
    if (faults_.take(kind, step, world_.rank())) {
      const std::string shard = (fs::path(dir) / shard_file_name(world_.rank(), world_.size())).string();
      corrupt_file(shard, kind == FaultKind::truncate_checkpoint);
      std::fprintf(stderr, "forge: fault injection: %s %s\n",
                   kind == FaultKind::truncate_checkpoint ? "truncated" : "flipped a byte of", shard.c_str());
    }
  if (hooks_.on_saved) hooks_.on_saved(step, why);
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
    say("time limit of %.1f minutes reached at step %lld\n", c_.train.max_minutes,
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
    say("peak activation memory %.1f MiB per micro-batch (recompute %s)\n",
        static_cast<double>(result.peak_activation_bytes) / 1048576.0, c_.train.recompute.c_str());
  }
  if (!r.applied) {
    if (profile_this_step) ops::profile_end();
    const std::string cause = !exception.empty()      ? "an exception in the step: " + exception
                              : !r.non_finite.empty() ? r.non_finite
                                                      : r.spike;
    roll_back(cause, result);
    return false;
  }
  detector_->accept(state_, r.loss, r.grad_norm);
  if (profile_this_step) {
    // This rank's ops; rank 0 reports (the ranks of a balanced layout run the same ops).
    const ops::OpProfile profile = ops::profile_end();
    say("%s", ops::format_profile(profile).c_str());
    if (g_leader)
      write_file_atomically(run_dir_ / "profile.json", ops::profile_json(profile) + "\n", "op profile");
    if (pipelining_) {
      // The step's measured pipeline timeline, one row per pp rank (of the first data-parallel replica).
      const PipelineTrace trace = gather_pipeline_trace(s.pp_group(), pipelining_->measured_spans());
      if (g_leader) {
        write_file_atomically(run_dir_ / "pipeline_trace.json", trace.json + "\n", "pipeline trace");
        std::string idle;
        for (size_t r = 0; r < trace.idle_fraction.size(); ++r)
          idle += fmt::format("{}{:.0f}%", r ? " | " : "", 100 * trace.idle_fraction[r]);
        say("pipeline timeline of step %lld: %s (chrome://tracing, ui.perfetto.dev) | idle per pp rank %s\n",
            static_cast<long long>(state_.step), (run_dir_ / "pipeline_trace.json").c_str(), idle.c_str());
      }
    }
  }
  result.losses.push_back(r.loss);
  result.grad_norms.push_back(r.grad_norm);
  interval_tokens_ += step_tokens_;
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

// The faults of drills that strike as a step starts (faults.h).
void TrainingRun::strike_before_step() {
  if (faults_.empty()) return;
  const int64_t step = state_.step + 1;
  const int rank = world_.rank();
  if (const Fault* f = faults_.take(FaultKind::kill, step, rank)) {
    std::fprintf(stderr, "forge: fault injection: %s: SIGKILL\n", FaultPlan::describe(*f).c_str());
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  if (const Fault* f = faults_.take(FaultKind::hang, step, rank)) {
    std::fprintf(stderr, "forge: fault injection: %s: this rank stops responding\n",
                 FaultPlan::describe(*f).c_str());
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

void TrainingRun::build_step_hooks() {
  const int rank = world_.rank();
  step_hooks_.on_micro_batch = [this, rank](int64_t step, int micro_batch) {
    if (micro_batch == 0)
      if (const Fault* f = faults_.take(FaultKind::throw_exception, step, rank))
        fail("{}: injected exception", FaultPlan::describe(*f));
  };
  step_hooks_.on_loss = [this, rank](int64_t step, LossSum& loss) {
    if (faults_.take(FaultKind::nan_loss, step, rank)) loss.sum = std::numeric_limits<double>::quiet_NaN();
    if (faults_.take(FaultKind::inf_loss, step, rank)) loss.sum = std::numeric_limits<double>::infinity();
    if (const Fault* f = faults_.take(FaultKind::spike, step, rank)) loss.sum *= f->factor;
  };
  step_hooks_.on_gradients = [this, rank](int64_t step, ParameterStore& params) {
    if (faults_.take(FaultKind::nan_grad, step, rank))
      params.grads().f32()[params.grads().numel() / 2] = std::numeric_limits<float>::quiet_NaN();
    if (const Fault* f = faults_.take(FaultKind::grad_spike, step, rank)) {
      float* g = params.grads().f32();
      for (int64_t i = 0; i < params.grads().numel(); ++i) g[i] *= static_cast<float>(f->factor);
    }
    if (hooks_.on_gradients) hooks_.on_gradients(step, params);
  };
  step_hooks_.judge = [this](int64_t step, double loss, double grad_norm) {
    return detector_->judge(state_, step, loss, grad_norm);
  };
}

// An anomaly in step state_.step + 1, agreed by every rank: restore the newest stable state (an in-memory
// snapshot, else the newest valid checkpoint), skip the data window that led here, optionally lower the
// learning rate, and continue; or, with rollback off or the retries spent, end the run with an account.
void TrainingRun::roll_back(const std::string& cause, TrainResult& result) {
  const int64_t step = state_.step + 1;
  write_metrics({{"event", "anomaly"}, {"step", step}, {"cause", cause}});
  auto stop = [&](const std::string& why) {
    // A save in flight holds a state from before the anomaly: it commits before the run ends (every rank
    // is here: the verdict is agreed).
    if (async_save_) commit_async_save();
    const std::string last = committed_step_ >= 0 ? fmt::format("the last checkpoint is step {} in {}",
                                                                committed_step_, checkpoint_dir_.string())
                                                  : std::string("no checkpoint of this run was saved");
    std::string account;
    for (const std::string& a : rollback_account_) account += "; " + a;
    fail("step {}: {}; the update was not applied and nothing was saved ({}){}{}", step, cause, last, why,
         account);
  };
  if (!c_.resilience.rollback) stop("");
  if (retries_ >= c_.resilience.max_retries)
    stop(fmt::format("; {} rollbacks in a row did not get past it (resilience.max_retries = {})", retries_,
                     c_.resilience.max_retries));
  if (async_save_) commit_async_save();  // a state from before the anomaly: it commits as it was
  const int64_t samples_at_anomaly = state_.first_sample_of(state_.step);
  // The same anomaly again: go one snapshot further back when there is one.
  if (retries_ > 0 && step <= last_anomaly_step_ && snapshots_.size() > 1) snapshots_.drop_newest();
  std::string restored;
  if (!snapshots_.empty()) {
    state_.restore(snapshots_.newest());
    restored = fmt::format("the in-memory snapshot of step {}", state_.step);
  } else {
    // The newest checkpoint on disk that loads (a damaged one is skipped).
    const std::vector<std::string> dirs = complete_checkpoints(checkpoint_dir_.string());
    for (const std::string& dir : dirs) {
      try {
        load_state(dir);
        restored = fmt::format("checkpoint {}", dir);
        break;
      } catch (const Error& e) {
        say("checkpoint %s does not load (%s): skipped\n", dir.c_str(), e.what());
      }
    }
    if (restored.empty())
      stop(c_.resilience.snapshot_every > 0
               ? "; there is no stable state to roll back to yet"
               : "; there is no stable state to roll back to (resilience.snapshot_every = 0 and no valid "
                 "checkpoint)");
  }
  const int64_t restored_step = state_.step;
  int64_t skipped = 0;
  if (c_.resilience.skip == "window")
    skipped = skip_data_window(state_, restored_step, step, samples_at_anomaly);
  if (c_.resilience.lr_factor < 1 && c_.resilience.lr_steps > 0) {
    state_.lr_scale = c_.resilience.lr_factor;
    state_.lr_scale_until = restored_step + 1 + c_.resilience.lr_steps;
  }
  ++retries_;
  last_anomaly_step_ = std::max(last_anomaly_step_, step);
  committed_step_ = -1;  // the state now differs from every checkpoint: the next save is made
  // The steps rolled back are not part of this run's losses.
  const int64_t kept = std::max<int64_t>(0, restored_step - first_step_);
  if (static_cast<int64_t>(result.losses.size()) > kept) {
    result.losses.resize(static_cast<size_t>(kept));
    result.grad_norms.resize(static_cast<size_t>(kept));
  }
  if (restored_step < first_step_) first_step_ = restored_step;
  ++result.rollbacks;
  const std::string lr =
      state_.lr_scale_until > restored_step + 1
          ? fmt::format(", learning rate x{:g} until step {}", state_.lr_scale, state_.lr_scale_until - 1)
          : std::string();
  const std::string what = fmt::format(
      "rollback {} of at most {} at step {} ({}): restored {}, skipped {} samples (steps {}-{}){}", retries_,
      c_.resilience.max_retries, step, cause, restored, skipped, restored_step + 1, step, lr);
  rollback_account_.push_back(
      fmt::format("rollback {} at step {} to step {}", retries_, step, restored_step));
  say("%s\n", what.c_str());
  write_metrics({{"event", "rollback"},
                 {"step", step},
                 {"cause", cause},
                 {"restored", restored},
                 {"restored_step", restored_step},
                 {"skipped_samples", skipped},
                 {"skipped_steps", c_.resilience.skip == "window" ? step - restored_step : 0},
                 {"retry", retries_},
                 {"lr_scale", state_.lr_scale_until > restored_step + 1 ? state_.lr_scale : 1.0}});
  interval_start_ = Clock::now();
  interval_tokens_ = 0;
}

// <run_dir>/heartbeat, rewritten after every step on the first rank: `forge launch --heartbeat` restarts a
// job whose heartbeat stops (a rank that hangs stalls every rank at its next collective).
void TrainingRun::write_heartbeat() {
  if (!g_leader) return;
  std::ofstream out(run_dir_ / "heartbeat", std::ios::trunc);
  out << state_.step << "\n";
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
  m.flops_per_s = m.tokens_per_s * flops_per_token_;
  m.mfu = m.flops_per_s / (peak_gflops_ * 1e9);
  m.elapsed_s = seconds_since(start_time_);
  const double per_step = seconds_since(train_start_) / static_cast<double>(step - first_step_);
  m.eta_s = planned ? per_step * static_cast<double>(state_.total_steps - step) : -1;
  if (c_.train.max_minutes > 0)
    m.eta_s = std::min(m.eta_s, c_.train.max_minutes * 60 - seconds_since(train_start_));
  const BalanceMetrics balance = balance_metrics(r);
  m.extra = balance.summary;
  say("%s\n", format_step_line(m).c_str());
  nlohmann::json record = {{"step", step},
                           {"loss", r.loss},
                           {"lr", r.lr},
                           {"grad_norm", r.grad_norm},
                           {"tokens_per_s", m.tokens_per_s},
                           {"tflops", m.flops_per_s / 1e12},
                           {"mfu", m.mfu},
                           {"tokens", step * step_tokens_},
                           {"elapsed_s", m.elapsed_s}};
  if (setup_->dp > 1) record["dp_overlap"] = setup_->buckets->total_stats().overlap_ratio();
  for (const auto& [key, value] : balance.fields.items()) record[key] = value;
  write_metrics(record);
  interval_start_ = Clock::now();
  interval_tokens_ = 0;
}

// A periodic evaluation; false when Ctrl-C interrupted it (the next step's stop check saves and ends the
// run).
bool TrainingRun::evaluate_now() {
  TrainSetup& s = *setup_;
  HeldOut e = evaluate(*s.model, pipelining_, *s.data, s.seq, s.micro,
                       std::min(heldout_windows_, c_.eval.batches * s.micro), s.dp_group(), s.pp_group(),
                       world_, s.layout.ep() > 1);
  if (e.interrupted) return false;
  const double bpb = e.bits_per_byte();
  say("eval step %lld | held-out loss %.4f | %.4f bits/byte\n", static_cast<long long>(state_.step),
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
    say("time budget %.3g minutes: planned %lld steps (%.3f s/step so far)\n", c_.train.max_minutes,
        static_cast<long long>(state_.total_steps), per_step);
  }
}

TrainResult TrainingRun::run() {
  g_leader = world_.rank() == 0;
  setup_ = std::make_unique<TrainSetup>(c_, world_);
  TrainSetup& s = *setup_;
  if (s.init_source) say("initialised from %s\n", s.init_source->dir.c_str());
  if (s.pipeline) {
    auto p = std::make_unique<Pipelining>(*s.pipeline, s.pp_rank, s.pp_group(), s.chunks(), s.stage_rows,
                                          c_.parallel.sequence_parallel ? s.layout.tp() : 1, s.mirror.get(),
                                          s.chunk_params);
    p->tie(s.tied_group.get(), s.tied_param);
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
  // The tokenizer travels inside each checkpoint (listed and checksummed in its manifest), so that `forge
  // generate`, `forge convert` and a resume find it.
  if (const Tokenizer* t = s.data->codec().tokenizer()) {
    std::string text = t->json_text();
    if (text.empty() || text.back() != '\n') text += '\n';
    checkpoint_files_.push_back({"tokenizer.json", std::move(text)});
  }

  faults_ = FaultPlan::for_run(c_.resilience.inject, "resilience.inject");
  if (!faults_.empty()) {
    std::string list;
    for (const Fault& f : faults_.faults()) list += (list.empty() ? "" : ", ") + FaultPlan::describe(f);
    say("fault injection: %s\n", list.c_str());
  }
  detector_.emplace(c_.resilience, c_.train.warmup);
  build_step_hooks();

  TrainResult result;
  train_start_ = interval_start_ = Clock::now();
  first_step_ = state_.step;
  // The first stable state: what a rollback before the first periodic snapshot restores.
  if (c_.resilience.rollback && c_.resilience.snapshot_every > 0) take_snapshot();
  while (state_.step < state_.total_steps) {
    if (stop_before_step(result)) break;
    if (!run_step(result)) continue;  // rolled back
    const int64_t step = state_.step;
    const bool last = step == state_.total_steps;
    if (c_.eval.every > 0 && step % c_.eval.every == 0 && !last && !evaluate_now()) continue;
    if (c_.checkpoint.every > 0 && step % c_.checkpoint.every == 0 && !last)
      save("periodic", c_.checkpoint.async);
    plan_length();
    if (step == first_step_ + 1) first_step_seconds_ = seconds_since(train_start_);
    if (hooks_.on_step) hooks_.on_step(step);
    if (hooks_.on_state) hooks_.on_state(state_);
  }
  return finish(std::move(result));
}

TrainResult TrainingRun::finish(TrainResult result) {
  TrainSetup& s = *setup_;
  result.steps_done = state_.step;
  if (fp8::DelayedScalingGroup* g = s.fp8 ? s.fp8->delayed_group() : nullptr)
    result.fp8_scales.assign(g->scales().begin(), g->scales().end());
  if (s.dp > 1 && state_.step > first_step_) {
    const parallel::GradReductionStats& st = s.buckets->total_stats();
    say("data-parallel gradient reduction: %.1f MiB per step, communication %.3f s, exposed %.3f s: %.0f%% "
        "overlapped with backward\n",
        static_cast<double>(st.bytes) / std::max<int64_t>(1, st.steps) / 1048576.0, st.communication_seconds,
        st.exposed_seconds, 100.0 * st.overlap_ratio());
  }
  if (snapshots_taken_ > 1) {
    say("resilience: %lld in-memory snapshots of %.1f MiB each (host memory held: %.1f MiB), %.1f ms each; "
        "%lld rollbacks\n",
        static_cast<long long>(snapshots_taken_),
        static_cast<double>(snapshots_.bytes()) / static_cast<double>(snapshots_.size()) / 1048576.0,
        static_cast<double>(snapshots_.bytes()) / 1048576.0, 1e3 * snapshot_seconds_ / snapshots_taken_,
        static_cast<long long>(result.rollbacks));
    write_metrics({{"event", "snapshots"},
                   {"step", state_.step},
                   {"count", snapshots_taken_},
                   {"seconds_each", snapshot_seconds_ / snapshots_taken_},
                   {"host_bytes", snapshots_.bytes()}});
  }
  if (Trainer::stop_flag().load()) {
    say("interrupted at step %lld: saving a checkpoint\n", static_cast<long long>(state_.step));
    save("interrupted");
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  // The final checkpoint first: a Ctrl-C (or a crash) during the evaluation or the sample loses nothing.
  save("final");
  HeldOut e = evaluate(*s.model, pipelining_, *s.data, s.seq, s.micro, heldout_windows_, s.dp_group(),
                       s.pp_group(), world_, s.layout.ep() > 1);
  if (e.interrupted) {
    say("interrupted during the final evaluation (the checkpoint of step %lld is saved)\n",
        static_cast<long long>(state_.step));
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  result.heldout_loss = e.loss.mean();
  result.heldout_bits_per_byte = e.bits_per_byte();
  say("final held-out loss %.4f nats/token = %.4f bits per byte (%lld tokens, %lld bytes; %.1f s total)\n",
      result.heldout_loss, result.heldout_bits_per_byte, static_cast<long long>(e.loss.tokens),
      static_cast<long long>(e.bytes), seconds_since(start_time_));
  write_metrics({{"step", state_.step},
                 {"eval_loss", result.heldout_loss},
                 {"eval_bits_per_byte", result.heldout_bits_per_byte},
                 {"final", true}});
  if (c_.sample.tokens > 0 && g_leader) sample(result);
  return result;
}

void TrainingRun::sample(TrainResult& result) {
  TrainSetup& s = *setup_;
  SamplingOptions so;
  so.max_new_tokens = c_.sample.tokens, so.context = s.seq, so.temperature = c_.sample.temperature;
  so.top_k = c_.sample.top_k, so.seed = c_.sample.seed;
  const TextCodec& codec = s.data->codec();
  std::vector<int32_t> prompt = codec.encode(c_.sample.prompt.empty() ? std::string("\n") : c_.sample.prompt);
  // Generation runs on one process: a model split over tp or pp ranks is read back whole from the checkpoint
  // (onto this rank's device).
  std::unique_ptr<Model> whole;
  if (s.layout.tp() > 1 || s.layout.pp() > 1 || s.layout.ep() > 1) {
    nn::ComputeOptions single;
    single.gemm_dtype = s.options.gemm_dtype;
    single.device = s.options.device;
    whole = load_pretrained_model(checkpoint_dir_, single);
  }
  std::vector<int32_t> out = generate(whole ? *whole : *s.model, prompt, so);
  result.sample = c_.sample.prompt + codec.decode(out);
  if (Trainer::stop_flag().load()) {  // Ctrl-C while sampling: the run still ends as interrupted (exit 130)
    result.interrupted = true;
    Trainer::stop_flag().store(false);
  }
  say("--- sample (temperature %.2f, top-k %lld) ---\n%s\n---\n", c_.sample.temperature,
      static_cast<long long>(c_.sample.top_k), result.sample.c_str());
}

}  // namespace

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
  TrainingRun run(config_, world, hooks_);
  return run.run();
}

}  // namespace forge::train
