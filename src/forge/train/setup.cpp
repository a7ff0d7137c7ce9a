#include "forge/train/setup.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>

#include "forge/core/device.h"
#include "forge/fp8/recipe.h"
#include "forge/kernels/emulated_device.h"
#include "forge/parallel/pipeline/replay.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
namespace {

// This process's rank among the ranks on its node (the GPU it drives): from the launcher's environment
// (OpenMPI, Slurm, torchrun-style LOCAL_RANK), else the world rank (one node).
int local_rank_on_node(const comm::Communicator& world) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* s = std::getenv(name)) return std::max(0, std::atoi(s));
  return world.rank();
}

parallel::Layout checked_layout(const TrainConfig& c, comm::Communicator& world) {
  // parallel.timeout_s, unless FORGE_COMM_TIMEOUT in the environment (read by comm) says otherwise.
  if (!std::getenv("FORGE_COMM_TIMEOUT")) world.set_timeout_seconds(c.parallel.timeout_s);
  // The layout is checked against the world before any work: a wrong -np or a model that does not split
  // fails here, on every rank, with the same message.
  return parallel::Layout(c.layout_spec(), world.size(), world.rank());
}

}  // namespace

int threads_per_rank(int64_t configured) {
  // More threads than cores only make OpenMP's barriers spin against each other (10-100x slower), and
  // libgomp itself fails on absurd counts.
  if (configured > omp_get_num_procs())
    fail("train.threads = {} exceeds the {} cores this process may run on; set at most {} (0 = all)",
         configured, omp_get_num_procs(), omp_get_num_procs());
  if (configured > 0) return static_cast<int>(configured);
  if (std::getenv("OMP_NUM_THREADS")) return omp_get_max_threads();
  int local = 1;
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    local = std::max(1, std::atoi(s));
  else if (const char* s = std::getenv("SLURM_NTASKS_PER_NODE"))
    local = std::max(1, std::atoi(s));
  return std::max(1, omp_get_num_procs() / local);
}

