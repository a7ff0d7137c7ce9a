// TrainState: everything a run's future depends on, in one place. The step counter, the parameters and the
// optimizer state (this rank's owned moments and the update count), the FP8 delayed-scaling histories, the
// data position (samples consumed before a base step, and samples per step since: a resume under another
// batch or world size continues at the exact next sample) and the planned length of a time-budget run.
// Training has no random state of its own: the data order is a function of (seed, sample index).
//
// It can be saved to a checkpoint and loaded from one (any layout loads any other), and snapshotted to host
// memory and restored, bitwise: a restore followed by the same steps gives the same losses and weights as
// the first time (what rollback builds on).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "forge/ckpt/sharded.h"
#include "forge/core/parameters.h"

namespace forge::nn {
class Fp8Context;
}
namespace forge::parallel {
class DistributedAdamW;
}

namespace forge::train {

struct TrainState {
  ParameterStore* params = nullptr;
  parallel::DistributedAdamW* optimizer = nullptr;
  nn::Fp8Context* fp8 = nullptr;  // null without FP8

  int64_t step = 0;  // optimizer steps completed
  // The data position: samples consumed before step base_step, then samples_per_step per step.
  int64_t base_step = 0, base_samples = 0, samples_per_step = 0;
  // Time-budget runs (train.steps = 0): the planned length, and whether it is final yet.
  int64_t total_steps = 0;
  bool plan_frozen = true;
  // After a rollback with resilience.lr_factor < 1: the learning rate is multiplied by lr_scale for the
  // steps before lr_scale_until (1-based step numbers < lr_scale_until).
  double lr_scale = 1.0;
  int64_t lr_scale_until = 0;
  // The loss and gradient norm of the latest accepted steps, oldest first: what spikes are judged against
  // (train/resilience.h).
  std::vector<double> recent_losses, recent_grad_norms;

  double lr_scale_at(int64_t step) const { return step < lr_scale_until ? lr_scale : 1.0; }

  int64_t samples_seen() const { return base_samples + (step - base_step) * samples_per_step; }
  // Index of the first sample of step `s` (0-based; s >= base_step).
  int64_t first_sample_of(int64_t s) const { return base_samples + (s - base_step) * samples_per_step; }

  // ---- Host snapshots (collective over nothing: each rank keeps its own part).
  struct Snapshot {
    int64_t step = 0, base_step = 0, base_samples = 0, samples_per_step = 0, total_steps = 0;
    bool plan_frozen = true;
    double lr_scale = 1.0;
    int64_t lr_scale_until = 0;
    std::vector<double> recent_losses, recent_grad_norms;
    int64_t optimizer_steps = 0;
    std::vector<float> params, exp_avg, exp_avg_sq;
    // With the distributed optimizer's sharded masters: its masters and the bf16 weights.
    std::vector<float> masters;
    std::vector<uint16_t> params_bf16;
    std::vector<float> fp8_history, fp8_scales;
  };
  Snapshot snapshot() const;
  // The same into `s`, reusing its buffers (no allocation after the first).
  void snapshot_into(Snapshot& s) const;
  // Puts everything back as it was at snapshot(); the bf16 shadow and FP8 weight casts follow.
  void restore(const Snapshot& s);
  // Forgets what a refused step recorded beyond its gradients (the FP8 delayed recipe's amaxes of the
  // current step, and its weight casts), so that the state is again exactly that after the last applied
  // step.
  void discard_refused_step();

  // ---- Checkpoints. The pieces of this rank's state to save, and the destinations to load into; after a
  // load, finish_load() applies what was read. The delayed-scaling state is saved per FP8 Linear, under its
  // name ("fp8.<linear>.amax_history" [history_len, 3], "fp8.<linear>.scales" [3]: input, weight,
  // gradient), so that any pipeline layout loads any other; it is the same on every rank holding the Linear
  // after each step's reduction, so one of them writes it: fp8_saves[l] says whether this rank writes Linear
  // l's (empty: world rank 0 writes all of them, as on one stage). The trainer sets it on tensor- and
  // data-parallel rank 0 of every pipeline rank, for a routed expert's Linears under expert parallelism on
  // expert_dp rank 0 of every ep rank, and never for DualPipe's mirrored copies.
  enum class Fp8Format { none, by_linear, whole };  // whole: the single-array format of older checkpoints
  std::vector<char> fp8_saves;
  std::vector<ShardPiece> pieces_to_save(int world_rank);
  // `names`: the checkpoint's tensors (sorted), when given: a Linear whose FP8 state it lacks (one added
  // since, e.g. by fp8.vision) keeps its fresh state and is named in `missing`.
  std::vector<ShardPiece> pieces_to_load(Fp8Format saved, const std::vector<std::string>* names = nullptr,
                                         std::vector<std::string>* missing = nullptr);
  void finish_load(Fp8Format saved);
  void finish_save();
  // What a checkpoint holds of the delayed-scaling state, from its tensor names (sorted).
  static Fp8Format fp8_format_of(const std::vector<std::string>& names);

 private:
  std::vector<float> fp8_history_, fp8_scales_;  // staging of the delayed-scaling state for checkpoints
  std::vector<std::vector<float>> fp8_linear_history_, fp8_linear_scales_;  // per Linear, by_linear
  // Sizes the staging of the delayed-scaling state (filled from it with export_state) and appends its
  // checkpoint pieces in `format` to `pieces` when given.
  void stage_fp8(bool export_state, Fp8Format format, std::vector<ShardPiece>* pieces,
                 const std::vector<std::string>* names = nullptr,
                 std::vector<std::string>* missing = nullptr);
};

}  // namespace forge::train
