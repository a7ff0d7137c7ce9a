// TrainConfig: everything a training run needs besides the model architecture (which comes from a
// Hugging Face config.json named in [model] config). Read from TOML; every key can be overridden with
// `--set section.key=value`. configs/default.toml lists every key with its default and meaning.
//
// Reading is strict: an unknown section or key is an error naming the file, line and key, with a
// "did you mean" hint for near misses, because a misspelt key silently ignored trains the wrong run.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "forge/core/tensor.h"
#include "forge/fp8/recipe.h"
#include "forge/nn/compute.h"
#include "forge/nn/fp8_context.h"
#include "forge/optim/lr_schedule.h"
#include "forge/parallel/context_parallel.h"
#include "forge/parallel/layout.h"
#include "forge/parallel/pipeline/schedule.h"
#include "forge/train/choice.h"

namespace forge::train {

// The settings that are one of a few values (train/choice.h), beside the enums of the layers below that
// serve as they are (Device, nn::Recompute, optim::LrSchedule::Kind, fp8::AmaxCompute,
// parallel::ContextAttention).
enum class DataOrder { shuffle, sequential };
enum class SftLoss { assistant, all };
enum class DtypeChoice { automatic, bf16, fp32 };
enum class Fp8RecipeChoice { off, delayed, current, block };
enum class Fp8FormatChoice { automatic, hybrid, e4m3 };
enum class BiasUpdate { sign, zero_mean };
enum class SkipData { window, none };
enum class SpikeMetric { ratio, zscore };

#define FORGE_CHOICE_NAMES(E, ...)                   \
  template <>                                        \
  struct ChoiceTraits<E> {                           \
    static const ChoiceNames<E>& names() {           \
      static const ChoiceNames<E> n = {__VA_ARGS__}; \
      return n;                                      \
    }                                                \
  };
FORGE_CHOICE_NAMES(DataOrder, {DataOrder::shuffle, "shuffle"}, {DataOrder::sequential, "sequential"})
FORGE_CHOICE_NAMES(SftLoss, {SftLoss::assistant, "assistant"}, {SftLoss::all, "all"})
FORGE_CHOICE_NAMES(optim::LrSchedule::Kind, {optim::LrSchedule::Kind::cosine, "cosine"},
                   {optim::LrSchedule::Kind::wsd, "wsd"}, {optim::LrSchedule::Kind::constant, "constant"})
FORGE_CHOICE_NAMES(Device, {Device::cpu, "cpu"}, {Device::cuda, "cuda"})
FORGE_CHOICE_NAMES(DtypeChoice, {DtypeChoice::automatic, "auto"}, {DtypeChoice::bf16, "bf16"},
                   {DtypeChoice::fp32, "fp32"})
FORGE_CHOICE_NAMES(nn::Recompute, {nn::Recompute::none, "none"}, {nn::Recompute::selective, "selective"},
                   {nn::Recompute::full, "full"})
FORGE_CHOICE_NAMES(parallel::ContextAttention, {parallel::ContextAttention::ring, "p2p"},
                   {parallel::ContextAttention::all_to_all, "a2a"})
FORGE_CHOICE_NAMES(pipeline::ScheduleKind, {pipeline::ScheduleKind::one_f_one_b, "1f1b"},
                   {pipeline::ScheduleKind::interleaved, "interleaved"},
                   {pipeline::ScheduleKind::zb_h1, "zb-h1"}, {pipeline::ScheduleKind::zbv, "zbv"},
                   {pipeline::ScheduleKind::dualpipe, "dualpipe"},
                   {pipeline::ScheduleKind::dualpipev, "dualpipev"})
FORGE_CHOICE_NAMES(Fp8RecipeChoice, {Fp8RecipeChoice::off, "off"}, {Fp8RecipeChoice::delayed, "delayed"},
                   {Fp8RecipeChoice::current, "current"}, {Fp8RecipeChoice::block, "block"})
FORGE_CHOICE_NAMES(Fp8FormatChoice, {Fp8FormatChoice::automatic, "auto"}, {Fp8FormatChoice::hybrid, "hybrid"},
                   {Fp8FormatChoice::e4m3, "e4m3"})
FORGE_CHOICE_NAMES(fp8::AmaxCompute, {fp8::AmaxCompute::max, "max"},
                   {fp8::AmaxCompute::most_recent, "most_recent"})
FORGE_CHOICE_NAMES(BiasUpdate, {BiasUpdate::sign, "sign"}, {BiasUpdate::zero_mean, "zero_mean"})
FORGE_CHOICE_NAMES(SkipData, {SkipData::window, "window"}, {SkipData::none, "none"})
FORGE_CHOICE_NAMES(SpikeMetric, {SpikeMetric::ratio, "ratio"}, {SpikeMetric::zscore, "zscore"})
#undef FORGE_CHOICE_NAMES

// data.tokenizer: "train" (a BPE learnt on the corpus), "bytes", or the path of a tokenizer.json.
enum class TokenizerSource { train, bytes, file };
// checkpoint.resume: "" (a fresh run), "auto" (this run's checkpoint directory if it holds one), or a path.
enum class ResumeMode { fresh, automatic, path };

struct TrainConfig {
  struct Model {
    std::string config = "configs/llama-default.json";  // relative paths are relative to the working dir
    std::string init_from;  // "" = random init; else a Hugging Face folder or forge checkpoint
    double init_std = 0.02;
    uint64_t seed = 1234;
    bool operator==(const Model&) const = default;
  };
  struct Data {
    std::string corpus = "kjv";       // "kjv" or a path to a UTF-8 text file
    std::string tokenizer = "train";  // "train" (BPE learnt on the corpus), "bytes", or a tokenizer.json
    int64_t vocab_size = 2048;        // BPE vocabulary when tokenizer = "train"
    std::string dataset;              // "" = the corpus; else a Megatron blend "PREFIX" or "W1 P1 W2 P2 ..."
    std::string split = "969,30,1";   // train,valid,test weights over each dataset's documents
    Choice<DataOrder> order = DataOrder::shuffle;  // with dataset: shuffled from the seed, or in order
    double heldout_fraction = 0.01;
    int64_t heldout_parts = 10;  // the held-out text: the tail of each of this many equal parts
    int64_t seq_len = 256;
    std::string cache_dir = "data";
    // Image-text data (a LlavaForConditionalGeneration model): a JSONL or a packed file (docs/formats.md).
    std::string images;             // "" = text data
    std::string heldout_images;     // "" = the last data.heldout_fraction of data.images' samples
    std::string image_processor;    // preprocessor_config.json; "" = the one beside data.images
    bool skip_bad_samples = false;  // image-text and SFT: skip and count bad lines instead of stopping
    // Supervised fine-tuning (docs/fine-tuning.md): conversations as JSONL, through the chat template.
    std::string sft;                                // "" = pretraining data
    std::string heldout_sft;                        // "" = the last data.heldout_fraction of data.sft's
    std::string chat_template;                      // "" = the folder of data.tokenizer
    Choice<SftLoss> sft_loss = SftLoss::assistant;  // the loss on the assistant's tokens, or on all
    bool sft_pack = false;       // several conversations per sequence, each attending to itself
    bool document_mask = false;  // pretraining: attention within documents, cut after each EOS token
    bool operator==(const Data&) const = default;
  };
  struct Train {
    int64_t micro_batch = 8;
    int64_t grad_accum = 1;
    int64_t steps = 0;         // 0 = as many as fit in max_minutes
    double max_minutes = 8.5;  // 0 = no limit
    double lr = 3e-3;
    double min_lr = 3e-4;
    int64_t warmup = 50;
    Choice<optim::LrSchedule::Kind> schedule = optim::LrSchedule::Kind::wsd;  // cosine | wsd | constant
    double wsd_decay_fraction = 0.2;
    double weight_decay = 0.1;
    double hidden_dropout = 0.0;  // on the embeddings and each layer's attention and MLP outputs
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double grad_clip = 1.0;  // 0 = no clipping
    Choice<Device> device = Device::cpu;
    Choice<DtypeChoice> dtype = DtypeChoice::automatic;  // auto: bf16 where the CPU has native bf16
    // Activations whose kernels take the compute dtype (nn::ComputeOptions::activation_dtype): auto = the
    // GEMM dtype; fp32 keeps them fp32 under bf16 GEMMs; bf16 needs bf16 GEMMs.
    Choice<DtypeChoice> activation_dtype = DtypeChoice::automatic;
    // With bf16 activations, keep the residual stream between layers in fp32 (Megatron's
    // fp32_residual_connection; nn::ComputeOptions::residual_dtype).
    bool fp32_residual = false;
    Choice<nn::Recompute> recompute = nn::Recompute::none;
    // > 0: recompute only the first this many layers of each pipeline stage (nn::ComputeOptions::
    // recompute_layers; Megatron's --recompute-method block --recompute-num-layers). 0 = every layer.
    int64_t recompute_layers = 0;
    // With recompute = selective, what is dropped and recomputed, comma-separated (nn::RecomputeModule's
    // names: core_attn, mlp_act, moe_act, norm, mla_up_proj); "" = core_attn,mlp_act,moe_act.
    std::string recompute_modules;
    // On a GPU: the fp32 masters and Adam moments in host memory, updated there (parallel::OptimizerOffload).
    bool optimizer_offload = false;
    std::string freeze;   // parts that do not train, comma-separated (a LLaVA's vision,projector,language)
    int64_t threads = 0;  // 0 = all cores
    double memory_limit_mb = 0;  // cap on each rank's host tensors (0 = none; train.device = cpu)
    bool operator==(const Train&) const = default;
  };
  struct Eval {
    int64_t every = 500;  // 0 = only at the end
    int64_t batches = 16;
    bool operator==(const Eval&) const = default;
  };
  struct Log {
    int64_t every = 10;
    std::string run_dir = "runs/default";
    double peak_gflops = 0;  // 0 = measure the GEMM peak at start
    int64_t profile_step =
        0;  // time every op of this step (1-based, as logged) and print where it went; 0 = off
    std::string hardware_profile;  // "" = off; else predict memory and step time at start (docs/simulator.md)
    bool report = true;            // write <run_dir>/report.html at the end of the run (forge report)
    int64_t expert_load_every = 100;  // per-expert loads in the metrics of the logged steps divisible by this
    bool operator==(const Log&) const = default;
  };
  struct Checkpoint {
    int64_t every = 0;      // 0 = only at the end and on Ctrl-C
    std::string dir;        // empty = <run_dir>/checkpoint
    std::string resume;     // empty = fresh run, "auto" = resume from dir if a checkpoint is there, or a path
    int64_t keep_last = 3;  // checkpoints kept in dir, the newest included (0 = all)
    bool overwrite = false;  // a fresh run may replace the checkpoints already in dir
    bool async = true;       // periodic saves written in the background (the step blocks for a copy)
    bool operator==(const Checkpoint&) const = default;
  };
  struct Sample {
    int64_t tokens = 200;
    std::string prompt = "And God said";
    double temperature = 0.8;  // 0 = greedy
    int64_t top_k = 40;        // 0 = whole vocabulary
    uint64_t seed = 7;
    int64_t captions = 0;  // image-text data: held-out samples captioned greedily after training
    int64_t answers = 0;   // fine-tuning data: held-out conversations answered greedily after training
    bool operator==(const Sample&) const = default;
  };
  // How the world's ranks are split (see forge/parallel/layout.h) and how gradients travel between them.
  struct Parallel {
    int64_t tp = 1;  // tensor parallel
    int64_t pp = 1;  // pipeline parallel
    Choice<pipeline::ScheduleKind> schedule =
        pipeline::ScheduleKind::one_f_one_b;  // pipeline schedule (parallel/pipeline/schedule.h)
    int64_t vpp = 1;                          // interleaved: chunks per pipeline rank
    std::string pp_layers;                    // layers per stage, "3,5,5,3"; empty: even
    int64_t dp = 0;                           // data parallel; 0 = derived: world size / (tp * pp * cp)
    int64_t cp = 1;                           // context parallel
    Choice<parallel::ContextAttention> cp_comm = parallel::ContextAttention::ring;  // cp > 1: attention
    int64_t ep = 1;          // expert parallel, carved from dp x cp
    bool ep_overlap = true;  // hide the token all-to-alls under compute (nn::ComputeOptions)
    bool sequence_parallel = false;
    bool distributed_optimizer = false;  // ZeRO-1: optimizer state sharded over dp
    bool overlap_grad_reduce = true;
    double bucket_mb = 0;  // 0 = by device (parallel::default_bucket_bytes)
    // Data-parallel gradient reductions in bf16 (parallel::BucketOptions::reduce_dtype).
    bool grad_reduce_in_bf16 = false;
    int64_t make_vocab_size_divisible_by = 128;
    double timeout_s = 300;  // 0 = wait forever
    bool operator==(const Parallel&) const = default;
  };

