// The training loop: builds the run's parts (setup, state, checkpoints, recovery, evaluation, progress log)
// and decides when each acts: when to step, log, evaluate, checkpoint, roll back, sample and stop.
#include "forge/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "forge/comm/comm.h"
#include "forge/core/device.h"
#include "forge/core/file_io.h"
#include "forge/core/memory.h"
#include "forge/kernels/profiler.h"
#include "forge/report/report.h"
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

// log.profile_step: this rank's ops (rank 0 reports: the ranks of a balanced layout run the same ops), and
// under pipeline parallelism the step's measured timeline, one row per pp rank (of the first data-parallel
// replica).
void report_profile(const TrainSetup& s, Pipelining* pipelining, const RunLog& log, const fs::path& run_dir,
                    int64_t step) {
  const ops::OpProfile profile = ops::profile_end();
  log.say("%s", ops::format_profile(profile).c_str());
  if (log.leader())
    write_file_atomically(run_dir / "profile.json", ops::profile_json(profile) + "\n", "op profile");
  if (!pipelining) return;
  const PipelineTrace trace = gather_pipeline_trace(s.pp_group(), pipelining->measured_spans());
  if (!log.leader()) return;
  write_file_atomically(run_dir / "pipeline_trace.json", trace.json + "\n", "pipeline trace");
  std::string idle;
  for (size_t r = 0; r < trace.idle_fraction.size(); ++r)
    idle += fmt::format("{}{:.0f}%", r ? " | " : "", 100 * trace.idle_fraction[r]);
  log.say("pipeline timeline of step %lld: %s (chrome://tracing, ui.perfetto.dev) | idle per pp rank %s\n",
          static_cast<long long>(step), (run_dir / "pipeline_trace.json").c_str(), idle.c_str());
}

std::atomic<int> g_signal_count{0};
void on_signal(int) {
  if (g_signal_count.fetch_add(1) >= 1) std::_Exit(130);  // second Ctrl-C: leave now
  Trainer::stop_flag().store(true);
}

}  // namespace

