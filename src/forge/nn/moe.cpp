#include "forge/nn/moe.h"

#include <algorithm>
#include <cmath>

#include "forge/core/error.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {
namespace {

// A GEMM operand of one tensor in the GEMM dtype (no FP8 parts).
GemmOperand operand_of(Tensor data) {
  GemmOperand op;
  op.data = std::move(data);
  return op;
}

// The router's outputs read back to the host (small: tokens x experts), for the balance losses' sums over
// token groups that span ranks or layers.
struct HostRouting {
  Tensor scores, score_sums, ids;
  explicit HostRouting(const Moe::Saved& s)
      : scores(s.scores.to(Device::cpu)),
        score_sums(s.score_sums.to(Device::cpu)),
        ids(s.expert_ids.to(Device::cpu)) {}
  // Over rows [first, first + tokens), padding left out: at[e] += the assignments to expert e, at[E + e] +=
  // the sum of s / n over the rows, at[2 E] += the rows.
  void add_sums(const std::vector<char>& padded, int64_t experts, int64_t k, int64_t first, int64_t tokens,
                double* at) const {
    const float* s = scores.f32();
    const float* n = score_sums.f32();
    const int32_t* e_ids = ids.i32();
    for (int64_t t = first; t < first + tokens; ++t) {
      if (!padded.empty() && padded[t]) continue;
      for (int64_t e = 0; e < experts; ++e) at[experts + e] += s[t * experts + e] / n[t];
      for (int64_t j = 0; j < k; ++j) at[e_ids[t * k + j]] += 1;
      at[2 * experts] += 1;
    }
  }
};

}  // namespace

Moe::Moe(ParameterStore* store, MoeParams params, MoeShape shape, ComputeOptions options, MoeStats* stats,
         const MoeStepScale* scale, int64_t router_aux_slot)
    : store_(store),
      params_(params),
      shape_(shape),
      options_(options),
      stats_(stats),
      scale_(scale),
      router_aux_slot_(router_aux_slot),
      act_dtype_(options.part_dtype()) {
  FORGE_CHECK(shape.experts > 0 && shape.top_k > 0 && shape.expert_ffn > 0 && shape.hidden > 0,
              "Moe: bad shape experts={} top_k={} expert_ffn={} hidden={}", shape.experts, shape.top_k,
              shape.expert_ffn, shape.hidden);
  if (shape.experts % options.ep_size() != 0)
    fail("{} routed experts do not split over parallel.ep = {} ranks", shape.experts, options.ep_size());
  // The router's GEMM and the correction bias (moved outside the optimizer) are fp32.
  store->keep_fp32(params.router);
  if (params.bias >= 0) store->keep_fp32(params.bias);
  const int64_t local = local_experts();
  if (options.fp8) {  // registered with the FP8 context in a fixed order: every gate|up, then every down
    fp8_gate_up_.reserve(static_cast<size_t>(local));
    fp8_down_.reserve(static_cast<size_t>(local));
    for (int64_t e = 0; e < local; ++e) {
      const int gate = params.first_gate_up + 2 * static_cast<int>(e);
      fp8_gate_up_.emplace_back(store, std::vector<int>{gate, gate + 1}, shape.hidden, options);
    }
    for (int64_t e = 0; e < local; ++e)
      fp8_down_.emplace_back(store, std::vector<int>{params.first_down + static_cast<int>(e)},
                             shape.expert_ffn, options);
  }
  if (params.shared.gate >= 0)
    shared_ = std::make_unique<Mlp>(store, params.shared, shape.hidden, shape.shared_ffn, options);
  if (stats_ && stats_->load.empty()) stats_->reset(shape.experts);
}

Tensor Moe::weights(DType dtype, int first, int count, int64_t cols) const {
  if (dtype == DType::bf16) {
    FORGE_CHECK(store_->has_bf16(), "bf16 GEMM requested but the model keeps no bf16 weights");
    return store_->span(store_->params_bf16(), first, count, cols);
  }
  return store_->fp32_span(first, count, cols);
}

// C [rows, n] = A_g [rows_g, k] @ op(W_g) per local expert, W_g the g-th of `count / experts`-parameter
// blocks from `first` (stored [n, k]; trans_b = false reads it as [k, n], the input gradient's dx = dy W_g).
Tensor Moe::grouped(const GemmOperand& a, int64_t rows, int first, int count, int64_t n, int64_t k,
                    bool trans_b, const std::vector<int64_t>& offsets, DType out_dtype) const {
  Tensor c = Tensor::empty({rows, n}, out_dtype, options_.device);
  if (rows == 0) return c;
  const Tensor w = weights(a.data.dtype(), first, count, trans_b ? k : n);
  ops::GroupedGemmParams p;
  p.groups = local_experts(), p.offsets = offsets.data(), p.n = n, p.k = k;
  p.a = a.data.raw(), p.lda = k, p.b = w.raw(), p.ldb = trans_b ? k : n, p.trans_b = trans_b;
  p.b_group_stride = n * k, p.ab_dtype = a.data.dtype(), p.c = c.raw(), p.c_dtype = out_dtype, p.ldc = n;
  ops::m_grouped_gemm(p, options_.device);
  return c;
}