TrainSetup::TrainSetup(const TrainConfig& c, comm::Communicator& world_)
    : config(c),
      world(world_),
      layout(checked_layout(c, world_)),
      memory_limit(static_cast<int64_t>(c.train.memory_limit_mb * 1048576.0),
                   fmt::format("train.memory_limit_mb = {}", c.train.memory_limit_mb)) {
  omp_set_num_threads(threads_per_rank(c.train.threads));
  if (!c.model.init_from.empty()) init_source = open_pretrained(c.model.init_from);
  model_source = init_source ? init_source->dir.string() : c.model.config;
  model_config = init_source ? init_source->config->clone() : read_model_config(c.model.config);
  check_model_fits();
  groups = parallel::make_groups(world, layout);
  dp = layout.dp(), dp_rank = layout.coordinate(parallel::Dim::dp), cp = layout.cp();
  seq = c.data.seq_len, micro = c.train.micro_batch, accum = c.train.grad_accum;
  device = c.train.device;
  open_devices();
  data = open_training_data(c, model_config.get());
  if (data->has_images() && layout.cp() > 1)
    fail(
        "{}: context parallelism splits sequences, and image-text data's images are whole in one (set "
        "parallel.cp = 1)",
        c.origin_of("parallel.cp"));
  if ((c.data.document_mask || (c.data.sft_pack && !c.data.sft.empty())) && layout.cp() > 1)
    fail("{}: document masks (data.{}) are not supported under context parallelism yet (set parallel.cp = 1)",
         c.origin_of("parallel.cp"), c.data.document_mask ? "document_mask" : "sft_pack");
  if (c.data.document_mask) {
    if (!c.data.sft.empty() || !c.data.images.empty())
      fail(
          "{}: data.document_mask cuts pretraining text at end-of-sequence tokens; fine-tuning data packs "
          "with data.sft_pack, image-text data does not pack",
          c.origin_of("data.document_mask"));
    if (!data->codec().eos_id())
      fail("{}: data.document_mask ends documents at the end-of-sequence token, and {} has none",
           c.origin_of("data.document_mask"), data->codec().description());
  }
  if (!c.train.freeze.empty() && model_config->architecture() != "LlavaForConditionalGeneration")
    fail("{}: train.freeze = \"{}\" freezes parts of a multimodal model; {} is one {}",
         c.origin_of("train.freeze"), c.train.freeze, model_source, model_config->architecture());
  const TextCodec& codec = data->codec();
  const int64_t vocab = model_config->shape().vocab;
  if (vocab < codec.vocab_size())
    fail(
        "{}: vocab_size {} is smaller than the {} tokens of the tokenizer ({}); set vocab_size >= {} or "
        "data.vocab_size <= {}",
        model_source, vocab, codec.vocab_size(), codec.description(), codec.vocab_size(), vocab);
  make_compute_options();
  make_pipeline();
  build_chunks();  // refuses a model larger than memory, before the step's own check
  check_step_fits();
  // A dry run's device holds zeros whatever is written (kernels/emulated_device.h): the host's fp32 copy of a
  // model far larger than this machine is not made.
  if (!EmulatedDevice::check_only()) model->initialize(c.model.seed);
  if (init_source) load_pretrained_weights(*init_source, model->params());

  // Data parallelism: gradients reduced in buckets while backward runs (sharded under ZeRO-1).
  parallel::BucketOptions bucket_options;
  bucket_options.bucket_bytes = parallel::bucket_bytes_of(c.parallel.bucket_mb, on_gpu(), dp);
  bucket_options.shard = c.parallel.distributed_optimizer;
  bucket_options.reduce_dtype = c.parallel.grad_reduce_in_bf16 ? DType::bf16 : DType::f32;
  // DualPipe's mirrored copies are summed once the schedule is done, before the buckets reduce over dp.
  bucket_options.overlap = c.parallel.overlap_grad_reduce && dp > 1 && !mirror && tied_param < 0;
  // On GPUs the gradient buckets reduce device memory: over NCCL, or with one replica over nothing at all.
  if (on_gpu() && !dp_nccl) dp_self = comm::make_self("dp");
  buckets = std::make_unique<parallel::GradBuckets>(
      &model->params(), on_gpu() ? (dp_nccl ? dp_nccl.get() : dp_self.get()) : &dp_group(), bucket_options);
  AdamWConfig adam_config{static_cast<float>(c.train.beta1), static_cast<float>(c.train.beta2),
                          static_cast<float>(c.train.eps), static_cast<float>(c.train.weight_decay)};
  std::vector<parallel::OptimizerGroup> optimizer_groups{{buckets.get(), &dp_group()}};
  if (layout.ep() > 1) {
    // The routed experts: each held by the expert-data-parallel ranks alone, whose gradients (every ep
    // rank's tokens for these experts) they sum, with their own ZeRO-1 shards; the ep ranks hold the others.
    parallel::BucketOptions expert_options = bucket_options;
    expert_options.group = "experts";
    expert_options.overlap = bucket_options.overlap && layout.expert_dp() > 1;
    comm::Communicator* expert_group = groups.expert_dp.get();
    if (on_gpu()) {
      if (!expert_dp_nccl) expert_dp_nccl = comm::make_self("expert_dp");
      expert_group = expert_dp_nccl.get();
    }
    expert_buckets = std::make_unique<parallel::GradBuckets>(&model->params(), expert_group, expert_options);
    optimizer_groups.push_back({expert_buckets.get(), groups.expert_dp.get(), groups.ep.get()});
  }
  optimizer = std::make_unique<parallel::DistributedAdamW>(
      &model->params(), adam_config, optimizer_groups, groups.model_parallel.get(),
      c.train.optimizer_offload ? parallel::OptimizerOffload::host : parallel::OptimizerOffload::none);
  schedule = c.lr_schedule();
}

// Tied embeddings under pp: where the first and the last stage are on two ranks (of the same tp and dp
// position), the last stage's copy of the embedding is a copy (out of the norm and the checkpoint) whose
// gradient is summed with the embedding's every step, so that both take the same update and stay equal.
// DeepSeek-V3's multi-token prediction modules (on the last stage) read the embedding too: the same pairing.
void TrainSetup::tie_embeddings_across_stages() {
  const nlohmann::json json = model_config->to_json();
  const bool mtp = json.contains("num_nextn_predict_layers") &&
                   json["num_nextn_predict_layers"].is_number() &&
                   json["num_nextn_predict_layers"].get<int64_t>() > 0;
  if (!pipeline || !(json.value("tie_word_embeddings", false) || mtp)) return;
  const pipeline::Placement& p = pipeline->placement;
  const int first = p.locate(0, 0).rank, last = p.locate(0, p.stages - 1).rank;
  if (first == last) return;  // one tensor in the rank's store (LlamaModel shares it between the chunks)
  const bool mine = pp_rank == first || pp_rank == last;
  tied_group = groups.pp->split(mine ? 0 : -1, pp_rank, "pp_tied_embedding");
  if (!mine) return;
  if (on_gpu()) tied_nccl = device_communicator(*tied_group, "pp_tied_embedding");
  tied_param = model->params().find("model.embed_tokens.weight");
  FORGE_CHECK(tied_param >= 0, "pp rank {} holds a tied end stage without the embedding", pp_rank);
  if (pp_rank == last) model->params().mark_copy(tied_param);
}