  // FP8 mixed precision of the transformer layers' Linears (docs/fp8.md; forge/fp8/recipe.h).
  struct Fp8 {
    Choice<Fp8RecipeChoice> recipe = Fp8RecipeChoice::off;
    Choice<Fp8FormatChoice> format = Fp8FormatChoice::automatic;  // auto: hybrid; e4m3 for block
    int64_t amax_history_len = 1024;
    Choice<fp8::AmaxCompute> amax_compute = fp8::AmaxCompute::max;
    int64_t margin = 0;
    bool power_of_two_scales = true;  // block recipe
    int64_t bf16_first_layers = 0;
    int64_t bf16_last_layers = 0;
    bool vision = false;  // multimodal: the encoder's layers and the projector run the recipe too
    bool save_fp8_inputs = true;
    int64_t accumulator_bits = 0;  // 0 = exact fp32 accumulation
    int64_t promote_every = 128;
    bool forward_fast_accumulation = true;
    bool operator==(const Fp8&) const = default;
  };

  // DeepSeekMoE's balancing (models with routed experts; others ignore it).
  struct Moe {
    double bias_update_rate = 1e-3;  // 0 = the correction biases stay fixed
    Choice<BiasUpdate> bias_update = BiasUpdate::sign;
    double seq_aux_loss_coeff = 1e-4;  // 0 = no sequence-wise balance loss
    double aux_loss_coeff = 0;         // 0 = no micro-batch (classic) auxiliary loss
    double capacity_factor = 0;        // 0 = dropless
    bool pad_to_capacity = false;      // with a capacity: every expert's rows padded to it (fixed shapes)
    bool operator==(const Moe&) const = default;
  };
  // Multi-token prediction (models with MTP modules; others ignore it).
  struct Mtp {
    double loss_weight = 0.3;  // lambda of main + lambda / D * sum_k L_k
    int64_t switch_step = 0;   // 0 = loss_weight throughout; else loss_weight_after from this step on
    double loss_weight_after = 0.1;
    bool operator==(const Mtp&) const = default;
  };

