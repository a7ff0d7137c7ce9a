#include "forge/train/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <variant>
#include <vector>

#include "forge/core/cpu_features.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"
#include "forge/train/faults.h"

namespace forge::train {
using namespace forge::optim;
namespace {

// One table drives parsing, overrides, validation of choices and to_toml(), so a key added here is
// readable, overridable and documented at once.
using FieldRef = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, ChoiceField*>;

struct KeySpec {
  std::string_view section;
  std::string_view key;
  FieldRef (*field)(TrainConfig&);
  std::string_view comment;
  std::vector<std::string_view> choices;  // allowed values of a string key; empty = any (a Choice: its names)

  std::string full_name() const { return fmt::format("{}.{}", section, key); }
};

// train.threads' upper bound: far above any machine's cores, below what OpenMP runtimes survive.
constexpr int64_t kMaxThreads = 4096;

#define FORGE_FIELD(member) +[](TrainConfig& c) -> FieldRef { return &c.member; }

const std::vector<KeySpec>& key_specs() {
  static const std::vector<KeySpec> specs = {
      {"model", "config", FORGE_FIELD(model.config), "Hugging Face config.json with the architecture", {}},
      {"model",
       "init_from",
       FORGE_FIELD(model.init_from),
       "\"\" = random init; else a Hugging Face folder or forge checkpoint whose weights (and config) to "
       "start from",
       {}},
      {"model", "init_std", FORGE_FIELD(model.init_std), "std of the normal initialisation of weights", {}},
      {"model", "seed", FORGE_FIELD(model.seed), "parameter initialisation seed", {}},

      {"data",
       "corpus",
       FORGE_FIELD(data.corpus),
       "\"kjv\" (King James Bible) or a path to a UTF-8 text file",
       {}},
      {"data",
       "tokenizer",
       FORGE_FIELD(data.tokenizer),
       "\"train\" (byte-level BPE learnt on the training split, cached), \"bytes\" (token = byte), or a "
       "tokenizer.json",
       {}},
      {"data",
       "vocab_size",
       FORGE_FIELD(data.vocab_size),
       "BPE vocabulary size when tokenizer = \"train\"",
       {}},
      {"data",
       "dataset",
       FORGE_FIELD(data.dataset),
       "\"\" = train on the corpus; else Megatron indexed datasets: \"PREFIX\" or a blend \"0.7 PREFIX_A 0.3 "
       "PREFIX_B\"",
       {}},
      {"data",
       "split",
       FORGE_FIELD(data.split),
       "with data.dataset: train,valid,test weights over each dataset's documents (valid is held out)",
       {}},
      {"data",
       "order",
       FORGE_FIELD(data.order),
       "with data.dataset: documents and samples shuffled from model.seed, or read in order",
       {}},
      {"data",
       "heldout_fraction",
       FORGE_FIELD(data.heldout_fraction),
       "fraction of the corpus held out for evaluation: the tail (cut at a line) of each of "
       "data.heldout_parts "
       "equal parts",
       {}},
      {"data",
       "heldout_parts",
       FORGE_FIELD(data.heldout_parts),
       "equal parts of the corpus whose tails make up the held-out text, spread over it as a random split "
       "would be (1 = the corpus's tail alone)",
       {}},
      {"data", "seq_len", FORGE_FIELD(data.seq_len), "tokens per training sequence", {}},
      {"data", "cache_dir", FORGE_FIELD(data.cache_dir), "where the default corpus is cached", {}},
      {"data",
       "images",
       FORGE_FIELD(data.images),
       "image-text data for a multimodal model: a JSONL of captions or conversations beside its images, or a "
       "packed file from forge data preprocess-images (\"\" = text data)",
       {}},
      {"data",
       "heldout_images",
       FORGE_FIELD(data.heldout_images),
       "held-out image-text data (\"\" = the last data.heldout_fraction of data.images' samples)",
       {}},
      {"data",
       "image_processor",
       FORGE_FIELD(data.image_processor),
       "the image processor's preprocessor_config.json (\"\" = the one beside data.images)",
       {}},
      {"data",
       "skip_bad_samples",
       FORGE_FIELD(data.skip_bad_samples),
       "image-text and SFT data: skip (and count) lines that are malformed, name a missing or undecodable "
       "image, or whose image tokens do not fit in seq_len (false: the first such line is an error)",
       {}},
      {"data",
       "sft",
       FORGE_FIELD(data.sft),
       "supervised fine-tuning: a JSONL of conversations (messages, or ShareGPT's conversations) rendered "
       "with "
       "the chat template, one per sequence (\"\" = pretraining data)",
       {}},
      {"data",
       "heldout_sft",
       FORGE_FIELD(data.heldout_sft),
       "held-out conversations (\"\" = the last data.heldout_fraction of data.sft's)",
       {}},
      {"data",
       "chat_template",
       FORGE_FIELD(data.chat_template),
       "with data.sft: a folder (chat_template.jinja or tokenizer_config.json), a tokenizer_config.json or a "
       ".jinja file (\"\" = the folder of data.tokenizer)",
       {}},
      {"data",
       "sft_loss",
       FORGE_FIELD(data.sft_loss),
       "with data.sft: the loss on the assistant's tokens, or on every token",
       {}},
      {"data",
       "sft_pack",
       FORGE_FIELD(data.sft_pack),
       "with data.sft: pack several conversations into each sequence, each attending only to itself with its "
       "positions restarting (false: one conversation per sequence, padded)",
       {}},
      {"data",
       "document_mask",
       FORGE_FIELD(data.document_mask),
       "pretraining data: attend within documents only, a document ending at each end-of-sequence token of "
       "data.tokenizer, positions restarting after it (Megatron's reset_attention_mask and "
       "reset_position_ids)",
       {}},

      {"train", "micro_batch", FORGE_FIELD(train.micro_batch), "sequences per micro-batch", {}},
      {"train", "grad_accum", FORGE_FIELD(train.grad_accum), "micro-batches per optimizer step", {}},
      {"train",
       "steps",
       FORGE_FIELD(train.steps),
       "optimizer steps (0 = as many as fit in max_minutes, planned from the speed of the first steps)",
       {}},
      {"train",
       "max_minutes",
       FORGE_FIELD(train.max_minutes),
       "stop training after this many minutes, then evaluate and sample (0 = no limit)",
       {}},
      {"train", "lr", FORGE_FIELD(train.lr), "peak learning rate", {}},
      {"train", "min_lr", FORGE_FIELD(train.min_lr), "learning rate at the end of the decay", {}},
      {"train", "warmup", FORGE_FIELD(train.warmup), "linear warmup steps", {}},
      {"train", "schedule", FORGE_FIELD(train.schedule), "learning-rate schedule after warmup", {}},
      {"train",
       "wsd_decay_fraction",
       FORGE_FIELD(train.wsd_decay_fraction),
       "wsd: final fraction of the steps that decays linearly to min_lr",
       {}},
      {"train", "weight_decay", FORGE_FIELD(train.weight_decay), "AdamW decoupled weight decay", {}},
      {"train",
       "hidden_dropout",
       FORGE_FIELD(train.hidden_dropout),
       "dropout probability on the embeddings and on each decoder layer's attention and feed-forward outputs "
       "before they join the residual stream (Megatron's hidden dropout; training steps only, the same masks "
       "under every parallel layout; 0 = off)",
       {}},
      {"train", "beta1", FORGE_FIELD(train.beta1), "AdamW first-moment decay", {}},
      {"train", "beta2", FORGE_FIELD(train.beta2), "AdamW second-moment decay", {}},
      {"train", "eps", FORGE_FIELD(train.eps), "AdamW epsilon", {}},
      {"train",
       "grad_clip",
       FORGE_FIELD(train.grad_clip),
       "clip the global gradient norm to this (0 = off)",
       {}},
      {"train",
       "device",
       FORGE_FIELD(train.device),
       "where the model trains: cpu, or cuda (one GPU per process: mpirun -np <GPUs> for tensor and data "
       "parallelism)",
       {}},
      {"train",
       "dtype",
       FORGE_FIELD(train.dtype),
       "GEMM dtype (master weights are always fp32); auto = bf16 where the CPU has native bf16 dot products, "
       "else fp32",
       {}},
      {"train",
       "activation_dtype",
       FORGE_FIELD(train.activation_dtype),
       "activations in the compute dtype where their kernels take it (docs/performance.md); auto = the GEMM "
       "dtype, fp32 = keep them fp32 under bf16 GEMMs",
       {}},
      {"train",
       "fp32_residual",
       FORGE_FIELD(train.fp32_residual),
       "with bf16 activations, keep the residual stream between layers (and the pipeline's messages) in fp32 "
       "(Megatron's fp32_residual_connection)",
       {}},
      {"train", "recompute", FORGE_FIELD(train.recompute), "activation recomputation", {}},
      {"train",
       "recompute_layers",
       FORGE_FIELD(train.recompute_layers),
       "recompute only the first this many layers of each pipeline stage (each chunk of an interleaved or V "
       "schedule), the rest keeping their activations: Megatron's block recompute (0 = every layer)",
       {}},
      {"train",
       "recompute_modules",
       FORGE_FIELD(train.recompute_modules),
       "with recompute = selective, what to drop and recompute in backward, comma-separated: core_attn, "
       "mlp_act, moe_act, norm (the norms' outputs the GEMMs keep), mla_up_proj (MLA's q, k, v) (\"\" = "
       "core_attn,mlp_act,moe_act)",
       {}},
      {"train",
       "optimizer_offload",
       FORGE_FIELD(train.optimizer_offload),
       "on a GPU, keep the fp32 master weights and both Adam moments in host memory and update there "
       "(Megatron's optimizer CPU offload): the device keeps bf16 weights and fp32 gradients, 12 bytes per "
       "parameter fewer; each step copies the gradients down and the weights back (needs train.dtype = bf16)",
       {}},
      {"train",
       "freeze",
       FORGE_FIELD(train.freeze),
       "parts of a multimodal model that do not train, comma-separated: vision, projector, language (\"\" = "
       "all train; LLaVA's first stage trains the projector alone: \"vision,language\")",
       {}},
      {"train",
       "threads",
       FORGE_FIELD(train.threads),
       "CPU threads per rank (0 = OMP_NUM_THREADS, else cores / ranks on the node)",
       {}},
      {"train",
       "memory_limit_mb",
       FORGE_FIELD(train.memory_limit_mb),
       "cap on each rank's tensor memory in MiB, as a device's capacity (0 = none; cpu): a step that needs "
       "more ends with an out-of-memory line",
       {}},

      {"parallel",
       "tp",
       FORGE_FIELD(parallel.tp),
       "tensor-parallel ranks (split heads, FFN and vocabulary)",
       {}},
      {"parallel",
       "pp",
       FORGE_FIELD(parallel.pp),
       "pipeline-parallel ranks (split the layers into stages)",
       {}},
      {"parallel",
       "schedule",
       FORGE_FIELD(parallel.schedule),
       "with pp > 1: the pipeline schedule (forge plan schedule shows each)",
       {}},
      {"parallel",
       "vpp",
       FORGE_FIELD(parallel.vpp),
       "schedule interleaved: model chunks per pipeline rank",
       {}},
      {"parallel",
       "pp_layers",
       FORGE_FIELD(parallel.pp_layers),
       "decoder layers per pipeline stage, e.g. \"3,5,5,3\" (\"\" = even split)",
       {}},
      {"parallel",
       "dp",
       FORGE_FIELD(parallel.dp),
       "data-parallel replicas (0 = derived: world size / (tp * pp * cp))",
       {}},
      {"parallel", "cp", FORGE_FIELD(parallel.cp), "context-parallel ranks (split the sequence)", {}},
      {"parallel",
       "cp_comm",
       FORGE_FIELD(parallel.cp_comm),
       "with cp > 1: attention across the group; p2p = keys and values passed around a ring, a2a = heads "
       "scattered and sequences gathered (Ulysses)",
       {}},
      {"parallel",
       "ep",
       FORGE_FIELD(parallel.ep),
       "expert-parallel ranks, carved from dp x cp (must divide it)",
       {}},
      {"parallel",
       "ep_overlap",
       FORGE_FIELD(parallel.ep_overlap),
       "with ep > 1: the shared experts compute while tokens travel, and overlapped pairs (DualPipe's, or "
       "without pipeline stages the forward of each micro-batch beside the backward of the one before) "
       "interleave their two micro-batches at the all-to-alls (false: wait where each transfer starts)",
       {}},
      {"parallel",
       "sequence_parallel",
       FORGE_FIELD(parallel.sequence_parallel),
       "with tp > 1: split norms and residuals along the sequence across the tp ranks",
       {}},
      {"parallel",
       "distributed_optimizer",
       FORGE_FIELD(parallel.distributed_optimizer),
       "Megatron's distributed optimizer: shard the Adam state, and under bf16 the fp32 master weights, over "
       "dp (reduce-scatter grads, all-gather weights)",
       {}},
      {"parallel",
       "overlap_grad_reduce",
       FORGE_FIELD(parallel.overlap_grad_reduce),
       "reduce gradient buckets during the backward pass",
       {}},
      {"parallel",
       "bucket_mb",
       FORGE_FIELD(parallel.bucket_mb),
       "gradient-reduction bucket size in MiB (0 = by device: 4 on CPUs, max(40M, 1M x dp) fp32 elements on "
       "GPUs as Megatron)",
       {}},
      {"parallel",
       "grad_reduce_in_bf16",
       FORGE_FIELD(parallel.grad_reduce_in_bf16),
       "reduce gradients over data-parallel ranks in bf16 (half the bytes; Megatron's grad_reduce_in_bf16): "
       "each bucket rounded once after the local fp32 accumulation, widened back",
       {}},
      {"parallel",
       "make_vocab_size_divisible_by",
       FORGE_FIELD(parallel.make_vocab_size_divisible_by),
       "with tp > 1: pad the vocabulary to a multiple of this x tp",
       {}},
      {"parallel",
       "timeout_s",
       FORGE_FIELD(parallel.timeout_s),
       "abort the job when a collective waits longer than this (0 = wait forever)",
       {}},

      {"fp8",
       "recipe",
       FORGE_FIELD(fp8.recipe),
       "FP8 GEMMs in the transformer layers' Linears (docs/fp8.md); delayed = amax history, current = own "
       "amax, block = 1x128 / 128x128 tiles",
       {}},
      {"fp8",
       "format",
       FORGE_FIELD(fp8.format),
       "FP8 formats: hybrid = E4M3 forward, E5M2 gradients; auto = hybrid, or e4m3 for the block recipe",
       {}},
      {"fp8", "amax_history_len", FORGE_FIELD(fp8.amax_history_len), "delayed: steps of amax history", {}},
      {"fp8", "amax_compute", FORGE_FIELD(fp8.amax_compute), "delayed: the amax a scale comes from", {}},
      {"fp8", "margin", FORGE_FIELD(fp8.margin), "delayed, current: scale = fp8_max / amax / 2^margin", {}},
      {"fp8",
       "power_of_two_scales",
       FORGE_FIELD(fp8.power_of_two_scales),
       "block: round each tile's scale down to a power of two",
       {}},
      {"fp8",
       "bf16_first_layers",
       FORGE_FIELD(fp8.bf16_first_layers),
       "keep the first this many layers out of FP8",
       {}},
      {"fp8",
       "bf16_last_layers",
       FORGE_FIELD(fp8.bf16_last_layers),
       "keep the last this many layers out of FP8",
       {}},
      {"fp8",
       "vision",
       FORGE_FIELD(fp8.vision),
       "multimodal models: the vision encoder's layers and the projector run the recipe too (the patch "
       "embedding stays in the GEMM dtype; false = all of the encoder and projector do)",
       {}},
      {"fp8",
       "save_fp8_inputs",
       FORGE_FIELD(fp8.save_fp8_inputs),
       "keep Linear inputs for backward as FP8 (1 byte) rather than in the GEMM dtype",
       {}},
      {"fp8",
       "accumulator_bits",
       FORGE_FIELD(fp8.accumulator_bits),
       "emulate an FP8 tensor core's accumulator of this many mantissa bits (0 = exact fp32; H100 ~ 14)",
       {}},
      {"fp8",
       "promote_every",
       FORGE_FIELD(fp8.promote_every),
       "with accumulator_bits: K elements between promotions to fp32",
       {}},
      {"fp8",
       "forward_fast_accumulation",
       FORGE_FIELD(fp8.forward_fast_accumulation),
       "delayed, current: forward GEMMs accumulate without promotion to fp32 (Hopper's fast accumulation, as "
       "TransformerEngine); gradient GEMMs always promote",
       {}},

      {"moe",
       "bias_update_rate",
       FORGE_FIELD(moe.bias_update_rate),
       "auxiliary-loss-free balancing: after each optimizer step every MoE layer's routing bias moves by "
       "this towards balance, from the expert loads of the global batch (0 = fixed biases)",
       {}},
      {"moe",
       "bias_update",
       FORGE_FIELD(moe.bias_update),
       "sign: bias += rate * sign(mean load - load) (DeepSeek-V3); zero_mean: the same updates less their "
       "mean",
       {}},
      {"moe",
       "seq_aux_loss_coeff",
       FORGE_FIELD(moe.seq_aux_loss_coeff),
       "alpha of the sequence-wise balance loss alpha * sum_i f_i P_i, averaged over sequences and added per "
       "MoE layer (0 = off)",
       {}},
      {"moe",
       "aux_loss_coeff",
       FORGE_FIELD(moe.aux_loss_coeff),
       "alpha of the classic (GShard / Switch) auxiliary loss alpha * sum_i f_i P_i over each micro-batch's "
       "tokens together, averaged over micro-batches and added per MoE layer (0 = off)",
       {}},
      {"moe",
       "capacity_factor",
       FORGE_FIELD(moe.capacity_factor),
       "each expert takes at most ceil(tokens * top_k / experts * this) assignments per micro-batch, the "
       "rest dropped (training and evaluation; generation never drops; 0 = dropless)",
       {}},
      {"moe",
       "pad_to_capacity",
       FORGE_FIELD(moe.pad_to_capacity),
       "with a capacity_factor: every expert's rows padded to its capacity with zero rows, so the expert "
       "GEMMs "
       "and the expert-parallel all-to-alls keep one shape (same results, more work)",
       {}},

      {"mtp",
       "loss_weight",
       FORGE_FIELD(mtp.loss_weight),
       "multi-token prediction: the loss is main + lambda / D * (sum of the D depths' losses), lambda = this",
       {}},
      {"mtp",
       "switch_step",
       FORGE_FIELD(mtp.switch_step),
       "from this step on lambda = loss_weight_after (0 = loss_weight throughout; DeepSeek-V3 went from 0.3 "
       "to 0.1)",
       {}},
      {"mtp", "loss_weight_after", FORGE_FIELD(mtp.loss_weight_after), "lambda from switch_step on", {}},

      {"eval", "every", FORGE_FIELD(eval.every), "evaluate every this many steps (0 = only at the end)", {}},
      {"eval", "batches", FORGE_FIELD(eval.batches), "held-out micro-batches per evaluation", {}},

      {"log", "every", FORGE_FIELD(log.every), "print and record metrics every this many steps", {}},
      {"log", "run_dir", FORGE_FIELD(log.run_dir), "metrics.jsonl, config.toml and checkpoints go here", {}},
      {"log",
       "peak_gflops",
       FORGE_FIELD(log.peak_gflops),
       "peak GEMM GFLOP/s of this machine for MFU (0 = measure at start)",
       {}},
      {"log",
       "profile_step",
       FORGE_FIELD(log.profile_step),
       "time every op of this step and print where its time went; the table also goes to "
       "<run_dir>/profile.json, and with pp > 1 the step's pipeline timeline to "
       "<run_dir>/pipeline_trace.json "
       "(0 = off)",
       {}},
      {"log",
       "hardware_profile",
       FORGE_FIELD(log.hardware_profile),
       "a hardware profile (forge plan calibrate's file, or h100, h200, a100, b200): print the simulator's "
       "prediction of memory per device and step time at start, and at the end how the run compared "
       "(\"\" = off; docs/simulator.md)",
       {}},
      {"log",
       "report",
       FORGE_FIELD(log.report),
       "write <run_dir>/report.html at the end of the run: loss, learning rate, throughput and memory "
       "curves, "
       "the op profile, the pipeline timeline and expert loads on one page (forge report; docs/report.md)",
       {}},
      {"log",
       "expert_load_every",
       FORGE_FIELD(log.expert_load_every),
       "models with routed experts: every expert's load per MoE layer goes into the metrics of the logged "
       "steps divisible by this, and of the last (the report's heat map; 0 = only the last)",
       {}},

      {"checkpoint",
       "every",
       FORGE_FIELD(checkpoint.every),
       "save every this many steps (0 = only at the end and on Ctrl-C)",
       {}},
      {"checkpoint",
       "dir",
       FORGE_FIELD(checkpoint.dir),
       "checkpoint directory (\"\" = <run_dir>/checkpoint)",
       {}},
      {"checkpoint",
       "resume",
       FORGE_FIELD(checkpoint.resume),
       "\"\" = fresh run, \"auto\" = continue from the newest complete checkpoint in dir (fresh if none), or "
       "a "
       "checkpoint path",
       {}},
      {"checkpoint",
       "keep_last",
       FORGE_FIELD(checkpoint.keep_last),
       "checkpoints kept in dir, the newest included (0 = all); older ones are deleted after each save",
       {}},
      {"checkpoint",
       "overwrite",
       FORGE_FIELD(checkpoint.overwrite),
       "let a fresh run (or one resumed from elsewhere) replace the checkpoints already in dir; without it "
       "such a "
       "run is refused",
       {}},
      {"checkpoint",
       "async",
       FORGE_FIELD(checkpoint.async),
       "periodic saves are written in the background: the step blocks only while the state is copied to "
       "host memory (final and Ctrl-C saves are synchronous)",
       {}},

      {"resilience",
       "rollback",
       FORGE_FIELD(resilience.rollback),
       "on an anomaly (NaN or Inf, a loss or gradient-norm spike, an exception in a step on one process) "
       "restore the last stable state and continue (false: stop there)",
       {}},
      {"resilience",
       "max_retries",
       FORGE_FIELD(resilience.max_retries),
       "rollbacks in a row (without a new stable snapshot in between) before the run stops",
       {}},
      {"resilience",
       "skip_first",
       FORGE_FIELD(resilience.skip_first),
       "the first rollback in a row keeps the state as it is (the anomalous step's update was never applied) "
       "and only skips that step's samples; a snapshot is restored only if the anomaly comes back (false: "
       "always restore)",
       {}},
      {"resilience",
       "snapshot_every",
       FORGE_FIELD(resilience.snapshot_every),
       "keep an in-memory snapshot of the state every this many steps, the rollback target (0 = none: roll "
       "back to the newest valid checkpoint on disk)",
       {}},
      {"resilience",
       "skip",
       FORGE_FIELD(resilience.skip),
       "after a rollback: window = skip the samples of the steps from the restored state to the anomaly, "
       "none = train on them again",
       {}},
      {"resilience",
       "lr_factor",
       FORGE_FIELD(resilience.lr_factor),
       "after a rollback multiply the learning rate by this, for lr_steps steps",
       {}},
      {"resilience",
       "lr_steps",
       FORGE_FIELD(resilience.lr_steps),
       "steps the lowered learning rate lasts",
       {}},
      {"resilience",
       "spike_metric",
       FORGE_FIELD(resilience.spike_metric),
       "ratio = a value over the window's median, zscore = standard deviations above the window's mean",
       {}},
      {"resilience",
       "loss_spike",
       FORGE_FIELD(resilience.loss_spike),
       "a step whose loss exceeds this (in spike_metric) is an anomaly (0 = off)",
       {}},
      {"resilience",
       "loss_spike_min",
       FORGE_FIELD(resilience.loss_spike_min),
       "... and only if it is also this many nats above the window's median (ratio) or mean (zscore): a loss "
       "near zero doubles in ordinary noise",
       {}},
      {"resilience",
       "grad_norm_spike",
       FORGE_FIELD(resilience.grad_norm_spike),
       "a step whose gradient norm exceeds this (in spike_metric) is an anomaly (0 = off)",
       {}},
      {"resilience",
       "window",
       FORGE_FIELD(resilience.window),
       "accepted steps the spike statistics look back over (spikes are judged once 10 are in)",
       {}},
      {"resilience",
       "spike_after",
       FORGE_FIELD(resilience.spike_after),
       "no spike detection up to this step (-1 = until the end of train.warmup)",
       {}},
      {"resilience",
       "inject",
       FORGE_FIELD(resilience.inject),
       "faults to inject, for drills and tests (docs/resilience.md), e.g. \"nan_loss step=5 rank=1; kill "
       "step=9\"; the FORGE_FAULT environment variable adds to it",
       {}},

      {"sample", "tokens", FORGE_FIELD(sample.tokens), "tokens to generate after training (0 = none)", {}},
      {"sample", "prompt", FORGE_FIELD(sample.prompt), "text the sample continues", {}},
      {"sample", "temperature", FORGE_FIELD(sample.temperature), "softmax temperature (0 = greedy)", {}},
      {"sample", "top_k", FORGE_FIELD(sample.top_k), "sample among the k most likely tokens (0 = all)", {}},
      {"sample", "seed", FORGE_FIELD(sample.seed), "sampling seed", {}},
      {"sample",
       "captions",
       FORGE_FIELD(sample.captions),
       "image-text data: after training, answer this many held-out samples greedily and count the answers "
       "equal to their reference, token for token (0 = none)",
       {}},
      {"sample",
       "answers",
       FORGE_FIELD(sample.answers),
       "fine-tuning data (data.sft): after training, answer the first assistant turn of this many held-out "
       "conversations greedily and count the answers equal to their reference, token for token (0 = none)",
       {}},
  };
  return specs;
}

#undef FORGE_FIELD

std::vector<std::string_view> section_names() {
  std::vector<std::string_view> names;
  for (const KeySpec& spec : key_specs())
    if (std::find(names.begin(), names.end(), spec.section) == names.end()) names.push_back(spec.section);
  return names;
}

const KeySpec* find_key(std::string_view section, std::string_view key) {
  for (const KeySpec& spec : key_specs())
    if (spec.section == section && spec.key == key) return &spec;
  return nullptr;
}

std::string did_you_mean(std::string_view name, const std::vector<std::string>& candidates) {
  return forge::did_you_mean(name, std::vector<std::string_view>(candidates.begin(), candidates.end()));
}

std::vector<std::string> keys_of_section(std::string_view section) {
  std::vector<std::string> keys;
  for (const KeySpec& spec : key_specs())
    if (spec.section == section) keys.emplace_back(spec.key);
  return keys;
}

std::vector<std::string> all_full_names() {
  std::vector<std::string> names;
  for (const KeySpec& spec : key_specs()) names.push_back(spec.full_name());
  return names;
}

std::string location(std::string_view source, const toml::source_region& region) {
  if (region.begin.line == 0) return std::string(source);
  return fmt::format("{}:{}", source, region.begin.line);
}

std::string_view toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    default:
      return "date/time";
  }
}

