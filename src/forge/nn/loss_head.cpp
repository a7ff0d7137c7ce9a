#include "forge/nn/loss_head.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

LossHead::LossHead(ParameterStore* store, int weight, int64_t vocab, int64_t vocab_start,
                   ComputeOptions options, float softcap)
    : store_(store),
      weight_(weight),
      vocab_(vocab),
      vocab_start_(vocab_start),
      options_(options),
      softcap_(softcap) {
  const Shape& shape = store->info(weight).shape;
  local_vocab_ = shape.at(0), dim_ = shape.at(1);
  if (options_.gemm_dtype != DType::bf16) store->keep_fp32(weight);  // an fp32 GEMM
}

namespace {

// Rows with a target whose (combined) target logit is >= the row's max logit over the whole vocabulary. The
// target logit sums to exactly the owning range's value (the others add 0), and the max over ranges is exact,
// so a hit compares a logit with itself.
int64_t count_top1_hits(TensorParallel* group, const Tensor& max_logit, const Tensor& target_logit,
                        const int32_t* targets) {
  const int64_t rows = max_logit.numel();
  Tensor host_max = max_logit.to(Device::cpu);
  if (group) group->all_reduce_max(host_max.f32(), rows, Device::cpu);
  const Tensor host_target = target_logit.to(Device::cpu);
  int64_t hits = 0;
  for (int64_t r = 0; r < rows; ++r) hits += targets[r] >= 0 && host_target.f32()[r] >= host_max.f32()[r];
  return hits;
}

}  // namespace

TensorParallel* LossHead::tp() const {
  return options_.tp && options_.tp->size() > 1 ? options_.tp : nullptr;
}

Tensor LossHead::weight_gemm() const {
  const auto& info = store_->info(weight_);
  if (options_.gemm_dtype == DType::bf16) return store_->params_bf16().view(info.offset, info.shape);
  return store_->param(weight_);
}