  // What happens when training goes wrong (docs/resilience.md; train/resilience.h).
  struct Resilience {
    bool rollback = true;         // restore the last stable state on an anomaly (false: stop there)
    int64_t max_retries = 3;      // rollbacks in a row without a new stable snapshot, then stop
    bool skip_first = true;       // the first rollback in a row only skips the anomalous step's samples
    int64_t snapshot_every = 50;  // in-memory snapshot every this many steps (0 = roll back from disk)
    Choice<SkipData> skip = SkipData::window;  // skip the samples between the restored step and the anomaly
    double lr_factor = 1.0;                    // after a rollback the learning rate is multiplied by this ...
    int64_t lr_steps = 0;                      // ... for this many steps
    Choice<SpikeMetric> spike_metric =
        SpikeMetric::ratio;       // to the window's median; against its mean and std
    double loss_spike = 2.0;      // flag a loss above this (ratio or z-score); 0 = off
    double loss_spike_min = 0.1;  // ... and at least this many nats above the window's median/mean
    double grad_norm_spike = 0;   // the same for the gradient norm; 0 = off
    int64_t window = 50;          // accepted steps the spike statistics look back over
    int64_t spike_after = -1;     // no spike detection up to this step (-1 = train.warmup)
    std::string inject;           // fault injection for drills and tests (also FORGE_FAULT)
    bool operator==(const Resilience&) const = default;
  };
  Model model;
  Data data;
  Train train;
  Eval eval;
  Log log;
  Checkpoint checkpoint;
  Sample sample;
  Parallel parallel;
  Fp8 fp8;
  Moe moe;
  Mtp mtp;
  Resilience resilience;
  std::string source = "<defaults>";  // where the settings came from (the file, or "<defaults>")
  // Where each key ("section.key") got its value: "<file>:<line>" from the TOML, or "--set 'train.lr=-1'";
  // keys left at their defaults have no entry. validate()'s messages start with the culprit's origin.
  // Not a setting: operator== ignores it.
  std::map<std::string, std::string, std::less<>> origins;