void check_choice(const KeySpec& spec, const std::vector<std::string_view>& choices, std::string_view value,
                  std::string_view where) {
  if (choices.empty() || std::find(choices.begin(), choices.end(), value) != choices.end()) return;
  std::string allowed;
  for (std::string_view choice : choices)
    allowed += fmt::format("{}'{}'", allowed.empty() ? "" : ", ", choice);
  fail("{}: {} must be one of {}, got '{}'", where, spec.full_name(), allowed, value);
}

// A Choice key takes a name of its enum.
void set_choice(const KeySpec& spec, ChoiceField& field, std::string_view value, std::string_view where) {
  check_choice(spec, field.names(), value, where);
  field.set(value);
}

void assign_from_toml(TrainConfig& config, const KeySpec& spec, const toml::node& node,
                      std::string_view where) {
  auto type_error = [&](std::string_view expected) {
    fail("{}: {} must be {}, got {}", where, spec.full_name(), expected, toml_type_name(node));
  };
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) type_error("a string");
          *field = node.as_string()->get();
          check_choice(spec, spec.choices, *field, where);
        } else if constexpr (std::is_same_v<T, ChoiceField>) {
          if (!node.is_string()) type_error("a string");
          set_choice(spec, *field, node.as_string()->get(), where);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) type_error("a boolean (true or false)");
          *field = node.as_boolean()->get();
        } else if constexpr (std::is_same_v<T, double>) {
          if (node.is_floating_point())
            *field = node.as_floating_point()->get();
          else if (node.is_integer())
            *field = static_cast<double>(node.as_integer()->get());
          else
            type_error("a number");
        } else {
          if (!node.is_integer()) type_error("an integer");
          const int64_t value = node.as_integer()->get();
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (value < 0) fail("{}: {} must be >= 0, got {}", where, spec.full_name(), value);
            *field = static_cast<uint64_t>(value);
          } else {
            *field = value;
          }
        }
      },
      spec.field(config));
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// TOML basic string with the escapes the spec requires.
std::string toml_quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20 || c == 0x7f)
          out += fmt::format("\\u{:04X}", c);
        else
          out += ch;
    }
  }
  return out + "\"";
}