// dW_g [m, n] += dy_g^T x_g per local expert, over the gradient blocks from `first`.
void Moe::grouped_weight_grad(const GemmOperand& dy, const GemmOperand& x, int first, int count, int64_t m,
                              int64_t n, const std::vector<int64_t>& offsets) const {
  if (offsets.back() > 0) {
    const Tensor dw = store_->span(store_->grads(), first, count, n);
    ops::GroupedGemmParams p;
    p.groups = local_experts(), p.offsets = offsets.data(), p.m = m, p.n = n;
    p.a = dy.data.raw(), p.lda = m, p.b = x.data.raw(), p.ldb = n, p.ab_dtype = dy.data.dtype();
    p.c = dw.f32(), p.ldc = n, p.c_group_stride = m * n, p.beta = 1.0f;
    ops::k_grouped_gemm(p, options_.device);
  }
  for (int id = first; id < first + count; ++id) store_->note_grad(id);
}

// silu(gate) * up of the sorted rows [R, 2 ffn], in gate_up's dtype.
Tensor Moe::swiglu(const Tensor& gate_up) const {
  const int64_t rows = gate_up.numel() / (2 * shape_.expert_ffn);
  Tensor act = Tensor::empty({rows, shape_.expert_ffn}, gate_up.dtype(), options_.device);
  if (rows > 0) {
    ops::SwigluParams sw;
    sw.rows = rows, sw.ffn = shape_.expert_ffn, sw.dtype = gate_up.dtype(), sw.gate_up = gate_up.raw(),
    sw.out = act.raw();
    ops::swiglu_forward(sw, options_.device);
  }
  return act;
}

// The same as the down GEMMs read it (not FP8).
GemmOperand Moe::activation(const Tensor& gate_up) const {
  return operand_of(to_gemm_dtype(swiglu(gate_up), options_.gemm_dtype));
}

template <typename Op>
Tensor Moe::per_expert(const Tensor& in, int64_t in_cols, int64_t out_cols,
                       const std::vector<int64_t>& offsets, Op op) const {
  Tensor out;
  if (out_cols > 0) out = Tensor::empty({offsets.back(), out_cols}, act_dtype_, options_.device);
  for (int64_t e = 0; e < local_experts(); ++e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
    if (rows == 0) continue;
    op(e, in.view(begin * in_cols, {rows, in_cols}),
       out_cols > 0 ? out.view(begin * out_cols, {rows, out_cols}) : Tensor());
  }
  return out;
}

// FP8: the down Linears' input operands from gate_up (forward: each expert's output into ys, returned;
// recompute in backward: the operands alone, as the weight gradient reads them).
Tensor Moe::fp8_down_forward(Saved& s, bool forward) const {
  const Tensor act = swiglu(s.gate_up);
  s.expert_act.assign(static_cast<size_t>(local_experts()), GemmOperand{});
  return per_expert(act, shape_.expert_ffn, forward ? shape_.hidden : 0, s.plan.local_offsets,
                    [&](int64_t e, const Tensor& a, const Tensor& y) {
                      const Linear& down = fp8_down_[static_cast<size_t>(e)];
                      GemmOperand& op = s.expert_act[static_cast<size_t>(e)];
                      op = down.input(a);
                      if (forward)
                        down.forward(op, y, y.dtype());
                      else
                        down.keep_for_backward(op);
                    });
}

