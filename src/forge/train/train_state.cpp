#include "forge/train/train_state.h"

#include <algorithm>
#include <cstring>

#include "forge/core/error.h"
#include "forge/core/memory.h"
#include "forge/fp8/scaling.h"
#include "forge/nn/fp8_context.h"
#include "forge/parallel/distributed_optimizer.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::ckpt;
namespace {

// T: float for fp32 tensors, uint16_t for bf16 ones.
template <typename T>
void copy_to_host(const Tensor& t, std::vector<T>& out) {
  out.resize(t.defined() ? static_cast<size_t>(t.numel()) : 0);  // undefined: an offloaded dry run's state
  if (out.empty()) return;
  FORGE_CHECK(t.bytes() == out.size() * sizeof(T), "snapshot of a {} tensor into {}-byte values",
              dtype_name(t.dtype()), sizeof(T));
  if (t.device() == Device::cpu) {
    copy_host_parallel(out.data(), t.raw(), t.bytes());
    return;
  }
  const Tensor host = t.to(Device::cpu);  // a GPU's state is staged to the host
  std::memcpy(out.data(), host.raw(), host.bytes());
}

template <typename T>
void from_host_vector(Tensor dst, const std::vector<T>& v, const char* what) {
  FORGE_CHECK(static_cast<int64_t>(v.size()) == (dst.defined() ? dst.numel() : 0),
              "restoring {}: the snapshot holds {} values, the state {}", what, v.size(), dst.numel());
  if (v.empty()) return;
  Tensor host = Tensor::empty({dst.numel()}, dst.dtype());
  std::memcpy(host.raw(), v.data(), host.bytes());
  dst.copy_from(host);
}

fp8::DelayedScalingGroup* delayed_group(nn::Fp8Context* fp8) { return fp8 ? fp8->delayed_group() : nullptr; }

}  // namespace

TrainState::Snapshot TrainState::snapshot() const {
  Snapshot s;
  snapshot_into(s);
  return s;
}

void TrainState::snapshot_into(Snapshot& s) const {
  s.step = step, s.base_step = base_step, s.base_samples = base_samples,
  s.samples_per_step = samples_per_step;
  s.total_steps = total_steps, s.plan_frozen = plan_frozen;
  s.lr_scale = lr_scale, s.lr_scale_until = lr_scale_until;
  s.recent_losses = recent_losses, s.recent_grad_norms = recent_grad_norms;
  s.optimizer_steps = optimizer->steps_taken();
  copy_to_host(params->params(), s.params);
  // Sharded masters: the optimizer's masters and the bf16 weights (the masters of other ranks' shards
  // behind them are not here) are the rest of the weights.
  s.masters.clear(), s.params_bf16.clear();
  if (optimizer->holds_masters()) {
    copy_to_host(optimizer->masters(), s.masters);
    copy_to_host(params->params_bf16(), s.params_bf16);
  }
  copy_to_host(optimizer->exp_avg(), s.exp_avg);
  copy_to_host(optimizer->exp_avg_sq(), s.exp_avg_sq);
  s.fp8_history.clear(), s.fp8_scales.clear();
  if (const fp8::DelayedScalingGroup* g = delayed_group(fp8)) {
    s.fp8_history.assign(static_cast<size_t>(g->history_len() * g->size()), 0.0f);
    s.fp8_scales.assign(static_cast<size_t>(g->size()), 1.0f);
    g->export_state(s.fp8_history, s.fp8_scales);
  }
}

void TrainState::restore(const Snapshot& s) {
  step = s.step, base_step = s.base_step, base_samples = s.base_samples,
  samples_per_step = s.samples_per_step;
  total_steps = s.total_steps, plan_frozen = s.plan_frozen;
  lr_scale = s.lr_scale, lr_scale_until = s.lr_scale_until;
  recent_losses = s.recent_losses, recent_grad_norms = s.recent_grad_norms;
  optimizer->set_steps_taken(s.optimizer_steps);
  from_host_vector(params->params(), s.params, "the weights");
  if (optimizer->holds_masters()) {
    from_host_vector(optimizer->masters(), s.masters, "the master weights");
    from_host_vector(params->params_bf16(), s.params_bf16, "the bf16 weights");
  }
  from_host_vector(optimizer->exp_avg(), s.exp_avg, "the first moments");
  from_host_vector(optimizer->exp_avg_sq(), s.exp_avg_sq, "the second moments");
  params->refresh_bf16();        // and a new weight version: FP8 weight casts are made again
  if (fp8) fp8->discard_step();  // what a refused step accumulated
  if (fp8::DelayedScalingGroup* g = delayed_group(fp8)) g->import_state(s.fp8_history, s.fp8_scales);
}

void TrainState::discard_refused_step() {
  if (!fp8) return;
  fp8->discard_step();
  params->refresh_bf16();  // a new weight version: the next step casts (and records) the weights again
}

TrainState::Fp8Format TrainState::fp8_format_of(const std::vector<std::string>& names) {
  if (std::binary_search(names.begin(), names.end(), "fp8.amax_history")) return Fp8Format::whole;
  for (const std::string& n : names)
    if (n.starts_with("fp8.") && n.ends_with(".amax_history")) return Fp8Format::by_linear;
  return Fp8Format::none;
}

