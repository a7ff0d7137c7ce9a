#include "forge/nn/compute.h"

#include "forge/kernels/ops.h"
#include "forge/nn/expert_parallel.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Recompute recompute_from_name(std::string_view name) {
  if (name == "none") return Recompute::none;
  if (name == "selective") return Recompute::selective;
  if (name == "full") return Recompute::full;
  fail("unknown recompute policy '{}' (expected none, selective or full)", name);
}

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "?";
}

int ComputeOptions::tp_rank() const { return tp ? tp->rank() : 0; }
int ComputeOptions::tp_size() const { return tp ? tp->size() : 1; }
int ComputeOptions::ep_rank() const { return ep ? ep->rank() : 0; }
int ComputeOptions::ep_size() const { return ep ? ep->size() : 1; }

namespace {

bool drops(const ComputeOptions& options, const DropoutRows& rows) {
  return options.hidden_dropout > 0.0f && rows.active();
}

void run_dropout(const ComputeOptions& options, const DropoutRows& rows, const Tensor& x, Tensor& y,
                 int64_t cols) {
  FORGE_CHECK(cols > 0 && x.numel() % cols == 0, "dropout: {} elements are not rows of {}", x.numel(), cols);
  ops::DropoutParams p;
  p.rows = x.numel() / cols, p.cols = cols, p.dtype = x.dtype();
  p.x = x.raw(), p.y = y.raw();
  p.rate = options.hidden_dropout, p.seed = options.dropout_seed, p.stream = rows.stream;
  p.first_sample = rows.first_sample, p.seq = rows.seq, p.row_begin = rows.row_begin;
  p.positions = rows.positions;
  ops::dropout(p, x.device());
}

}  // namespace

void dropout_inplace(const ComputeOptions& options, const DropoutRows& rows, Tensor& x, int64_t cols) {
  if (drops(options, rows)) run_dropout(options, rows, x, x, cols);
}

Tensor dropout_copy(const ComputeOptions& options, const DropoutRows& rows, const Tensor& x, int64_t cols) {
  if (!drops(options, rows)) return x;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  run_dropout(options, rows, x, y, cols);
  return y;
}

Tensor to_gemm_dtype(const Tensor& x, DType gemm_dtype) {
  if (x.dtype() == gemm_dtype) return x;
  FORGE_CHECK(gemm_dtype == DType::bf16 && x.dtype() == DType::f32, "no {} GEMM operand from a {} tensor",
              dtype_name(gemm_dtype), dtype_name(x.dtype()));
  Tensor y = Tensor::empty(x.shape(), DType::bf16, x.device());
  ops::convert_to_bf16(x.f32(), y.bf16(), x.numel(), x.device());
  return y;
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  if (dtype == DType::bf16) return to_gemm_dtype(x, dtype);
  Tensor y = Tensor::empty(x.shape(), dtype, x.device());
  ops::StridedCopyParams c;
  c.shape[2] = x.numel(), c.src = x.elements(), c.dst = y.elements();
  ops::strided_copy(c, x.device());
  return y;
}

}  // namespace forge::nn