// Shortest text that reads back to the same double, spelled as a TOML float (never as an integer).
std::string toml_float(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

}  // namespace

TrainConfig TrainConfig::from_toml_file(const std::filesystem::path& path) {
  return from_toml_string(read_file(path, "config file"), path.string());
}

TrainConfig TrainConfig::from_toml_string(std::string_view text, std::string_view source_name) {
  toml::table root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    fail("{}:{}:{}: invalid TOML: {}", source_name, e.source().begin.line, e.source().begin.column,
         e.description());
  }
  TrainConfig config;
  config.source = std::string(source_name);
  const std::vector<std::string_view> sections = section_names();
  std::vector<std::string> section_candidates(sections.begin(), sections.end());
  for (auto&& [section_key, section_node] : root) {
    const std::string_view section = section_key.str();
    const std::string where = location(source_name, section_key.source());
    const bool known_section = std::find(sections.begin(), sections.end(), section) != sections.end();
    if (!section_node.is_table()) {
      if (known_section)
        fail("{}: '{}' must be a section ([{}]), got {}", where, section, section,
             toml_type_name(section_node));
      // A key written above every section header: point at the section it belongs to.
      std::string hint;
      for (const KeySpec& spec : key_specs())
        if (spec.key == section) {
          hint = fmt::format("; did you mean '{}' under [{}]?", spec.key, spec.section);
          break;
        }
      if (hint.empty()) hint = did_you_mean(section, all_full_names());
      fail("{}: unknown key '{}' outside any section{}", where, section, hint);
    }
    if (!known_section)
      fail("{}: unknown section [{}]{}", where, section, did_you_mean(section, section_candidates));
    for (auto&& [key, node] : *section_node.as_table()) {
      const std::string key_where = location(source_name, key.source());
      const KeySpec* spec = find_key(section, key.str());
      if (!spec)
        fail("{}: unknown key '{}.{}'{}", key_where, section, key.str(),
             did_you_mean(key.str(), keys_of_section(section)));
      assign_from_toml(config, *spec, node, key_where);
      config.origins[spec->full_name()] = key_where;
    }
  }
  return config;
}