std::vector<Model*> TrainSetup::chunks() const {
  std::vector<Model*> out{model.get()};
  for (const auto& m : more_chunks) out.push_back(m.get());
  return out;
}

void TrainSetup::build_chunks() {
  const float init_std = static_cast<float>(config.model.init_std);
  if (chunk_stages.size() == 1) {
    model = build_model(*model_config, options, chunk_stages[0], init_std);
    tie_embeddings_across_stages();
    return;
  }
  rank_params = std::make_unique<ParameterStore>();
  for (size_t c = 0; c < chunk_stages.size(); ++c) {
    const int first_param = rank_params->count();
    const int64_t first_linear = options.fp8 ? options.fp8->linears() : 0;
    std::unique_ptr<Model> built =
        build_model(*model_config, options, chunk_stages[c], init_std, true, rank_params.get());
    chunk_params.push_back({first_param, rank_params->count()});
    chunk_fp8_linears.push_back({first_linear, options.fp8 ? options.fp8->linears() : 0});
    if (c == 0)
      model = std::move(built);
    else
      more_chunks.push_back(std::move(built));
  }
  rank_params->allocate(options.gemm_dtype == DType::bf16, true, options.device);
  if (options.fp8) options.fp8->seal();
  tie_embeddings_across_stages();
  if (pipeline->placement.mirrored) {
    // Rank r holds stage r as chunk 0 and a copy of stage P-1-r as chunk 1, which rank P-1-r holds as its
    // chunk 0: the copies are not primary, so each element counts once in the norm and in checkpoints.
    for (int id = chunk_params[1].first; id < chunk_params[1].second; ++id) rank_params->mark_copy(id);
    const int P = layout.pp();
    mirror = groups.pp->split(std::min(pp_rank, P - 1 - pp_rank), pp_rank, "pp_mirror");
    if (on_gpu()) mirror_nccl = device_communicator(*mirror, "pp_mirror");
  }
}

// This rank's stage: the schedule's placement of the stages over the pp ranks, and the layers of each stage
// (an even split, or parallel.pp_layers).
void TrainSetup::make_pipeline() {
  const TrainConfig& c = config;
  const int pp = layout.pp();
  const int64_t layers = model_config->shape().layers;
  chunk_stages = {StageSpec::whole()};
  stage_rows = micro * local_seq() / (c.parallel.sequence_parallel && layout.tp() > 1 ? layout.tp() : 1);
  if (pp == 1) {
    if (!c.parallel.pp_layers.empty())
      (void)pipeline::stage_layer_counts(layers, 1, c.parallel.pp_layers, "parallel.pp = 1");
    return;
  }
  pp_rank = layout.coordinate(parallel::Dim::pp);
  // Expert parallelism's overlap pairs the interleaved schedule's steady-state forwards and backwards.
  const pipeline::ScheduleRequest request{c.parallel.schedule, pp, static_cast<int>(accum),
                                          static_cast<int>(c.parallel.vpp),
                                          layout.ep() > 1 && c.parallel.ep_overlap};
  try {
    pipeline = std::make_unique<pipeline::Schedule>(pipeline::make_schedule(request));
  } catch (const Error& e) {
    fail("{}: {} (micro-batches per step = train.grad_accum)", c.origin_of("parallel.schedule"), e.what());
  }
  const pipeline::Placement& p = pipeline->placement;
  if (on_gpu())
    pp_links = std::make_unique<pipeline::Links>(
        *pipeline, pp_group(), [this](comm::Communicator& bootstrap, const std::string& name) {
          return device_communicator(bootstrap, name);
        });
  else
    pp_links = std::make_unique<pipeline::Links>(pp_group());

  const std::string stages_from =
      p.stages == pp ? fmt::format("parallel.pp = {}", pp)
      : c.parallel.schedule == pipeline::ScheduleKind::interleaved
          ? fmt::format("parallel.pp = {} x parallel.vpp = {}", pp, c.parallel.vpp)
          : fmt::format("parallel.pp = {} x 2 (schedule {})", pp, c.parallel.schedule.name());
  const std::vector<int64_t> counts =
      pipeline::stage_layer_counts(layers, p.stages, c.parallel.pp_layers, stages_from);
  chunk_stages.clear();
  for (int chunk = 0; chunk < p.chunks; ++chunk)
    chunk_stages.push_back(StageSpec::of_counts(counts, p.stage(pp_rank, chunk)));
  const pipeline::Replay unit = pipeline::replay(*pipeline);
  std::vector<std::string> ranges;
  for (int64_t s = 0, first = 0; s < p.stages; first += counts[s++])
    ranges.push_back(counts[s] == 1 ? fmt::format("{}", first)
                                    : fmt::format("{}-{}", first, first + counts[s] - 1));
  int64_t pairs = 0;
  for (const auto& list : pipeline->actions)
    pairs += std::count_if(list.begin(), list.end(),
                           [](const pipeline::Action& a) { return a.op == pipeline::Op::forward_backward; });
  pipeline_summary = fmt::format(
      "pipeline parallel {}: schedule {}, {} micro-batches per step, stages of layers {} | bubble {:.0f}% of "
      "the step under unit costs, peak {} chunks' activations per rank{}",
      pp, pipeline->name, accum, fmt::join(ranges, " | "), 100 * unit.bubble_fraction(),
      unit.max_peak_activations(), pairs > 0 ? fmt::format(", {} overlapped F&B pairs", pairs) : "");
}

