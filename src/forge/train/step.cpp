#include "forge/train/step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "forge/core/fibers.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/ops.h"
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

// Whether every gradient this rank holds is finite: the norm sums primary copies only, so a NaN in a
// replicated copy (a tensor-parallel rank's copy of a norm weight) would otherwise be applied unseen.
bool local_gradients_finite(const ParameterStore& params) {
  const Tensor& grads = params.grads();
  if (grads.numel() == 0) return true;
  double sum = 0;
  Tensor device_sum;  // one double (as two floats' bytes) on a device
  if (params.device() != Device::cpu) device_sum = Tensor::zeros({2}, DType::f32, params.device());
  double* total = device_sum.defined() ? static_cast<double*>(device_sum.raw()) : &sum;
  ops::sum_squares_accumulate(grads.f32(), grads.numel(), total, params.device());
  if (device_sum.defined()) std::memcpy(&sum, device_sum.to(Device::cpu).raw(), sizeof(double));
  return std::isfinite(sum);
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

// Expert parallelism's traffic per slot (rows received, rows sent, the tokens' rank spread summed, its
// tokens, its maximum), this rank's, gathered over its ep group ([ep][slots][kExpertTraffic]; empty without
// expert parallelism). Under pp a slot lives on one stage (or on both copies of a mirrored one, which counted
// one direction's micro-batches each): the counts summed, the maximum a maximum.
constexpr int64_t kExpertTraffic = 5;
std::vector<double> gather_expert_traffic(TrainSetup& setup, const std::vector<ExpertLayerView>& views,
                                          int64_t slots) {
  const int ep = setup.layout.ep();
  if (ep <= 1 || slots == 0) return {};
  std::vector<double> traffic(static_cast<size_t>(kExpertTraffic * slots), 0.0);
  for (const ExpertLayerView& v : views) {
    double* at = traffic.data() + kExpertTraffic * v.slot;
    at[0] += static_cast<double>(v.stats->received), at[1] += static_cast<double>(v.stats->sent);
    at[2] += v.stats->rank_spread, at[3] += static_cast<double>(v.stats->spread_tokens);
    at[4] = std::max(at[4], static_cast<double>(v.stats->max_spread));
  }
  if (setup.layout.pp() > 1) {
    std::vector<double> most(static_cast<size_t>(slots));
    for (int64_t slot = 0; slot < slots; ++slot) most[slot] = traffic[kExpertTraffic * slot + 4];
    comm::all_reduce_sum(setup.pp_group(), traffic.data(), kExpertTraffic * slots);
    setup.pp_group().all_reduce(most.data(), slots, comm::Type::f64, comm::ReduceOp::max).wait();
    for (int64_t slot = 0; slot < slots; ++slot) traffic[kExpertTraffic * slot + 4] = most[slot];
  }
  std::vector<double> all(static_cast<size_t>(ep * kExpertTraffic * slots));
  setup.groups.ep->all_gather(traffic.data(), all.data(), kExpertTraffic * slots, comm::Type::f64).wait();
  return all;
}

// The step's expert loads and MTP totals over the global batch, into r; then every MoE layer's bias update
// (collective over the world). Each rank lays out every MoE layer of the model by slot, filled where its
// chunks hold the layer, and sums over pp (the stages hold different layers; DualPipe's two copies of a stage
// saw half of the micro-batches each) and then over dp; tensor-parallel ranks route the same gathered rows
// and so hold the same counts already.
void finish_balancing(TrainSetup& setup, StepResult& r) {
  const TrainConfig& c = setup.config;
  Model& first = *setup.model;
  const int64_t slots = first.expert_layer_count(), experts = first.routed_experts(),
                depth = first.mtp_depth_count();
  if (slots == 0 && depth == 0) return;
  // The classic auxiliary loss's, or Hugging Face's load-balancing loss's (each layer's aux_sum its share).
  const double aux_coefficient =
      c.moe.aux_loss_coeff > 0 ? c.moe.aux_loss_coeff : setup.model_config->training_router_aux_loss_coef();
  const int64_t stride = experts + 5;  // loads, balance sum, sequences, aux sum, micro-batches, dropped
  std::vector<double> sums(static_cast<size_t>(slots * stride + 3 * depth), 0.0);
  std::vector<double> maxes(static_cast<size_t>(2 * slots), 0.0);  // layer index, bias norm
  std::vector<ExpertLayerView> views;
  for (Model* m : setup.chunks())
    for (const ExpertLayerView& v : m->expert_layers()) {
      double* at = sums.data() + v.slot * stride;
      std::copy(v.stats->load.begin(), v.stats->load.end(), at);
      at[experts] = v.stats->balance_sum, at[experts + 1] = static_cast<double>(v.stats->sequences);
      at[experts + 2] = v.stats->aux_sum, at[experts + 3] = static_cast<double>(v.stats->micro_batches);
      at[experts + 4] = static_cast<double>(v.stats->dropped);
      maxes[2 * v.slot] = static_cast<double>(v.layer);
      if (v.bias >= 0) {
        const Tensor bias = m->params().param(v.bias).to(Device::cpu);
        double norm = 0;
        for (int64_t e = 0; e < bias.numel(); ++e) norm += static_cast<double>(bias.f32()[e]) * bias.f32()[e];
        maxes[2 * v.slot + 1] = std::sqrt(norm);
      }
      views.push_back(v);
    }
  // MTP runs on the last stage, each micro-batch once (under DualPipe on whichever copy ended it).
  for (Model* m : setup.chunks()) {
    const std::vector<MtpDepthTotals> totals = m->mtp_totals();
    for (size_t d = 0; d < totals.size(); ++d) {
      double* at = sums.data() + slots * stride + 3 * static_cast<int64_t>(d);
      at[0] += totals[d].loss.sum, at[1] += static_cast<double>(totals[d].loss.tokens);
      at[2] += static_cast<double>(totals[d].top1);
    }
  }
  const int ep = setup.layout.ep();
  const std::vector<double> all_traffic = gather_expert_traffic(setup, views, slots);
  const int64_t n = static_cast<int64_t>(sums.size());
  if (setup.layout.pp() > 1) {
    comm::all_reduce_sum(setup.pp_group(), sums.data(), n);
    if (slots > 0)
      setup.pp_group()
          .all_reduce(maxes.data(), static_cast<int64_t>(maxes.size()), comm::Type::f64, comm::ReduceOp::max)
          .wait();
  }
  if (setup.dp_group().size() > 1) comm::all_reduce_sum(setup.dp_group(), sums.data(), n);

  r.experts.resize(static_cast<size_t>(slots));
  for (int64_t slot = 0; slot < slots; ++slot) {
    const double* at = sums.data() + slot * stride;
    ExpertLayerReport& e = r.experts[static_cast<size_t>(slot)];
    e.layer = static_cast<int64_t>(maxes[2 * slot]), e.bias_norm = maxes[2 * slot + 1];
    e.load.assign(at, at + experts);
    e.balance_loss = at[experts + 1] > 0 ? c.moe.seq_aux_loss_coeff * at[experts] / at[experts + 1] : 0.0;
    e.aux_loss = at[experts + 3] > 0 ? aux_coefficient * at[experts + 2] / at[experts + 3] : 0.0;
    e.dropped = static_cast<int64_t>(at[experts + 4]);
    if (!all_traffic.empty()) {
      double spread = 0, tokens = 0;
      for (int q = 0; q < ep; ++q) {
        const double* t = all_traffic.data() + (q * slots + slot) * kExpertTraffic;
        e.received.push_back(static_cast<int64_t>(t[0]));
        e.sent += static_cast<int64_t>(t[1]);
        spread += t[2], tokens += t[3];
        e.max_ranks_per_token = std::max(e.max_ranks_per_token, static_cast<int64_t>(t[4]));
      }
      e.ranks_per_token = tokens > 0 ? spread / tokens : 0.0;
    }
  }
  r.with_aux_loss = aux_coefficient > 0 && slots > 0;
  r.with_capacity = c.moe.capacity_factor > 0 && slots > 0;
  r.mtp.resize(static_cast<size_t>(depth));
  for (int64_t d = 0; d < depth; ++d) {
    const double* at = sums.data() + slots * stride + 3 * d;
    MtpDepthTotals& t = r.mtp[static_cast<size_t>(d)];
    t.loss.sum = at[0], t.loss.tokens = static_cast<int64_t>(at[1]), t.top1 = static_cast<int64_t>(at[2]);
  }
  // The update every copy of a layer makes alike, from the global loads.
  for (const ExpertLayerView& v : views) v.stats->load = r.experts[static_cast<size_t>(v.slot)].load;
  const bool zero_mean = c.moe.bias_update == BiasUpdate::zero_mean;
  for (Model* m : setup.chunks())
    m->apply_bias_updates(static_cast<float>(c.moe.bias_update_rate), zero_mean);
}

// Delayed scaling: every rank that holds a Linear agrees on its step's amaxes, so all use the same scales
// next step, those one process running the whole batch would use. Collective over the world.
void reduce_step_amaxes(TrainSetup& setup, nn::Fp8Context& fp8) {
  std::span<float> amaxes = fp8.step_amaxes();
  if (amaxes.empty()) return;
  const auto max_over = [](comm::Communicator* group, float* data, int64_t n) {
    if (group->size() > 1 && n > 0) group->all_reduce(data, n, comm::Type::f32, comm::ReduceOp::max).wait();
  };
  // DualPipe: a stage's two copies see one direction's micro-batches each; their Linears take the max of
  // both, stage by stage in increasing order on both ranks of the mirror pair.
  if (setup.mirror)
    for (int c : setup.pipeline->placement.chunks_by_stage(setup.pp_rank)) {
      const auto [first, end] = setup.chunk_fp8_linears[c];
      max_over(setup.mirror.get(), amaxes.data() + 3 * first, 3 * (end - first));
    }
  // The stage's ranks (each pipeline stage holds its own Linears): tensor parallel, then data parallel. Under
  // expert parallelism a routed expert lives on the ranks of one expert_dp group alone, which see every token
  // routed to it, so the whole array goes over expert_dp (a part of dp) and then the dense Linears' slots
  // over ep (dp = ep x expert_dp).
  const parallel::Layout& layout = setup.layout;
  max_over(setup.groups.tp.get(), amaxes.data(), static_cast<int64_t>(amaxes.size()));
  if (layout.ep() == 1) {
    max_over(&setup.dp_group(), amaxes.data(), static_cast<int64_t>(amaxes.size()));
    return;
  }
  max_over(setup.groups.expert_dp.get(), amaxes.data(), static_cast<int64_t>(amaxes.size()));
  std::vector<float> dense;
  for (int l = 0; l < fp8.linears(); ++l)
    if (!fp8.is_expert(l)) dense.insert(dense.end(), amaxes.begin() + 3 * l, amaxes.begin() + 3 * l + 3);
  max_over(setup.groups.ep.get(), dense.data(), static_cast<int64_t>(dense.size()));
  for (int l = 0, at = 0; l < fp8.linears(); ++l)
    if (!fp8.is_expert(l)) std::copy_n(dense.begin() + 3 * at++, 3, amaxes.begin() + 3 * l);
}

}  // namespace