void TrainConfig::apply_override(std::string_view assignment) {
  const std::string where = fmt::format("--set '{}'", assignment);
  const size_t equals = assignment.find('=');
  if (equals == std::string_view::npos) fail("{}: expected section.key=value", where);
  const std::string_view name = trim(assignment.substr(0, equals));
  const std::string_view text = trim(assignment.substr(equals + 1));
  const size_t dot = name.find('.');
  const KeySpec* spec =
      dot == std::string_view::npos ? nullptr : find_key(name.substr(0, dot), name.substr(dot + 1));
  if (!spec) {
    // "lr=..." without its section: name the section(s) it belongs to.
    std::string sections;
    for (const KeySpec& candidate : key_specs())
      if (dot == std::string_view::npos && candidate.key == name)
        sections += fmt::format("{}'{}'", sections.empty() ? "" : " or ", candidate.full_name());
    if (!sections.empty()) fail("{}: unknown key '{}'; did you mean {}?", where, name, sections);
    fail("{}: unknown key '{}'{}", where, name, did_you_mean(name, all_full_names()));
  }

  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, ChoiceField>) {
          std::string_view value = text;
          if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') &&
              value.back() == value.front())
            value = value.substr(1, value.size() - 2);
          if constexpr (std::is_same_v<T, ChoiceField>) {
            set_choice(*spec, *field, value, where);
          } else {
            check_choice(*spec, spec->choices, value, where);
            *field = std::string(value);
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          if (text != "true" && text != "false")
            fail("{}: '{}' is not a boolean (true or false) (for {})", where, text, name);
          *field = text == "true";
        } else if constexpr (std::is_same_v<T, double>) {
          double value = 0;
          auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
          if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
            fail("{}: '{}' is not a finite number (for {})", where, text, name);
          *field = value;
        } else {
          int64_t value = 0;
          auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
          if (text.empty() || ec != std::errc() || end != text.data() + text.size())
            fail("{}: '{}' is not an integer (for {})", where, text, name);
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (value < 0) fail("{}: {} must be >= 0, got {}", where, name, value);
          }
          *field = static_cast<T>(value);
        }
      },
      spec->field(*this));
  origins[spec->full_name()] = where;
}

