#include "forge/train/trainer.h"

#include <omp.h>

#include <chrono>
#include <algorithm>
#include <cstdarg>
#include <cstdlib>
#include <cmath>
#include <limits>
#include <optional>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/pretrained.h"
#include "forge/ckpt/sharded.h"
#include "forge/comm/comm.h"
#include "forge/core/cpu_features.h"
#include "forge/core/device.h"
#include "forge/core/file_io.h"
#include "forge/core/memory.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/profiler.h"
#include "forge/models/llama.h"
#include "forge/models/sampling.h"
#include "forge/optim/adamw.h"
#include "forge/parallel/distributed_optimizer.h"
#include "forge/parallel/grad_buckets.h"
#include "forge/parallel/layout.h"
#include "forge/parallel/tensor_parallel.h"
#include "forge/train/metrics.h"
#include "forge/train/peak.h"
#include "forge/train/run_directory.h"
#include "forge/train/training_data.h"

namespace forge {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct HeldOut {
  LossSum loss;
  int64_t bytes = 0;  // bytes of text the predicted tokens stand for
  bool interrupted = false;
  double bits_per_byte() const { return bytes ? loss.sum / std::log(2.0) / static_cast<double>(bytes) : 0.0; }
};

// Loss over held-out windows [0, windows) in batches of `batch`, with the byte count of the targets. Under
// data parallelism the batches are dealt round-robin over the dp ranks and the sums added up over dp.
// Ctrl-C (the stop flag, agreed over `world` before each batch) ends it early with interrupted set.
HeldOut evaluate(LlamaModel& model, const TrainingData& data, int64_t seq, int64_t batch, int64_t windows,
                 comm::Communicator& dp, comm::Communicator& world) {
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
    if (w >= windows) continue;
    int64_t b = std::min(batch, windows - w);
    data.heldout_batch(w, b, ids.data(), targets.data());
    LossSum part = model.forward_loss(ids.data(), targets.data(), b, seq);
    total.loss.sum += part.sum, total.loss.tokens += part.tokens;
    for (int64_t i = 0; i < b * seq; ++i) total.bytes += data.codec().byte_length(targets[i]);
    progress.update(w + b);
  }
  progress.finish();
  if (dp.size() > 1) {
    double sums[3] = {total.loss.sum, static_cast<double>(total.loss.tokens), static_cast<double>(total.bytes)};
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

// OpenMP threads per rank: train.threads, else OMP_NUM_THREADS when set, else this node's cores shared by
// its ranks.
int threads_per_rank(int64_t configured) {
  // More threads than cores only make OpenMP's barriers spin against each other (10-100x slower), and
  // libgomp itself fails on absurd counts.
  if (configured > omp_get_num_procs())
    fail("train.threads = {} exceeds the {} cores this process may run on; set at most {} (0 = all)", configured,
         omp_get_num_procs(), omp_get_num_procs());
  if (configured > 0) return static_cast<int>(configured);
  if (std::getenv("OMP_NUM_THREADS")) return omp_get_max_threads();
  int local = 1;
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(s));
  else if (const char* s = std::getenv("SLURM_NTASKS_PER_NODE")) local = std::max(1, std::atoi(s));
  return std::max(1, omp_get_num_procs() / local);
}

// This process's rank among the ranks on its node (the GPU it drives): from the launcher's environment
// (OpenMPI, Slurm, torchrun-style LOCAL_RANK), else the world rank (one node).
int local_rank_on_node(const comm::Communicator& world) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* s = std::getenv(name)) return std::max(0, std::atoi(s));
  return world.rank();
}

// The first parameter whose gradient holds a non-finite value on this rank ("" if none).
std::string first_non_finite_gradient(const nn::ParameterStore& params) {
  const Tensor host = params.device() == Device::cpu ? params.grads() : params.grads().to(Device::cpu);
  const float* g = host.f32();
  for (const nn::ParamInfo& info : params.infos()) {
    const int64_t n = shape_numel(info.shape);
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(g[info.offset + i])) return fmt::format("'{}' ({})", info.name, g[info.offset + i]);
  }
  return "";
}

