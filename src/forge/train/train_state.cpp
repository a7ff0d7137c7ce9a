#include "forge/train/train_state.h"

#include <algorithm>

#include "forge/core/error.h"
#include "forge/fp8/scaling.h"
#include "forge/nn/fp8_context.h"
#include "forge/parallel/distributed_optimizer.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::ckpt;
namespace {

std::vector<float> to_host_vector(const Tensor& t) {
  const Tensor host = t.to(Device::cpu);
  return std::vector<float>(host.f32(), host.f32() + host.numel());
}

void from_host_vector(Tensor dst, const std::vector<float>& v, const char* what) {
  FORGE_CHECK(static_cast<int64_t>(v.size()) == dst.numel(),
              "restoring {}: the snapshot holds {} values, the state {}", what, v.size(), dst.numel());
  Tensor host = Tensor::empty({dst.numel()}, DType::f32);
  std::copy(v.begin(), v.end(), host.f32());
  dst.copy_from(host);
}

fp8::DelayedScalingGroup* delayed_group(nn::Fp8Context* fp8) { return fp8 ? fp8->delayed_group() : nullptr; }

}  // namespace

TrainState::Snapshot TrainState::snapshot() const {
  Snapshot s;
  s.step = step, s.base_step = base_step, s.base_samples = base_samples,
  s.samples_per_step = samples_per_step;
  s.total_steps = total_steps, s.plan_frozen = plan_frozen;
  s.optimizer_steps = optimizer->steps_taken();
  s.params = to_host_vector(params->params());
  s.exp_avg = to_host_vector(optimizer->exp_avg());
  s.exp_avg_sq = to_host_vector(optimizer->exp_avg_sq());
  if (const fp8::DelayedScalingGroup* g = delayed_group(fp8)) {
    s.fp8_history.assign(static_cast<size_t>(g->history_len() * g->size()), 0.0f);
    s.fp8_scales.assign(static_cast<size_t>(g->size()), 1.0f);
    g->export_state(s.fp8_history, s.fp8_scales);
  }
  return s;
}

void TrainState::restore(const Snapshot& s) {
  step = s.step, base_step = s.base_step, base_samples = s.base_samples,
  samples_per_step = s.samples_per_step;
  total_steps = s.total_steps, plan_frozen = s.plan_frozen;
  optimizer->set_steps_taken(s.optimizer_steps);
  from_host_vector(params->params(), s.params, "the weights");
  from_host_vector(optimizer->exp_avg(), s.exp_avg, "the first moments");
  from_host_vector(optimizer->exp_avg_sq(), s.exp_avg_sq, "the second moments");
  params->refresh_bf16();  // and a new weight version: FP8 weight casts are made again
  if (fp8::DelayedScalingGroup* g = delayed_group(fp8)) g->import_state(s.fp8_history, s.fp8_scales);
}

void TrainState::stage_fp8(bool export_state, std::vector<ShardPiece>* pieces) {
  const fp8::DelayedScalingGroup* g = delayed_group(fp8);
  const int64_t len = g->history_len(), n = g->size();
  fp8_history_.assign(static_cast<size_t>(len * n), 0.0f);
  fp8_scales_.assign(static_cast<size_t>(n), 1.0f);
  if (export_state) g->export_state(fp8_history_, fp8_scales_);
  if (!pieces) return;
  pieces->push_back({"fp8.amax_history", {len, n}, {len, n}, -1, 0, 0, len * n, fp8_history_.data()});
  pieces->push_back({"fp8.scales", {n}, {n}, -1, 0, 0, n, fp8_scales_.data()});
}

// The delayed-scaling state is identical on every rank after each step's reduction: rank 0 writes it.
std::vector<ShardPiece> TrainState::pieces_to_save(int world_rank) {
  std::vector<ShardPiece> pieces = optimizer->checkpoint_pieces(true);
  if (delayed_group(fp8)) {
    stage_fp8(/*export_state=*/true, world_rank == 0 ? &pieces : nullptr);
  }
  return pieces;
}

void TrainState::finish_save() { optimizer->finish_save(); }

std::vector<ShardPiece> TrainState::pieces_to_load(bool with_fp8) {
  // Any layout loads any other: each rank fills its shard of the weights and its owned optimizer state.
  std::vector<ShardPiece> pieces = optimizer->checkpoint_pieces_for_load(true);
  if (delayed_group(fp8) && with_fp8) {
    stage_fp8(/*export_state=*/false, &pieces);
  }
  return pieces;
}

void TrainState::finish_load(bool with_fp8) {
  optimizer->finish_load();
  params->refresh_bf16();
  if (fp8::DelayedScalingGroup* g = delayed_group(fp8); g && with_fp8)
    g->import_state(fp8_history_, fp8_scales_);
}

}  // namespace forge::train