std::string TrainConfig::origin_of(std::string_view key) const {
  auto it = origins.find(key);
  return it != origins.end() ? it->second : source;
}

std::vector<std::string> TrainConfig::frozen_parts() const {
  std::vector<std::string> parts;
  std::string_view rest = train.freeze;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view part = rest.substr(0, comma);
    while (!part.empty() && part.front() == ' ') part.remove_prefix(1);
    while (!part.empty() && part.back() == ' ') part.remove_suffix(1);
    if (part != "vision" && part != "projector" && part != "language")
      fail("{}: train.freeze names '{}'; the parts are vision, projector and language",
           origin_of("train.freeze"), part);
    if (std::find(parts.begin(), parts.end(), part) == parts.end()) parts.emplace_back(part);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  if (parts.size() == 3)
    fail("{}: train.freeze = \"{}\" freezes every part: nothing would train", origin_of("train.freeze"),
         train.freeze);
  return parts;
}

namespace {

// The rules' shared tools: one key against its rule, and the blame of a rule over several keys.
struct Checks {
  const TrainConfig& c;
  template <typename V>
  void operator()(bool ok, std::string_view key, const V& value, std::string_view rule) const {
    if (!ok) fail("{}: {} must be {}, got {}", c.origin_of(key), key, rule, value);
  }
  // A rule over several keys: the message starts with the origin of the first key (in `keys`' order) that
  // was set, and ends naming each other key's origin where it differs, so both culprits are named.
  struct Blame {
    std::string where, others;
  };
  Blame blame(std::initializer_list<std::string_view> keys) const {
    Blame b;
    auto first =
        std::find_if(keys.begin(), keys.end(), [&](std::string_view k) { return c.origins.count(k); });
    b.where = first != keys.end() ? c.origin_of(*first) : c.source;
    for (std::string_view key : keys) {
      const std::string from = c.origin_of(key);
      if (from != b.where)
        b.others += fmt::format("{}{}: {}", b.others.empty() ? " (" : "; ", key,
                                c.origins.count(key) ? from : std::string("its default"));
    }
    if (!b.others.empty()) b.others += ")";
    return b;
  }
};

bool is_finite(double v) { return std::isfinite(v); }

// model.* and data.*
void check_model_and_data(const TrainConfig& c, const Checks& k) {
  k(!c.model.config.empty(), "model.config", "\"\"", "a path to a config.json");
  k(is_finite(c.model.init_std) && c.model.init_std > 0, "model.init_std", c.model.init_std, "> 0");

  k(!c.data.corpus.empty(), "data.corpus", "\"\"", "\"kjv\" or a path to a text file");
  k(c.data.heldout_fraction > 0 && c.data.heldout_fraction < 1, "data.heldout_fraction",
    c.data.heldout_fraction, "in (0, 1)");
  k(c.data.heldout_parts >= 1 && c.data.heldout_parts <= 100000, "data.heldout_parts", c.data.heldout_parts,
    "in [1, 100000]");
  k(c.data.seq_len > 0, "data.seq_len", c.data.seq_len, "> 0");
  k(!c.data.cache_dir.empty(), "data.cache_dir", "\"\"", "a directory");
  k(!c.data.tokenizer.empty(), "data.tokenizer", "\"\"", "\"train\", \"bytes\" or a tokenizer.json path");
  k(c.data.vocab_size >= 257 && c.data.vocab_size <= (int64_t{1} << 24), "data.vocab_size", c.data.vocab_size,
    "in [257, 16777216] (256 byte tokens, an end-of-text token, then merges)");
}

// train.*
void check_training(const TrainConfig& c, const Checks& k) {
  k(c.train.micro_batch > 0, "train.micro_batch", c.train.micro_batch, "> 0");
  k(c.train.grad_accum > 0, "train.grad_accum", c.train.grad_accum, "> 0");
  if (!(c.train.steps > 0 || (c.train.steps == 0 && c.train.max_minutes > 0))) {
    const Checks::Blame b = k.blame({"train.steps", "train.max_minutes"});
    fail(
        "{}: train.steps must be > 0 (or 0 together with train.max_minutes > 0), got {} with "
        "train.max_minutes = {}{}",
        b.where, c.train.steps, c.train.max_minutes, b.others);
  }
  k(is_finite(c.train.max_minutes) && c.train.max_minutes >= 0, "train.max_minutes", c.train.max_minutes,
    ">= 0 (0 = no limit)");
  if (c.train.activation_dtype == DtypeChoice::bf16 && c.gemm_dtype() != DType::bf16) {
    const Checks::Blame b = k.blame({"train.activation_dtype", "train.dtype"});
    fail("{}: train.activation_dtype = bf16 needs bf16 GEMMs, but train.dtype resolves to fp32{}", b.where,
         b.others);
  }
  k(is_finite(c.train.lr) && c.train.lr > 0, "train.lr", c.train.lr, "> 0");
  k(is_finite(c.train.min_lr) && c.train.min_lr >= 0, "train.min_lr", c.train.min_lr, ">= 0");
  if (c.train.min_lr > c.train.lr) {
    const Checks::Blame b = k.blame({"train.min_lr", "train.lr"});
    fail("{}: train.min_lr ({}) must not exceed train.lr ({}){}", b.where, c.train.min_lr, c.train.lr,
         b.others);
  }
  k(c.train.warmup >= 0, "train.warmup", c.train.warmup, ">= 0");
  k(is_finite(c.train.wsd_decay_fraction) && c.train.wsd_decay_fraction > 0 &&
        c.train.wsd_decay_fraction <= 1,
    "train.wsd_decay_fraction", c.train.wsd_decay_fraction, "in (0, 1]");
  k(is_finite(c.train.weight_decay) && c.train.weight_decay >= 0, "train.weight_decay", c.train.weight_decay,
    ">= 0");
  k(c.train.hidden_dropout >= 0 && c.train.hidden_dropout < 1, "train.hidden_dropout", c.train.hidden_dropout,
    "in [0, 1)");
  k(c.train.beta1 >= 0 && c.train.beta1 < 1, "train.beta1", c.train.beta1, "in [0, 1)");
  k(c.train.beta2 >= 0 && c.train.beta2 < 1, "train.beta2", c.train.beta2, "in [0, 1)");
  k(is_finite(c.train.eps) && c.train.eps > 0, "train.eps", c.train.eps, "> 0");
  k(is_finite(c.train.grad_clip) && c.train.grad_clip >= 0, "train.grad_clip", c.train.grad_clip,
    ">= 0 (0 = off)");
  k(c.train.recompute_layers >= 0, "train.recompute_layers", c.train.recompute_layers,
    ">= 0 (0 = every layer)");
  if (c.train.recompute_layers > 0 && c.train.recompute == nn::Recompute::none) {
    const Checks::Blame b = k.blame({"train.recompute_layers", "train.recompute"});
    fail("{}: train.recompute_layers = {} limits recomputation to some layers, but train.recompute is none{}",
         b.where, c.train.recompute_layers, b.others);
  }
  if (!c.train.recompute_modules.empty()) {
    try {
      (void)nn::recompute_modules_from_names(c.train.recompute_modules);
    } catch (const Error& e) {
      fail("{}: train.recompute_modules = \"{}\": {}", c.origin_of("train.recompute_modules"),
           c.train.recompute_modules, e.what());
    }
    if (c.train.recompute != nn::Recompute::selective) {
      const Checks::Blame b = k.blame({"train.recompute_modules", "train.recompute"});
      fail(
          "{}: train.recompute_modules = \"{}\" chooses what selective recompute drops, but train.recompute "
          "is "
          "{}{}",
          b.where, c.train.recompute_modules, c.train.recompute.name(), b.others);
    }
  }
  // OpenMP's runtime crashes on absurd team sizes (100000 threads segfaults libgomp); the trainer checks the
  // machine's cores.
  k(c.train.threads >= 0 && c.train.threads <= kMaxThreads, "train.threads", c.train.threads,
    fmt::format("in [0, {}] (0 = all cores)", kMaxThreads));
  k(is_finite(c.train.memory_limit_mb) && c.train.memory_limit_mb >= 0, "train.memory_limit_mb",
    c.train.memory_limit_mb, ">= 0 (0 = no limit)");
  if (c.train.optimizer_offload) {
    const Checks::Blame b = k.blame({"train.optimizer_offload", "train.device"});
    if (c.train.device == Device::cpu)
      fail(
          "{}: train.optimizer_offload = true moves a GPU's optimizer state to the host, but train.device = "
          "cpu keeps it there already{}",
          b.where, b.others);
    if (c.gemm_dtype() != DType::bf16)
      fail(
          "{}: train.optimizer_offload = true needs bf16 weights on the device (train.dtype = bf16), not {}: "
          "with fp32 ones the device keeps its fp32 weights",
          c.origin_of("train.optimizer_offload"), dtype_name(c.gemm_dtype()));
  }
  k(c.train.memory_limit_mb == 0 || c.train.device == Device::cpu, "train.memory_limit_mb",
    c.train.memory_limit_mb,
    "0 with train.device = " + std::string(c.train.device.name()) + " (a GPU's own memory is its limit)");
}

// parallel.*
void check_parallelism(const TrainConfig& c, const Checks& k) {
  // The layout holds int sizes; the world size is checked against them when the job starts.
  auto parallel_size = [&](std::string_view key, int64_t value) {
    k(value >= 1, key, value, ">= 1");
    k(value <= std::numeric_limits<int>::max(), key, value, "at most 2147483647");
  };
  parallel_size("parallel.tp", c.parallel.tp);
  parallel_size("parallel.pp", c.parallel.pp);
  parallel_size("parallel.vpp", c.parallel.vpp);
  k(c.parallel.dp >= 0, "parallel.dp", c.parallel.dp, ">= 1 (or 0 = derived from the world size)");
  k(c.parallel.dp <= std::numeric_limits<int>::max(), "parallel.dp", c.parallel.dp, "at most 2147483647");
  parallel_size("parallel.cp", c.parallel.cp);
  parallel_size("parallel.ep", c.parallel.ep);
  k(is_finite(c.parallel.bucket_mb) && c.parallel.bucket_mb >= 0, "parallel.bucket_mb", c.parallel.bucket_mb,
    ">= 0 (0 = by device)");
  k(c.parallel.make_vocab_size_divisible_by >= 1, "parallel.make_vocab_size_divisible_by",
    c.parallel.make_vocab_size_divisible_by, ">= 1");
  k(is_finite(c.parallel.timeout_s) && c.parallel.timeout_s >= 0, "parallel.timeout_s", c.parallel.timeout_s,
    ">= 0 (0 = wait forever)");
}

// fp8.* (the rules themselves live with the options they govern)
void check_fp8(const TrainConfig& c, const Checks& k) {
  if (c.fp8.recipe != Fp8RecipeChoice::off) {
    // The FP8 rules are stated once, with the options they govern (nn::validate and fp8::validate, which
    // fp8_options() runs and whose messages name these keys); here only that the int fields convert.
    for (auto [key, value] : {std::pair<std::string_view, int64_t>{"fp8.margin", c.fp8.margin},
                              {"fp8.accumulator_bits", c.fp8.accumulator_bits}})
      k(value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max(), key, value,
        "within the range of an int");
    try {
      (void)c.fp8_options();
    } catch (const Error& e) {
      // The message names the key(s) at fault; the recipe is what turned their checks on.
      const std::string_view what = e.what();
      std::vector<std::string> named;
      for (const KeySpec& spec : key_specs())
        if (spec.section == "fp8" && spec.key != "recipe" &&
            what.find(spec.full_name()) != std::string_view::npos)
          named.push_back(spec.full_name());
      Checks::Blame b;
      switch (named.size()) {
        case 0:
          b = k.blame({"fp8.recipe"});
          break;
        case 1:
          b = k.blame({named[0], "fp8.recipe"});
          break;
        default:
          b = k.blame({named[0], named[1], "fp8.recipe"});
      }
      fail("{}: {}{}", b.where, what, b.others);
    }
  }
}

// moe.*
void check_moe(const TrainConfig& c, const Checks& k) {
  k(is_finite(c.moe.bias_update_rate) && c.moe.bias_update_rate >= 0, "moe.bias_update_rate",
    c.moe.bias_update_rate, ">= 0 (0 = fixed biases)");
  k(is_finite(c.moe.seq_aux_loss_coeff) && c.moe.seq_aux_loss_coeff >= 0, "moe.seq_aux_loss_coeff",
    c.moe.seq_aux_loss_coeff, ">= 0 (0 = off)");
  k(is_finite(c.moe.aux_loss_coeff) && c.moe.aux_loss_coeff >= 0, "moe.aux_loss_coeff", c.moe.aux_loss_coeff,
    ">= 0 (0 = off)");
  k(is_finite(c.moe.capacity_factor) && c.moe.capacity_factor >= 0, "moe.capacity_factor",
    c.moe.capacity_factor, ">= 0 (0 = dropless)");
  if (c.moe.pad_to_capacity && c.moe.capacity_factor == 0)
    fail(
        "{}: moe.pad_to_capacity = true pads every expert's rows to its capacity, but moe.capacity_factor = "
        "0 "
        "(dropless) sets none; set a capacity_factor or turn the padding off",
        c.origin_of("moe.pad_to_capacity"));
}

// resilience.* and mtp.*
void check_resilience_and_mtp(const TrainConfig& c, const Checks& k) {
  k(c.resilience.max_retries >= 0, "resilience.max_retries", c.resilience.max_retries, ">= 0");
  k(c.resilience.snapshot_every >= 0, "resilience.snapshot_every", c.resilience.snapshot_every,
    ">= 0 (0 = roll back from disk)");
  k(is_finite(c.resilience.lr_factor) && c.resilience.lr_factor > 0 && c.resilience.lr_factor <= 1,
    "resilience.lr_factor", c.resilience.lr_factor, "in (0, 1]");
  k(c.resilience.lr_steps >= 0, "resilience.lr_steps", c.resilience.lr_steps, ">= 0");
  k(is_finite(c.resilience.loss_spike) && c.resilience.loss_spike >= 0, "resilience.loss_spike",
    c.resilience.loss_spike, ">= 0 (0 = off)");
  k(is_finite(c.resilience.loss_spike_min) && c.resilience.loss_spike_min >= 0, "resilience.loss_spike_min",
    c.resilience.loss_spike_min, ">= 0");
  k(is_finite(c.resilience.grad_norm_spike) && c.resilience.grad_norm_spike >= 0,
    "resilience.grad_norm_spike", c.resilience.grad_norm_spike, ">= 0 (0 = off)");
  k(c.resilience.spike_metric != SpikeMetric::ratio || c.resilience.loss_spike == 0 ||
        c.resilience.loss_spike > 1,
    "resilience.loss_spike", c.resilience.loss_spike, "> 1 with spike_metric = ratio (or 0 = off)");
  k(c.resilience.spike_metric != SpikeMetric::ratio || c.resilience.grad_norm_spike == 0 ||
        c.resilience.grad_norm_spike > 1,
    "resilience.grad_norm_spike", c.resilience.grad_norm_spike, "> 1 with spike_metric = ratio (or 0 = off)");
  k(c.resilience.window >= 10, "resilience.window", c.resilience.window, ">= 10");
  (void)FaultPlan::parse(c.resilience.inject, c.origin_of("resilience.inject") + ": resilience.inject");
  k(c.resilience.spike_after >= -1, "resilience.spike_after", c.resilience.spike_after,
    ">= 0 (or -1 = train.warmup)");
  k(is_finite(c.mtp.loss_weight) && c.mtp.loss_weight >= 0, "mtp.loss_weight", c.mtp.loss_weight, ">= 0");
  k(c.mtp.switch_step >= 0, "mtp.switch_step", c.mtp.switch_step, ">= 0 (0 = no switch)");
  k(is_finite(c.mtp.loss_weight_after) && c.mtp.loss_weight_after >= 0, "mtp.loss_weight_after",
    c.mtp.loss_weight_after, ">= 0");
}

// eval.*, log.*, checkpoint.* and sample.*, and the seeds
void check_outputs(const TrainConfig& c, const Checks& k) {
  k(c.eval.every >= 0, "eval.every", c.eval.every, ">= 0 (0 = only at the end)");
  k(c.eval.batches > 0, "eval.batches", c.eval.batches, "> 0");
  k(c.log.every > 0, "log.every", c.log.every, "> 0");
  k(!c.log.run_dir.empty(), "log.run_dir", "\"\"", "a directory");
  k(is_finite(c.log.peak_gflops) && c.log.peak_gflops >= 0, "log.peak_gflops", c.log.peak_gflops,
    ">= 0 (0 = measure)");
  k(c.log.profile_step >= 0, "log.profile_step", c.log.profile_step, ">= 0 (0 = off)");
  k(c.log.expert_load_every >= 0, "log.expert_load_every", c.log.expert_load_every,
    ">= 0 (0 = only the last)");
  k(c.checkpoint.every >= 0, "checkpoint.every", c.checkpoint.every, ">= 0 (0 = only at the end)");
  k(c.checkpoint.keep_last >= 0, "checkpoint.keep_last", c.checkpoint.keep_last, ">= 0 (0 = keep all)");
  k(c.sample.tokens >= 0, "sample.tokens", c.sample.tokens, ">= 0");
  k(is_finite(c.sample.temperature) && c.sample.temperature >= 0, "sample.temperature", c.sample.temperature,
    ">= 0 (0 = greedy)");
  k(c.sample.top_k >= 0, "sample.top_k", c.sample.top_k, ">= 0 (0 = all)");
  k(c.sample.captions >= 0, "sample.captions", c.sample.captions, ">= 0 (0 = none)");
  k(c.sample.answers >= 0, "sample.answers", c.sample.answers, ">= 0 (0 = none)");
  if (c.sample.answers > 0 && c.data.sft.empty()) {
    const Checks::Blame b = k.blame({"sample.answers", "data.sft"});
    fail("{}: sample.answers = {} needs fine-tuning data (data.sft), which is not set{}", b.where,
         c.sample.answers, b.others);
  }
  if (c.sample.captions > 0 && c.data.images.empty()) {
    const Checks::Blame b = k.blame({"sample.captions", "data.images"});
    fail("{}: sample.captions = {} needs image-text data (data.images), which is not set{}", b.where,
         c.sample.captions, b.others);
  }
  k(c.model.seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "model.seed", c.model.seed,
    "a TOML integer (< 2^63)");
  k(c.sample.seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "sample.seed", c.sample.seed,
    "a TOML integer (< 2^63)");
}

// every string key against its allowed values
void check_choices(const TrainConfig& c, const Checks& k) {
  TrainConfig copy = c;  // choices are checked through the table so the allowed list lives in one place
  for (const KeySpec& spec : key_specs()) {
    FieldRef field = spec.field(copy);
    if (auto* text = std::get_if<std::string*>(&field))
      check_choice(spec, spec.choices, **text, c.origin_of(spec.full_name()));
  }
}

}  // namespace