LoadSummary summarize_load(const std::vector<double>& load) {
  LoadSummary s;
  if (load.empty()) return s;
  s.min = *std::min_element(load.begin(), load.end()), s.max = *std::max_element(load.begin(), load.end());
  double sum = 0;
  for (double x : load) sum += x;
  s.mean = sum / static_cast<double>(load.size());
  if (s.mean <= 0) return s;
  double var = 0;
  for (double x : load) var += (x - s.mean) * (x - s.mean);
  s.cv = std::sqrt(var / static_cast<double>(load.size())) / s.mean;
  s.max_violation = (s.max - s.mean) / s.mean;
  return s;
}

BalanceMetrics balance_metrics(const StepResult& r, bool with_loads) {
  BalanceMetrics m;
  nlohmann::json& out = m.fields;
  std::string& summary = m.summary;
  if (!r.experts.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    double worst = 0, cv = 0, balance = 0, aux = 0, bias = 0, assignments = 0;
    int64_t dropped = 0;
    // Dropped over the assignments routed (the loads count them before the drop).
    const auto fraction = [](double drops, double routed) { return routed > 0 ? drops / routed : 0.0; };
    for (const ExpertLayerReport& e : r.experts) {
      const LoadSummary s = summarize_load(e.load);
      const double routed = std::accumulate(e.load.begin(), e.load.end(), 0.0);
      layers.push_back({{"layer", e.layer},
                        {"min", s.min},
                        {"max", s.max},
                        {"cv", s.cv},
                        {"max_violation", s.max_violation},
                        {"bias_norm", e.bias_norm},
                        {"balance_loss", e.balance_loss},
                        {"aux_loss", e.aux_loss},
                        {"dropped", e.dropped},
                        {"dropped_fraction", fraction(static_cast<double>(e.dropped), routed)}});
      if (with_loads) layers.back()["load"] = e.load;
      if (!e.received.empty()) {
        layers.back()["received"] = e.received, layers.back()["sent"] = e.sent;
        layers.back()["ranks_per_token"] = e.ranks_per_token;
        layers.back()["max_ranks_per_token"] = e.max_ranks_per_token;
      }
      worst = std::max(worst, s.max_violation), cv += s.cv, balance += e.balance_loss, aux += e.aux_loss;
      bias = std::max(bias, e.bias_norm), dropped += e.dropped, assignments += routed;
    }
    cv /= static_cast<double>(r.experts.size());
    const double dropped_fraction = fraction(static_cast<double>(dropped), assignments);
    out["moe"] = {{"max_violation", worst},
                  {"cv", cv},
                  {"balance_loss", balance},
                  {"aux_loss", aux},
                  {"bias_norm", bias},
                  {"dropped", dropped},
                  {"dropped_fraction", dropped_fraction},
                  {"layers", layers}};
    summary = fmt::format("maxvio {:.2f} cv {:.2f} bal {:.2e}", worst, cv, balance);
    if (r.with_aux_loss) summary += fmt::format(" aux {:.2e}", aux);
    if (r.with_capacity) summary += fmt::format(" drop {:.1f}%", 100 * dropped_fraction);
  }
  if (!r.mtp.empty()) {
    nlohmann::json depths = nlohmann::json::array();
    std::string losses, top1;
    for (size_t d = 0; d < r.mtp.size(); ++d) {
      const MtpDepthTotals& t = r.mtp[d];
      const double accepted =
          t.loss.tokens > 0 ? static_cast<double>(t.top1) / static_cast<double>(t.loss.tokens) : 0.0;
      depths.push_back({{"depth", d + 1}, {"loss", t.loss.mean()}, {"top1", accepted}});
      losses += fmt::format("{}{:.3f}", d ? "/" : "", t.loss.mean());
      top1 += fmt::format("{}{:.0f}%", d ? "/" : "", 100 * accepted);
    }
    out["mtp"] = depths;
    summary += fmt::format("{}mtp {} top1 {}", summary.empty() ? "" : " | ", losses, top1);
  }
  return m;
}