template <typename Overlapped>
Tensor Moe::routed_forward(const Tensor& h, int64_t seq, Saved& s, bool training, DType out_dtype,
                           Overlapped overlapped) const {
  const Device device = options_.device;
  const int64_t hidden = shape_.hidden, experts = shape_.experts, k = shape_.top_k, ffn = shape_.expert_ffn;
  const int64_t local = local_experts();
  const int64_t rows = h.numel() / hidden;

  // Router logits in fp32 (the scores decide the routing; bf16 would flip near-ties), from h widened to fp32
  // when it is bf16 (as Hugging Face's DeepSeek-V3 router reads a bf16 model's hidden states).
  Tensor logits = Tensor::empty({rows, experts}, DType::f32, device);
  if (rows > 0) {
    const Tensor h32 = to_dtype(h, DType::f32);
    ops::GemmParams g;
    g.m = rows, g.n = experts, g.k = hidden, g.a = h32.f32(), g.lda = hidden;
    g.b = store_->param(params_.router).f32(), g.ldb = hidden, g.trans_b = true, g.c = logits.f32(),
    g.ldc = experts;
    ops::gemm(g, device);
  }
  s.h = h;
  s.expert_ids = Tensor::empty({rows, k}, DType::i32, device);
  s.weights = Tensor::empty({rows, k}, DType::f32, device);
  s.scores = Tensor::empty({rows, experts}, DType::f32, device);
  ops::MoeRouterParams r;
  r.tokens = rows, r.experts = experts, r.top_k = k, r.groups = shape_.groups,
  r.topk_groups = shape_.topk_groups;
  r.score = shape_.score, r.normalize = shape_.normalize, r.scaling = shape_.scaling, r.logits = logits.f32();
  r.bias = params_.bias >= 0 ? store_->param(params_.bias).f32() : nullptr;
  r.expert_ids = s.expert_ids.i32(), r.weights = s.weights.f32(), r.scores = s.scores.f32();
  // The balance loss per sequence: its gradient when it has a coefficient, its value for the statistics. The
  // auxiliary loss over the whole micro-batch (every rank of a tp group routes the same gathered rows): only
  // when it has a coefficient.
  const bool balance = training && seq > 0 && rows % seq == 0 && (stats_ || (scale_ && scale_->balance != 0));
  // Hugging Face's load-balancing loss: with its record (a training forward; evaluation keeps none).
  const bool router_aux =
      training && rows > 0 && scale_ && router_aux_slot_ >= 0 && s.router_aux && scale_->router_aux != 0;
  FORGE_CHECK(!router_aux || scale_->aux == 0,
              "Moe: the classic auxiliary loss and Hugging Face's load-balancing loss are both on");
  const bool aux = router_aux || (training && rows > 0 && scale_ && scale_->aux != 0);
  Tensor losses, aux_loss;
  if (balance || aux) s.score_sums = Tensor::empty({rows}, DType::f32, device);
  if (balance) {
    s.fraction = Tensor::empty({rows / seq, experts}, DType::f32, device);
    losses = Tensor::empty({rows / seq}, DType::f32, device);
    r.seq_len = seq, r.score_sums = s.score_sums.f32(), r.expert_fraction = s.fraction.f32();
    r.balance_loss = losses.f32();
  }
  if (aux) {
    s.aux_fraction = Tensor::empty({experts}, DType::f32, device);
    aux_loss = Tensor::empty({1}, DType::f32, device);
    r.score_sums = s.score_sums.f32(), r.aux_fraction = s.aux_fraction.f32(), r.aux_loss = aux_loss.f32();
  }
  s.balance_scale = balance && scale_ ? scale_->balance : 0.0f;
  s.aux_scale = router_aux ? scale_->router_aux : aux ? scale_->aux : 0.0f;
  ops::moe_router_forward(r, device);
  s.padded = training ? padded_rows(rows, seq) : std::vector<char>();
  const bool classic_aux = aux && !router_aux;
  if (options_.cp && (balance || classic_aux))
    balance_over_context(s, rows, balance ? seq : 0, classic_aux, losses, aux_loss);
  if (router_aux) record_router_aux(s, rows);

  // Sort the assignments by expert; the grouped GEMMs take the offsets on the host. Capacity in forward
  // only (see moe.h); the counts are taken before the drop.
  const double wanted = std::ceil(static_cast<double>(rows * k) / experts * shape_.capacity_factor);
  const int64_t capacity = training && shape_.capacity_factor > 0
                               ? static_cast<int64_t>(std::min(wanted, static_cast<double>(rows * k)))
                               : 0;
  s.row_of = Tensor::empty({rows * k}, DType::i32, device);
  // FP8 tensor cores take token counts in multiples of 16: on a GPU every expert's segment is padded to that.
  const int64_t align = fp8() && options_.kernel_device() != Device::cpu ? 16 : 1;
  ops::MoeSortParams q;
  q.tokens = rows, q.top_k = k, q.experts = experts, q.capacity = capacity, q.align = align;
  q.pad_to_capacity = capacity > 0 && shape_.pad_to_capacity;
  s.source = Tensor::empty({ops::moe_sorted_rows_bound(q)}, DType::i32, device);
  Tensor offsets = Tensor::empty({experts + 1}, DType::i64, device);
  Tensor counts = Tensor::empty({experts}, DType::i64, device);
  q.expert_ids = s.expert_ids.i32();
  q.row_of = s.row_of.i32(), q.source = s.source.i32(), q.offsets = offsets.data<int64_t>();
  q.counts = counts.data<int64_t>();
  ops::moe_sort_by_expert(q, device);
  const Tensor host_offsets = offsets.to(Device::cpu);
  s.offsets.assign(host_offsets.data<int64_t>(), host_offsets.data<int64_t>() + experts + 1);
  const int64_t sorted = s.offsets.back();
  if (training) {
    const Tensor host_counts = counts.to(Device::cpu);
    s.load.assign(host_counts.data<int64_t>(), host_counts.data<int64_t>() + experts);
    if (!s.padded.empty()) {  // under cp: the padding's routes count in no load
      const Tensor ids = s.expert_ids.to(Device::cpu);
      for (int64_t t = 0; t < static_cast<int64_t>(s.padded.size()); ++t)
        for (int64_t j = 0; j < k && s.padded[t]; ++j) s.load[ids.i32()[t * k + j]] -= 1;
    }
    s.dropped = 0;
    if (capacity > 0)
      for (double load : s.load) s.dropped += std::max<int64_t>(0, static_cast<int64_t>(load) - capacity);
    if (balance) {
      const Tensor host_losses = losses.to(Device::cpu);
      double sum = 0;
      for (int64_t i = 0; i < host_losses.numel(); ++i) sum += host_losses.f32()[i];
      s.balance_sum = sum, s.sequences = rows / seq;
    }
    if (classic_aux) s.aux_sum = aux_loss.to(Device::cpu).f32()[0], s.micro_batches = 1;
    s.rank_spread = 0, s.max_spread = 0;
    if (options_.ep_size() > 1 && rows > 0) {
      const Tensor ids = s.expert_ids.to(Device::cpu);
      std::vector<char> reached(static_cast<size_t>(options_.ep_size()));
      for (int64_t t = 0; t < rows; ++t) {
        std::fill(reached.begin(), reached.end(), 0);
        int64_t spread = 0;
        for (int64_t j = 0; j < k; ++j) {
          char& r = reached[static_cast<size_t>(ids.i32()[t * k + j] / local)];
          spread += r == 0, r = 1;
        }
        s.rank_spread += static_cast<double>(spread), s.max_spread = std::max(s.max_spread, spread);
      }
    }
  }

  // The rows travel and reach the experts as their GEMMs read them (bf16 GEMMs: bf16, rounded once here).
  Tensor sorted_xs = Tensor::empty({sorted, hidden}, rows_dtype(), device);
  ops::MoePermuteParams pp;
  pp.tokens = rows, pp.top_k = k, pp.hidden = hidden, pp.rows = sorted, pp.row_of = s.row_of.i32();
  pp.source = s.source.i32(), pp.x = h.elements(), pp.out = sorted_xs.elements();
  ops::moe_permute(pp, device);

  // To the experts' ranks (nothing moves without expert parallelism); the shared experts run meanwhile.
  s.plan = plan_dispatch(options_.ep, s.offsets);
  ExpertDispatch dispatch;
  dispatch.start(options_.ep, s.plan, sorted_xs, hidden, /*to_experts=*/true);
  Tensor xs;
  if (!options_.ep_overlap) xs = dispatch.finish();
  overlapped();
  if (options_.ep_overlap) xs = dispatch.finish();
  const int64_t received = s.plan.received();
  const std::vector<int64_t>& offsets_local = s.plan.local_offsets;
  Tensor ys;
  if (fp8()) {
    s.expert_xs.assign(static_cast<size_t>(local), GemmOperand{});
    s.gate_up =
        per_expert(xs, hidden, 2 * ffn, offsets_local, [&](int64_t e, const Tensor& x, const Tensor& y) {
          GemmOperand& op = s.expert_xs[static_cast<size_t>(e)];
          op = fp8_gate_up_[static_cast<size_t>(e)].input(x);
          fp8_gate_up_[static_cast<size_t>(e)].forward(op, y, y.dtype());
        });
    ys = fp8_down_forward(s, true);
  } else {
    s.xs = operand_of(xs);
    s.gate_up = grouped(s.xs, received, params_.first_gate_up, 2 * static_cast<int>(local), 2 * ffn, hidden,
                        true, offsets_local, act_dtype_);
    s.act = activation(s.gate_up);
    ys = grouped(s.act, received, params_.first_down, static_cast<int>(local), hidden, ffn, true,
                 offsets_local, act_dtype_);
  }
  s.ys = combine_rows(options_.ep, s.plan, ys, hidden);  // back to the tokens' rank, in sorted order

  Tensor out = Tensor::empty({rows, hidden}, out_dtype, device);
  ops::MoeUnpermuteParams u;
  u.tokens = rows, u.top_k = k, u.hidden = hidden, u.rows = sorted, u.row_of = s.row_of.i32();
  u.source = s.source.i32(), u.weights = s.weights.f32(), u.y = s.ys.elements(), u.out = out.elements();
  ops::moe_unpermute(u, device);
  return out;
}