void TrainConfig::validate() const {
  const Checks k{*this};
  frozen_parts();
  check_model_and_data(*this, k);
  check_training(*this, k);
  check_parallelism(*this, k);
  check_fp8(*this, k);
  check_moe(*this, k);
  check_resilience_and_mtp(*this, k);
  check_outputs(*this, k);
  check_choices(*this, k);
}

std::string TrainConfig::to_toml() const {
  TrainConfig copy = *this;  // the field table hands out mutable pointers
  std::string out;
  std::string_view section;
  for (const KeySpec& spec : key_specs()) {
    if (spec.section != section) {
      out += fmt::format("{}[{}]\n", section.empty() ? "" : "\n", spec.section);
      section = spec.section;
    }
    const std::string value = std::visit(
        [](auto* field) -> std::string {
          using T = std::remove_pointer_t<decltype(field)>;
          if constexpr (std::is_same_v<T, std::string>)
            return toml_quote(*field);
          else if constexpr (std::is_same_v<T, ChoiceField>)
            return toml_quote(field->name());
          else if constexpr (std::is_same_v<T, double>)
            return toml_float(*field);
          else if constexpr (std::is_same_v<T, bool>)
            return *field ? "true" : "false";
          else
            return fmt::format("{}", *field);
        },
        spec.field(copy));
    std::string assignment = fmt::format("{} = {}", spec.key, value);
    std::string comment(spec.comment);
    FieldRef field = spec.field(copy);
    auto* choice = std::get_if<ChoiceField*>(&field);
    const std::vector<std::string_view> choices = choice ? (*choice)->names() : spec.choices;
    for (size_t i = 0; i < choices.size(); ++i)
      comment += fmt::format("{}{}", i == 0 ? ": " : " | ", choices[i]);
    out += fmt::format("{:<32} # {}\n", assignment, comment);
  }
  return out;
}

