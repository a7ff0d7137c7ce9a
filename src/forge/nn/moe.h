// DeepSeekMoE feed-forward: a router picks top_k of `experts` SwiGLU experts per token (ops::moe_router_*:
// sigmoid or softmax scores, group-limited top-k on scores + correction bias, weights from the unbiased
// scores), the tokens are sorted by expert (ops::moe_sort_by_expert) and every expert runs as one GEMM over
// its contiguous rows (ops::m_grouped_gemm / k_grouped_gemm), each token's expert outputs are combined with
// its weights (ops::moe_unpermute), and the shared experts (a plain SwiGLU Mlp every token passes through)
// are added.
//
// Balancing (DeepSeek-V3, auxiliary-loss-free): the correction bias steers selection only and is updated once
// per optimizer step from the tokens each expert received over the global batch (apply_bias_update, after the
// caller has summed the loads over its data-parallel ranks); the optional sequence-wise balance loss
// alpha * mean over sequences of sum_i f_i P_i and the optional classic auxiliary loss (the same over each
// micro-batch's tokens together) reach the router through their gradients (MoeStepScale); so does Hugging
// Face's load-balancing loss over every layer's router at once (MoeRouterAux).
//
// Capacity (MoeShape::capacity_factor > 0): an expert takes at most ceil(rows * top_k / experts * factor) of
// a micro-batch's assignments, in assignment order; a dropped one contributes nothing (the token keeps the
// shared experts and, in the decoder layer, the residual). forward drops, in training and in evaluation alike
// (as GShard and Megatron: the held-out loss is that of the model as trained); forward_cached (generation)
// never does: its rows are a prefill chunk or one decode step of every sequence in the batch, and a generated
// token must not depend on how the prompt was chunked or on which other sequences share its batch.
//
// Dtypes: the sorted rows and their gradients travel (expert parallelism) and reach the experts in the dtype
// their GEMMs read (bf16 GEMMs: bf16); with bf16 activations the experts' outputs, the combination and the
// layer's output are bf16 too, while the router reads its input widened to fp32 and computes in fp32.
//
// FP8 (ComputeOptions::fp8): every routed expert's gate|up and down run as their own FP8 Linears
// (nn/linear.h) over the expert's contiguous rows: their own weight casts and scales (delayed: their own amax
// history; block: 1x128 tiles of each expert's rows, so no tile of the weight gradient's token dimension
// spans two experts; DeepSeek-V3 trains its experts with the block recipe). On a GPU each expert's segment of
// the sort is padded to a multiple of 16 rows (FP8 tensor cores' granularity) with zero rows the combination
// ignores. The router stays fp32 and the shared experts are an Mlp, FP8 like any other.
//
// Tensor parallelism (expert-tensor-parallel = tp): every expert's width is split over the group like an Mlp
// (gate|up column-parallel, down row-parallel); the router and its bias are replicated and route the same
// gathered rows on every rank. The experts' output is a partial sum that reduce_out completes; the gates'
// gradient, partial for the same reason, is summed over the group before the router's backward.
//
// Expert parallelism (ComputeOptions::ep): the layer holds experts / ep of the routed experts (rank p of the
// group experts [p L, (p + 1) L)), the router and the shared experts whole. Every rank routes its own
// tokens over all experts and sorts them; the token dispatcher (nn/expert_parallel.h) sends each expert's
// rows to its rank, the local experts run over what every rank sent them, and the outputs come back to be
// combined where the tokens live. The shared experts compute while the rows travel (forward and backward).
// Under tensor parallelism too, each tp rank exchanges with the same tp rank of the other ep ranks, its share
// of the experts' width.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forge/kernels/ops.h"
#include "forge/nn/compute.h"
#include "forge/nn/expert_parallel.h"
#include "forge/nn/layer_part.h"
#include "forge/nn/linear.h"
#include "forge/nn/mlp.h"