Tensor Moe::forward(const Tensor& h, int64_t, int64_t seq, LayerPart::Saved& saved, bool keep_all) const {
  Saved& s = static_cast<Saved&>(saved);
  const Tensor full = gather_in(options_.tp, h);
  Tensor z;  // the shared experts' output, computed while the routed rows travel
  Tensor y = reduce_out(options_.tp, routed_forward(full, seq, s, true, act_dtype_, [&] {
                          if (shared_) z = shared_->forward(h, s.shared, keep_all);
                        }));
  if (!keep_all && options_.recomputes(RecomputeModule::moe_act))
    s.act = GemmOperand{}, s.expert_act.clear();  // selective recompute: SwiGLU again in backward
  if (shared_) ops::add_inplace(y.elements(), z.elements(), y.numel(), options_.device);
  return y;
}

// The router's input (its weight gradient reads it; the experts keep their own permuted rows) and the shared
// experts' input.
void Moe::drop_input(LayerPart::Saved& saved) const {
  Saved& s = static_cast<Saved&>(saved);
  s.h = Tensor();
  if (shared_) shared_->drop_input(s.shared);
}

void Moe::restore_input(const Tensor& h, LayerPart::Saved& saved) const {
  Saved& s = static_cast<Saved&>(saved);
  s.h = gather_in(options_.tp, h);
  if (shared_) shared_->restore_input(h, s.shared);
}

