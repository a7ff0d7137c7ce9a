#include "forge/train/trainer.h"

#include <omp.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/pretrained.h"
#include "forge/core/cpu_features.h"
#include "forge/core/memory.h"
#include "forge/models/llama.h"
#include "forge/models/sampling.h"
#include "forge/optim/adamw.h"
#include "forge/train/metrics.h"
#include "forge/train/peak.h"
#include "forge/train/training_data.h"

namespace forge {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct HeldOut {
  LossSum loss;
  int64_t bytes = 0;  // bytes of text the predicted tokens stand for
  double bits_per_byte() const { return bytes ? loss.sum / std::log(2.0) / static_cast<double>(bytes) : 0.0; }
};

// Loss over held-out windows [0, windows) in batches of `batch`, with the byte count of the targets.
HeldOut evaluate(LlamaModel& model, const TrainingData& data, int64_t seq, int64_t batch, int64_t windows) {
  std::vector<int32_t> ids(batch * seq), targets(batch * seq);
  HeldOut total;
  ProgressBar progress("eval", windows);  // draws only on a terminal
  for (int64_t w = 0; w < windows; w += batch) {
    int64_t b = std::min(batch, windows - w);
    data.heldout_batch(w, b, ids.data(), targets.data());
    LossSum part = model.forward_loss(ids.data(), targets.data(), b, seq);
    total.loss.sum += part.sum, total.loss.tokens += part.tokens;
    for (int64_t i = 0; i < b * seq; ++i) total.bytes += data.codec().byte_length(targets[i]);
    progress.update(w + b);
  }
  progress.finish();
  return total;
}

std::atomic<int> g_signal_count{0};
void on_signal(int) {
  if (g_signal_count.fetch_add(1) >= 1) std::_Exit(130);  // second Ctrl-C: leave now
  Trainer::stop_flag().store(true);
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

Trainer::Trainer(TrainConfig config) : config_(std::move(config)) { config_.validate(); }

TrainResult Trainer::run() {
  const auto& c = config_;
  if (c.train.threads > 0) omp_set_num_threads(static_cast<int>(c.train.threads));
  const auto start_time = Clock::now();

  std::optional<PretrainedDir> init_source;
  if (!c.model.init_from.empty()) init_source = open_pretrained(c.model.init_from);
  const std::string model_source = init_source ? init_source->dir.string() : c.model.config;
  LlamaConfig model_config = init_source ? init_source->config : LlamaConfig::from_json_file(c.model.config);
  if (c.data.seq_len > model_config.max_position_embeddings)
    fail("data.seq_len {} exceeds max_position_embeddings {} of {}", c.data.seq_len,
         model_config.max_position_embeddings, model_source);

  std::unique_ptr<TrainingData> data = open_training_data(c);
  const TextCodec& codec = data->codec();
  if (model_config.vocab_size < codec.vocab_size())
    fail("{}: vocab_size {} is smaller than the {} tokens of the tokenizer ({}); set vocab_size >= {} or "
         "data.vocab_size <= {}", model_source, model_config.vocab_size, codec.vocab_size(), codec.description(),
         codec.vocab_size(), model_config.vocab_size);
  const int64_t seq = c.data.seq_len, micro = c.train.micro_batch, accum = c.train.grad_accum;
  const int64_t heldout_windows = data->heldout_windows();

  nn::ComputeOptions options;
  std::string dtype_name_used = c.train.dtype;
  if (dtype_name_used == "auto") dtype_name_used = cpu_has_native_bf16() ? "bf16" : "fp32";
  options.gemm_dtype = dtype_from_name(dtype_name_used);
  options.recompute = nn::recompute_from_name(c.train.recompute);
  LlamaModel model(model_config, options, static_cast<float>(c.model.init_std));
  model.initialize(c.model.seed);
  if (init_source) {
    load_pretrained_weights(*init_source, model.params());
    std::printf("initialised from %s\n", init_source->dir.c_str());
  }
  AdamWConfig adam_config{static_cast<float>(c.train.beta1), static_cast<float>(c.train.beta2),
                          static_cast<float>(c.train.eps), static_cast<float>(c.train.weight_decay)};
  AdamW optimizer(&model.params(), adam_config);
  LrSchedule schedule = c.lr_schedule();
  // Time-budget mode (steps = 0): the schedule's length is planned once, from the measured speed of the
  // first steps (which are all in warmup, where the LR does not depend on the length).
  const bool plan_steps = c.train.steps == 0;
  int64_t total_steps = c.train.steps;
  if (plan_steps) schedule.total_steps = total_steps = std::numeric_limits<int32_t>::max();

  const fs::path run_dir(c.log.run_dir);
  fs::create_directories(run_dir);
  const fs::path checkpoint_dir = c.checkpoint_dir();
  int64_t step = 0;
  fs::path resume_from;
  if (c.checkpoint.resume == "auto") {
    if (checkpoint_exists(checkpoint_dir.string())) resume_from = checkpoint_dir;
  } else if (!c.checkpoint.resume.empty()) {
    resume_from = c.checkpoint.resume;
  }
  if (!resume_from.empty()) {
    CheckpointState state = read_checkpoint_manifest(resume_from.string());
    if (state.model_config != model_config.to_json())
      fail("checkpoint {} was trained with a different model config than {}", resume_from.string(), model_source);
    if (state.extra.contains("tokenizer") && state.extra["tokenizer"] != codec.description())
      fail("checkpoint {} was trained with tokenizer {}, not {}", resume_from.string(),
           state.extra["tokenizer"].get<std::string>(), codec.description());
    state = load_checkpoint(resume_from.string(), model.params(), &optimizer);
    step = state.step;
    if (plan_steps && state.extra.contains("planned_steps"))
      schedule.total_steps = total_steps = state.extra["planned_steps"].get<int64_t>();
    std::printf("resumed from %s at step %lld\n", resume_from.c_str(), static_cast<long long>(step));
  }
  {
    std::ofstream out(run_dir / "config.toml");
    out << c.to_toml();
  }
  MetricsWriter metrics(run_dir, /*truncate=*/resume_from.empty());

  const double flops_per_token = model_config.flops_per_token(seq);
  const double peak_gflops =
      c.log.peak_gflops > 0 ? c.log.peak_gflops : measure_gemm_peak_gflops(options.gemm_dtype);
  std::printf("model %.2fM parameters | %s compute | recompute %s | %lld-token batches (%lld x %lld x %lld) | "
              "peak %s GEMM %.0f GFLOP/s (%s)\n",
              static_cast<double>(model_config.num_parameters()) / 1e6,
              (dtype_name_used + (c.train.dtype == "auto" ? " (auto)" : "")).c_str(),
              c.train.recompute.c_str(), static_cast<long long>(c.tokens_per_step()), static_cast<long long>(micro),
              static_cast<long long>(accum), static_cast<long long>(seq), dtype_name_used.c_str(), peak_gflops,
              c.log.peak_gflops > 0 ? "given" : "measured");
  std::printf("%s\n", data->describe().c_str());
  std::fflush(stdout);

  auto save = [&](const char* why) {
    CheckpointState state;
    state.step = step;
    state.model_config = model_config.to_json();
    state.extra = {{"tokens_seen", step * c.tokens_per_step()}, {"reason", why}, {"tokenizer", codec.description()}};
    if (plan_steps) state.extra["planned_steps"] = total_steps;
    // The tokenizer goes along (before the manifest), so `forge generate` and `forge convert` find it.
    if (codec.tokenizer()) {
      fs::create_directories(checkpoint_dir);
      codec.tokenizer()->save(checkpoint_dir / "tokenizer.json");
    }
    save_checkpoint(checkpoint_dir.string(), model.params(), &optimizer, state);
    std::printf("checkpoint saved to %s (step %lld, %s)\n", checkpoint_dir.c_str(), static_cast<long long>(step), why);
    std::fflush(stdout);
  };

  TrainResult result;
  std::vector<int32_t> ids(micro * seq), targets(micro * seq);
  const float grad_scale = 1.0f / static_cast<float>(micro * accum * seq);
  const auto train_start = Clock::now();
  auto interval_start = Clock::now();
  int64_t interval_tokens = 0;
  const int64_t first_step = step;
  double first_step_seconds = 0;
  bool plan_frozen = !plan_steps || total_steps != std::numeric_limits<int32_t>::max();
  while (step < total_steps) {
    if (stop_flag().load()) break;
    if (c.train.max_minutes > 0 && seconds_since(train_start) > c.train.max_minutes * 60) {
      std::printf("time limit of %.1f minutes reached at step %lld\n", c.train.max_minutes,
                  static_cast<long long>(step));
      result.time_limit_reached = true;
      break;
    }
    if (step == first_step) reset_peak_memory();
    const int64_t live_before = memory_stats().live_bytes;
    model.params().zero_grads();
    LossSum loss;
    for (int64_t m = 0; m < accum; ++m) {
      data->train_batch((step * accum + m) * micro, micro, ids.data(), targets.data());
      LossSum part = model.forward_backward(ids.data(), targets.data(), micro, seq, grad_scale);
      loss.sum += part.sum, loss.tokens += part.tokens;
    }
    if (step == first_step) {
      result.peak_activation_bytes = memory_stats().peak_bytes - live_before;
      std::printf("peak activation memory %.1f MiB per micro-batch (recompute %s)\n",
                  static_cast<double>(result.peak_activation_bytes) / 1048576.0, c.train.recompute.c_str());
    }
    const double mean_loss = loss.mean();
    if (!std::isfinite(mean_loss)) fail("training loss is {} at step {}: stopping", mean_loss, step);
    const double grad_norm = global_grad_norm(model.params());
    const float lr = schedule.lr_at(step);
    optimizer.step(lr, clip_coefficient(grad_norm, static_cast<float>(c.train.grad_clip)));
    ++step;
    result.losses.push_back(mean_loss);
    interval_tokens += c.tokens_per_step();

    const bool last = step == total_steps;
    if (step % c.log.every == 0 || last || step == first_step + 1) {
      double dt = seconds_since(interval_start);
      StepLine m;
      const bool planned = plan_frozen;
      m.step = step, m.total_steps = planned ? total_steps : 0, m.loss = mean_loss, m.lr = lr, m.grad_norm = grad_norm;
      m.tokens_per_s = static_cast<double>(interval_tokens) / dt;
      m.flops_per_s = m.tokens_per_s * flops_per_token;
      m.mfu = m.flops_per_s / (peak_gflops * 1e9);
      m.elapsed_s = seconds_since(start_time);
      double per_step = seconds_since(train_start) / static_cast<double>(step - first_step);
      m.eta_s = planned ? per_step * static_cast<double>(total_steps - step) : -1;
      if (c.train.max_minutes > 0) m.eta_s = std::min(m.eta_s, c.train.max_minutes * 60 - seconds_since(train_start));
      std::printf("%s\n", format_step_line(m).c_str());
      std::fflush(stdout);
      nlohmann::json record = {{"step", step},           {"loss", mean_loss},       {"lr", lr},
                               {"grad_norm", grad_norm}, {"tokens_per_s", m.tokens_per_s},
                               {"tflops", m.flops_per_s / 1e12}, {"mfu", m.mfu},
                               {"tokens", step * c.tokens_per_step()}, {"elapsed_s", m.elapsed_s}};
      metrics.write(record);
      interval_start = Clock::now();
      interval_tokens = 0;
    }
    if (c.eval.every > 0 && step % c.eval.every == 0 && !last) {
      HeldOut e = evaluate(model, *data, seq, micro, std::min(heldout_windows, c.eval.batches * micro));
      const double bpb = e.bits_per_byte();
      std::printf("eval step %lld | held-out loss %.4f | %.4f bits/byte\n", static_cast<long long>(step),
                  e.loss.mean(), bpb);
      std::fflush(stdout);
      metrics.write({{"step", step}, {"eval_loss", e.loss.mean()}, {"eval_bits_per_byte", bpb}});
    }
    if (c.checkpoint.every > 0 && step % c.checkpoint.every == 0 && !last) save("periodic");
    if (plan_steps && !plan_frozen && step - first_step >= 3) {
      // Re-estimate the length from the average speed so far (after the first step, which pays one-time
      // costs), keeping 3% of the budget for evaluations. The plan is frozen when the next step's LR would
      // depend on it: at the end of warmup for cosine, at the start of the decay for WSD.
      const double per_step =
          (seconds_since(train_start) - first_step_seconds) / static_cast<double>(step - first_step - 1);
      const double left = c.train.max_minutes * 60 * 0.97 - seconds_since(train_start);
      schedule.total_steps = total_steps = step + std::max<int64_t>(1, static_cast<int64_t>(left / per_step));
      if (step + 1 >= schedule.decay_begins()) {
        plan_frozen = true;
        std::printf("time budget %.3g minutes: planned %lld steps (%.3f s/step so far)\n", c.train.max_minutes,
                    static_cast<long long>(total_steps), per_step);
      }
    }
    if (step == first_step + 1) first_step_seconds = seconds_since(train_start);
    if (on_step_) on_step_(step);
  }
  result.steps_done = step;
  if (stop_flag().load()) {
    std::printf("interrupted at step %lld: saving a checkpoint\n", static_cast<long long>(step));
    save("interrupted");
    result.interrupted = true;
    stop_flag().store(false);
    return result;
  }

  HeldOut e = evaluate(model, *data, seq, micro, heldout_windows);
  result.heldout_loss = e.loss.mean();
  result.heldout_bits_per_byte = e.bits_per_byte();
  std::printf("final held-out loss %.4f nats/token = %.4f bits per byte (%lld tokens, %lld bytes; %.1f s total)\n",
              result.heldout_loss, result.heldout_bits_per_byte, static_cast<long long>(e.loss.tokens),
              static_cast<long long>(e.bytes), seconds_since(start_time));
  metrics.write({{"step", step}, {"eval_loss", result.heldout_loss}, {"eval_bits_per_byte", result.heldout_bits_per_byte},
                 {"final", true}});
  save("final");

  if (c.sample.tokens > 0) {
    SamplingOptions so;
    so.max_new_tokens = c.sample.tokens, so.context = seq, so.temperature = c.sample.temperature;
    so.top_k = c.sample.top_k, so.seed = c.sample.seed;
    std::vector<int32_t> prompt = codec.encode(c.sample.prompt.empty() ? std::string("\n") : c.sample.prompt);
    std::vector<int32_t> out = generate(model, prompt, so);
    result.sample = c.sample.prompt + codec.decode(out);
    std::printf("--- sample (temperature %.2f, top-k %lld) ---\n%s\n---\n", c.sample.temperature,
                static_cast<long long>(c.sample.top_k), result.sample.c_str());
  }
  return result;
}

}  // namespace forge