// What a step allocates beyond the model, bounded from below so that a refusal is never wrong: the batch's
// token ids and targets (on the host), and on a CPU the activations, of which every layer keeps at least its
// input for the backward whatever the recompute mode. A micro-batch or an accumulation that cannot fit is
// refused here in one line naming the key, rather than met as an allocation failure in the first step.
void TrainSetup::check_step_fits() const {
  const TrainConfig& c = config;
  const ModelShape shape = model_config->shape();
  double available = static_cast<double>(host_memory_bytes());
  std::string holder = "this machine's";
  if (c.train.memory_limit_mb > 0 && c.train.memory_limit_mb * 1048576.0 < available)
    available = c.train.memory_limit_mb * 1048576.0, holder = "train.memory_limit_mb's";
  constexpr double kGiB = 1073741824.0;
  const double local_tokens =
      static_cast<double>(micro) * static_cast<double>(seq) / static_cast<double>(layout.cp());
  const double batch_bytes = 2.0 * static_cast<double>(accum) * local_tokens * sizeof(int32_t);
  if (batch_bytes > available)
    fail(
        "train.micro_batch = {} x train.grad_accum = {}: a step's token ids and targets alone need {:.1f} "
        "GiB, "
        "more than {} {:.1f} GiB; lower train.grad_accum or train.micro_batch",
        micro, accum, batch_bytes / kGiB, holder, available / kGiB);
  if (device != Device::cpu) return;  // a GPU's activations are its allocator's to report
  const double layers = static_cast<double>(shape.layers) / static_cast<double>(layout.pp());
  const double bytes_per_value = c.train.dtype == DtypeChoice::fp32 ? 4.0 : 2.0;
  const double tp_rows = c.parallel.sequence_parallel ? static_cast<double>(layout.tp()) : 1.0;
  const double activation_bytes =
      layers * local_tokens / tp_rows * static_cast<double>(shape.hidden) * bytes_per_value;
  if (activation_bytes > available)
    fail(
        "train.micro_batch = {}: one micro-batch's activations need at least {:.1f} GiB ({:g} layers x {} x "
        "{} "
        "tokens x hidden {} x {:g} bytes), more than {} {:.1f} GiB; lower train.micro_batch or data.seq_len",
        micro, activation_bytes / kGiB, layers, micro, seq / layout.cp(), shape.hidden, bytes_per_value,
        holder, available / kGiB);
}

