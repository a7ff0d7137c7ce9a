#include "forge/nn/linear.h"

#include "forge/core/device.h"
#include "forge/fp8/quantize.h"
#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

using fp8::Recipe;
using fp8::TensorRole;

namespace {
uint8_t* codes(const Tensor& t) { return t.data<uint8_t>(); }
// A current-recipe scale_inv in device memory for the GEMM, or null (the host value then serves).
const float* scale_inv_pointer(const Tensor& scales) {
  return scales.defined() ? scales.f32() + kScaleInv : nullptr;
}
}  // namespace

int64_t GemmOperand::bytes() const {
  int64_t total = 0;
  for (const Tensor* t : {&data, &tiles, &data_t, &tiles_t, &high, &scales})
    if (t->defined()) total += static_cast<int64_t>(t->bytes());
  return total;
}

Linear::Linear(ParameterStore* store, std::vector<int> params, int64_t in_features,
               const ComputeOptions& options, std::string name)
    : store_(store),
      first_(params.at(0)),
      count_(static_cast<int>(params.size())),
      in_(in_features),
      gemm_dtype_(options.gemm_dtype),
      device_(options.device),
      tensor_core_shapes_(options.kernel_device() != Device::cpu),
      fp8_(options.fp8),
      tp_(options.tp && options.tp->size() > 1 ? options.tp : nullptr) {
  for (int i = 0; i < count_; ++i) {
    FORGE_CHECK(params[static_cast<size_t>(i)] == first_ + i,
                "Linear over '{}': its weights are not registered in a row", store_->info(first_).name);
    out_ += store_->info(first_ + i).shape.at(0);
    // An fp32 GEMM or an FP8 weight cast reads the fp32 weights.
    if (gemm_dtype_ != DType::bf16 || fp8_) store_->keep_fp32(first_ + i);
  }
  if (!fp8_) return;
  slot_ = fp8_->add_linear(name.empty() ? store_->info(first_).name : std::move(name), device_,
                           store_->info(first_).group == "experts");
  // The FP8 weight lives as long as the model: allocate it with the model, not inside the first step.
  Fp8Weight& w = fp8_->weight(slot_);
  w.q = Tensor::empty({out_, in_}, fp8_->dtype(TensorRole::weight), device_);
  w.q_t = Tensor::empty({in_, out_}, fp8_->dtype(TensorRole::weight), device_);
  if (fp8_->recipe() == Recipe::block) {
    w.block_scale_inv = Tensor::empty({fp8::num_blocks(out_), fp8::num_blocks(in_)}, DType::f32, device_);
    w.block_scale_inv_t = Tensor::empty({fp8::num_blocks(in_), fp8::num_blocks(out_)}, DType::f32, device_);
  }
  if (fp8_->recipe() == Recipe::current) w.scales = Tensor::empty({kScaleFloats}, DType::f32, device_);
}

Tensor Linear::weight(DType dtype) const {
  if (dtype == DType::bf16) {
    FORGE_CHECK(store_->has_bf16(), "bf16 GEMM requested but the model keeps no bf16 weights");
    return store_->span(store_->params_bf16(), first_, count_, in_);
  }
  return store_->fp32_span(first_, count_, in_);
}

const Fp8Weight& Linear::fp8_weight() const {
  Fp8Weight& w = fp8_->weight(slot_);
  const fp8::RecipeConfig& rc = fp8_->options().recipe;
  // Delayed scaling: a new scale (end of step) needs a new cast even if the weights did not change.
  const bool delayed = rc.recipe == Recipe::delayed;
  if (w.version == store_->version() &&
      (!delayed || w.scale == fp8_->delayed_scale(slot_, TensorRole::weight)))
    return w;
  const Tensor master = store_->fp32_span(first_, count_, in_);
  const DType dtype = fp8_->dtype(TensorRole::weight);
  ops::Fp8CastParams cast;
  cast.rows = out_, cast.cols = in_, cast.x = master.f32(), cast.fp8 = dtype;
  cast.q = codes(w.q), cast.q_t = codes(w.q_t);
  if (rc.recipe == Recipe::block) {
    cast.power_of_two_scales = rc.power_of_two_scales;
    cast.scale_inv = w.block_scale_inv.f32(), cast.scale_inv_t = w.block_scale_inv_t.f32();
    ops::fp8_quantize_128x128(cast, device_);
  } else if (rc.recipe == Recipe::delayed) {
    const float scale = fp8_->delayed_scale(slot_, TensorRole::weight);
    cast.scale = scale;
    cast.amax_accumulate = fp8_->amax_accumulator(slot_, TensorRole::weight);
    ops::fp8_cast_transpose(cast, device_);
    w.scale = scale, w.scale_inv = 1.0f / scale;
  } else {
    // Current scaling, in device memory: every shard of a split weight takes the scale of the whole weight
    // (its amax max-reduced over the tensor-parallel group), so a layout computes what one process would.
    float* scales = w.scales.f32();
    ops::amax_to(master.f32(), master.numel(), scales + kAmax, device_);
    if (tp_) tp_->all_reduce_max(scales + kAmax, 1, device_);
    cast.amax_in = scales + kAmax, cast.margin = rc.margin;
    cast.scale_out = scales + kScale, cast.scale_inv_out = scales + kScaleInv;
    ops::fp8_cast_transpose(cast, device_);
  }
  w.version = store_->version();
  fp8_->count_weight_cast();
  return w;
}