Tensor Moe::backward_input(const Tensor& dy_in, int64_t, int64_t, LayerPart::Saved& saved) const {
  Saved& s = static_cast<Saved&>(saved);
  const Device device = options_.device;
  const int64_t hidden = shape_.hidden, experts = shape_.experts, k = shape_.top_k, ffn = shape_.expert_ffn;
  const int64_t rows = s.h.numel() / hidden, sorted = s.offsets.back();
  const int64_t local = local_experts(), received = s.plan.received();
  const std::vector<int64_t>& offsets_local = s.plan.local_offsets;
  // Hugging Face's load-balancing loss: the model has set the micro-batch's total over every layer by now.
  if (s.aux_scale != 0.0f && scale_ && scale_->router_aux != 0.0f && router_aux_slot_ >= 0 && s.router_aux)
    s.aux_sum = router_aux_fraction(s), s.micro_batches = 1;
  if (stats_ && !s.load.empty()) {
    for (int64_t e = 0; e < experts; ++e) stats_->load[e] += s.load[e];
    stats_->dropped += s.dropped;
    stats_->sent += s.plan.sent(), stats_->received += s.plan.received();
    stats_->rank_spread += s.rank_spread, stats_->max_spread = std::max(stats_->max_spread, s.max_spread);
    if (options_.ep_size() > 1) stats_->spread_tokens += rows;
    stats_->balance_sum += s.balance_sum, stats_->sequences += s.sequences;
    stats_->aux_sum += s.aux_sum, stats_->micro_batches += s.micro_batches;
  }
  const Tensor dy = gather_in(options_.tp, dy_in);

  // Through the combination: each sorted row's gradient, and the gates' (partial over tp ranks, whose expert
  // outputs are partial sums).
  // dys travels and reaches the experts as their GEMMs read it, like the forward's rows.
  Tensor dys = Tensor::empty({sorted, hidden}, rows_dtype(), device);
  Tensor dweights = Tensor::empty({rows, k}, DType::f32, device);
  ops::MoeUnpermuteParams u;
  u.tokens = rows, u.top_k = k, u.hidden = hidden, u.rows = sorted, u.row_of = s.row_of.i32();
  u.source = s.source.i32(), u.weights = s.weights.f32(), u.y = s.ys.elements(), u.dout = dy.elements();
  u.dy = dys.elements(), u.dweights = dweights.f32();
  ops::moe_unpermute_backward(u, device);
  s.ys = Tensor();
  if (options_.tp) options_.tp->all_reduce_sum(dweights.f32(), dweights.numel(), device);

  // To the experts' ranks; the shared experts' input gradient meanwhile.
  ExpertDispatch dispatch;
  dispatch.start(options_.ep, s.plan, dys, hidden, /*to_experts=*/true);
  Tensor dz, local_dys;
  if (!options_.ep_overlap) local_dys = dispatch.finish();
  if (shared_) dz = shared_->backward_input(dy_in, s.shared);
  if (options_.ep_overlap) local_dys = dispatch.finish();

  // Through the experts.
  Tensor dact;
  if (fp8()) {
    if (s.expert_act.empty()) fp8_down_forward(s, false);  // selective recompute
    s.expert_dys.assign(static_cast<size_t>(local), GemmOperand{});
    dact =
        per_expert(local_dys, hidden, ffn, offsets_local, [&](int64_t e, const Tensor& d, const Tensor& dx) {
          GemmOperand& op = s.expert_dys[static_cast<size_t>(e)];
          op = fp8_down_[static_cast<size_t>(e)].grad_output(d);
          fp8_down_[static_cast<size_t>(e)].backward_input(op, dx, dx.dtype());
        });
  } else {
    if (!s.act.defined()) s.act = activation(s.gate_up);  // selective recompute
    s.dys = operand_of(local_dys);
    dact = grouped(s.dys, received, params_.first_down, static_cast<int>(local), ffn, hidden, false,
                   offsets_local, act_dtype_);
  }
  Tensor dgate_up = Tensor::empty({received, 2 * ffn}, act_dtype_, device);
  if (received > 0) {
    ops::SwigluParams sw;
    sw.rows = received, sw.ffn = ffn, sw.dtype = act_dtype_, sw.gate_up = s.gate_up.raw(),
    sw.dout = dact.raw(), sw.dgate_up = dgate_up.raw();
    ops::swiglu_backward(sw, device);
  }
  s.gate_up = Tensor();
  Tensor local_dxs;
  if (fp8()) {
    s.expert_dgate_up.assign(static_cast<size_t>(local), GemmOperand{});
    local_dxs = per_expert(dgate_up, 2 * ffn, hidden, offsets_local,
                           [&](int64_t e, const Tensor& d, const Tensor& dx) {
                             GemmOperand& op = s.expert_dgate_up[static_cast<size_t>(e)];
                             op = fp8_gate_up_[static_cast<size_t>(e)].grad_output(d);
                             fp8_gate_up_[static_cast<size_t>(e)].backward_input(op, dx, dx.dtype());
                           });
  } else {
    s.dgate_up = operand_of(to_gemm_dtype(dgate_up, options_.gemm_dtype));
    local_dxs = grouped(s.dgate_up, received, params_.first_gate_up, 2 * static_cast<int>(local), hidden,
                        2 * ffn, false, offsets_local, act_dtype_);
  }
  const Tensor dxs = combine_rows(options_.ep, s.plan, local_dxs, hidden);  // back, in sorted order
  Tensor dh = Tensor::empty({rows, hidden}, DType::f32, device);
  ops::MoePermuteParams pp;
  pp.tokens = rows, pp.top_k = k, pp.hidden = hidden, pp.rows = sorted, pp.row_of = s.row_of.i32();
  pp.source = s.source.i32(), pp.dout = dxs.elements(), pp.dx = dh.f32();
  ops::moe_permute_backward(pp, device);

  // Through the router: the gates' gradient and the balance loss's, to the logits and on to h. Every rank
  // computes the same (full) router gradient; only rank 0 adds it to the partial sums reduce_out completes.
  s.dlogits = Tensor::empty({rows, experts}, DType::f32, device);
  ops::MoeRouterParams r;
  r.tokens = rows, r.experts = experts, r.top_k = k, r.groups = shape_.groups,
  r.topk_groups = shape_.topk_groups;
  r.score = shape_.score, r.normalize = shape_.normalize, r.scaling = shape_.scaling;
  r.expert_ids = s.expert_ids.i32(), r.scores = s.scores.f32(), r.dweights = dweights.f32();
  r.dlogits = s.dlogits.f32();
  if (s.balance_scale != 0.0f) {
    r.seq_len = rows / s.fraction.dim(0), r.score_sums = s.score_sums.f32(),
    r.expert_fraction = s.fraction.f32();
    r.balance_scale = s.balance_scale;
  }
  if (s.aux_scale != 0.0f)
    r.score_sums = s.score_sums.f32(), r.aux_fraction = s.aux_fraction.f32(), r.aux_scale = s.aux_scale;
  ops::moe_router_backward(r, device);
  // Padding takes no balance gradient: its rows of dlogits zeroed (in device memory on a GPU).
  for (int64_t t = 0; t < static_cast<int64_t>(s.padded.size()); ++t)
    if (s.padded[t]) s.dlogits.view(t * experts, {experts}).fill_zero();
  if (rows > 0 && options_.tp_rank() == 0) {
    ops::GemmParams g;
    g.m = rows, g.n = hidden, g.k = experts, g.a = s.dlogits.f32(), g.lda = experts;
    g.b = store_->param(params_.router).f32(), g.ldb = hidden, g.c = dh.f32(), g.ldc = hidden, g.beta = 1.0f;
    ops::gemm(g, device);
  }
  s.scores = s.score_sums = s.fraction = s.aux_fraction = s.weights = s.expert_ids = Tensor();
  // dh sums the experts' and the router's gradients in fp32; its partial sums cross the tp group in the
  // activation dtype.
  Tensor dx = reduce_out(options_.tp, options_.tp_size() > 1 ? to_dtype(dh, act_dtype_) : dh);
  if (shared_) ops::add_inplace(dx.elements(), dz.elements(), dx.numel(), device);
  return dx;
}