std::filesystem::path TrainConfig::checkpoint_dir() const {
  if (!checkpoint.dir.empty()) return checkpoint.dir;
  return std::filesystem::path(log.run_dir) / "checkpoint";
}

TokenizerSource TrainConfig::tokenizer_source() const {
  if (data.tokenizer == "train") return TokenizerSource::train;
  return data.tokenizer == "bytes" ? TokenizerSource::bytes : TokenizerSource::file;
}

ResumeMode TrainConfig::resume_mode() const {
  if (checkpoint.resume.empty()) return ResumeMode::fresh;
  return checkpoint.resume == "auto" ? ResumeMode::automatic : ResumeMode::path;
}

DType TrainConfig::gemm_dtype() const {
  if (train.dtype == DtypeChoice::automatic)
    return train.device != Device::cpu || cpu_has_native_bf16() ? DType::bf16 : DType::f32;
  return train.dtype == DtypeChoice::bf16 ? DType::bf16 : DType::f32;
}

uint32_t TrainConfig::recompute_modules() const {
  return train.recompute == nn::Recompute::selective
             ? nn::recompute_modules_from_names(train.recompute_modules)
             : 0;
}

std::string TrainConfig::recompute_summary() const {
  std::string out(train.recompute.name());
  if (train.recompute == nn::Recompute::selective && !train.recompute_modules.empty())
    out += fmt::format(" ({})", nn::recompute_modules_names(recompute_modules()));
  if (train.recompute != nn::Recompute::none && train.recompute_layers > 0)
    out += train.recompute_layers == 1
               ? std::string(", first layer of each stage")
               : fmt::format(", first {} layers of each stage", train.recompute_layers);
  return out;
}

