#include "forge/nn/compute.h"

#include <utility>

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

namespace {
constexpr std::pair<RecomputeModule, std::string_view> kModuleNames[] = {
    {RecomputeModule::core_attn, "core_attn"},
    {RecomputeModule::mlp_act, "mlp_act"},
    {RecomputeModule::moe_act, "moe_act"},
    {RecomputeModule::norm, "norm"},
    {RecomputeModule::mla_up_proj, "mla_up_proj"}};
}  // namespace

uint32_t recompute_modules_from_names(std::string_view list) {
  uint32_t modules = 0;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    std::string_view word = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    while (!word.empty() && word.front() == ' ') word.remove_prefix(1);
    while (!word.empty() && word.back() == ' ') word.remove_suffix(1);
    bool known = false;
    for (const auto& [module, name] : kModuleNames)
      if (word == name) modules |= module_bit(module), known = true;
    if (!known)
      fail("unknown recompute module '{}' (expected core_attn, mlp_act, moe_act, norm or mla_up_proj)", word);
  }
  return modules;
}

std::string recompute_modules_names(uint32_t modules) {
  std::string out;
  for (const auto& [module, name] : kModuleNames)
    if (modules & module_bit(module)) {
      if (!out.empty()) out += ',';
      out += name;
    }
  return out;
}

bool ComputeOptions::recomputes(RecomputeModule m) const {
  if (recompute == Recompute::none) return false;
  const uint32_t set = recompute == Recompute::selective && recompute_modules != 0 ? recompute_modules
                                                                                   : kDefaultRecomputeModules;
  return (set & module_bit(m)) != 0;
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