LossSum NoPipelining::run(Model& model, int count, const std::function<MicroBatch(int)>& micro_batch) {
  LossSum total;
  if (order_ == Order::paired) {
    std::unique_ptr<StageActivations> pending;  // the micro-batch whose backward comes next
    auto forward = [&](int m) {
      std::unique_ptr<StageActivations> saved;
      const StageOutput out = model.forward(micro_batch(m), Tensor(), &saved);
      total.sum += out.loss.sum, total.tokens += out.loss.tokens;
      return saved;
    };
    for (int m = 0; m < count; ++m) {
      if (!pending) {
        pending = forward(m);
        continue;
      }
      std::unique_ptr<StageActivations> next;
      run_interleaved([&] { next = forward(m); }, [&] { model.backward(Tensor(), *pending); });
      pending = std::move(next);
    }
    if (pending) model.backward(Tensor(), *pending);
    return total;
  }
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
      case Order::paired:
        FORGE_CHECK(false, "the paired order runs above");
        break;
    }
  }
  for (auto& saved : deferred) model.backward_weight(*saved);
  return total;
}

namespace {

// One step's micro-batches as this rank reads them, or the error that refused them.
struct StepData {
  std::vector<std::vector<int32_t>> ids, targets;
  std::vector<std::vector<int64_t>> documents;  // packed documents per micro-batch (empty: none)
  std::vector<std::vector<float>> pixels;       // image-text data: each micro-batch's images
  std::vector<int64_t> images;
  std::string error;
};

// Sample order is that of one rank running dp x accum micro-batches: replica d takes the d-th run. Each
// micro-batch has its own ids and targets, which a schedule may still read (the embedding's W) later. They
// are read before anything else, and a failure to read them (a damaged dataset file) is agreed over the
// world: every rank refuses the step together with nothing changed, rather than one rank leaving the others
// waiting inside the step's collectives. Under context parallelism the cp ranks of a replica read the same
// sequences and keep their slices.
StepData read_step_data(TrainSetup& setup, int64_t step, int64_t first_sample, const StepHooks& hooks) {
  const int64_t micro = setup.micro, seq = setup.seq, accum = setup.accum, local_seq = setup.local_seq();
  StepData d;
  d.ids.resize(accum), d.targets.resize(accum), d.pixels.resize(accum), d.images.assign(accum, 0);
  d.documents.resize(accum);
  std::vector<int32_t> whole_ids, whole_targets;
  try {
    for (int64_t m = 0; m < accum; ++m) {
      if (hooks.on_read) hooks.on_read(step, static_cast<int>(m));
      d.ids[m].resize(micro * local_seq), d.targets[m].resize(micro * local_seq);
      whole_ids.resize(micro * seq), whole_targets.resize(micro * seq);
      d.images[m] = setup.data->train_batch_images(first_sample + (setup.dp_rank * accum + m) * micro, micro,
                                                   whole_ids.data(), whole_targets.data(), d.pixels[m]);
      const int64_t first = first_sample + (setup.dp_rank * accum + m) * micro;
      if (setup.config.data.document_mask)
        d.documents[m] = documents_at_eos(whole_ids.data(), micro, seq, *setup.data->codec().eos_id());
      else
        setup.data->train_documents(first, micro, d.documents[m]);
      setup.context_slice(whole_ids.data(), d.ids[m].data(), micro);
      setup.context_slice(whole_targets.data(), d.targets[m].data(), micro);
    }
  } catch (const PermanentError&) {
    throw;  // reading it again would fail the same way: not a data error to skip
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(fmt::format("out of memory reading the step's {} x {} micro-batches of {} tokens",
                                  accum, micro, seq));
  } catch (const std::exception& e) {
    d.error = e.what()[0] ? e.what() : "unknown error";
  }
  comm::Communicator& world = setup.world;
  if (world.size() > 1 && comm::all_reduce_max(world, d.error.empty() ? 0.0 : 1.0) > 0) {
    const std::vector<std::string> errors = comm::all_gather_strings(world, d.error);
    d.error.clear();
    for (size_t r = 0; r < errors.size() && d.error.empty(); ++r)
      if (!errors[r].empty()) d.error = fmt::format("{} (rank {})", errors[r], r);
  }
  return d;
}

// Forward and backward of every micro-batch under the schedule, the gradients reduced over dp; returns this
// rank's loss sum.
LossSum run_micro_batches(TrainSetup& setup, const TrainState& state, Schedule& schedule, StepData& d,
                          int64_t step, int64_t first_sample, const StepHooks& hooks) {
  const TrainConfig& c = setup.config;
  Model& model = *setup.model;
  ParameterStore& params = model.params();
  const int64_t micro = setup.micro, seq = setup.seq, accum = setup.accum, dp = setup.dp;
  const int64_t local_seq = setup.local_seq();
  params.zero_grads();
  params.begin_grad_step(schedule.micro_batches_per_chunk(static_cast<int>(accum)));
  setup.buckets->begin_step();
  if (setup.expert_buckets) setup.expert_buckets->begin_step();
  // Over every token of the step: each cp rank holds seq / cp of each sequence, whose sums add up over dp x
  // cp. Fine-tuning data averages over the step's trained tokens instead (transformers' num_items_in_batch),
  // counted over the world, where every tp and pp rank holds the same tokens as its group.
  double averaged = static_cast<double>(micro * accum * dp * seq);
  if (setup.data->loss_per_trained_token()) {
    double trained = 0;
    for (const std::vector<int32_t>& t : d.targets)
      trained += static_cast<double>(std::count_if(t.begin(), t.end(), [](int32_t x) { return x >= 0; }));
    trained = comm::all_reduce_sum(setup.world, trained) /
              static_cast<double>(setup.layout.tp() * setup.layout.pp());
    averaged = std::max(trained, 1.0);
  }
  const float grad_scale = static_cast<float>(1.0 / averaged);
  TrainStepSettings settings;
  settings.balance_scale =
      static_cast<float>(c.moe.seq_aux_loss_coeff / static_cast<double>(micro * accum * dp));
  settings.aux_loss_scale = static_cast<float>(c.moe.aux_loss_coeff / static_cast<double>(accum * dp));
  settings.micro_batch_weight = static_cast<float>(1.0 / static_cast<double>(accum * dp));
  settings.mtp_weight = static_cast<float>(c.mtp_loss_weight_at(state.step + 1));
  for (Model* m : setup.chunks()) m->begin_train_step(settings);
  // Where each local position sits in its sequence (context parallelism keeps a slice), for dropout's masks.
  std::vector<int32_t> positions;
  if (setup.layout.cp() > 1) {
    std::vector<int32_t> whole(seq);
    std::iota(whole.begin(), whole.end(), 0);
    positions.resize(local_seq);
    setup.context_slice(whole.data(), positions.data(), 1);
  }
  LossSum loss = schedule.run(model, static_cast<int>(accum), [&](int m) {
    if (hooks.on_micro_batch) hooks.on_micro_batch(step, m);
    MicroBatch mb{d.ids[m].data(), d.targets[m].data(), micro,      local_seq,
                  grad_scale,      d.pixels[m].data(),  d.images[m]};
    mb.first_sample = first_sample + (setup.dp_rank * accum + m) * micro;
    mb.positions = positions.empty() ? nullptr : positions.data();
    mb.documents = d.documents[m].empty() ? nullptr : &d.documents[m];
    return mb;
  });
  FORGE_CHECK(!params.grad_step_active(),
              "the schedule left parameters without their last gradient of the step");
  setup.buckets->finish();
  if (setup.expert_buckets) setup.expert_buckets->finish();
  if (hooks.on_gradients) hooks.on_gradients(step, params);
  if (hooks.on_loss) hooks.on_loss(step, loss);
  return loss;
}

// The step's loss over the pipeline's last stage and the replicas (and under cp each rank's part of the
// tokens), and its image count.
void reduce_loss(TrainSetup& setup, LossSum loss, const StepData& d, StepResult& r) {
  if (setup.layout.pp() > 1) {  // the loss lives on the last stage
    double sums[2] = {loss.sum, static_cast<double>(loss.tokens)};
    comm::all_reduce_sum(setup.pp_group(), sums, 2);
    loss.sum = sums[0], loss.tokens = static_cast<int64_t>(sums[1]);
  }
  r.local_loss = loss.mean();
  r.images = std::accumulate(d.images.begin(), d.images.end(), int64_t{0});
  if (setup.dp_group().size() > 1) {
    double sums[3] = {loss.sum, static_cast<double>(loss.tokens), static_cast<double>(r.images)};
    comm::all_reduce_sum(setup.dp_group(), sums, 3);
    loss.sum = sums[0], loss.tokens = static_cast<int64_t>(sums[1]), r.images = static_cast<int64_t>(sums[2]);
  }
  r.loss = loss.mean();
}

}  // namespace

