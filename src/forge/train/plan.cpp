#include "forge/train/plan.h"

#include "forge/core/error.h"

namespace forge::train {

sim::Strategy strategy_of(const TrainConfig& c, int world_size) {
  sim::Strategy s;
  const parallel::LayoutSpec l = c.layout_spec();
  s.tp = l.tp, s.pp = l.pp, s.ep = l.ep, s.cp = l.cp;
  s.cp_comm = c.parallel.cp_comm;
  s.dp = l.dp > 0 ? l.dp : world_size / std::max(1, l.tp * l.pp * l.cp);
  if (s.dp < 1 || s.world() != world_size)
    fail(
        "{} ranks do not split into parallel.tp = {} x parallel.cp = {} x parallel.pp = {} x parallel.dp = "
        "{}",
        world_size, s.tp, s.cp, s.pp, l.dp);
  s.vpp = static_cast<int>(c.parallel.vpp);
  s.schedule = c.parallel.schedule;
  s.pp_layers = c.parallel.pp_layers;
  s.sequence_parallel = c.parallel.sequence_parallel;
  s.distributed_optimizer = c.parallel.distributed_optimizer;
  s.optimizer_offload = c.train.optimizer_offload;
  s.overlap_grad_reduce = c.parallel.overlap_grad_reduce;
  s.bucket_mb = c.parallel.bucket_mb;
  s.grad_reduce_in_bf16 = c.parallel.grad_reduce_in_bf16;
  s.vocab_divisible_by = c.parallel.make_vocab_size_divisible_by;
  s.micro_batch = c.train.micro_batch, s.grad_accum = c.train.grad_accum, s.seq = c.data.seq_len;
  s.recompute = c.train.recompute;
  s.recompute_layers = c.train.recompute_layers;
  s.recompute_modules = c.recompute_modules();
  s.dtype = c.gemm_dtype();
  s.activation_dtype = c.activation_dtype();
  s.fp32_residual = c.train.fp32_residual;
  s.fp8 = c.fp8_options();
  s.fp8_recipe = c.fp8.recipe.name();
  s.moe_capacity_factor = c.moe.capacity_factor, s.moe_pad_to_capacity = c.moe.pad_to_capacity;
  s.ep_overlap = c.parallel.ep_overlap;
  return s;
}

}  // namespace forge::train