namespace forge::nn {

struct MoeShape {
  int64_t hidden = 0, experts = 0, top_k = 0;
  int64_t groups = 1, topk_groups = 1;
  int64_t expert_ffn = 0;  // this rank's share of one routed expert's width
  int64_t shared_ffn = 0;  // this rank's share of the shared experts' width (0: no shared experts)
  ops::MoeScore score = ops::MoeScore::sigmoid;
  bool normalize = true;
  float scaling = 1.0f;
  // Assignments an expert takes per micro-batch in forward: ceil(tokens * top_k / experts * capacity_factor);
  // 0: dropless. forward_cached is always dropless.
  double capacity_factor = 0;
  // Under context parallelism: the last this many positions of every whole sequence are padding (multi-token
  // prediction's depth k keeps every position of the chunks, its last k without a target): they route like
  // any token but count in no load, balance loss or statistic, and take no balance gradient.
  int64_t padded_tail = 0;
  // With a capacity: every expert's rows padded to it with zero rows (ops::MoeSortParams::pad_to_capacity),
  // so the GEMMs and the all-to-alls have the same shapes every micro-batch. The results are those without.
  bool pad_to_capacity = false;
};

// Its parameters, by id in the store. The routed experts' weights (this rank's: all of them, or its L under
// expert parallelism) are registered gate_0, up_0, gate_1, up_1, ..., then down_0, down_1, ...: all gate|up
// matrices form one [L * 2 * ffn, hidden] block and all down matrices one [L * hidden, ffn] block, the
// grouped GEMMs' stacked operands.
struct MoeParams {
  int router = -1;         // gate.weight [experts, hidden]
  int bias = -1;           // gate.e_score_correction_bias [experts] (-1: none); never has a gradient
  int first_gate_up = -1;  // expert e: gate first_gate_up + 2e, up first_gate_up + 2e + 1
  int first_down = -1;     // expert e: down first_down + e
  MlpParams shared;        // shared_experts (gate -1: none)
};

// Per layer and optimizer step, on the host: what balancing and the metrics read.
struct MoeStats {
  std::vector<double> load;  // tokens routed to each expert by this step's training micro-batches
  double balance_sum = 0;    // sum over their sequences of sum_i f_i P_i (before the coefficient)
  int64_t sequences = 0;
  // sum over the micro-batches of their sum_i f_i P_i (computed when aux != 0); with router_aux, this layer's
  // share of MoeRouterAux's loss, (k / L) sum_e fbar[e] P_l[e] (the layers' shares add up to the loss)
  double aux_sum = 0;
  int64_t micro_batches = 0;  // those aux_sum counts
  int64_t dropped = 0;        // assignments over capacity
  // Expert parallelism: rows this rank's experts took (from every rank, its own included) and rows it sent
  // to other ranks' experts (the dispatch's all-to-all volume out; the combine returns as many).
  int64_t received = 0, sent = 0;
  // Expert parallelism: over the tokens routed here, the ranks each one's experts live on (the dispatch's
  // fan-out, which group-limited routing bounds: n_group / topk_group aligned with the ranks is DeepSeek-V3's
  // node-limited routing), summed, and the most any token reached.
  double rank_spread = 0;
  int64_t spread_tokens = 0, max_spread = 0;
  void reset(int64_t experts) {
    load.assign(experts, 0.0), balance_sum = 0, sequences = 0, aux_sum = 0, micro_batches = 0, dropped = 0;
    received = 0, sent = 0, rank_spread = 0, spread_tokens = 0, max_spread = 0;
  }
};

// Set by the model for each step, read at forward and kept with the micro-batch. balance: d(total loss) /
// d(balance loss of one sequence), the coefficient divided by the sequences of the global batch; aux:
// d(total loss) / d(auxiliary loss of one micro-batch), its coefficient divided by the micro-batches of the
// global batch; router_aux: the same for Hugging Face's load-balancing loss (MoeRouterAux) with the model's
// router_aux_loss_coef (0: that loss is off). aux and router_aux are not both on.
struct MoeStepScale {
  float balance = 0.0f;
  float aux = 0.0f;
  float router_aux = 0.0f;
};

// Hugging Face's load-balancing loss of Mixtral and Qwen3-MoE (output_router_logits = true;
// transformers' load_balancing_loss_func): one loss over the router logits of every MoE layer at once, their
// tokens concatenated. With T tokens in the micro-batch, L MoE layers, f_l[e] = E / (k T) x the assignments
// layer l gave expert e and P_l[e] layer l's mean probability of e (the softmax, as the classic loss's P):
//   loss = k x sum_e fbar[e] Pbar[e],   fbar, Pbar the means of f_l, P_l over the layers
// (= E x sum_e (assignments to e over all layers / (L T)) x (mean probability of e over all layers), the
// value transformers computes). Its gradient reaches layer l's router as the classic auxiliary loss's does,
// with f = (k / L) fbar in place of the layer's own f. One record per micro-batch, kept with its activations
// (so that pipeline stages and overlapped pairs may hold several micro-batches at once): each layer of the
// stage writes its f_l and P_l at forward (a recomputed forward writes the same values again); before the
// stage's backward the model sets `total`, the sum of f_l over all L layers, and each layer reads it. Under
// pipeline parallelism the stages' sums travel with the hidden states: forward, `before` (the earlier
// stages' layers); backward, `total` (models::Model::stage_routing_size). Under context parallelism f and P
// are over the whole micro-batch, as the classic loss's.
struct MoeRouterAux {
  int64_t layers = 0;                            // L, the model's MoE layers over every stage
  std::vector<std::vector<double>> fraction;     // [local slot][experts]: this stage's layers' f_l
  std::vector<std::vector<double>> probability;  // [local slot][experts]: P_l
  std::vector<double> before;                    // [experts]: sum of f_l over the earlier stages' layers
  std::vector<double> total;                     // [experts]: sum of f_l over all L (set before backward)
  void reset(int64_t model_layers, int64_t local_layers, int64_t experts) {
    layers = model_layers;
    before.assign(static_cast<size_t>(experts), 0.0);
    fraction.assign(static_cast<size_t>(local_layers), before);
    probability = fraction;
    total.clear();
  }
  // before + this stage's f_l, added in layer order (the same sums, bit for bit, however the layers are cut
  // into stages).
  std::vector<double> through_here() const {
    std::vector<double> sum = before;
    for (const std::vector<double>& f : fraction)
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += f[e];
    return sum;
  }
};

class Moe final : public LayerPart {
 public:
  struct Saved : LayerPart::Saved {
    Tensor h;                             // the router's input (gathered rows), in the activation dtype
    Tensor expert_ids, weights;           // [rows, top_k]
    Tensor scores, score_sums, fraction;  // router state for its backward
    Tensor row_of, source;                // the sort
    std::vector<int64_t> offsets;         // host: expert e owns sorted rows [offsets[e], offsets[e + 1])
    // Where the sorted rows go; plan.local_offsets: local expert l owns rows [.[l], .[l + 1]) of the rows
    // the experts run over (the sorted rows themselves without expert parallelism).
    DispatchPlan plan;
    float balance_scale = 0;
    Tensor aux_fraction;  // [experts]: the micro-batch's f, for the auxiliary loss' backward
    float aux_scale = 0;
    // The experts' rows (R of them: local_offsets.back()):
    GemmOperand xs;             // permuted rows as the gate|up GEMMs read them
    Tensor gate_up;             // [R, 2 ffn], in the activation dtype
    GemmOperand act;            // silu(gate) * up as the down GEMMs read it
    Tensor ys;                  // expert outputs (unweighted) in sorted order, back on the tokens' rank
    GemmOperand dys, dgate_up;  // from backward_input, for backward_weight
    // FP8: the same operands per expert (empty for an expert without rows).
    std::vector<GemmOperand> expert_xs, expert_act, expert_dys, expert_dgate_up;
    Tensor dlogits;            // [rows, experts]
    std::vector<char> padded;  // [rows] under context parallelism with a padded tail: 1 = padding
    std::vector<double> load;  // this micro-batch's tokens per expert (counted before any drop)
    int64_t dropped = 0;       // its assignments over capacity
    double rank_spread = 0;    // expert parallelism: its tokens' ranks reached, summed (MoeStats)
    int64_t max_spread = 0;
    double balance_sum = 0;  // sum over its sequences of sum_i f_i P_i
    int64_t sequences = 0;
    double aux_sum = 0;  // its sum_i f_i P_i over all its rows (micro_batches = 1 when computed)
    int64_t micro_batches = 0;
    Mlp::Saved shared;
  };