  // Keys missing from the file keep their defaults. Errors: forge::Error "<file>:<line>: ...".
  static TrainConfig from_toml_file(const std::filesystem::path& path);
  static TrainConfig from_toml_string(std::string_view text, std::string_view source_name);
  // "section.key=value"; the value is parsed as the key's type (strings may be quoted, bare ones are
  // trimmed).
  void apply_override(std::string_view assignment);
  // Ranges and cross-key rules (lr >= min_lr >= 0, fractions in range, enum values). Call after overrides.
  // Each message starts with the origin of the key at fault (origin_of); a rule between two keys names
  // the other key's origin too when it differs.
  void validate() const;
  // origins' entry for the key, else `source` (a default, or a value set in code).
  std::string origin_of(std::string_view key) const;
  // Every key with a comment, in the order of configs/default.toml; from_toml_string(to_toml()) == *this.
  std::string to_toml() const;

  std::filesystem::path checkpoint_dir() const;
  optim::LrSchedule lr_schedule() const;
  // [parallel]'s sizes for parallel::Layout (dp 0 = derived from the world size). Call after validate().
  parallel::LayoutSpec layout_spec() const;
  // train.freeze as a list of parts (each one of vision, projector, language; validate() checks).
  std::vector<std::string> frozen_parts() const;
  TokenizerSource tokenizer_source() const;
  ResumeMode resume_mode() const;
  // train.dtype resolved: auto is bf16 on a GPU or a CPU with native bf16, else fp32.
  DType gemm_dtype() const;
  // train.activation_dtype resolved (auto: gemm_dtype()). Call after validate().
  DType activation_dtype() const;
  // train.recompute for logs: "none", "full", or "full, first 4 layers of each stage" (recompute_layers).
  std::string recompute_summary() const;
  // train.recompute_modules as nn::ComputeOptions::recompute_modules (0: the default). Call after validate().
  uint32_t recompute_modules() const;
  // The residual stream's dtype: the activation dtype, or fp32 with train.fp32_residual.
  // Call after validate().
  DType residual_dtype() const;
  // [fp8] as the model's FP8 options; std::nullopt when fp8.recipe = "off". Call after validate().
  std::optional<nn::Fp8Options> fp8_options() const;
  // lambda of step `step` (1-based).
  double mtp_loss_weight_at(int64_t step) const {
    return mtp.switch_step > 0 && step >= mtp.switch_step ? mtp.loss_weight_after : mtp.loss_weight;
  }
  int64_t tokens_per_step() const { return train.micro_batch * train.grad_accum * data.seq_len; }

  // Compares the settings, not where they came from.
  bool operator==(const TrainConfig& other) const;
};

}  // namespace forge::train