void Moe::backward_weight(LayerPart::Saved& saved) const {
  Saved& s = static_cast<Saved&>(saved);
  const int64_t hidden = shape_.hidden, experts = shape_.experts, ffn = shape_.expert_ffn;
  const int64_t local = local_experts();
  const std::vector<int64_t>& offsets_local = s.plan.local_offsets;
  if (fp8()) {
    // An expert without rows has no operands; its (zero) gradient is final all the same.
    for (size_t e = 0; e < static_cast<size_t>(local); ++e)
      if (s.expert_dys.size() > e && s.expert_dys[e].defined())
        fp8_down_[e].backward_weight(s.expert_dys[e], s.expert_act[e]);
      else
        store_->note_grad(params_.first_down + static_cast<int>(e));
    for (size_t e = 0; e < static_cast<size_t>(local); ++e)
      if (s.expert_dgate_up.size() > e && s.expert_dgate_up[e].defined()) {
        fp8_gate_up_[e].backward_weight(s.expert_dgate_up[e], s.expert_xs[e]);
      } else {
        store_->note_grad(params_.first_gate_up + 2 * static_cast<int>(e));
        store_->note_grad(params_.first_gate_up + 2 * static_cast<int>(e) + 1);
      }
  } else {
    grouped_weight_grad(s.dys, s.act, params_.first_down, static_cast<int>(local), hidden, ffn,
                        offsets_local);
    grouped_weight_grad(s.dgate_up, s.xs, params_.first_gate_up, 2 * static_cast<int>(local), 2 * ffn, hidden,
                        offsets_local);
  }
  const int64_t rows = s.h.numel() / hidden;
  if (rows > 0) {
    ops::GemmParams g;
    g.m = experts, g.n = hidden, g.k = rows, g.a = s.dlogits.f32(), g.lda = experts, g.trans_a = true;
    const Tensor h32 = to_dtype(s.h, DType::f32);
    g.b = h32.f32(), g.ldb = hidden, g.c = store_->grad(params_.router).f32(), g.ldc = hidden, g.beta = 1.0f;
    ops::gemm(g, options_.device);
  }
  store_->note_grad(params_.router);
  if (params_.bias >= 0) store_->note_grad(params_.bias);  // no gradient: its zeros are final
  if (shared_) shared_->backward_weight(s.shared);
  s = Saved{};
}

