#include "forge/train/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/fault_injection.h"
#include "forge/kernels/emulated_device.h"
#include "forge/models/model.h"
#include "forge/train/training_data.h"

namespace forge::train {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace {

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

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

Checkpointing::Checkpointing(const TrainConfig& config, comm::Communicator& world, const RunLog& log,
                             RunRecords& records, FaultPlan& faults, TrainSetup& setup, TrainState& state,
                             std::function<void(int64_t, const std::string&)> on_saved)
    : c_(config),
      world_(world),
      log_(log),
      records_(records),
      faults_(faults),
      setup_(setup),
      state_(state),
      on_saved_(std::move(on_saved)),
      dir_(config.checkpoint_dir()) {}

Checkpointing::~Checkpointing() = default;

void Checkpointing::add_file(std::string name, std::string text) {
  files_.push_back({std::move(name), std::move(text)});
}

void Checkpointing::reserve_background_buffer(int64_t floats) {
  async_buffer_.resize(static_cast<size_t>(floats));
}

std::string Checkpointing::newest_description() const {
  return committed_step_ >= 0 ? fmt::format("the newest checkpoint is still step {}", committed_step_)
                              : std::string("no checkpoint of this run is saved yet");
}

CheckpointState Checkpointing::load(const fs::path& from) {
  // The load below verifies the checksum of each file it reads; here only the manifest matters.
  CheckpointState saved = read_checkpoint_manifest(from.string(), /*verify_files=*/false);
  const std::vector<std::string> names = checkpoint_tensor_names(from.string());
  TrainState::Fp8Format fp8_saved = TrainState::fp8_format_of(names);
  const bool delayed = setup_.fp8 && setup_.fp8->delayed_group();
  if (delayed && fp8_saved == TrainState::Fp8Format::whole && setup_.layout.pp() > 1) {
    log_.say(
        "the checkpoint's FP8 scaling state is in the single-array format of older versions, which only a "
        "one-stage layout reads: delayed scaling starts from fresh amax histories\n");
    fp8_saved = TrainState::Fp8Format::none;
  } else if (delayed && fp8_saved == TrainState::Fp8Format::none) {
    log_.say("the checkpoint holds no FP8 scaling state: delayed scaling starts from fresh amax histories\n");
  }
  std::vector<std::string> fp8_missing;
  std::vector<ShardPiece> pieces = state_.pieces_to_load(fp8_saved, &names, &fp8_missing);
  if (!fp8_missing.empty())
    log_.say(
        "the checkpoint holds no FP8 scaling state for %zu of this run's FP8 Linears (%s%s; fp8.vision or "
        "the bf16 layers changed?): their delayed scaling starts from fresh amax histories\n",
        fp8_missing.size(), fp8_missing[0].c_str(), fp8_missing.size() > 1 ? ", ..." : "");
  saved = load_sharded_checkpoint(from.string(), world_, pieces);
  state_.finish_load(fp8_saved);
  setup_.optimizer->set_steps_taken(saved.optimizer_steps >= 0 ? saved.optimizer_steps : saved.step);
  state_.step = state_.base_step = saved.step;
  state_.base_samples = samples_seen_of(saved, setup_.seq);
  // A time-budget run (train.steps = 0) continues with the length it planned.
  if (c_.train.steps == 0 && saved.extra.contains("planned_steps"))
    setup_.schedule.total_steps = state_.total_steps = saved.extra["planned_steps"].get<int64_t>();
  // What resilience carries (absent from older checkpoints: defaults).
  state_.lr_scale = saved.extra.value("lr_scale", 1.0);
  state_.lr_scale_until = saved.extra.value("lr_scale_until", int64_t{0});
  state_.recent_losses = saved.extra.value("recent_losses", std::vector<double>{});
  state_.recent_grad_norms = saved.extra.value("recent_grad_norms", std::vector<double>{});
  return saved;
}

std::string Checkpointing::load_newest() {
  for (const std::string& dir : complete_checkpoints(dir_.string())) {
    try {
      load(dir);
      return dir;
    } catch (const Error& e) {
      log_.say("checkpoint %s: passed over %s: %s\n", dir_.c_str(), fs::path(dir).filename().c_str(),
               e.what());
    }
  }
  return "";
}

ResumeOutcome Checkpointing::resume(const ResumeDecision& decision) {
  std::vector<fs::path> candidates = {decision.checkpoint};
  if (decision.from_own_directory && c_.resume_mode() == ResumeMode::automatic) {
    const int64_t newest = read_checkpoint_manifest(decision.checkpoint.string(), false).step;
    for (const std::string& dir : complete_checkpoints(dir_.string()))
      if (read_checkpoint_manifest(dir, false).step < newest) candidates.push_back(dir);
  }
  ResumeOutcome outcome;
  CheckpointState saved;
  for (size_t i = 0; i < candidates.size(); ++i) {
    check_resumable(read_checkpoint_manifest(candidates[i].string(), /*verify_files=*/false), candidates[i],
                    checkpoint_tensor_names(candidates[i].string()), *setup_.model_config,
                    setup_.model_source, setup_.data->codec(), c_);
    try {
      saved = load(candidates[i]);
      outcome.from = candidates[i];
      break;
    } catch (const Error& e) {
      if (i + 1 == candidates.size()) throw;
      const std::string note =
          fmt::format("checkpoint {}: passed over {}: {}; trying {}", dir_.string(),
                      candidates[i].filename().string(), e.what(), candidates[i + 1].filename().string());
      log_.say("%s\n", note.c_str());
      outcome.skipped.push_back(note);
    }
  }
  if (decision.from_own_directory) committed_step_ = state_.step;
  const int64_t saved_per_step = saved.extra.value("samples_per_step", int64_t{0});
  log_.say(
      "resumed from %s at step %lld (sample %lld%s)\n", outcome.from.c_str(),
      static_cast<long long>(state_.step), static_cast<long long>(state_.base_samples),
      saved_per_step > 0 && saved_per_step != state_.samples_per_step
          ? fmt::format("; {} sequences per step now, {} before", state_.samples_per_step, saved_per_step)
                .c_str()
          : "");
  return outcome;
}

CheckpointState Checkpointing::manifest_to_save(const char* why) const {
  const parallel::Layout& layout = setup_.layout;
  const TextCodec& codec = setup_.data->codec();
  CheckpointState saved;
  saved.step = state_.step;
  saved.optimizer_steps = setup_.optimizer->steps_taken();
  saved.layout = {{"tp", layout.tp()},
                  {"dp", layout.dp()},
                  {"pp", layout.pp()},
                  {"cp", layout.cp()},
                  {"ep", layout.ep()},
                  {"sequence_parallel", c_.parallel.sequence_parallel},
                  {"distributed_optimizer", c_.parallel.distributed_optimizer}};
  saved.model_config = setup_.model_config->to_json();
  const int64_t samples = state_.samples_seen();
  saved.extra = {{"tokens_seen", samples * setup_.seq},
                 {"samples_seen", samples},
                 {"samples_per_step", state_.samples_per_step},
                 {"seq_len", setup_.seq},
                 {"reason", why},
                 {"tokenizer", codec.description()},
                 {"tokenizer_fingerprint", codec.fingerprint()},
                 {"recent_losses", state_.recent_losses},
                 {"recent_grad_norms", state_.recent_grad_norms}};
  if (state_.lr_scale_until > state_.step)
    saved.extra["lr_scale"] = state_.lr_scale, saved.extra["lr_scale_until"] = state_.lr_scale_until;
  if (c_.train.steps == 0) saved.extra["planned_steps"] = state_.total_steps;
  return saved;
}

void Checkpointing::save(const char* why, bool background) {
  // A dry run's state is zeros (kernels/emulated_device.h) and its model may be far larger than this
  // machine's memory and disk: nothing is written.
  if (EmulatedDevice::check_only()) {
    log_.say("dry run: no checkpoint of step %lld is written (%s)\n", static_cast<long long>(state_.step),
             why);
    return;
  }
  // At most one save in flight: the previous one commits first (which may be this very step's).
  const bool was_in_flight = async_ != nullptr;
  if (async_) commit_pending();
  if (state_.step == committed_step_) {
    if (!was_in_flight)
      log_.say("checkpoint of step %lld is already saved in %s\n", static_cast<long long>(state_.step),
               dir_.c_str());
    return;
  }
  const CheckpointState saved = manifest_to_save(why);
  if (faults_.take(FaultKind::disk_full, state_.step, world_.rank()))
    arm_fail_point("save.write_shard",
                   fmt::format("cannot write the checkpoint shard of step {}: No space left on device (fault "
                               "injection: disk_full)",
                               state_.step));
  const std::vector<ShardPiece> pieces = state_.pieces_to_save(world_.rank());
  CheckpointSaveOptions options;
  options.keep_last = c_.checkpoint.keep_last;
  options.files = files_;
  const auto save_start = Clock::now();
  try {
    if (background) {
      async_ = std::make_unique<AsyncCheckpointSave>(
          dir_.string(), world_, pieces, saved, options, &async_buffer_,
          // On a CPU the writer reads the state itself until the next update (detach_pending,
          // StepHooks::before_update).
          setup_.on_gpu() ? AsyncCheckpointSave::Source::copy : AsyncCheckpointSave::Source::live);
      state_.finish_save();
      async_reason_ = why;
      async_started_ = save_start;
      return;
    }
    const std::string dir = save_checkpoint_step(dir_.string(), world_, pieces, saved, options);
    state_.finish_save();
    const double seconds = seconds_since(save_start);
    after_commit(state_.step, dir, why, seconds, seconds);
  } catch (const Error& e) {
    state_.finish_save();
    if (std::string_view(why) != "periodic") throw;
    // The previous checkpoint is untouched (the save's staging folder is gone): training goes on.
    report_failed_save(state_.step, why, e.what());
  }
}

void Checkpointing::commit_pending() {
  std::unique_ptr<AsyncCheckpointSave> save = std::move(async_);
  if (!save) return;
  const double blocked = save->blocked_seconds();
  try {
    const std::string dir = save->finish();
    after_commit(save->step(), dir, async_reason_, seconds_since(async_started_), blocked);
  } catch (const Error& e) {
    report_failed_save(save->step(), async_reason_, e.what());
  }
}

void Checkpointing::report_failed_save(int64_t step, const std::string& why, const std::string& error) {
  log_.say("checkpoint of step %lld failed: %s; training goes on (%s)\n", static_cast<long long>(step),
           error.c_str(), newest_description().c_str());
  records_.write({{"event", "checkpoint_failed"}, {"step", step}, {"reason", why}, {"error", error}});
}

// A committed checkpoint: the log line, the metrics record, the hook, and the checkpoint faults of drills.
void Checkpointing::after_commit(int64_t step, const std::string& dir, const std::string& why, double seconds,
                                 double blocked_seconds) {
  committed_step_ = step;
  const bool background = blocked_seconds < seconds;
  if (background)
    log_.say("checkpoint saved to %s (step %lld, %s, %.2f s in the background, the step blocked %.3f s)\n",
             dir.c_str(), static_cast<long long>(step), why.c_str(), seconds, blocked_seconds);
  else
    log_.say("checkpoint saved to %s (step %lld, %s, %.2f s)\n", dir.c_str(), static_cast<long long>(step),
             why.c_str(), seconds);
  nlohmann::json record = {
      {"event", "checkpoint"}, {"step", step}, {"reason", why}, {"dir", dir}, {"seconds", seconds}};
  if (background) record["blocked_s"] = blocked_seconds;
  records_.write(record);
  for (FaultKind kind : {FaultKind::corrupt_checkpoint, FaultKind::truncate_checkpoint})
    if (faults_.take(kind, step, world_.rank())) {
      const std::string shard = (fs::path(dir) / shard_file_name(world_.rank(), world_.size())).string();
      corrupt_file(shard, kind == FaultKind::truncate_checkpoint);
      std::fprintf(stderr, "forge: fault injection: %s %s\n",
                   kind == FaultKind::truncate_checkpoint ? "truncated" : "flipped a byte of", shard.c_str());
    }
  if (on_saved_) on_saved_(step, why);
}

}  // namespace forge::train