GemmOperand Linear::quantize(const Tensor& x, int64_t cols, TensorRole role, bool with_rows,
                             bool with_transpose, const GemmOperand* scale_of) const {
  FORGE_CHECK((x.dtype() == DType::f32 || x.dtype() == DType::bf16) && x.numel() % cols == 0,
              "FP8 Linear '{}': expected an fp32 or bf16 operand of [*, {}], got {} {}",
              fp8_->linear_name(slot_), cols, dtype_name(x.dtype()), shape_string(x.shape()));
  const int64_t rows = x.numel() / cols;
  // Tensor cores read FP8 operands in rows of 16-byte multiples; the transposed copies' rows are the tokens.
  if (tensor_core_shapes_ && (rows % 16 != 0 || cols % 16 != 0))
    fail(
        "FP8 Linear '{}' on {}: {} x {} operand; FP8 tensor cores need the token count and the features "
        "to be multiples of 16 (change the batch or sequence length, or keep this layer in bf16)",
        fp8_->linear_name(slot_), device_name(device_), rows, cols);
  const DType dtype = fp8_->dtype(role);
  const fp8::RecipeConfig& rc = fp8_->options().recipe;
  GemmOperand op;
  if (with_rows) op.data = Tensor::empty({rows, cols}, dtype, device_);
  if (with_transpose) op.data_t = Tensor::empty({cols, rows}, dtype, device_);
  if (!with_rows && !with_transpose) return op;
  ops::Fp8CastParams cast;
  // The cast kernels read a bf16 activation as it is (widening each element in registers): no fp32 copy.
  const ConstElements xe = x.elements();
  cast.rows = rows, cast.cols = cols, cast.x = xe, cast.fp8 = dtype;
  if (with_rows) cast.q = codes(op.data);
  if (with_transpose) cast.q_t = codes(op.data_t);
  if (rc.recipe == Recipe::block) {
    // One read of x gives both layouts' 1x128 tiles.
    cast.power_of_two_scales = rc.power_of_two_scales;
    if (with_rows) op.tiles = Tensor::empty({rows, fp8::num_blocks(cols)}, DType::f32, device_);
    if (with_transpose) op.tiles_t = Tensor::empty({cols, fp8::num_blocks(rows)}, DType::f32, device_);
    if (with_rows) cast.scale_inv = op.tiles.f32();
    if (with_transpose) cast.scale_inv_t = op.tiles_t.f32();
    ops::fp8_quantize_1x128(cast, device_);
    return op;
  }
  if (rc.recipe == Recipe::current) {
    // Two passes in stream order, nothing back to the host: max |x| into device memory, then the cast, which
    // computes the scale from it where it runs and writes scale and scale_inv beside it for the GEMMs. A
    // re-cast takes the earlier cast's amax (the same amax gives the same scale) and its scale_inv.
    cast.margin = rc.margin;
    if (scale_of) {
      FORGE_CHECK(scale_of->scales.defined(), "FP8 Linear '{}': the re-cast operand carries no scales",
                  fp8_->linear_name(slot_));
      op.scales = scale_of->scales;
      cast.amax_in = op.scales.f32() + kAmax;
    } else {
      op.scales = Tensor::empty({kScaleFloats}, DType::f32, device_);
      float* scales = op.scales.f32();
      ops::amax_to(xe, x.numel(), scales + kAmax, device_);
      cast.amax_in = scales + kAmax;
      cast.scale_out = scales + kScale, cast.scale_inv_out = scales + kScaleInv;
    }
    ops::fp8_cast_transpose(cast, device_);
    return op;
  }
  // Delayed: the scale of the previous steps' history (host), and one pass giving the layouts and the amax.
  const float scale = scale_of ? scale_of->scale : fp8_->delayed_scale(slot_, role);
  cast.scale = scale;
  if (!scale_of && fp8_->recording()) cast.amax_accumulate = fp8_->amax_accumulator(slot_, role);
  ops::fp8_cast_transpose(cast, device_);
  op.scale = scale, op.scale_inv = 1.0f / scale;
  return op;
}