void TrainSetup::check_model_fits() const {
  const TrainConfig& c = config;
  const ModelShape s = model_config->shape();
  if (c.data.seq_len > s.max_positions)
    fail("data.seq_len {} exceeds max_position_embeddings {} of {}", c.data.seq_len, s.max_positions,
         model_source);
  parallel::validate_model_fit(layout, {s.hidden, s.heads, s.kv_heads, s.ffn, s.vocab, s.layers},
                               c.parallel.make_vocab_size_divisible_by);
  if (layout.ep() > 1) {
    const int64_t experts = model_config->routed_experts();
    if (experts <= 0)
      fail("{}: parallel.ep = {} spreads routed experts over ranks, but {} ({}) has none",
           c.origin_of("parallel.ep"), layout.ep(), model_source, model_config->architecture());
    if (experts % layout.ep() != 0)
      fail("{}: parallel.ep = {} does not divide the {} routed experts of {}", c.origin_of("parallel.ep"),
           layout.ep(), experts, model_source);
  }
  if (model_config->training_router_aux_loss_coef() > 0) {
    if (c.moe.aux_loss_coeff > 0)
      fail(
          "{}: moe.aux_loss_coeff = {} adds forge's per-layer auxiliary loss, and {} sets "
          "output_router_logits = true, which adds Hugging Face's over all layers: keep one",
          c.origin_of("moe.aux_loss_coeff"), c.moe.aux_loss_coeff, model_source);
  }
  // Context parallelism cuts every sequence into 2 x cp chunks (two per rank, one early and one late, for
  // causal balance); all-to-all attention scatters each tensor-parallel rank's heads over cp.
  const int cp_size = layout.cp();
  const parallel::ContextSplitProblem split =
      parallel::context_split_problem(cp_size, c.parallel.cp_comm, c.data.seq_len, s.heads / layout.tp(),
                                      std::max<int64_t>(1, s.kv_heads / layout.tp()));
  if (!split.none()) fail("{}: {}", c.origin_of(split.setting), split.problem);
  // Sequence parallelism splits each micro-batch's token rows over tp; with the (local) sequence a multiple
  // of tp every batch size splits (evaluation's last batch may be smaller), as Megatron requires.
  const int64_t local = c.data.seq_len / cp_size;
  if (c.parallel.sequence_parallel && layout.tp() > 1 && local % layout.tp() != 0)
    fail("parallel.sequence_parallel: {} must be a multiple of parallel.tp = {}",
         cp_size > 1 ? fmt::format("the {} tokens per rank (data.seq_len = {} / parallel.cp = {})", local,
                                   c.data.seq_len, cp_size)
                     : fmt::format("data.seq_len = {}", c.data.seq_len),
         layout.tp());
}

void TrainSetup::context_slice(const int32_t* whole, int32_t* local, int64_t batch) const {
  if (cp == 1) {
    std::copy_n(whole, batch * seq, local);
    return;
  }
  parallel::ContextSplit::make(static_cast<int>(cp), layout.coordinate(parallel::Dim::cp), seq)
      .take_local(whole, local, batch, 1);
}

// GPUs: one per process, the local rank's. Device buffers (tensor-parallel activations and gradients,
// data-parallel gradient buckets, ZeRO-1's parameter all-gathers) go over NCCL communicators of the tp and dp
// groups; host buffers (scalars, flags, per-row loss statistics, FP8 amaxes, checkpoints' host copies) still
// go over MPI.
void TrainSetup::open_devices() {
  if (!on_gpu()) return;
  const TrainConfig& c = config;
  if (!device_usable(device))
    fail("{}: train.device = {}, but no GPU is usable here (or this binary has no CUDA backend)",
         c.origin_of("train.device"), c.train.device.name());
  if (c.fp8.recipe != Fp8RecipeChoice::off && c.data.seq_len % 16 != 0)
    fail(
        "{}: data.seq_len = {} must be a multiple of 16 for FP8 on {} (FP8 tensor cores read token counts in "
        "multiples of 16)",
        c.origin_of("data.seq_len"), c.data.seq_len, c.train.device.name());
  if (c.fp8.recipe != Fp8RecipeChoice::off && c.fp8.accumulator_bits > 0)
    fail(
        "{}: fp8.accumulator_bits = {} models the tensor cores' accumulator on the CPU; on {} the hardware "
        "accumulates: set it to 0",
        c.origin_of("fp8.accumulator_bits"), c.fp8.accumulator_bits, c.train.device.name());
  const DeviceMemory& gpu = device_memory(device);
  const int local_rank = local_rank_on_node(world), visible = gpu.device_count();
  // A process that sees one GPU drives it (Slurm's --gpu-bind or a per-rank CUDA_VISIBLE_DEVICES); one that
  // sees the node's GPUs drives its local rank's.
  if (visible > 1 && local_rank >= visible)
    fail("{}: local rank {} has no GPU of its own ({} visible): start at most one process per GPU", c.source,
         local_rank, visible);
  gpu_ordinal_ = visible > 1 ? local_rank : 0;
  gpu.select_device(gpu_ordinal_);
  if (layout.tp() > 1) tp_nccl = device_communicator(*groups.tp, "tp");
  if (dp_group().size() > 1) dp_nccl = device_communicator(dp_group(), "dp");  // dp x cp
  if (layout.ep() > 1) ep_nccl = device_communicator(*groups.ep, "ep");
  if (layout.cp() > 1) cp_nccl = device_communicator(*groups.cp, "cp");
  if (layout.ep() > 1 && layout.expert_dp() > 1)
    expert_dp_nccl = device_communicator(*groups.expert_dp, "expert_dp");
}