// What went wrong in a step whose loss or gradient norm is not finite, and on which ranks (collective).
std::string describe_non_finite_step(comm::Communicator& world, const nn::ParameterStore& params,
                                     double local_loss, double loss, double grad_norm) {
  std::string mine;
  if (!std::isfinite(local_loss)) mine = fmt::format("loss {}", local_loss);
  if (const std::string g = first_non_finite_gradient(params); !g.empty())
    mine += fmt::format("{}gradient of {}", mine.empty() ? "" : ", ", g);
  const std::vector<std::string> reports = comm::all_gather_strings(world, mine);
  std::string where;
  for (size_t r = 0; r < reports.size(); ++r)
    if (!reports[r].empty()) {
      where = fmt::format("first on rank {}: {}", r, reports[r]);
      break;
    }
  std::string what = !std::isfinite(loss)        ? fmt::format("the training loss is {}", loss)
                     : !std::isfinite(grad_norm) ? fmt::format("the gradient norm is {} (loss {:.4f})", grad_norm, loss)
                                                 : std::string("a rank's gradients are not finite");
  return where.empty() ? what : fmt::format("{} ({})", what, where);
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
                     const LlamaConfig& model_config, const std::string& model_source, const TextCodec& codec,
                     const TrainConfig& c) {
  const std::string where = dir.string();
  std::optional<LlamaConfig> saved;
  try {
    saved = LlamaConfig::from_json(state.model_config, where + " (manifest.json model_config)");
  } catch (const Error& e) {
    fail("checkpoint {} cannot be resumed: its model config is unreadable: {}", where, e.what());
  }
  if (saved->to_json() != model_config.to_json())
    fail("checkpoint {} was trained with a different model config than {} (saved: {})", where, model_source,
         state.model_config.dump());
  if (std::none_of(names.begin(), names.end(), [](const std::string& n) { return n.starts_with("exp_avg."); }))
    fail("checkpoint {} holds weights only, no optimizer state (as forge convert --to forge writes), so it cannot "
         "be resumed; start a new run from its weights with --set model.init_from={}",
         where, where);
  // The tokenizer by content, never by path: the same file elsewhere is the same tokenizer, another file at
  // the same path is not.
  std::string saved_tokenizer;
  if (state.extra.contains("tokenizer_fingerprint")) {
    saved_tokenizer = state.extra["tokenizer_fingerprint"].get<std::string>();
  } else if (fs::exists(dir / "tokenizer.json")) {
    saved_tokenizer = TextCodec::from_tokenizer(Tokenizer::from_file(dir / "tokenizer.json"), "").fingerprint();
  } else if (state.extra.contains("tokenizer")) {
    saved_tokenizer = TextCodec::bytes().fingerprint();  // saved without tokenizer.json: byte-level
  }
  if (!saved_tokenizer.empty() && saved_tokenizer != codec.fingerprint())
    fail("checkpoint {} was trained with another tokenizer ({}) than this run's {} ({}); resuming would feed it "
         "other token ids",
         where, state.extra.value("tokenizer", std::string("unknown")), codec.description(), codec.fingerprint());
  // Samples are windows of seq_len tokens: another length has no sample at which to continue.
  const int64_t saved_seq = state.extra.value("seq_len", int64_t{0});
  if (saved_seq > 0 && saved_seq != c.data.seq_len)
    fail("checkpoint {} was trained with data.seq_len = {}, this run has {}: resuming would skip or repeat data; "
         "keep data.seq_len = {} (micro_batch, grad_accum and the world size may change)",
         where, saved_seq, c.data.seq_len, saved_seq);
  if (saved_seq == 0 && !state.extra.contains("samples_seen") &&
      state.extra.value("tokens_seen", int64_t{0}) % c.data.seq_len != 0)
    fail("checkpoint {} saw {} tokens, not a whole number of data.seq_len = {} sequences: it was trained with "
         "another sequence length",
         where, state.extra.value("tokens_seen", int64_t{0}), c.data.seq_len);
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

Trainer::Trainer(TrainConfig config, comm::Communicator* world) : config_(std::move(config)), world_(world) {
  config_.validate();
}

TrainResult Trainer::run() {
  const auto& c = config_;
  const auto start_time = Clock::now();

  // The layout is checked against the world before any work: a wrong -np or a model that does not split
  // fails here, on every rank, with the same message.
  comm::Communicator& world = world_ ? *world_ : comm::world();
  // parallel.timeout_s, unless FORGE_COMM_TIMEOUT in the environment (read by comm) says otherwise.
  if (!std::getenv("FORGE_COMM_TIMEOUT")) world.set_timeout_seconds(c.parallel.timeout_s);
  g_leader = world.rank() == 0;
  const parallel::Layout layout(c.layout_spec(), world.size(), world.rank());
  if (layout.pp() > 1 || layout.cp() > 1 || layout.ep() > 1)
    fail("parallel.pp = {}, parallel.cp = {}, parallel.ep = {}: this version trains with tensor and data "
         "parallelism only; pipeline, context and expert parallelism are not implemented yet",
         layout.pp(), layout.cp(), layout.ep());
  omp_set_num_threads(threads_per_rank(c.train.threads));

  std::optional<PretrainedDir> init_source;
  if (!c.model.init_from.empty()) init_source = open_pretrained(c.model.init_from);
  const std::string model_source = init_source ? init_source->dir.string() : c.model.config;
  LlamaConfig model_config = init_source ? init_source->config : LlamaConfig::from_json_file(c.model.config);
  if (c.data.seq_len > model_config.max_position_embeddings)
    fail("data.seq_len {} exceeds max_position_embeddings {} of {}", c.data.seq_len,
         model_config.max_position_embeddings, model_source);
  parallel::validate_model_fit(layout,
                               {model_config.hidden_size, model_config.num_attention_heads,
                                model_config.num_key_value_heads, model_config.intermediate_size,
                                model_config.vocab_size, model_config.num_hidden_layers},
                               c.parallel.make_vocab_size_divisible_by);
  // Sequence parallelism splits each micro-batch's token rows over tp; with seq_len a multiple of tp every
  // batch size splits (evaluation's last batch may be smaller), as Megatron requires.
  if (c.parallel.sequence_parallel && layout.tp() > 1 && c.data.seq_len % layout.tp() != 0)
    fail("parallel.sequence_parallel: data.seq_len = {} must be a multiple of parallel.tp = {}", c.data.seq_len,
         layout.tp());
  parallel::ParallelGroups groups = parallel::make_groups(world, layout);
  comm::Communicator& dp_group = *groups.dp_cp;
  const int64_t dp = layout.dp(), dp_rank = layout.coordinate(parallel::Dim::dp);

  const Device device = device_from_name(c.train.device);
  const bool on_gpu = device != Device::cpu;
  // GPUs: one per process, the local rank's. Device buffers (tensor-parallel activations and gradients,
  // data-parallel gradient buckets, ZeRO-1's parameter all-gathers) go over NCCL communicators of the tp and dp groups; host buffers (scalars,
  // flags, per-row loss statistics, FP8 amaxes, checkpoints' host copies) still go over MPI.
  std::unique_ptr<comm::Communicator> dp_nccl, tp_nccl, dp_self;
  if (on_gpu) {
    if (!device_usable(device))
      fail("{}: train.device = {}, but no GPU is usable here (or this binary has no CUDA backend)", c.origin_of("train.device"),
           c.train.device);
    if (layout.pp() > 1 || layout.cp() > 1 || layout.ep() > 1)
      fail("{}: train.device = {} supports tensor and data parallelism only for now ({})", c.origin_of("train.device"),
           c.train.device, layout.describe());
    if (c.fp8.recipe != "off" && c.data.seq_len % 16 != 0)
      fail("{}: data.seq_len = {} must be a multiple of 16 for FP8 on {} (FP8 tensor cores read token counts in "
           "multiples of 16)",
           c.origin_of("data.seq_len"), c.data.seq_len, c.train.device);
    if (c.fp8.recipe != "off" && c.fp8.accumulator_bits > 0)
      fail("{}: fp8.accumulator_bits = {} models the tensor cores' accumulator on the CPU; on {} the hardware "
           "accumulates: set it to 0",
           c.origin_of("fp8.accumulator_bits"), c.fp8.accumulator_bits, c.train.device);
    const DeviceMemory& gpu = device_memory(device);
    const int local_rank = local_rank_on_node(world), visible = gpu.device_count();
    // A process that sees one GPU drives it (Slurm's --gpu-bind or a per-rank CUDA_VISIBLE_DEVICES); one that
    // sees the node's GPUs drives its local rank's.
    if (visible > 1 && local_rank >= visible)
      fail("{}: local rank {} has no GPU of its own ({} visible): start at most one process per GPU", c.source,
           local_rank, visible);
    const int ordinal = visible > 1 ? local_rank : 0;
    gpu.select_device(ordinal);
    if (layout.tp() > 1) tp_nccl = comm::make_nccl(*groups.tp, ordinal, "tp", gpu.stream());
    if (dp > 1) dp_nccl = comm::make_nccl(dp_group, ordinal, "dp", gpu.stream());
  }
  std::unique_ptr<TrainingData> data = open_training_data(c);
  const TextCodec& codec = data->codec();
  if (model_config.vocab_size < codec.vocab_size())
    fail("{}: vocab_size {} is smaller than the {} tokens of the tokenizer ({}); set vocab_size >= {} or "
         "data.vocab_size <= {}", model_source, model_config.vocab_size, codec.vocab_size(), codec.description(),
         codec.vocab_size(), model_config.vocab_size);
  const int64_t seq = c.data.seq_len, micro = c.train.micro_batch, accum = c.train.grad_accum;
  const int64_t heldout_windows = data->heldout_windows();
  // A step is micro x accum sequences on each of the dp replicas.
  const int64_t step_tokens = c.tokens_per_step() * dp;

  nn::ComputeOptions options;
  options.device = device;
  std::string dtype_name_used = c.train.dtype;
  if (dtype_name_used == "auto") dtype_name_used = on_gpu || cpu_has_native_bf16() ? "bf16" : "fp32";
  options.gemm_dtype = dtype_from_name(dtype_name_used);
  options.recompute = nn::recompute_from_name(c.train.recompute);
  parallel::CommTensorParallel tensor_parallel(groups.tp.get(), c.parallel.sequence_parallel, tp_nccl.get());
  if (layout.tp() > 1) options.tp = &tensor_parallel;
  options.vocab_divisible_by = c.parallel.make_vocab_size_divisible_by;
  // FP8: the context lives as long as the model, which reads it through options.fp8.
  std::optional<nn::Fp8Context> fp8_context;
  std::string fp8_summary = "off";
  if (std::optional<nn::Fp8Options> f = c.fp8_options()) {
    const int64_t layers = model_config.num_hidden_layers, kept = f->bf16_first_layers + f->bf16_last_layers;
    if (kept >= layers)
      fail("{}: fp8.bf16_first_layers + fp8.bf16_last_layers = {} keep all {} layers out of FP8; lower them or set "
           "fp8.recipe = \"off\"", c.origin_of("fp8.bf16_first_layers"), kept, layers);
    fp8_context.emplace(*f);
    options.fp8 = &*fp8_context;
    fp8_summary = fmt::format("{} ({}", c.fp8.recipe, fp8::format_name(f->recipe.format));
    if (f->recipe.recipe == fp8::Recipe::delayed)
      fp8_summary += fmt::format(", history {} {}", f->recipe.amax_history_len,
                                 fp8::amax_compute_name(f->recipe.amax_compute));
    if (f->recipe.recipe == fp8::Recipe::block && f->recipe.power_of_two_scales) fp8_summary += ", 2^k scales";
    fp8_summary += fmt::format(", layers {}..{}", f->bf16_first_layers, layers - f->bf16_last_layers - 1);
    if (!f->save_fp8_inputs) fp8_summary += ", inputs saved in " + std::string(dtype_name(options.gemm_dtype));
    if (f->accumulator_bits > 0)
      fp8_summary += fmt::format(", {}-bit accumulator promoted every {}", f->accumulator_bits, f->promote_every);
    fp8_summary += ")";
  }
  LlamaModel model(model_config, options, static_cast<float>(c.model.init_std));
  model.initialize(c.model.seed);
  if (init_source) {
    load_pretrained_weights(*init_source, model.params());
    say("initialised from %s\n", init_source->dir.c_str());
  }
  // Data parallelism: gradients reduced in buckets while backward runs (sharded under ZeRO-1).
  parallel::BucketOptions bucket_options;
  bucket_options.bucket_bytes = static_cast<int64_t>(c.parallel.bucket_mb * 1048576.0);
  bucket_options.shard = c.parallel.distributed_optimizer;
  bucket_options.overlap = c.parallel.overlap_grad_reduce;
  // On GPUs the gradient buckets reduce device memory: over NCCL, or with one replica over nothing at all.
  if (on_gpu && !dp_nccl) dp_self = comm::make_self("dp");
  parallel::GradBuckets buckets(&model.params(), on_gpu ? (dp_nccl ? dp_nccl.get() : dp_self.get()) : &dp_group,
                                bucket_options);
  if (dp > 1) model.set_grads_ready([&buckets](int64_t offset) { buckets.ready_from(offset); });
  AdamWConfig adam_config{static_cast<float>(c.train.beta1), static_cast<float>(c.train.beta2),
                          static_cast<float>(c.train.eps), static_cast<float>(c.train.weight_decay)};
  parallel::DistributedAdamW optimizer(&model.params(), adam_config, &dp_group, groups.model_parallel.get(),
                                       &buckets);
  LrSchedule schedule = c.lr_schedule();
  // Time-budget mode (steps = 0): the schedule's length is planned once, from the measured speed of the
  // first steps (which are all in warmup, where the LR does not depend on the length).
  const bool plan_steps = c.train.steps == 0;
  int64_t total_steps = c.train.steps;
  if (plan_steps) schedule.total_steps = total_steps = std::numeric_limits<int32_t>::max();

  // The delayed-scaling state (identical on every rank after each step's reduction) travels with
  // checkpoints, written by rank 0, so a resumed run continues with the same scales.
  std::vector<float> fp8_history, fp8_scales;
  auto append_fp8_pieces = [&](std::vector<ShardPiece>& pieces, bool saving) {
    fp8::DelayedScalingGroup* g = fp8_context ? fp8_context->delayed_group() : nullptr;
    if (!g) return;
    const int64_t len = g->history_len(), n = g->size();
    fp8_history.assign(static_cast<size_t>(len * n), 0.0f);
    fp8_scales.assign(static_cast<size_t>(n), 1.0f);
    if (saving) g->export_state(fp8_history, fp8_scales);
    if (saving && world.rank() != 0) return;
    pieces.push_back({"fp8.amax_history", {len, n}, {len, n}, -1, 0, 0, len * n, fp8_history.data()});
    pieces.push_back({"fp8.scales", {n}, {n}, -1, 0, 0, n, fp8_scales.data()});
  };

  const fs::path run_dir(c.log.run_dir);
  const fs::path checkpoint_dir = c.checkpoint_dir();
  // Rank 0 holds the run's directories against other runs and decides where the run starts; every rank
  // learns the outcome (or the refusal) from it.
  DirectoryLock run_dir_lock, checkpoint_dir_lock;
  ResumeDecision decision;
  {
    std::string error;
    nlohmann::json shared;
    if (g_leader) {
      try {
        run_dir_lock = DirectoryLock(run_dir, "log.run_dir");
        std::error_code ec;
        const fs::path relative = fs::relative(checkpoint_dir, run_dir, ec);
        if (ec || relative.empty() || *relative.begin() == "..")
          checkpoint_dir_lock = DirectoryLock(checkpoint_dir, "checkpoint.dir");
        decision = decide_resume(c);
        shared = {{"checkpoint", decision.checkpoint.string()},
                  {"note", decision.note},
                  {"own", decision.from_own_directory}};
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    const std::string message = error.empty() ? shared.dump() : "!" + error;
    const std::string outcome = world.size() > 1 ? comm::all_gather_strings(world, message)[0] : message;
    if (outcome.starts_with("!")) throw Error(outcome.substr(1));
    const nlohmann::json got = nlohmann::json::parse(outcome);
    decision.checkpoint = got["checkpoint"].get<std::string>();
    decision.note = got["note"].get<std::string>();
    decision.from_own_directory = got["own"].get<bool>();
  }
  if (!decision.note.empty()) say("%s\n", decision.note.c_str());
  const fs::path& resume_from = decision.checkpoint;
  int64_t step = 0;
  // The data position: samples (sequences) consumed before step `base_step`, so that a resumed run with
  // another batch size or world size continues at the exact next sample.
  int64_t base_step = 0, base_samples = 0;
  const int64_t samples_per_step = micro * accum * dp;
  // The step whose checkpoint is already committed in checkpoint_dir (-1: none), so that saving it again
  // (Ctrl-C right after a resume) is skipped.
  int64_t committed_step = -1;
  if (!resume_from.empty()) {
    // The load below verifies the checksum of each file it reads; here only the manifest matters.
    CheckpointState state = read_checkpoint_manifest(resume_from.string(), /*verify_files=*/false);
    const std::vector<std::string> saved_names = checkpoint_tensor_names(resume_from.string());
    check_resumable(state, resume_from, saved_names, model_config, model_source, codec, c);
    // Any layout loads any other: each rank fills its shard of the weights and its owned optimizer state.
    std::vector<ShardPiece> pieces = optimizer.checkpoint_pieces_for_load(true);
    const bool fp8_saved = std::binary_search(saved_names.begin(), saved_names.end(), "fp8.amax_history");
    if (fp8_saved) append_fp8_pieces(pieces, /*saving=*/false);
    state = load_sharded_checkpoint(resume_from.string(), world, pieces);
    optimizer.finish_load();
    model.params().refresh_bf16();
    if (fp8::DelayedScalingGroup* g = fp8_context ? fp8_context->delayed_group() : nullptr) {
      if (fp8_saved)
        g->import_state(fp8_history, fp8_scales);
      else
        say("the checkpoint holds no FP8 scaling state: delayed scaling starts from fresh amax histories\n");
    }
    optimizer.set_steps_taken(state.optimizer_steps >= 0 ? state.optimizer_steps : state.step);
    step = base_step = state.step;
    base_samples = samples_seen_of(state, seq);
    if (decision.from_own_directory) committed_step = step;
    if (plan_steps && state.extra.contains("planned_steps"))
      schedule.total_steps = total_steps = state.extra["planned_steps"].get<int64_t>();
    const int64_t saved_per_step = state.extra.value("samples_per_step", int64_t{0});
    say("resumed from %s at step %lld (sample %lld%s)\n", resume_from.c_str(), static_cast<long long>(step),
        static_cast<long long>(base_samples),
        saved_per_step > 0 && saved_per_step != samples_per_step
            ? fmt::format("; {} sequences per step now, {} before", samples_per_step, saved_per_step).c_str()
            : "");
  }
  if (g_leader) write_file_atomically(run_dir / "config.toml", c.to_toml(), "run configuration");
  std::optional<MetricsWriter> metrics;
  if (g_leader) {
    if (!resume_from.empty()) trim_metrics(run_dir, step);
    metrics.emplace(run_dir, /*truncate=*/resume_from.empty());
    if (!resume_from.empty()) metrics->write({{"event", "resume"}, {"step", step}, {"checkpoint", resume_from.string()}});
  }
  auto write_metrics = [&](const nlohmann::json& record) {
    if (metrics) metrics->write(record);
  };

  const double flops_per_token = model_config.flops_per_token(seq);
  // Every rank measures its share of the machine; the job's peak is their sum.
  // On a GPU, the tensor cores' dense peak of the precision that runs the Linears.
  const double rank_peak = c.log.peak_gflops > 0 ? c.log.peak_gflops / world.size()
                           : on_gpu ? (options.fp8 ? kHopperFp8PeakGflops : kHopperBf16PeakGflops)
                                    : measure_gemm_peak_gflops(options.gemm_dtype);
  const double peak_gflops = comm::all_reduce_sum(world, rank_peak);
  say("model %.2fM parameters | %s compute%s | fp8 %s | recompute %s | %lld-token batches (%lld x %lld x %lld x dp "
      "%lld) | peak %s GEMM %.0f GFLOP/s (%s)\n",
      static_cast<double>(model_config.num_parameters()) / 1e6,
      (dtype_name_used + (c.train.dtype == "auto" ? " (auto)" : "")).c_str(),
      on_gpu ? (" on " + std::string(device_name(options.device))).c_str() : "", fp8_summary.c_str(),
      c.train.recompute.c_str(),
      static_cast<long long>(step_tokens), static_cast<long long>(micro), static_cast<long long>(accum),
      static_cast<long long>(seq), static_cast<long long>(dp), options.fp8 && on_gpu ? "fp8" : dtype_name_used.c_str(),
      peak_gflops, c.log.peak_gflops > 0 ? "given" : on_gpu ? "H100/H200 dense" : "measured");
  if (world.size() > 1) {
    say("%s\n", layout.describe().c_str());
    say("tensor parallel %d%s | data parallel %lld: %zu gradient buckets of <= %.1f MiB, %s, overlap %s | "
        "optimizer state %.1f MiB per rank | %d OpenMP threads per rank\n",
        layout.tp(), c.parallel.sequence_parallel ? " + sequence parallel" : "", static_cast<long long>(dp),
        buckets.buckets().size(), c.parallel.bucket_mb,
        c.parallel.distributed_optimizer ? "reduce-scatter + ZeRO-1 (sharded Adam state)" : "all-reduce",
        c.parallel.overlap_grad_reduce ? "on" : "off", static_cast<double>(optimizer.state_bytes()) / 1048576.0,
        omp_get_max_threads());
  }
  say("%s\n", data->describe().c_str());

  // The tokenizer travels inside each checkpoint (listed and checksummed in its manifest), so that `forge
  // generate`, `forge convert` and a resume find it.
  std::vector<NamedFile> checkpoint_files;
  if (const Tokenizer* t = codec.tokenizer()) {
    std::string text = t->json_text();
    if (text.empty() || text.back() != '\n') text += '\n';
    checkpoint_files.push_back({"tokenizer.json", std::move(text)});
  }
  auto save = [&](const char* why) {
    if (step == committed_step) {
      say("checkpoint of step %lld is already saved in %s\n", static_cast<long long>(step), checkpoint_dir.c_str());
      return;
    }
    CheckpointState state;
    state.step = step;
    state.optimizer_steps = optimizer.steps_taken();
    state.layout = {{"tp", layout.tp()}, {"dp", layout.dp()}, {"pp", layout.pp()}, {"cp", layout.cp()},
                    {"ep", layout.ep()}, {"sequence_parallel", c.parallel.sequence_parallel},
                    {"distributed_optimizer", c.parallel.distributed_optimizer}};
    state.model_config = model_config.to_json();
    const int64_t samples = base_samples + (step - base_step) * samples_per_step;
    state.extra = {{"tokens_seen", samples * seq},
                   {"samples_seen", samples},
                   {"samples_per_step", samples_per_step},
                   {"seq_len", seq},
                   {"reason", why},
                   {"tokenizer", codec.description()},
                   {"tokenizer_fingerprint", codec.fingerprint()}};
    if (plan_steps) state.extra["planned_steps"] = total_steps;
    std::vector<ShardPiece> pieces = optimizer.checkpoint_pieces(true);
    append_fp8_pieces(pieces, /*saving=*/true);
    CheckpointSaveOptions save_options;
    save_options.keep_last = c.checkpoint.keep_last;
    save_options.files = checkpoint_files;
    const auto save_start = Clock::now();
    const std::string saved = save_checkpoint_step(checkpoint_dir.string(), world, pieces, state, save_options);
    optimizer.finish_save();
    committed_step = step;
    const double seconds = seconds_since(save_start);
    say("checkpoint saved to %s (step %lld, %s, %.2f s)\n", saved.c_str(), static_cast<long long>(step), why,
        seconds);
    write_metrics({{"event", "checkpoint"}, {"step", step}, {"reason", why}, {"dir", saved}, {"seconds", seconds}});
    if (on_saved_) on_saved_(step, why);
  };

  TrainResult result;
  std::vector<int32_t> ids(micro * seq), targets(micro * seq);
  const float grad_scale = 1.0f / static_cast<float>(micro * accum * dp * seq);
  const auto train_start = Clock::now();
  auto interval_start = Clock::now();
  int64_t interval_tokens = 0;
  const int64_t first_step = step;
  double first_step_seconds = 0;
  bool plan_frozen = !plan_steps || total_steps != std::numeric_limits<int32_t>::max();
  while (step < total_steps) {
    // Every rank must take the same decision to stop (Ctrl-C reaches ranks at different moments; clocks
    // differ): the flags are agreed over the world.
    double flags[2] = {stop_flag().load() ? 1.0 : 0.0,
                       c.train.max_minutes > 0 && seconds_since(train_start) > c.train.max_minutes * 60 ? 1.0 : 0.0};
    if (world.size() > 1) world.all_reduce(flags, 2, comm::Type::f64, comm::ReduceOp::max).wait();
    if (flags[0] > 0) {
      stop_flag().store(true);
      break;
    }
    if (flags[1] > 0) {
      say("time limit of %.1f minutes reached at step %lld\n", c.train.max_minutes, static_cast<long long>(step));
      result.time_limit_reached = true;
      break;
    }
    // Activation memory: the host's allocations, or on a GPU its allocator's.
    if (step == first_step) on_gpu ? device_memory(device).reset_peak() : reset_peak_memory();
    const int64_t live_before = on_gpu ? device_memory(device).peak_allocated() : memory_stats().live_bytes;
    const bool profile_this_step = step + 1 == c.log.profile_step;  // steps are logged 1-based
    if (profile_this_step) ops::profile_begin(device);
    model.params().zero_grads();
    buckets.begin_step();
    LossSum loss;
    // Sample order is that of one rank running dp x accum micro-batches: replica d takes the d-th run.
    const int64_t step_samples = base_samples + (step - base_step) * samples_per_step;
    for (int64_t m = 0; m < accum; ++m) {
      data->train_batch(step_samples + (dp_rank * accum + m) * micro, micro, ids.data(), targets.data());
      LossSum part = model.forward_backward(ids.data(), targets.data(), micro, seq, grad_scale, m == accum - 1);
      loss.sum += part.sum, loss.tokens += part.tokens;
    }
    buckets.finish();
    if (on_gradients_) on_gradients_(step + 1, model.params());
    const double local_loss = loss.mean();
    if (dp > 1) {
      double sums[2] = {loss.sum, static_cast<double>(loss.tokens)};
      comm::all_reduce_sum(dp_group, sums, 2);
      loss.sum = sums[0], loss.tokens = static_cast<int64_t>(sums[1]);
    }
    if (step == first_step) {
      result.peak_activation_bytes =
          (on_gpu ? device_memory(device).peak_allocated() : memory_stats().peak_bytes) - live_before;
      say("peak activation memory %.1f MiB per micro-batch (recompute %s)\n",
          static_cast<double>(result.peak_activation_bytes) / 1048576.0, c.train.recompute.c_str());
    }
    const double mean_loss = loss.mean();
    const double grad_norm = optimizer.grad_norm();
    // A non-finite loss or gradient norm (the same on every rank: both are reduced) is never applied: the
    // weights, the optimizer state and the checkpoints stay those of the last good step.
    // Agreed over the world: a rank whose copy alone went bad (replicated gradients are not reduced again for
    // the norm) must not leave the others applying the step without it.
    bool non_finite = !std::isfinite(mean_loss) || !std::isfinite(grad_norm);
    if (world.size() > 1) non_finite = comm::all_reduce_max(world, non_finite ? 1.0 : 0.0) > 0;
    if (non_finite) {
      const std::string cause = describe_non_finite_step(world, model.params(), local_loss, mean_loss, grad_norm);
      const std::string last =
          committed_step >= 0 ? fmt::format("the last checkpoint is step {} in {}", committed_step, checkpoint_dir.string())
                              : std::string("no checkpoint of this run was saved");
      write_metrics({{"event", "non_finite"}, {"step", step + 1}, {"cause", cause}});
      fail("step {}: {}; the update was not applied and nothing was saved ({})", step + 1, cause, last);
    }
    const float lr = schedule.lr_at(step);
    optimizer.step(lr, clip_coefficient(grad_norm, static_cast<float>(c.train.grad_clip)));
    if (fp8_context) {
      // Delayed scaling: every rank (tensor- and data-parallel) agrees on the step's amaxes, so all use the
      // same scales next step, those one process running the whole batch would use.
      std::span<float> amaxes = fp8_context->step_amaxes();
      if (!amaxes.empty() && world.size() > 1)
        world.all_reduce(amaxes.data(), static_cast<int64_t>(amaxes.size()), comm::Type::f32, comm::ReduceOp::max)
            .wait();
      fp8_context->end_step();
    }
    ++step;
    if (profile_this_step) {
      // This rank's ops; rank 0 reports (the ranks of a balanced layout run the same ops).
      const ops::OpProfile profile = ops::profile_end();
      say("%s", ops::format_profile(profile).c_str());
      if (g_leader) {
        write_file_atomically(run_dir / "profile.json", ops::profile_json(profile) + "\n", "op profile");
      }
    }
    result.losses.push_back(mean_loss);
    result.grad_norms.push_back(grad_norm);
    interval_tokens += step_tokens;

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
      say("%s\n", format_step_line(m).c_str());
      nlohmann::json record = {{"step", step},           {"loss", mean_loss},       {"lr", lr},
                               {"grad_norm", grad_norm}, {"tokens_per_s", m.tokens_per_s},
                               {"tflops", m.flops_per_s / 1e12}, {"mfu", m.mfu},
                               {"tokens", step * step_tokens}, {"elapsed_s", m.elapsed_s}};
      if (dp > 1) record["dp_overlap"] = buckets.total_stats().overlap_ratio();
      write_metrics(record);
      interval_start = Clock::now();
      interval_tokens = 0;
    }
    if (c.eval.every > 0 && step % c.eval.every == 0 && !last) {
      HeldOut e =
          evaluate(model, *data, seq, micro, std::min(heldout_windows, c.eval.batches * micro), dp_group, world);
      if (e.interrupted) continue;  // the next step's stop check saves and ends the run
      const double bpb = e.bits_per_byte();
      say("eval step %lld | held-out loss %.4f | %.4f bits/byte\n", static_cast<long long>(step), e.loss.mean(), bpb);
      write_metrics({{"step", step}, {"eval_loss", e.loss.mean()}, {"eval_bits_per_byte", bpb}});
    }
    if (c.checkpoint.every > 0 && step % c.checkpoint.every == 0 && !last) save("periodic");
    if (plan_steps && !plan_frozen && step - first_step >= 3) {
      // Re-estimate the length from the average speed so far (after the first step, which pays one-time
      // costs), keeping 3% of the budget for evaluations. The plan is frozen when the next step's LR would
      // depend on it: at the end of warmup for cosine, at the start of the decay for WSD. Ranks agree on
      // the most pessimistic estimate.
      const double per_step =
          (seconds_since(train_start) - first_step_seconds) / static_cast<double>(step - first_step - 1);
      const double left = c.train.max_minutes * 60 * 0.97 - seconds_since(train_start);
      double planned = static_cast<double>(step + std::max<int64_t>(1, static_cast<int64_t>(left / per_step)));
      if (world.size() > 1) planned = -comm::all_reduce_max(world, -planned);
      schedule.total_steps = total_steps = static_cast<int64_t>(planned);
      if (step + 1 >= schedule.decay_begins()) {
        plan_frozen = true;
        say("time budget %.3g minutes: planned %lld steps (%.3f s/step so far)\n", c.train.max_minutes,
            static_cast<long long>(total_steps), per_step);
      }
    }
    if (step == first_step + 1) first_step_seconds = seconds_since(train_start);
    if (on_step_) on_step_(step);
  }
  result.steps_done = step;
  if (fp8::DelayedScalingGroup* g = fp8_context ? fp8_context->delayed_group() : nullptr)
    result.fp8_scales.assign(g->scales().begin(), g->scales().end());
  if (dp > 1 && step > first_step) {
    const parallel::GradReductionStats& s = buckets.total_stats();
    say("data-parallel gradient reduction: %.1f MiB per step, communication %.3f s, exposed %.3f s: %.0f%% "
        "overlapped with backward\n",
        static_cast<double>(s.bytes) / std::max<int64_t>(1, s.steps) / 1048576.0, s.communication_seconds,
        s.exposed_seconds, 100.0 * s.overlap_ratio());
  }
  if (stop_flag().load()) {
    say("interrupted at step %lld: saving a checkpoint\n", static_cast<long long>(step));
    save("interrupted");
    result.interrupted = true;
    stop_flag().store(false);
    return result;
  }

  // The final checkpoint first: a Ctrl-C (or a crash) during the evaluation or the sample loses nothing.
  save("final");
  HeldOut e = evaluate(model, *data, seq, micro, heldout_windows, dp_group, world);
  if (e.interrupted) {
    say("interrupted during the final evaluation (the checkpoint of step %lld is saved)\n",
        static_cast<long long>(step));
    result.interrupted = true;
    stop_flag().store(false);
    return result;
  }
  result.heldout_loss = e.loss.mean();
  result.heldout_bits_per_byte = e.bits_per_byte();
  say("final held-out loss %.4f nats/token = %.4f bits per byte (%lld tokens, %lld bytes; %.1f s total)\n",
      result.heldout_loss, result.heldout_bits_per_byte, static_cast<long long>(e.loss.tokens),
      static_cast<long long>(e.bytes), seconds_since(start_time));
  write_metrics({{"step", step}, {"eval_loss", result.heldout_loss}, {"eval_bits_per_byte", result.heldout_bits_per_byte},
                 {"final", true}});

  if (c.sample.tokens > 0 && g_leader) {
    SamplingOptions so;
    so.max_new_tokens = c.sample.tokens, so.context = seq, so.temperature = c.sample.temperature;
    so.top_k = c.sample.top_k, so.seed = c.sample.seed;
    std::vector<int32_t> prompt = codec.encode(c.sample.prompt.empty() ? std::string("\n") : c.sample.prompt);
    // Generation runs on one process: a model split over tp ranks is read back whole from the checkpoint
    // (onto this rank's device).
    std::unique_ptr<LlamaModel> whole;
    if (layout.tp() > 1) {
      nn::ComputeOptions single;
      single.gemm_dtype = options.gemm_dtype;
      single.device = options.device;
      whole = load_pretrained_model(checkpoint_dir, single);
    }
    std::vector<int32_t> out = generate(whole ? *whole : model, prompt, so);
    result.sample = c.sample.prompt + codec.decode(out);
    if (stop_flag().load()) {  // Ctrl-C while sampling: the run still ends as interrupted (exit 130)
      result.interrupted = true;
      stop_flag().store(false);
    }
    say("--- sample (temperature %.2f, top-k %lld) ---\n%s\n---\n", c.sample.temperature,
        static_cast<long long>(c.sample.top_k), result.sample.c_str());
  }
  return result;
}

}  // namespace forge