namespace detail {

void TrainingRun::make_schedule() {
  TrainSetup& s = *setup_;
  if (s.pipeline) {
    auto p = std::make_unique<Pipelining>(*s.pipeline, s.pp_rank, s.pp_group(), *s.pp_links, s.chunks(),
                                          s.stage_rows, c_.parallel.sequence_parallel ? s.layout.tp() : 1,
                                          s.mirror_grads(), s.chunk_params);
    p->tie(s.tied_grads(), s.tied_param);
    pipelining_ = p.get();
    schedule_ = std::move(p);
    return;
  }
  // Expert parallelism with its overlap: the step's micro-batches in overlapped pairs (1F1B on one stage),
  // each one's all-to-alls under the other's compute.
  const bool paired = s.layout.ep() > 1 && c_.parallel.ep_overlap && s.accum > 1;
  schedule_ =
      std::make_unique<NoPipelining>(paired ? NoPipelining::Order::paired : NoPipelining::Order::fused);
}

void TrainingRun::init_state() {
  TrainSetup& s = *setup_;
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
}

// Before anything is written: the setup, the state and the run's parts.
void TrainingRun::set_up() {
  // A fault spec that does not parse is bad input, refused before the setup.
  faults_ = FaultPlan::for_run(c_.resilience.inject, "resilience.inject");
  setup_ = std::make_unique<TrainSetup>(c_, world_);
  TrainSetup& s = *setup_;
  if (s.init_source) log_.say("initialised from %s\n", s.init_source->dir.c_str());
  make_schedule();
  init_state();
  checkpoints_ =
      std::make_unique<Checkpointing>(c_, world_, log_, records_, faults_, s, state_, hooks_.on_saved);
  recovery_ = std::make_unique<Recovery>(c_, world_, log_, records_, faults_, state_, *checkpoints_);
  evaluation_ = std::make_unique<Evaluation>(c_, world_, log_, records_, s, pipelining_, checkpoints_->dir());
  progress_ = std::make_unique<ProgressLog>(c_, world_, log_, records_, s, state_, start_time_);
}

// Rank 0 holds the run's directories against other runs and decides where the run starts; every rank learns
// the outcome (or the refusal) from it.
ResumeDecision TrainingRun::decide_start() {
  ResumeDecision decision;
  std::string error;
  nlohmann::json shared;
  if (log_.leader()) {
    try {
      run_dir_lock_ = DirectoryLock(run_dir_, "log.run_dir");
      const fs::path checkpoint_dir = checkpoints_->dir();
      std::error_code ec;
      const fs::path relative = fs::relative(checkpoint_dir, run_dir_, ec);
      if (ec || relative.empty() || *relative.begin() == "..")
        checkpoint_dir_lock_ = DirectoryLock(checkpoint_dir, "checkpoint.dir");
      decision = decide_resume(c_);
      shared = {{"checkpoint", decision.checkpoint.string()},
                {"note", decision.note},
                {"own", decision.from_own_directory}};
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const std::string message = error.empty() ? shared.dump() : "!" + error;
  const std::string outcome = world_.size() > 1 ? comm::all_gather_strings(world_, message)[0] : message;
  if (outcome.starts_with("!")) throw Error(outcome.substr(1));
  const nlohmann::json got = nlohmann::json::parse(outcome);
  decision.checkpoint = got["checkpoint"].get<std::string>();
  decision.note = got["note"].get<std::string>();
  decision.from_own_directory = got["own"].get<bool>();
  if (!decision.note.empty()) log_.say("%s\n", decision.note.c_str());
  return decision;
}

void TrainingRun::open_records(const ResumeOutcome& resumed) {
  if (!log_.leader()) return;
  write_file_atomically(run_dir_ / "config.toml", c_.to_toml(), "run configuration");
  const bool resuming = !resumed.from.empty();
  if (resuming) trim_metrics(run_dir_, state_.step);
  records_.open(run_dir_, /*truncate=*/!resuming);
  if (resuming)
    records_.write({{"event", "resume"}, {"step", state_.step}, {"checkpoint", resumed.from.string()}});
  for (const std::string& note : resumed.skipped)
    records_.write({{"event", "checkpoint_invalid"}, {"step", state_.step}, {"note", note}});
}

// The tokenizer travels inside each checkpoint (listed and checksummed in its manifest), so that `forge
// generate`, `forge convert` and a resume find it; and the image processor, for `forge generate --image`.
void TrainingRun::add_checkpoint_files() {
  const TrainingData& data = *setup_->data;
  if (const Tokenizer* t = data.codec().tokenizer()) {
    std::string text = t->json_text();
    if (text.empty() || text.back() != '\n') text += '\n';
    checkpoints_->add_file("tokenizer.json", std::move(text));
  }
  if (std::string processor = data.image_processor_json(); !processor.empty())
    checkpoints_->add_file("preprocessor_config.json", std::move(processor));
  // Background saves copy into a host buffer: the weights and both moments bound what a rank saves (the
  // FP8 state, if any, grows it once).
  if (c_.checkpoint.every > 0 && c_.checkpoint.async)
    checkpoints_->reserve_background_buffer(state_.params->params().numel() +
                                            setup_->optimizer->master_numel() +
                                            2 * setup_->optimizer->moment_numel());
}

// Every rank must take the same decision to stop (Ctrl-C reaches ranks at different moments; clocks differ):
// the flags are agreed over the world.
// The same reduction tells whether every rank has written its shard of the save in flight, which then
// commits (the manifest last).
bool TrainingRun::stop_before_step(TrainResult& result) {
  double flags[3] = {
      Trainer::stop_flag().load() ? 1.0 : 0.0,
      c_.train.max_minutes > 0 && progress_->seconds_since_start() > c_.train.max_minutes * 60 ? 1.0 : 0.0,
      checkpoints_->pending_written() ? 0.0 : 1.0};
  if (world_.size() > 1) world_.all_reduce(flags, 3, comm::Type::f64, comm::ReduceOp::max).wait();
  if (checkpoints_->pending() && flags[2] == 0) checkpoints_->commit_pending();
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
  const bool first = state_.step == progress_->first_step();
  // Activation memory: the host's allocations, or on a GPU its allocator's.
  if (first) s.on_gpu() ? device_memory(device).reset_peak() : reset_peak_memory();
  const int64_t live_before = s.on_gpu() ? device_memory(device).peak_allocated() : memory_stats().live_bytes;
  const bool profile_this_step = state_.step + 1 == c_.log.profile_step;  // steps are logged 1-based
  if (profile_this_step) ops::profile_begin(device);
  if (profile_this_step && pipelining_) pipelining_->measure_next_run();
  recovery_->strike_before_step(state_.step + 1);
  const auto step_start = Clock::now();
  StepResult r;
  std::string exception;
  try {
    r = train_step(s, state_, *schedule_, step_hooks_);
  } catch (const PermanentError& e) {
    // Not an anomaly a rollback could cure: the same step needs the same memory again, the same data holds
    // the same token ids.
    fail("step {}: {}", state_.step + 1, e.what());
  } catch (const std::bad_alloc&) {
    fail("step {}: out of memory (std::bad_alloc)", state_.step + 1);
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
  const double step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
  if (first && exception.empty()) {
    result.peak_activation_bytes =
        (s.on_gpu() ? device_memory(device).peak_allocated() : memory_stats().peak_bytes) - live_before;
    log_.say("peak activation memory %.1f MiB per micro-batch (recompute %s)\n",
             static_cast<double>(result.peak_activation_bytes) / 1048576.0, c_.recompute_summary().c_str());
  }
  if (!r.applied) {
    if (profile_this_step) ops::profile_end();
    const std::string cause = !exception.empty()      ? "an exception in the step: " + exception
                              : !r.data_error.empty() ? "the step's data could not be read: " + r.data_error
                              : !r.non_finite.empty() ? r.non_finite
                                                      : r.spike;
    const int64_t restored = recovery_->roll_back(cause);
    // The steps rolled back are not part of this run's losses.
    const int64_t kept = std::max<int64_t>(0, restored - progress_->first_step());
    if (static_cast<int64_t>(result.losses.size()) > kept) {
      result.losses.resize(static_cast<size_t>(kept));
      result.grad_norms.resize(static_cast<size_t>(kept));
    }
    progress_->rolled_back(restored);
    ++result.rollbacks;
    return false;
  }
  if (profile_this_step) report_profile(s, pipelining_, log_, run_dir_, state_.step);
  result.losses.push_back(r.loss);
  result.grad_norms.push_back(r.grad_norm);
  progress_->step(r, step_seconds);
  recovery_->accept(r.loss, r.grad_norm);
  write_heartbeat();
  return true;
}

// What the loop does after an applied step: the periodic evaluation and checkpoint, the length plan, the
// callers' hooks.
void TrainingRun::after_step(int64_t step) {
  const bool last = step == state_.total_steps;
  if (c_.eval.every > 0 && step % c_.eval.every == 0 && !last && !evaluation_->periodic(step)) return;
  if (c_.checkpoint.every > 0 && step % c_.checkpoint.every == 0 && !last)
    checkpoints_->save("periodic", c_.checkpoint.async);
  plan_length();
  if (step == progress_->first_step() + 1) first_step_seconds_ = progress_->seconds_since_start();
  if (hooks_.on_step) hooks_.on_step(step);
  if (hooks_.on_state) {
    checkpoints_->detach_pending();  // the hook may change the state
    hooks_.on_state(state_);
  }
}

// Time-budget mode: re-estimate the length from the average speed so far (after the first step, which pays
// one-time costs), keeping 3% of the budget for evaluations. The plan is frozen when the next step's LR would
// depend on it: at the end of warmup for cosine, at the start of the decay for WSD. Ranks agree on the most
// pessimistic estimate.
void TrainingRun::plan_length() {
  const int64_t step = state_.step, first = progress_->first_step();
  if (!plan_steps_ || state_.plan_frozen || step - first < 3) return;
  const double elapsed = progress_->seconds_since_start();
  const double per_step = (elapsed - first_step_seconds_) / static_cast<double>(step - first - 1);
  const double left = c_.train.max_minutes * 60 * 0.97 - elapsed;
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
  // The run's last record says how it ended, so that a script can tell an interrupted run from a failed one
  // where the exit status cannot (mpirun signalled itself exits 1 whatever its ranks return).
  try {
    TrainResult result = train();
    records_.write({{"event", "end"},
                    {"step", state_.step},
                    {"status", result.interrupted          ? "interrupted"
                               : result.time_limit_reached ? "time_limit"
                                                           : "completed"}});
    return result;
  } catch (const std::exception& e) {
    // The run's own error is what ends it: a record that cannot be written (a full disk) does not replace it.
    try {
      records_.write({{"event", "end"}, {"step", state_.step}, {"status", "failed"}, {"error", e.what()}});
    } catch (const std::exception&) {
    }
    throw;
  }
}

TrainResult TrainingRun::train() {
  set_up();
  const ResumeDecision decision = decide_start();
  ResumeOutcome resumed;
  if (!decision.checkpoint.empty()) resumed = checkpoints_->resume(decision);
  open_records(resumed);
  progress_->banner();
  progress_->predict();
  add_checkpoint_files();
  if (!faults_.empty()) {
    std::string list;
    for (const Fault& f : faults_.faults()) list += (list.empty() ? "" : ", ") + FaultPlan::describe(f);
    log_.say("fault injection: %s\n", list.c_str());
  }
  step_hooks_ = recovery_->step_hooks(hooks_.on_gradients);

  TrainResult result;
  progress_->start();
  recovery_->start();
  while (state_.step < state_.total_steps) {
    if (stop_before_step(result)) break;
    progress_->before_step();
    if (run_step(result)) after_step(state_.step);
  }
  return finish(std::move(result));
}

TrainResult TrainingRun::finish(TrainResult result) {
  TrainSetup& s = *setup_;
  result.steps_done = state_.step;
  progress_->finish();
  if (fp8::DelayedScalingGroup* g = s.fp8 ? s.fp8->delayed_group() : nullptr)
    result.fp8_scales.assign(g->scales().begin(), g->scales().end());
  recovery_->report_snapshots(result.rollbacks);
  if (Trainer::stop_flag().load()) {
    log_.say("interrupted at step %lld: saving a checkpoint\n", static_cast<long long>(state_.step));
    checkpoints_->save("interrupted");
    write_report();
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  // The final checkpoint first: a Ctrl-C (or a crash) during the evaluation or the sample loses nothing.
  checkpoints_->save("final");
  const double run_seconds = std::chrono::duration<double>(Clock::now() - start_time_).count();
  if (!evaluation_->final(state_.step, result, run_seconds)) {
    log_.say("interrupted during the final evaluation (the checkpoint of step %lld is saved)\n",
             static_cast<long long>(state_.step));
    result.interrupted = true;
    Trainer::stop_flag().store(false);
    return result;
  }
  write_report();
  if (c_.sample.tokens > 0 && log_.leader()) evaluation_->sample(result);
  if (c_.sample.captions > 0 && log_.leader() && !result.interrupted)
    evaluation_->caption(state_.step, result, c_.sample.captions, "captions");
  if (c_.sample.answers > 0 && log_.leader() && !result.interrupted)
    evaluation_->caption(state_.step, result, c_.sample.answers, "answers");
  return result;
}

void TrainingRun::write_report() {
  if (!c_.log.report || !log_.leader() || !records_.is_open()) return;
  // The run is trained and saved by now: a report that cannot be written is a warning, not a failed run.
  try {
    const fs::path output = run_dir_ / "report.html";
    report::write_report(report::read_runs({run_dir_}), output);
    log_.say("report: %s (forge report %s)\n", output.c_str(), run_dir_.c_str());
  } catch (const std::exception& e) {
    log_.say("warning: the report was not written: %s\n", e.what());
  }
}

// <run_dir>/heartbeat, rewritten after every step on the first rank: `forge launch --heartbeat` restarts a
// job whose heartbeat stops (a rank that hangs stalls every rank at its next collective).
void TrainingRun::write_heartbeat() {
  if (!log_.leader()) return;
  std::ofstream out(run_dir_ / "heartbeat", std::ios::trunc);
  out << state_.step << "\n";
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
