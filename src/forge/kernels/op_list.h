// Every op of the op table, declared once (included by ops.h after the parameter structs). From this list
// follow the table's members (OpTable), the public wrappers (ops::gemm(p, device), ...) and their support
// queries (ops::supports_gemm(p, device, &reason)), OpId, the backends' declarations and table initialisers
// (cpu_kernels.h / cpu_table.cpp, cuda_kernels.h / cuda_table.cpp), the device emulation's guarded wrappers
// and the profiler's timed ones. docs/adding-an-op.md says what else a new op needs.
//
//   X(name, result, (parameters), (arguments))
//
// Parameter types are written ops:: qualified so that the list expands the same way in forge::ops, forge::cpu
// and forge::cuda. The comments say what the loose-argument ops do; the parameter structs document the rest.
#pragma once

// clang-format off
#define FORGE_OPS(X)                                                                                           \
  X(gemm, void, (const ops::GemmParams& p), (p))                                                               \
  X(fp8_gemm, void, (const ops::Fp8GemmParams& p), (p))                                                        \
  X(rmsnorm_forward, void, (const ops::RmsNormParams& p), (p))                                                 \
  X(rmsnorm_backward_input, void, (const ops::RmsNormParams& p), (p))                                          \
  X(rmsnorm_backward_weight, void, (const ops::RmsNormParams& p), (p))                                         \
  X(rope, void, (const ops::RopeParams& p), (p))                                                               \
  X(swiglu_forward, void, (const ops::SwigluParams& p), (p))                                                   \
  X(swiglu_backward, void, (const ops::SwigluParams& p), (p))                                                  \
  X(dropout, void, (const ops::DropoutParams& p), (p))                                                         \
  X(layernorm_forward, void, (const ops::LayerNormParams& p), (p))                                             \
  X(layernorm_backward_input, void, (const ops::LayerNormParams& p), (p))                                      \
  X(layernorm_backward_weight, void, (const ops::LayerNormParams& p), (p))                                     \
  X(gelu_forward, void, (const ops::GeluParams& p), (p))                                                       \
  X(gelu_backward, void, (const ops::GeluParams& p), (p))                                                      \
  X(bias_add, void, (const ops::BiasParams& p), (p))                                                           \
  X(bias_backward, void, (const ops::BiasParams& p), (p))                                                      \
  X(attention_forward, void, (const ops::AttentionParams& p), (p))                                             \
  X(attention_backward, void, (const ops::AttentionParams& p), (p))                                            \
  X(embedding_forward, void, (const ops::EmbeddingParams& p), (p))                                             \
  X(embedding_backward_weight, void, (const ops::EmbeddingParams& p), (p))                                     \
  X(linear_cross_entropy_forward, void, (const ops::LinearCrossEntropyParams& p), (p))                         \
  X(linear_cross_entropy_backward, void, (const ops::LinearCrossEntropyParams& p), (p))                        \
  X(adamw, void, (const ops::AdamWParams& p), (p))                                                             \
  /* y += x, each fp32 or bf16 (a bf16 y rounds each sum once) */                                              \
  X(add_inplace, void, (Elements y, ConstElements x, int64_t n), (y, x, n))                                    \
  /* The sum of squares in double (for the global gradient norm). */                                           \
  X(sum_squares, double, (const float* x, int64_t n), (x, n))                                                  \
  /* *total += the same sum, where the op runs (total: one double in memory of the op's device); on a GPU in   \
     stream order, without a synchronisation, so that a norm over many ranges reads back once. The additions   \
     happen in call order, each the same double addition a host `total += sum_squares(...)` would make. */     \
  X(sum_squares_accumulate, void, (const float* x, int64_t n, double* total), (x, n, total))                   \
  X(scale_inplace, void, (float* x, float s, int64_t n), (x, s, n))                                            \
  /* x[i] = cap * tanh(x[i] / cap) (logit soft-capping of inference logits; cap > 0). */                       \
  X(softcap_inplace, void, (float* x, float cap, int64_t n), (x, cap, n))                                      \
  /* y[i] = bf16(x[i]) (round to nearest even; NaN stays NaN) and back (exact). */                             \
  X(convert_to_bf16, void, (const float* x, uint16_t* y, int64_t n), (x, y, n))                                \
  X(convert_to_f32, void, (const uint16_t* x, float* y, int64_t n), (x, y, n))                                 \
  /* max |x[i]| on the host (NaN when any element is NaN; 0 for n = 0). On a GPU this waits for the device. */ \
  X(amax, float, (const float* x, int64_t n), (x, n))                                                          \
  /* The same max written to *out, one float in memory of the op's device, where the op runs: on a GPU in      \
     stream order, without a synchronisation (the input of a device-side scale: Fp8CastParams::amax_in). x is  \
     fp32 or bf16. */                                                                                          \
  X(amax_to, void, (ConstElements x, int64_t n, float* out), (x, n, out))                                      \
  X(fp8_cast_transpose, float, (const ops::Fp8CastParams& p), (p))                                             \
  X(fp8_quantize_1x128, void, (const ops::Fp8CastParams& p), (p))                                              \
  X(fp8_quantize_128x128, void, (const ops::Fp8CastParams& p), (p))                                            \
  X(kv_append, void, (const ops::KvAppendParams& p), (p))                                                      \
  X(attention_merge, void, (const ops::AttentionMergeParams& p), (p))                                          \
  X(strided_copy, void, (const ops::StridedCopyParams& p), (p))                                                \
  /* Mixture of experts (the parameter structs say what each computes). */                                     \
  X(moe_sort_by_expert, void, (const ops::MoeSortParams& p), (p))                                              \
  X(moe_permute, void, (const ops::MoePermuteParams& p), (p))                                                  \
  X(moe_permute_backward, void, (const ops::MoePermuteParams& p), (p))                                         \
  X(moe_unpermute, void, (const ops::MoeUnpermuteParams& p), (p))                                              \
  X(moe_unpermute_backward, void, (const ops::MoeUnpermuteParams& p), (p))                                     \
  X(m_grouped_gemm, void, (const ops::GroupedGemmParams& p), (p))                                              \
  X(k_grouped_gemm, void, (const ops::GroupedGemmParams& p), (p))                                              \
  X(moe_router_forward, void, (const ops::MoeRouterParams& p), (p))                                            \
  X(moe_router_backward, void, (const ops::MoeRouterParams& p), (p))                                           \
  /* Auxiliary-loss-free balancing: bias[e] += rate * sign(mean - load[e]), mean = sum(load) / experts, and    \
     with zero_mean the updates' mean subtracted (sign(0) = 0). load: tokens routed to each expert. */         \
  X(moe_bias_update, void, (float* bias, const double* load, int64_t experts, float rate, bool zero_mean),     \
    (bias, load, experts, rate, zero_mean))
// clang-format on

// (a, b) -> a, b: a parenthesised list's contents.
#define FORGE_OP_UNPAREN(...) __VA_ARGS__
// ((a, b), c) -> (a, b, c): a parameter or argument list with more appended.
#define FORGE_OP_APPEND(list, ...) (FORGE_OP_UNPAREN list, __VA_ARGS__)

// A backend's declarations of one op (inside its namespace): the kernel, and the predicate its support query
// and the kernel's own parameter check share. The predicate returns false, with the one-line error the kernel
// would fail with in *reason when reason is not null, where the backend refuses the parameters.
#define FORGE_OP_DECLARE_KERNEL(name, result, params, args) \
  result name params;                                       \
  bool supports_##name FORGE_OP_APPEND(params, std::string* reason);
