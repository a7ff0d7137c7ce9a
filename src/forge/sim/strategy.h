// A parallel strategy as the simulator sees it: the sizes of the layout, the pipeline schedule, the batch
// shape and the memory-saving choices (recompute, ZeRO-1, FP8) of one training run. train/plan.h makes one
// from a run's TrainConfig, so that what `forge plan` predicts is what `forge train` would run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "forge/core/dtype.h"
#include "forge/nn/compute.h"
#include "forge/nn/fp8_context.h"
#include "forge/parallel/context_parallel.h"
#include "forge/parallel/pipeline/schedule.h"

namespace forge::sim {

struct Strategy {
  int tp = 1, pp = 1, dp = 1, ep = 1, vpp = 1;
  int cp = 1;                                                             // context parallel
  parallel::ContextAttention cp_comm = parallel::ContextAttention::ring;  // parallel.cp_comm
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::one_f_one_b;  // parallel.schedule (pp > 1)
  std::string pp_layers;                                                  // parallel.pp_layers ("" = even)
  bool sequence_parallel = false;
  bool distributed_optimizer = false;  // ZeRO-1
  bool optimizer_offload = false;      // train.optimizer_offload: masters and moments in host memory
  bool overlap_grad_reduce = true;
  double bucket_mb = 0;              // parallel.bucket_mb (0: by device, parallel::default_bucket_bytes)
  bool grad_reduce_in_bf16 = false;  // parallel.grad_reduce_in_bf16
  int64_t vocab_divisible_by = 128;
  int64_t micro_batch = 1;  // sequences per micro-batch
  int64_t grad_accum = 1;   // micro-batches per step (per data-parallel replica)
  int64_t seq = 0;
  nn::Recompute recompute = nn::Recompute::none;
  int64_t recompute_layers = 0;          // train.recompute_layers (0: every layer recomputes per `recompute`)
  uint32_t recompute_modules = 0;        // train.recompute_modules (nn::RecomputeModule mask; 0: the default)
  DType dtype = DType::bf16;             // GEMM operands: bf16 | f32
  DType activation_dtype = DType::bf16;  // train.activation_dtype resolved (bf16 needs bf16 GEMMs)
  bool fp32_residual = false;            // train.fp32_residual
  std::optional<nn::Fp8Options> fp8;
  std::string fp8_recipe = "off";  // its name, for tables
  // Mixture-of-experts layers: moe.capacity_factor (0: dropless), moe.pad_to_capacity, parallel.ep_overlap.
  double moe_capacity_factor = 0;
  bool moe_pad_to_capacity = false;
  bool ep_overlap = true;

  int world() const { return tp * cp * pp * dp; }
  int64_t global_batch() const { return micro_batch * grad_accum * dp; }
  int64_t tokens_per_step() const { return global_batch() * seq; }
  // "tp2 pp2 dp2 1f1b mb2x8 rc:none zero sp fp8:delayed"
  std::string describe() const;
  // The --set options that train with it: "--set parallel.tp=2 --set parallel.pp=2 ...".
  std::string set_line() const;
};

}  // namespace forge::sim