void TrainState::stage_fp8(bool export_state, Fp8Format format, std::vector<ShardPiece>* pieces,
                           const std::vector<std::string>* names, std::vector<std::string>* missing) {
  const fp8::DelayedScalingGroup* g = delayed_group(fp8);
  const int64_t len = g->history_len(), n = g->size();
  fp8_history_.assign(static_cast<size_t>(len * n), 0.0f);
  fp8_scales_.assign(static_cast<size_t>(n), 1.0f);
  // Loading starts from the current state too: what the checkpoint does not hold stays as it is.
  g->export_state(fp8_history_, fp8_scales_);
  if (!pieces) return;
  if (format == Fp8Format::whole) {
    // Slot s of the arrays is Linear s / 3's role s % 3, in the order this rank registered them: only the
    // layout that wrote them (one stage holding every Linear) reads them back.
    pieces->push_back({"fp8.amax_history", {len, n}, {len, n}, -1, 0, 0, len * n, fp8_history_.data()});
    pieces->push_back({"fp8.scales", {n}, {n}, -1, 0, 0, n, fp8_scales_.data()});
    return;
  }
  const int64_t linears = fp8->linears();
  FORGE_CHECK(n == 3 * linears, "delayed scaling holds {} slots for {} Linears", n, linears);
  fp8_linear_history_.assign(static_cast<size_t>(linears), std::vector<float>(static_cast<size_t>(len * 3)));
  fp8_linear_scales_.assign(static_cast<size_t>(linears), std::vector<float>(3));
  for (int64_t l = 0; l < linears; ++l) {
    const bool skip = export_state && !fp8_saves.empty() && !fp8_saves[static_cast<size_t>(l)];
    std::vector<float>& h = fp8_linear_history_[l];
    std::vector<float>& sc = fp8_linear_scales_[l];
    for (int64_t age = 0; age < len; ++age)
      for (int64_t role = 0; role < 3; ++role) h[age * 3 + role] = fp8_history_[age * n + 3 * l + role];
    for (int64_t role = 0; role < 3; ++role) sc[role] = fp8_scales_[3 * l + role];
    if (skip) continue;
    const std::string& name = fp8->linear_name(static_cast<int>(l));
    if (names && !std::binary_search(names->begin(), names->end(), "fp8." + name + ".amax_history")) {
      if (missing) missing->push_back(name);
      continue;
    }
    pieces->push_back({"fp8." + name + ".amax_history", {len, 3}, {len, 3}, -1, 0, 0, len * 3, h.data()});
    pieces->push_back({"fp8." + name + ".scales", {3}, {3}, -1, 0, 0, 3, sc.data()});
  }
}

// The per-Linear staging back into the arrays import_state takes.
static void unstage_by_linear(const std::vector<std::vector<float>>& history,
                              const std::vector<std::vector<float>>& scales, int64_t len, int64_t n,
                              std::vector<float>& all_history, std::vector<float>& all_scales) {
  for (size_t l = 0; l < history.size(); ++l) {
    for (int64_t age = 0; age < len; ++age)
      for (int64_t role = 0; role < 3; ++role)
        all_history[age * n + 3 * l + role] = history[l][age * 3 + role];
    for (int64_t role = 0; role < 3; ++role) all_scales[3 * l + role] = scales[l][role];
  }
}

// The delayed-scaling state is identical on every rank of a stage after each step's reduction: one of them
// writes it.
std::vector<ShardPiece> TrainState::pieces_to_save(int world_rank) {
  std::vector<ShardPiece> pieces = optimizer->checkpoint_pieces(true);
  if (delayed_group(fp8))
    stage_fp8(/*export_state=*/true, Fp8Format::by_linear,
              world_rank == 0 || !fp8_saves.empty() ? &pieces : nullptr);
  return pieces;
}

void TrainState::finish_save() { optimizer->finish_save(); }

std::vector<ShardPiece> TrainState::pieces_to_load(Fp8Format saved, const std::vector<std::string>* names,
                                                   std::vector<std::string>* missing) {
  // Any layout loads any other: each rank fills its shard of the weights and its owned optimizer state.
  std::vector<ShardPiece> pieces = optimizer->checkpoint_pieces_for_load(true);
  if (delayed_group(fp8) && saved != Fp8Format::none)
    stage_fp8(/*export_state=*/false, saved, &pieces, names, missing);
  return pieces;
}

void TrainState::finish_load(Fp8Format saved) {
  optimizer->finish_load();
  params->refresh_bf16();
  fp8::DelayedScalingGroup* g = delayed_group(fp8);
  if (!g || saved == Fp8Format::none) return;
  if (saved == Fp8Format::by_linear)
    unstage_by_linear(fp8_linear_history_, fp8_linear_scales_, g->history_len(), g->size(), fp8_history_,
                      fp8_scales_);
  g->import_state(fp8_history_, fp8_scales_);
}

}  // namespace forge::train