// A NCCL communicator over the ranks of `bootstrap` (a host group), its operations ordered after the work
// the GPU's compute stream has queued.
std::unique_ptr<comm::Communicator> TrainSetup::device_communicator(comm::Communicator& bootstrap,
                                                                    const std::string& name) const {
  return comm::make_nccl(bootstrap, gpu_ordinal_, name, device_memory(device).stream());
}

void TrainSetup::make_compute_options() {
  const TrainConfig& c = config;
  options.device = device;
  options.gemm_dtype = c.gemm_dtype();
  options.activation_dtype = c.activation_dtype();
  options.residual_dtype = c.residual_dtype();
  options.hidden_dropout = static_cast<float>(c.train.hidden_dropout);
  // Its own stream of the run's seed: the masks share no counters with the initialisation's.
  options.dropout_seed = c.model.seed ^ 0xD7090E7D7090E7D7ull;
  dtype_name = options.gemm_dtype == DType::bf16 ? "bf16" : "fp32";
  options.recompute = c.train.recompute;
  options.recompute_layers = c.train.recompute_layers;
  options.recompute_modules = c.recompute_modules();
  options.frozen = c.frozen_parts();
  tensor_parallel = std::make_unique<parallel::CommTensorParallel>(
      groups.tp.get(), c.parallel.sequence_parallel, tp_nccl.get());
  if (layout.tp() > 1) options.tp = tensor_parallel.get();
  if (layout.cp() > 1) {
    context_parallel = std::make_unique<parallel::CommContextParallel>(groups.cp.get(), c.parallel.cp_comm,
                                                                       cp_nccl.get(), device);
    options.cp = context_parallel.get();
  }
  if (layout.ep() > 1) {
    expert_parallel = std::make_unique<parallel::CommExpertParallel>(groups.ep.get(), ep_nccl.get());
    options.ep = expert_parallel.get();
    options.ep_overlap = c.parallel.ep_overlap;
  }
  options.vocab_divisible_by = c.parallel.make_vocab_size_divisible_by;
  options.moe_capacity_factor = c.moe.capacity_factor;
  options.moe_pad_to_capacity = c.moe.pad_to_capacity;
  // FP8: the context lives as long as the model, which reads it through options.fp8.
  std::optional<nn::Fp8Options> f = c.fp8_options();
  if (!f) return;
  const int64_t layers = model_config->shape().layers, kept = f->bf16_first_layers + f->bf16_last_layers;
  if (kept >= layers)
    fail(
        "{}: fp8.bf16_first_layers + fp8.bf16_last_layers = {} keep all {} layers out of FP8; lower them or "
        "set "
        "fp8.recipe = \"off\"",
        c.origin_of("fp8.bf16_first_layers"), kept, layers);
  fp8 = std::make_unique<nn::Fp8Context>(*f);
  options.fp8 = fp8.get();
  fp8_summary = fmt::format("{} ({}", c.fp8.recipe.name(), fp8::format_name(f->recipe.format));
  if (f->recipe.recipe == fp8::Recipe::delayed)
    fp8_summary += fmt::format(", history {} {}", f->recipe.amax_history_len,
                               fp8::amax_compute_name(f->recipe.amax_compute));
  if (f->recipe.recipe == fp8::Recipe::block && f->recipe.power_of_two_scales) fp8_summary += ", 2^k scales";
  fp8_summary += fmt::format(", layers {}..{}", f->bf16_first_layers, layers - f->bf16_last_layers - 1);
  if (!f->save_fp8_inputs)
    fp8_summary += ", inputs saved in " + std::string(forge::dtype_name(options.gemm_dtype));
  if (f->accumulator_bits > 0)
    fp8_summary +=
        fmt::format(", {}-bit accumulator promoted every {}", f->accumulator_bits, f->promote_every);
  fp8_summary += ")";
}

}  // namespace forge::train