LossTotals LossHead::forward(const Tensor& hidden, const int32_t* targets, const int32_t* device_targets,
                             float grad_scale, Tensor* dhidden, bool count_top1) const {
  // Vocabulary-parallel (tp > 1): each rank covers its vocabulary range over all rows (gathered under
  // sequence parallelism); backward's partial hidden gradients sum (or reduce-scatter) over the group.
  TensorParallel* group = tp();
  const Tensor full = gather_in(group, hidden);
  const int64_t rows = full.dim(0);
  Tensor hidden_gemm = to_gemm_dtype(full, options_.gemm_dtype);
  Tensor weight = weight_gemm();
  const Device device = options_.device;
  Tensor lse = Tensor::empty({rows}, DType::f32, device), loss = Tensor::empty({rows}, DType::f32, device);
  Tensor target_logit = Tensor::empty({rows}, DType::f32, device);
  ops::LinearCrossEntropyParams p;
  p.rows = rows, p.dim = dim_, p.vocab = local_vocab_;
  p.vocab_start = vocab_start_, p.global_vocab = vocab_;
  p.gemm_dtype = options_.gemm_dtype;
  p.softcap = softcap_;
  // GPUs want few, large GEMMs: 16 chunks for a 128K vocabulary (a 256 MiB workspace at 8192 rows).
  if (options_.kernel_device() != Device::cpu) p.vocab_chunk = 8192;
  p.hidden_gemm = hidden_gemm.raw(), p.weight_gemm = weight.raw();
  p.targets = device_targets, p.lse = lse.f32(), p.loss = loss.f32(), p.target_logit = target_logit.f32();
  Tensor max_logit;
  if (count_top1) max_logit = Tensor::empty({rows}, DType::f32, device), p.max_logit = max_logit.f32();
  Tensor dfull;
  if (dhidden) {
    dfull = Tensor::empty({rows, dim_}, DType::f32, device);
    p.grad_scale = grad_scale, p.dhidden = dfull.f32();
    if (store_->trainable(weight_)) p.dweight = store_->grad(weight_).f32();  // else frozen: none
  }
  // Training (forward then backward here, on the same workspace): keep the logits for backward when the
  // budget allows, rather than computing them twice.
  p.keep_logits = dhidden != nullptr &&
                  rows * local_vocab_ * static_cast<int64_t>(sizeof(float)) <= options_.keep_logits_bytes;
  Tensor workspace = Tensor::empty({ops::linear_cross_entropy_workspace_floats(p)}, DType::f32, device);
  p.workspace = workspace.f32();
  ops::linear_cross_entropy_forward(p, device);
  Tensor host_target;  // the target logits on the host, combined over the group (when needed)
  if (group) {
    // The per-row statistics (a float per row each way) are combined on the host; on the CPU the host
    // tensors are the outputs themselves.
    const int n = group->size();
    std::vector<float> all(static_cast<size_t>(n) * rows);
    Tensor host_lse = lse.to(Device::cpu);
    host_target = target_logit.to(Device::cpu);
    Tensor host_loss = device == Device::cpu ? loss : Tensor::empty({rows}, DType::f32);
    group->all_gather(host_lse.f32(), all.data(), rows, Device::cpu);
    group->all_reduce_sum(host_target.f32(), rows, Device::cpu);
    for (int64_t r = 0; r < rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; ++i) m = std::max(m, all[i * rows + r]);
      double sum = 0;
      for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(all[i * rows + r]) - m);
      host_lse.f32()[r] = m + static_cast<float>(std::log(sum));
      host_loss.f32()[r] = targets[r] < 0 ? 0.0f : host_lse.f32()[r] - host_target.f32()[r];
    }
    if (device != Device::cpu) lse.copy_from(host_lse), loss.copy_from(host_loss);
  }
  if (dhidden) {
    ops::linear_cross_entropy_backward(p, device);
    if (p.dweight) store_->note_grad(weight_);
    *dhidden = reduce_out(group, dfull);
  }
  const Tensor host_loss = loss.to(Device::cpu);
  LossTotals result;
  for (int64_t i = 0; i < rows; ++i)
    if (targets[i] >= 0) result.sum += host_loss.f32()[i], ++result.tokens;
  if (count_top1)
    result.top1 = count_top1_hits(group, max_logit, group ? host_target : target_logit, targets);
  return result;
}

Tensor LossHead::logits(const Tensor& hidden) const {
  TensorParallel* group = tp();
  const Tensor full = gather_in(group, hidden);
  const int64_t rows = full.dim(0), v = vocab_, local = local_vocab_;
  Tensor hidden_gemm = to_gemm_dtype(full, options_.gemm_dtype);
  Tensor weight = weight_gemm();
  Tensor out = Tensor::empty({rows, local}, DType::f32, options_.device);
  ops::GemmParams p;
  p.m = rows, p.n = local, p.k = dim_;
  p.a = hidden_gemm.raw(), p.lda = p.k, p.b = weight.raw(), p.ldb = p.k, p.trans_b = true;
  p.ab_dtype = options_.gemm_dtype, p.c = out.f32(), p.ldc = local;
  ops::gemm(p, options_.device);
  if (softcap_ > 0.0f) ops::softcap_inplace(out.f32(), softcap_, out.numel(), options_.device);
  if (!group) return out;
  // Gather the vocabulary ranges and drop the padding: [tp, rows, local] -> [rows, vocab].
  const int n = group->size();
  Tensor all = Tensor::empty({n, rows, local}, DType::f32);
  const Tensor host_out = out.to(Device::cpu);
  group->all_gather(host_out.f32(), all.f32(), rows * local, Device::cpu);
  Tensor logits = Tensor::empty({rows, v}, DType::f32);
  for (int i = 0; i < n; ++i) {
    const int64_t width = std::clamp<int64_t>(v - i * local, 0, local);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(all.f32() + (i * rows + r) * local, width, logits.f32() + r * v + i * local);
  }
  return logits;
}

}  // namespace forge::nn
