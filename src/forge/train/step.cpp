#include "forge/train/step.h"

#include <algorithm>
#include <cmath>

#include "forge/fp8/scaling.h"
#include "forge/optim/adamw.h"

namespace forge::train {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
namespace {

// The first parameter whose gradient holds a non-finite value on this rank ("" if none).
std::string first_non_finite_gradient(const ParameterStore& params) {
  const Tensor host = params.device() == Device::cpu ? params.grads() : params.grads().to(Device::cpu);
  const float* g = host.f32();
  for (const ParamInfo& info : params.infos()) {
    const int64_t n = shape_numel(info.shape);
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(g[info.offset + i])) return fmt::format("'{}' ({})", info.name, g[info.offset + i]);
  }
  return "";
}

// What went wrong in a step whose loss or gradient norm is not finite, and on which ranks (collective).
std::string describe_non_finite_step(comm::Communicator& world, const ParameterStore& params,
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
  std::string what = !std::isfinite(loss) ? fmt::format("the training loss is {}", loss)
                     : !std::isfinite(grad_norm)
                         ? fmt::format("the gradient norm is {} (loss {:.4f})", grad_norm, loss)
                         : std::string("a rank's gradients are not finite");
  return where.empty() ? what : fmt::format("{} ({})", what, where);
}

}  // namespace

LossSum NoPipelining::run(Model& model, int count, const std::function<MicroBatch(int)>& micro_batch) {
  LossSum total;
  std::vector<std::unique_ptr<StageActivations>> deferred;
  for (int m = 0; m < count; ++m) {
    std::unique_ptr<StageActivations> saved;
    const StageOutput out = model.forward(micro_batch(m), Tensor(), &saved);
    total.sum += out.loss.sum, total.tokens += out.loss.tokens;
    switch (order_) {
      case Order::fused:
        model.backward(Tensor(), *saved);
        break;
      case Order::b_then_w:
        model.backward_input(Tensor(), *saved);
        model.backward_weight(*saved);
        break;
      case Order::deferred_w:
        model.backward_input(Tensor(), *saved);
        deferred.push_back(std::move(saved));
        break;
    }
  }
  for (auto& saved : deferred) model.backward_weight(*saved);
  return total;
}

StepResult train_step(TrainSetup& setup, TrainState& state, Schedule& schedule,
                      const std::function<void(int64_t, ParameterStore&)>& on_gradients) {
  const TrainConfig& c = setup.config;
  Model& model = *setup.model;
  ParameterStore& params = model.params();
  const int64_t micro = setup.micro, seq = setup.seq, accum = setup.accum, dp = setup.dp;
  params.zero_grads();
  params.begin_grad_step(schedule.micro_batches_per_chunk(static_cast<int>(accum)));
  setup.buckets->begin_step();
  // Sample order is that of one rank running dp x accum micro-batches: replica d takes the d-th run. Each
  // micro-batch has its own ids and targets, which a schedule may still read (the embedding's W) later.
  const int64_t first_sample = state.first_sample_of(state.step);
  std::vector<std::vector<int32_t>> ids(accum), targets(accum);
  const float grad_scale = 1.0f / static_cast<float>(micro * accum * dp * seq);
  LossSum loss = schedule.run(model, static_cast<int>(accum), [&](int m) {
    ids[m].resize(micro * seq), targets[m].resize(micro * seq);
    setup.data->train_batch(first_sample + (setup.dp_rank * accum + m) * micro, micro, ids[m].data(),
                            targets[m].data());
    return MicroBatch{ids[m].data(), targets[m].data(), micro, seq, grad_scale};
  });
  FORGE_CHECK(!params.grad_step_active(),
              "the schedule left parameters without their last gradient of the step");
  setup.buckets->finish();
  if (on_gradients) on_gradients(state.step + 1, params);

  StepResult r;
  if (setup.layout.pp() > 1) {  // the loss lives on the last stage
    double sums[2] = {loss.sum, static_cast<double>(loss.tokens)};
    comm::all_reduce_sum(setup.pp_group(), sums, 2);
    loss.sum = sums[0], loss.tokens = static_cast<int64_t>(sums[1]);
  }
  r.local_loss = loss.mean();
  if (dp > 1) {
    double sums[2] = {loss.sum, static_cast<double>(loss.tokens)};
    comm::all_reduce_sum(setup.dp_group(), sums, 2);
    loss.sum = sums[0], loss.tokens = static_cast<int64_t>(sums[1]);
  }
  r.loss = loss.mean();
  r.grad_norm = setup.optimizer->grad_norm();
  // A non-finite loss or gradient norm (the same on every rank: both are reduced) is never applied: the
  // weights, the optimizer state and the checkpoints stay those of the last good step. Agreed over the world:
  // a rank whose copy alone went bad (replicated gradients are not reduced again for the norm) must not leave
  // the others applying the step without it.
  comm::Communicator& world = setup.world;
  bool non_finite = !std::isfinite(r.loss) || !std::isfinite(r.grad_norm);
  if (world.size() > 1) non_finite = comm::all_reduce_max(world, non_finite ? 1.0 : 0.0) > 0;
  if (non_finite) {
    r.non_finite = describe_non_finite_step(world, params, r.local_loss, r.loss, r.grad_norm);
    return r;
  }
  r.lr = setup.schedule.lr_at(state.step);
  setup.optimizer->step(r.lr, clip_coefficient(r.grad_norm, static_cast<float>(c.train.grad_clip)));
  if (nn::Fp8Context* fp8 = setup.fp8.get()) {
    // Delayed scaling: every rank (tensor- and data-parallel) agrees on the step's amaxes, so all use the
    // same scales next step, those one process running the whole batch would use.
    std::span<float> amaxes = fp8->step_amaxes();
    // Under pipeline parallelism each stage's ranks hold other Linears than the other stages': the
    // reduction runs over the ranks of this stage (tp, then dp) instead of the world.
    // DualPipe: a stage's two copies see one direction's micro-batches each; their Linears take the max of
    // both, stage by stage in increasing order on both ranks of the mirror pair.
    if (setup.mirror && !amaxes.empty()) {
      for (int c : setup.pipeline->placement.chunks_by_stage(setup.pp_rank)) {
        const auto [first, end] = setup.chunk_fp8_linears[c];
        if (end > first)
          setup.mirror
              ->all_reduce(amaxes.data() + 3 * first, 3 * (end - first), comm::Type::f32, comm::ReduceOp::max)
              .wait();
      }
    }
    std::vector<comm::Communicator*> over{&world};
    if (setup.layout.pp() > 1) over = {setup.groups.tp.get(), &setup.dp_group()};
    for (comm::Communicator* group : over)
      if (!amaxes.empty() && group->size() > 1)
        group
            ->all_reduce(amaxes.data(), static_cast<int64_t>(amaxes.size()), comm::Type::f32,
                         comm::ReduceOp::max)
            .wait();
    fp8->end_step();
  }
  ++state.step;
  r.applied = true;
  return r;
}

}  // namespace forge::train