Tensor Moe::forward_cached(const Tensor& h, int64_t, int64_t, const KvLayer*) const {
  Saved scratch;
  const Tensor full = gather_in(options_.tp, h);
  Tensor z;
  Tensor y = reduce_out(options_.tp, routed_forward(full, 0, scratch, false, DType::f32, [&] {
                          Mlp::Saved shared;
                          if (shared_) z = shared_->forward(h, shared, false);
                        }));
  if (shared_) ops::add_inplace(y.elements(), z.elements(), y.numel(), options_.device);
  return y;
}

void Moe::apply_bias_update(float rate, bool zero_mean) const {
  FORGE_CHECK(stats_ != nullptr, "Moe::apply_bias_update: the layer keeps no statistics");
  if (params_.bias >= 0) {
    // The op reads doubles (exact counts); forge's tensors have no f64 dtype, so an i64 tensor holds them.
    Tensor load = Tensor::empty({shape_.experts}, DType::i64, Device::cpu);
    std::copy(stats_->load.begin(), stats_->load.end(), reinterpret_cast<double*>(load.raw()));
    const Tensor on_device = load.to(options_.device);
    ops::moe_bias_update(store_->param(params_.bias).f32(), reinterpret_cast<const double*>(on_device.raw()),
                         shape_.experts, rate, zero_mean, options_.device);
    store_->mark_updated();
  }
  stats_->reset(shape_.experts);
}

std::vector<char> Moe::padded_rows(int64_t rows, int64_t seq) const {
  if (!options_.cp || shape_.padded_tail == 0 || seq <= 0) return {};
  const ContextParallel& cp = *options_.cp;
  const int64_t end = seq * cp.size() - shape_.padded_tail, half = seq / 2;
  std::vector<char> padded(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % seq;
    padded[r] = cp.first_position(t < half ? 0 : 1, seq) + t % half >= end;
  }
  return padded;
}

