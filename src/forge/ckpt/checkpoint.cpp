// The single-process checkpoint API on the sharded format: a one-rank world ("self" communicator) whose
// pieces are the store's whole tensors. Manifest reading (read_checkpoint_manifest, checkpoint_exists)
// lives with the format in sharded.cpp.
#include "forge/ckpt/checkpoint.h"

#include <algorithm>

#include "forge/ckpt/sharded.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"

namespace forge::ckpt {

void save_checkpoint(const std::string& dir, const ParameterStore& params, const OptimizerMoments* optimizer,
                     const CheckpointState& state) {
  CheckpointState saved = state;
  saved.optimizer_steps = optimizer ? optimizer->steps : -1;
  const auto self = comm::make_self();
  save_sharded_checkpoint(dir, *self, parameter_store_pieces(params, optimizer, /*for_saving=*/true), saved);
}

CheckpointState load_checkpoint(const std::string& dir, ParameterStore& params, OptimizerMoments* optimizer) {
  // Said up front: otherwise the first missing moment would be the error.
  if (optimizer) {
    const std::vector<std::string> names = checkpoint_tensor_names(dir);
    if (std::none_of(names.begin(), names.end(),
                     [](const std::string& n) { return n.starts_with("exp_avg."); }))
      fail("checkpoint {} holds no optimizer state", dir);
  }
  const auto self = comm::make_self();
  CheckpointState state =
      load_sharded_checkpoint(dir, *self, parameter_store_pieces(params, optimizer, /*for_saving=*/false));
  params.refresh_bf16();
  // A save that did not record AdamW's count took one optimizer step per training step.
  if (optimizer) optimizer->steps = state.optimizer_steps >= 0 ? state.optimizer_steps : state.step;
  return state;
}

}  // namespace forge::ckpt