  Moe() = default;
  // stats, scale: owned by the model (null: no statistics / no balance loss); router_aux_slot: this layer's
  // row in each micro-batch's MoeRouterAux (LayerPart::Saved::router_aux), -1: it takes no part in Hugging
  // Face's load-balancing loss.
  Moe(ParameterStore* store, MoeParams params, MoeShape shape, ComputeOptions options, MoeStats* stats,
      const MoeStepScale* scale, int64_t router_aux_slot = -1);

  std::unique_ptr<LayerPart::Saved> new_saved() const override { return std::make_unique<Saved>(); }
  Tensor forward(const Tensor& h, int64_t batch, int64_t seq, LayerPart::Saved& saved,
                 bool keep_all) const override;
  Tensor backward_input(const Tensor& dy, int64_t batch, int64_t seq, LayerPart::Saved& saved) const override;
  void backward_weight(LayerPart::Saved& saved) const override;
  Tensor forward_cached(const Tensor& h, int64_t batch, int64_t tokens, const KvLayer* cache) const override;
  DType input_dtype() const override { return act_dtype_; }
  void drop_input(LayerPart::Saved& saved) const override;
  void restore_input(const Tensor& h, LayerPart::Saved& saved) const override;

  const MoeShape& shape() const { return shape_; }
  // bias += rate * sign(mean - load) from stats->load (which the caller has summed over data-parallel ranks),
  // optionally zero-mean; then clears the statistics for the next step.
  void apply_bias_update(float rate, bool zero_mean) const;