// Context parallelism: a balance loss's group (a sequence; the micro-batch) is spread over the cp ranks, each
// holding some of its tokens. f and P are sums over the group's tokens divided by its size T: each rank sums
// its tokens' counts and s / n (padding left out), the sums and the token counts are added over cp, and the
// group's f, P and loss follow; f is written back as the group's. Each rank then differentiates the group's
// loss with respect to its own tokens: the backward divides by the local count the kernel was given, so the
// scale becomes scale x local / T. The router's outputs are small (tokens x experts): on a GPU they are read
// back to the host for these sums and the group's f and losses written back.
void Moe::balance_over_context(Saved& s, int64_t rows, int64_t seq, bool aux, Tensor& losses,
                               Tensor& aux_loss) const {
  ContextParallel& cp = *options_.cp;
  const int64_t experts = shape_.experts, k = shape_.top_k, groups = seq > 0 ? rows / seq : 0;
  const int64_t width = 2 * experts + 1;  // [counts | sum of s / n | tokens]
  std::vector<float> sums(static_cast<size_t>((groups + (aux ? 1 : 0)) * width), 0.0f);
  const HostRouting routing(s);
  // What the group's statistics overwrite: host tensors (the router's own on the CPU), copied back after.
  const bool on_host =
      s.fraction.defined() ? s.fraction.device() == Device::cpu : s.aux_fraction.device() == Device::cpu;
  auto host_of = [&](const Tensor& t) {
    return !t.defined() || on_host ? t : Tensor::empty(t.shape(), t.dtype());
  };
  Tensor fraction = host_of(s.fraction), aux_fraction = host_of(s.aux_fraction),
         host_losses = host_of(losses), host_aux_loss = host_of(aux_loss);
  auto local_sums = [&](int64_t group, int64_t first, int64_t tokens) {
    std::vector<double> at(static_cast<size_t>(width), 0.0);
    routing.add_sums(s.padded, experts, k, first, tokens, at.data());
    std::copy(at.begin(), at.end(),
              sums.begin() + group * width);  // counts exact in fp32, means rounded once
  };
  for (int64_t q = 0; q < groups; ++q) local_sums(q, q * seq, seq);
  if (aux) local_sums(groups, 0, rows);
  cp.all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  auto group_loss = [&](int64_t group, float* f) {
    const float* at = sums.data() + group * width;
    const double T = at[2 * experts];
    double loss = 0;
    for (int64_t e = 0; e < experts; ++e) {
      f[e] = static_cast<float>(static_cast<double>(experts) / (static_cast<double>(k) * T) * at[e]);
      loss += double{f[e]} * (at[experts + e] / T);
    }
    return std::pair{static_cast<float>(loss), T};
  };
  for (int64_t q = 0; q < groups; ++q) {
    const auto [loss, T] = group_loss(q, fraction.f32() + q * experts);
    host_losses.f32()[q] = loss;
    if (q == 0) s.balance_scale *= static_cast<float>(static_cast<double>(seq) / T);
  }
  if (aux) {
    const auto [loss, T] = group_loss(groups, aux_fraction.f32());
    host_aux_loss.f32()[0] = loss;
    s.aux_scale *= static_cast<float>(static_cast<double>(rows) / T);
  }
  if (on_host) return;
  if (groups > 0) s.fraction.copy_from(fraction), losses.copy_from(host_losses);
  if (aux) s.aux_fraction.copy_from(aux_fraction), aux_loss.copy_from(host_aux_loss);
}

// f_l and P_l on the host from the router's outputs (small: tokens x experts), padding left out, summed over
// the cp group when there is one.
void Moe::record_router_aux(Saved& s, int64_t rows) const {
  const int64_t experts = shape_.experts, k = shape_.top_k;
  std::vector<double> sums(static_cast<size_t>(2 * experts + 1), 0.0);  // [counts | sum of s / n | tokens]
  HostRouting(s).add_sums(s.padded, experts, k, 0, rows, sums.data());
  if (options_.cp) {
    std::vector<float> wire(sums.begin(), sums.end());  // counts and tokens are exact in fp32
    options_.cp->all_reduce_sum(wire.data(), static_cast<int64_t>(wire.size()));
    std::copy(wire.begin(), wire.end(), sums.begin());
  }
  const double tokens = sums[2 * experts];
  MoeRouterAux& record = *s.router_aux;
  FORGE_CHECK(router_aux_slot_ < static_cast<int64_t>(record.fraction.size()),
              "Moe: router_aux slot {} of a record for {} layers", router_aux_slot_, record.fraction.size());
  std::vector<double>& f = record.fraction[static_cast<size_t>(router_aux_slot_)];
  std::vector<double>& p = record.probability[static_cast<size_t>(router_aux_slot_)];
  for (int64_t e = 0; e < experts; ++e) {
    f[e] = tokens > 0 ? static_cast<double>(experts) / (static_cast<double>(k) * tokens) * sums[e] : 0.0;
    p[e] = tokens > 0 ? sums[experts + e] / tokens : 0.0;
  }
  // The backward divides by the rows it is given: the group's loss over `tokens` of them.
  if (options_.cp && tokens > 0) s.aux_scale *= static_cast<float>(static_cast<double>(rows) / tokens);
}

double Moe::router_aux_fraction(Saved& s) const {
  const MoeRouterAux& record = *s.router_aux;
  const int64_t experts = shape_.experts, layers = record.layers;
  FORGE_CHECK(
      static_cast<int64_t>(record.total.size()) == experts && layers > 0,
      "Moe: backward of Hugging Face's load-balancing loss before the model set its total over the {} "
      "layers",
      layers);
  const double per_layer = static_cast<double>(shape_.top_k) / static_cast<double>(layers);
  Tensor fraction = Tensor::empty({experts}, DType::f32);
  double share = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const double mean = record.total[e] / static_cast<double>(layers);
    fraction.f32()[e] = static_cast<float>(per_layer * mean);
    share += per_layer * mean * record.probability[static_cast<size_t>(router_aux_slot_)][e];
  }
  s.aux_fraction.copy_from(fraction);
  return share;
}

}  // namespace forge::nn