GemmOperand Linear::input(const Tensor& x) const {
  GemmOperand op;
  if (!fp8_) {
    op.data = to_gemm_dtype(x, gemm_dtype_);
    return op;
  }
  const bool save_fp8 = fp8_->options().save_fp8_inputs;
  op = quantize(x, in_, TensorRole::input, /*with_rows=*/true, /*with_transpose=*/save_fp8);
  if (!save_fp8) op.high = to_gemm_dtype(x, gemm_dtype_);
  return op;
}

GemmOperand Linear::grad_output(const Tensor& dy) const {
  if (!fp8_) {
    GemmOperand op;
    op.data = to_gemm_dtype(dy, gemm_dtype_);
    return op;
  }
  return quantize(dy, out_, TensorRole::grad_output, true, true);
}

void Linear::keep_for_backward(GemmOperand& x) const {
  if (!fp8_) return;
  x.data = x.tiles = Tensor();  // the weight gradient reads only the transposed copy
  if (x.high.defined()) x.data_t = x.tiles_t = Tensor();  // save_fp8_inputs = false: cast again in backward
}

namespace {
ops::Fp8GemmParams fp8_params(const Fp8Options& options) {
  ops::Fp8GemmParams p;
  p.accumulator_bits = options.accumulator_bits;
  p.promote_every = options.promote_every;
  if (options.recipe.recipe == Recipe::block) p.scaling = ops::Fp8Scaling::block;
  return p;
}
}  // namespace

// The backend is asked first, so that a shape it cannot take (a token count FP8 tensor cores do not tile) is
// refused naming this Linear, not from inside the kernel.
void Linear::run_fp8_gemm(const ops::Fp8GemmParams& p) const {
  if (std::string why; !ops::supports_fp8_gemm(p, device_, &why))
    fail("FP8 GEMM of '{}' ([{}, {}] weight, {} x {} x {}) on {}: {}", fp8_->linear_name(slot_), out_, in_,
         p.m, p.n, p.k, device_name(device_), why);
  ops::fp8_gemm(p, device_);
}

// The GEMM's [rows, cols] result in `dtype`: `out` when the caller gave one (checked), else a new tensor.
Tensor Linear::result(const Tensor& out, int64_t rows, int64_t cols, DType dtype, const char* what) const {
  if (!out.defined()) return Tensor::empty({rows, cols}, dtype, device_);
  FORGE_CHECK(out.dtype() == dtype && out.numel() == rows * cols && out.device() == device_,
              "Linear::{}: the output must be {} [{}, {}] on {}, got {} {}", what, dtype_name(dtype), rows,
              cols, device_name(device_), dtype_name(out.dtype()), shape_string(out.shape()));
  return out;
}

Tensor Linear::forward(GemmOperand& x, const Tensor& out, DType dtype) const {
  FORGE_CHECK(x.data.defined(), "Linear::forward: the operand holds no forward copy");
  const int64_t rows = x.data.numel() / in_;
  Tensor y = result(out, rows, out_, dtype, "forward");
  if (!fp8_) {
    Tensor w = weight(x.data.dtype());
    ops::GemmParams p;
    p.m = rows, p.n = out_, p.k = in_;
    p.a = x.data.raw(), p.lda = in_;
    p.b = w.raw(), p.ldb = in_, p.trans_b = true;
    p.ab_dtype = x.data.dtype();
    p.c = y.raw(), p.c_dtype = y.dtype(), p.ldc = out_;
    ops::gemm(p, device_);
    return y;
  }
  const Fp8Weight& w = fp8_weight();
  ops::Fp8GemmParams p = fp8_params(fp8_->options());
  p.fast_accumulation = fp8_->options().forward_fast_accumulation;  // forward only (block scaling ignores it)
  p.m = rows, p.n = out_, p.k = in_;
  p.a = codes(x.data), p.lda = in_, p.a_dtype = x.data.dtype();
  p.b = codes(w.q), p.ldb = in_, p.trans_b = true, p.b_dtype = w.q.dtype();
  p.c = y.raw(), p.c_dtype = y.dtype(), p.ldc = out_;
  if (p.scaling == ops::Fp8Scaling::block) {
    p.a_scales = x.tiles.f32(), p.b_scales = w.block_scale_inv.f32(),
    p.b_block = ops::Fp8BlockScales::block_128x128;
  } else {
    p.a_scale_inv = x.scale_inv, p.b_scale_inv = w.scale_inv;
    p.a_scale_inv_ptr = scale_inv_pointer(x.scales), p.b_scale_inv_ptr = scale_inv_pointer(w.scales);
  }
  run_fp8_gemm(p);
  keep_for_backward(x);
  return y;
}