DType TrainConfig::activation_dtype() const {
  if (train.activation_dtype == DtypeChoice::automatic) return gemm_dtype();
  return train.activation_dtype == DtypeChoice::bf16 ? DType::bf16 : DType::f32;
}

// FP8 runs too: their casts read bf16 activations as they are.
DType TrainConfig::residual_dtype() const { return train.fp32_residual ? DType::f32 : activation_dtype(); }

LrSchedule TrainConfig::lr_schedule() const {
  LrSchedule schedule;
  schedule.kind = train.schedule;
  schedule.peak_lr = static_cast<float>(train.lr);
  schedule.min_lr = static_cast<float>(train.min_lr);
  schedule.warmup_steps = train.warmup;
  schedule.total_steps = train.steps;
  schedule.decay_fraction = train.wsd_decay_fraction;
  return schedule;
}

parallel::LayoutSpec TrainConfig::layout_spec() const {
  // validate() keeps every size within int; a config used without it still gets a clear error here.
  auto narrow = [](std::string_view key, int64_t value) {
    if (value < 0 || value > std::numeric_limits<int>::max())
      fail("parallel.{} is out of range: {}", key, value);
    return static_cast<int>(value);
  };
  parallel::LayoutSpec spec;
  spec.tp = narrow("tp", parallel.tp);
  spec.pp = narrow("pp", parallel.pp);
  spec.dp = narrow("dp", parallel.dp);
  spec.cp = narrow("cp", parallel.cp);
  spec.ep = narrow("ep", parallel.ep);
  return spec;
}

std::optional<nn::Fp8Options> TrainConfig::fp8_options() const {
  nn::Fp8Options o;
  switch (fp8.recipe) {
    case Fp8RecipeChoice::off:
      return std::nullopt;
    case Fp8RecipeChoice::delayed:
      o.recipe.recipe = fp8::Recipe::delayed;
      break;
    case Fp8RecipeChoice::current:
      o.recipe.recipe = fp8::Recipe::current;
      break;
    case Fp8RecipeChoice::block:
      o.recipe.recipe = fp8::Recipe::block;
      break;
  }
  const bool block = o.recipe.recipe == fp8::Recipe::block;
  switch (fp8.format) {
    case Fp8FormatChoice::automatic:
      o.recipe.format = block ? fp8::Format::e4m3 : fp8::Format::hybrid;
      break;
    case Fp8FormatChoice::hybrid:
      o.recipe.format = fp8::Format::hybrid;
      break;
    case Fp8FormatChoice::e4m3:
      o.recipe.format = fp8::Format::e4m3;
      break;
  }
  o.recipe.amax_history_len = fp8.amax_history_len;
  o.recipe.amax_compute = fp8.amax_compute;
  o.recipe.margin = static_cast<int>(fp8.margin);
  o.recipe.power_of_two_scales = fp8.power_of_two_scales;
  o.bf16_first_layers = fp8.bf16_first_layers;
  o.bf16_last_layers = fp8.bf16_last_layers;
  o.vision = fp8.vision;
  o.save_fp8_inputs = fp8.save_fp8_inputs;
  o.accumulator_bits = static_cast<int>(fp8.accumulator_bits);
  o.promote_every = fp8.promote_every;
  o.forward_fast_accumulation = fp8.forward_fast_accumulation;
  nn::validate(o);
  return o;
}

bool TrainConfig::operator==(const TrainConfig& other) const {
  return model == other.model && data == other.data && train == other.train && eval == other.eval &&
         log == other.log && checkpoint == other.checkpoint && sample == other.sample &&
         parallel == other.parallel && fp8 == other.fp8 && moe == other.moe && mtp == other.mtp &&
         resilience == other.resilience;
}

}  // namespace forge::train