 private:
  // The routed experts over h [rows, hidden] (gathered); fills the saved state or a scratch one. training:
  // a micro-batch of forward (training or evaluation: balance losses, statistics, capacity); false:
  // forward_cached. overlapped runs while the dispatch's rows travel.
  template <typename Overlapped>
  // out_dtype: the combined output's.
  Tensor routed_forward(const Tensor& h, int64_t seq, Saved& s, bool training, DType out_dtype,
                        Overlapped overlapped) const;
  // Under context parallelism: the balance losses' f and P over the whole groups, whose tokens the cp ranks
  // share (rewrites s.fraction, s.aux_fraction, losses and aux_loss).
  void balance_over_context(Saved& s, int64_t rows, int64_t seq, bool aux, Tensor& losses,
                            Tensor& aux_loss) const;
  // Hugging Face's load-balancing loss: this layer's f_l and P_l of the micro-batch into its record
  // (s.router_aux; over the cp group's tokens, rescaling s.aux_scale as balance_over_context does).
  void record_router_aux(Saved& s, int64_t rows) const;
  // Its backward: s.aux_fraction becomes (k / L) fbar; returns this layer's share of the loss.
  double router_aux_fraction(Saved& s) const;
  // The rows of a micro-batch of `seq`-row sequences (this rank's tokens) that are padding (padded_tail);
  // empty when none are.
  std::vector<char> padded_rows(int64_t rows, int64_t seq) const;
  int64_t local_experts() const { return shape_.experts / options_.ep_size(); }
  Tensor grouped(const GemmOperand& a, int64_t rows, int first, int count, int64_t n, int64_t k, bool trans_b,
                 const std::vector<int64_t>& offsets, DType out_dtype) const;
  void grouped_weight_grad(const GemmOperand& dy, const GemmOperand& x, int first, int count, int64_t m,
                           int64_t n, const std::vector<int64_t>& offsets) const;
  Tensor weights(DType dtype, int first, int count, int64_t cols) const;
  GemmOperand activation(const Tensor& gate_up) const;
  Tensor swiglu(const Tensor& gate_up) const;  // [R, ffn], in gate_up's dtype
  bool fp8() const { return !fp8_gate_up_.empty(); }
  // The dtype the sorted rows and their gradients travel in: what the experts' GEMMs read (FP8: the
  // activation dtype, which each expert's Linear casts).
  DType rows_dtype() const { return fp8() ? act_dtype_ : options_.gemm_dtype; }
  // FP8: for every expert with rows, op(expert's operand, its rows of `in` [R, in_cols], its rows of `out`
  // [R, out_cols]); the result tensor `out` (in the activation dtype) is allocated here.
  template <typename Op>
  Tensor per_expert(const Tensor& in, int64_t in_cols, int64_t out_cols, const std::vector<int64_t>& offsets,
                    Op op) const;
  Tensor fp8_down_forward(Saved& s, bool forward) const;

  ParameterStore* store_ = nullptr;
  MoeParams params_;
  MoeShape shape_;
  ComputeOptions options_;
  MoeStats* stats_ = nullptr;
  const MoeStepScale* scale_ = nullptr;
  int64_t router_aux_slot_ = -1;
  std::unique_ptr<Mlp> shared_;
  std::vector<Linear> fp8_gate_up_, fp8_down_;  // FP8: per expert
  // The input, the experts' gate|up, SwiGLU and outputs, the output and their gradients: bf16 under
  // ComputeOptions::activation_dtype bf16 (with bf16 GEMMs, not FP8), else fp32. The router, its gates and
  // the sum of a token's input gradient over its experts and the router stay fp32.
  DType act_dtype_ = DType::f32;
};

}  // namespace forge::nn