Tensor Linear::backward_input(GemmOperand& dy, const Tensor& out, DType dtype) const {
  FORGE_CHECK(dy.data.defined(), "Linear::backward_input: the gradient operand holds no row-wise copy");
  const int64_t rows = dy.data.numel() / out_;
  Tensor dx = result(out, rows, in_, dtype, "backward_input");
  if (!fp8_) {
    Tensor w = weight(dy.data.dtype());
    ops::GemmParams p;
    p.m = rows, p.n = in_, p.k = out_;
    p.a = dy.data.raw(), p.lda = out_;
    p.b = w.raw(), p.ldb = in_;
    p.ab_dtype = dy.data.dtype();
    p.c = dx.raw(), p.c_dtype = dx.dtype(), p.ldc = in_;
    ops::gemm(p, device_);
    return dx;
  }
  const Fp8Weight& w = fp8_weight();
  ops::Fp8GemmParams p = fp8_params(fp8_->options());
  p.m = rows, p.n = in_, p.k = out_;
  p.a = codes(dy.data), p.lda = out_, p.a_dtype = dy.data.dtype();
  // B = W^T [in, out] = [N, K]: K-major, as the tensor cores take it.
  p.b = codes(w.q_t), p.ldb = out_, p.trans_b = true, p.b_dtype = w.q_t.dtype();
  p.c = dx.raw(), p.c_dtype = dx.dtype(), p.ldc = in_;
  if (p.scaling == ops::Fp8Scaling::block) {
    p.a_scales = dy.tiles.f32(), p.b_scales = w.block_scale_inv_t.f32();
    p.b_block = ops::Fp8BlockScales::block_128x128;
  } else {
    p.a_scale_inv = dy.scale_inv, p.b_scale_inv = w.scale_inv;
    p.a_scale_inv_ptr = scale_inv_pointer(dy.scales), p.b_scale_inv_ptr = scale_inv_pointer(w.scales);
  }
  run_fp8_gemm(p);
  dy.data = dy.tiles = Tensor();  // the weight gradient reads the transposed copy
  return dx;
}

void Linear::backward_weight(const GemmOperand& dy, const GemmOperand& x) const {
  if (!store_->trainable(first_)) return;  // frozen: no weight gradient
  accumulate_weight_grad(dy, x);
  for (int i = first_; i < first_ + count_; ++i) store_->note_grad(i);
}

void Linear::accumulate_weight_grad(const GemmOperand& dy, const GemmOperand& x) const {
  Tensor dw = store_->span(store_->grads(), first_, count_, in_);
  if (!fp8_) {
    FORGE_CHECK(dy.data.dtype() == x.data.dtype(), "Linear::backward_weight: operand dtypes differ");
    const int64_t rows = dy.data.numel() / out_;
    ops::GemmParams p;
    p.m = out_, p.n = in_, p.k = rows;
    p.a = dy.data.raw(), p.lda = out_, p.trans_a = true;
    p.b = x.data.raw(), p.ldb = in_;
    p.ab_dtype = dy.data.dtype();
    p.c = dw.f32(), p.ldc = in_;
    p.beta = 1.0f;
    ops::gemm(p, device_);
    return;
  }
  // Inputs kept in the GEMM dtype are cast again, with the scale forward used.
  GemmOperand recast;
  const GemmOperand* xs = &x;
  if (x.high.defined()) {
    const bool block = fp8_->recipe() == Recipe::block;
    recast = quantize(x.high, in_, TensorRole::input, /*with_rows=*/false, /*with_transpose=*/true,
                      block ? nullptr : &x);
    xs = &recast;
  }
  FORGE_CHECK(dy.data_t.defined() && xs->data_t.defined(),
              "Linear::backward_weight: transposed operands missing");
  // dW [out, in] = dy^T [out, tokens] . (x^T [in, tokens])^T: both operands K-major (K = the tokens), the
  // layout FP8 tensor cores take, and under the block recipe both in 1x128 tiles along the tokens.
  const int64_t rows = dy.data_t.dim(1);
  ops::Fp8GemmParams p = fp8_params(fp8_->options());
  p.m = out_, p.n = in_, p.k = rows;
  p.a = codes(dy.data_t), p.lda = rows, p.a_dtype = dy.data_t.dtype();
  p.b = codes(xs->data_t), p.ldb = rows, p.trans_b = true, p.b_dtype = xs->data_t.dtype();
  p.c = dw.f32(), p.ldc = in_;
  p.beta = 1.0f;
  if (p.scaling == ops::Fp8Scaling::block) {
    p.a_scales = dy.tiles_t.f32(), p.b_scales = xs->tiles_t.f32(),
    p.b_block = ops::Fp8BlockScales::tile_1x128;
  } else {
    p.a_scale_inv = dy.scale_inv, p.b_scale_inv = xs->scale_inv;
    p.a_scale_inv_ptr = scale_inv_pointer(dy.scales), p.b_scale_inv_ptr = scale_inv_pointer(xs->scales);
  }
  run_fp8_gemm(p);
}

}  // namespace forge::nn