StepResult train_step(TrainSetup& setup, TrainState& state, Schedule& schedule, const StepHooks& hooks) {
  const TrainConfig& c = setup.config;
  ParameterStore& params = setup.model->params();
  comm::Communicator& world = setup.world;
  const int64_t step = state.step + 1, first_sample = state.first_sample_of(state.step);
  StepData data = read_step_data(setup, step, first_sample, hooks);
  if (!data.error.empty()) {
    StepResult refused;
    refused.data_error = data.error;
    return refused;
  }
  const LossSum loss = run_micro_batches(setup, state, schedule, data, step, first_sample, hooks);
  StepResult r;
  reduce_loss(setup, loss, data, r);
  r.grad_norm = setup.optimizer->grad_norm();
  // A non-finite loss or gradient norm (the same on every rank: both are reduced) is never applied: the
  // weights, the optimizer state and the checkpoints stay those of the last good step. Agreed over the world:
  // a rank whose copy alone went bad (replicated gradients are not reduced again for the norm) must not leave
  // the others applying the step without it.
  // A spike is judged on values every rank holds alike; the verdict is agreed all the same, in the same
  // reduction, so that no rank could ever apply a step another refused.
  const bool finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm) && local_gradients_finite(params);
  std::string spike = finite && hooks.judge ? hooks.judge(step, r.loss, r.grad_norm) : std::string();
  double verdict[2] = {finite ? 0.0 : 1.0, spike.empty() ? 0.0 : 1.0};
  if (world.size() > 1) world.all_reduce(verdict, 2, comm::Type::f64, comm::ReduceOp::max).wait();
  if (verdict[0] > 0) {
    r.non_finite = describe_non_finite_step(world, params, r.local_loss, r.loss, r.grad_norm);
    return r;
  }
  if (verdict[1] > 0) {
    r.spike = spike.empty() ? std::string("a spike judged on another rank") : spike;
    return r;
  }
  r.lr = static_cast<float>(setup.schedule.lr_at(state.step) * state.lr_scale_at(step));
  if (hooks.before_update) hooks.before_update();
  setup.optimizer->step(r.lr, clip_coefficient(r.grad_norm, static_cast<float>(c.train.grad_clip)));
  if (nn::Fp8Context* fp8 = setup.fp8.get()) {
    reduce_step_amaxes(setup, *fp8);
    fp8->end_step();
  }
  finish_balancing(setup, r);
  ++state.step;
  r.applied = true;
  return r;
}

}  // namespace forge::train
