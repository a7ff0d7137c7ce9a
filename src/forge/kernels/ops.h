// The op table: every numeric op forge runs, once per backend. Modules call the free functions below;
// they dispatch on the device to that backend's table. Parameters are plain structs of pointers, sizes
// and strides (elements, not bytes). Activations are fp32 in memory; GEMMs take fp32 or bf16 operands,
// accumulate in fp32 and write fp32 or bf16.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/element_ptr.h"
#include "forge/core/tensor.h"
#include "forge/kernels/op_list.h"

namespace forge::ops {

// C[M,N] = alpha * op(A) @ op(B) + beta * C, row-major. op(A) is [M,K]: A is stored [M,K] with leading
// dimension lda, or [K,M] when trans_a. op(B) is [K,N]: B is stored [K,N], or [N,K] when trans_b.
// Both operands share ab_dtype (f32 or bf16). Training uses three layouts:
//   forward         y  = x @ W^T          gemm_nt  (trans_b)
//   backward_input  dx = dy @ W           gemm_nn
//   backward_weight dW += dy^T @ x        gemm_tn  (trans_a, beta = 1)
// C holds c_dtype elements: f32 (float), or bf16 (uint16_t bits) with bf16 operands. A bf16 C is the fp32
// result rounded once: alpha * op(A) op(B) + beta * C is computed in fp32 (beta != 0 reads the old C as bf16,
// widened exactly) and rounded to nearest even on the store, so on the CPU it equals the fp32-output GEMM of
// the same operands rounded to bf16, bitwise. Any other c_dtype, or bf16 C with fp32 operands (cuBLASLt has
// no fp32 x fp32 -> bf16 matmul), fails with one line naming the op and the dtype.
struct GemmParams {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  DType ab_dtype = DType::f32;
  void* c = nullptr;  // c_dtype elements; a float* assigns to it as it is
  int64_t ldc = 0;
  DType c_dtype = DType::f32;
  float alpha = 1.0f;
  float beta = 0.0f;
};
// The output rule above, part of both backends' support predicates: false (the reason, naming `op`, in
// *reason when not null) unless c_dtype is f32, or bf16 with non-fp32 operands.
bool supports_gemm_output(const char* op, DType c_dtype, DType operand_dtype, std::string* reason);

// Emulated FP8 GEMM: C[m,n] = alpha * op(A)[m,k] @ op(B)[k,n] + beta * C, C in c_dtype (leading dimension
// ldc): f32, or bf16 with GemmParams' rule (the fp32 result, beta's old C read as bf16, rounded once to
// nearest even; on the CPU bitwise the fp32-output result rounded). Other output dtypes fail with one line.
// A and B hold one-byte FP8 codes, each with its own dtype (e4m3 or e5m2: E4M3 x E4M3 in the forward,
// E4M3 x E5M2 or E5M2 x E4M3 for gradients); trans_a / trans_b / lda / ldb mean what they mean in GemmParams
// (A stored [m,k], or [k,m] when trans_a; B stored [k,n], or [n,k] when trans_b). A dequantised value is
// code * scale_inv. The CPU kernel widens the codes to bf16 (every E4M3/E5M2 value is exact in bf16) and runs
// the bf16 GEMM with fp32 accumulation, so with accumulator_bits = 0 the result is the exact FP8 GEMM up to
// the fp32 accumulation order.
//
// Scaling:
//   per_tensor  one a_scale_inv and one b_scale_inv, folded into alpha.
//   block       DeepSeek-V3 fine-grained scaling along K in blocks of kFp8BlockSize = 128 (kb = ceil(k/128)
//               blocks; the last may be shorter). For every K-block the partial product is computed in fp32,
//               multiplied by its A and B scales and added into an fp32 accumulator (DeepSeek's promotion).
//      a_scales  1x128 tiles: one scale per (row i of op(A), K-block), row-major [m][kb], whether or not A is
//                stored transposed.
//      b_scales  b_block = tile_1x128: one scale per (column j of op(B), K-block), row-major [n][kb].
//                b_block = block_128x128: one scale per 128x128 block of B *as stored*, row-major in B's
//                storage order: [ceil(n/128)][kb] when trans_b (B stored [n,k]), [kb][ceil(n/128)] when not
//                (B stored [k,n]). A weight W [out,in] therefore keeps a single scale tensor
//                [ceil(out/128)][ceil(in/128)] that serves both of its GEMMs.
//   The three Linear GEMMs (x [tokens,in], W [out,in], dy [tokens,out]):
//      forward          y  = x @ W^T    A = x  (m = tokens, K = in),   1x128 tiles along in;  B = W, trans_b,
//                                       n = out, 128x128 blocks [out/128][in/128].
//      backward_input   dx = dy @ W     A = dy (m = tokens, K = out),  1x128 tiles along out; B = W, not
//                                       transposed (K = out runs down W's rows), same [out/128][in/128]
//                                       scales.
//      backward_weight  dW = dy^T @ x   A = dy, trans_a (m = out, K = tokens): dy quantised in 128x1 tiles
//                                       along tokens, scales [out][tokens/128]; B = x, not transposed
//                                       (n = in, K = tokens), b_block = tile_1x128, scales [in][tokens/128].
//
// Limited-precision accumulation (accumulator_bits > 0) models FP8 tensor cores, which keep only ~14 bits of
// the running sum inside an MMA: K is cut into promotion intervals of promote_every elements (aligned at 0)
// and each interval into sub-slices of kFp8AccumulateSlice = 32. The dot product over a sub-slice is computed
// in fp32; it is added to the interval's running sum, and the sum is truncated (rounded toward zero) to
// accumulator_bits explicit mantissa bits after every addition, the way the hardware drops the aligned
// addends' low bits. At the end of each interval the running sum is promoted: scaled (block mode) and added
// into the fp32 accumulator. This is a model, not the hardware's exact bit behaviour (the sub-slice width,
// the fp32 sub-slice sums and truncation of the sum rather than of each aligned addend are our choices); it
// serves to study how accumulator width and promotion interval affect the result. promote_every must be a
// multiple of 32; in block mode it must divide 128 (a block's scales apply to whole intervals); in per_tensor
// mode 0 means never promote (the whole K accumulates in limited precision). With accumulator_bits = 0 the
// accumulation is plain fp32 and promote_every is ignored.
enum class Fp8Scaling : uint8_t { per_tensor, block };
enum class Fp8BlockScales : uint8_t { tile_1x128, block_128x128 };
constexpr int64_t kFp8BlockSize = 128;
constexpr int64_t kFp8AccumulateSlice = 32;

struct Fp8GemmParams {
  int64_t m = 0, n = 0, k = 0;
  const uint8_t* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  DType a_dtype = DType::e4m3;
  const uint8_t* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  DType b_dtype = DType::e4m3;
  void* c = nullptr;  // c_dtype elements; a float* assigns to it as it is
  int64_t ldc = 0;
  DType c_dtype = DType::f32;
  float alpha = 1.0f;
  float beta = 0.0f;
  Fp8Scaling scaling = Fp8Scaling::per_tensor;
  float a_scale_inv = 1.0f, b_scale_inv = 1.0f;  // per_tensor
  // per_tensor, optional: where set, the operand's scale_inv is this float in memory of the op's device, read
  // where the op runs (in stream order on a GPU), in place of the host value above. A scale computed on a GPU
  // (current scaling: Fp8CastParams::scale_inv_out) thus reaches the GEMM without a trip to the host. Host
  // values must be finite (checked); a value behind a pointer is checked only on the CPU (on a GPU, reading
  // it would wait for the device). Ignored under block scaling.
  const float* a_scale_inv_ptr = nullptr;
  const float* b_scale_inv_ptr = nullptr;
  const float* a_scales = nullptr;  // block: [m][kb]
  const float* b_scales = nullptr;  // block: see b_block
  Fp8BlockScales b_block = Fp8BlockScales::block_128x128;
  int accumulator_bits = 0;     // 0 = exact fp32 accumulation; else 1..23 mantissa bits
  int64_t promote_every = 128;  // elements of K between promotions to fp32 (limited accumulation only)
  // Per-tensor scaling only: Hopper's fast accumulation. The tensor cores' partial sums are never promoted to
  // fp32 inside K (cuBLASLt's FAST_ACCUM): faster, less exact; TransformerEngine's choice for forward GEMMs
  // (gradients promote). The CPU model with accumulator_bits > 0 then accumulates the whole K in limited
  // precision, as promote_every = 0; with exact accumulation it changes nothing. Block scaling ignores it:
  // its promotion at every K-block is where the block scales apply.
  bool fast_accumulation = false;
};

// RMSNorm over the last dimension: y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps), kept for backward.
// x, y, dy and dx each hold fp32 or bf16, independently (a bf16 output is rounded once; every sum is fp32);
// the weight, rstd and dweight are fp32.
struct RmsNormParams {
  int64_t rows = 0, dim = 0;
  ConstElements x;
  const float* weight = nullptr;
  float eps = 1e-5f;
  // The scale is weight + weight_offset (Gemma's RMSNorm scales by 1 + w: offset 1); dweight is unchanged.
  float weight_offset = 0.0f;
  Elements y;             // forward output [rows, dim]
  float* rstd = nullptr;  // [rows]
  ConstElements dy;
  Elements dx;               // backward_input: written (overwrite)
  float* dweight = nullptr;  // backward_weight: accumulated (+=)
};

// Rotary position embedding, Hugging Face Llama convention (rotate_half: dims i and i + d/2 pair up).
// x is [batch, seq, heads, head_dim] with `token_stride` elements between consecutive tokens and head_dim
// between heads (so q and k can be rotated in place inside a fused qkv buffer). cos/sin are [seq_tables,
// head_dim/2] tables; token t of the sequence uses row (position_offset + t). inverse = true applies the
// transposed rotation (the backward pass).
struct RopeParams {
  int64_t batch = 0, seq = 0, heads = 0, head_dim = 0, token_stride = 0;
  Elements x;  // fp32, or bf16 (rotated in fp32, rounded once)
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t position_offset = 0;
  bool inverse = false;
  // Pairs (2i, 2i + 1) instead of (i, i + head_dim / 2): DeepSeek-V3's rope_interleave. Hugging Face then
  // also moves the rotated pairs to halves, a permutation applied to q and k alike that leaves every q.k, and
  // so attention, unchanged; forge rotates in place and keeps the interleaved layout.
  bool interleaved = false;
};

// The gate's activation of a gated-linear-unit MLP.
enum class GluActivation {
  silu,       // SwiGLU (LLaMA, Qwen, Mistral, DeepSeek): silu(g) = g sigmoid(g)
  gelu_tanh,  // GeGLU with the tanh GELU (Gemma's gelu_pytorch_tanh): g/2 (1 + tanh(sqrt(2/pi)(g + 0.044715
              // g^3)))
};

// A gated linear unit on a fused [rows, 2*ffn] input: gate = columns [0, ffn), up = [ffn, 2*ffn);
// out = act(gate) * up, [rows, ffn] (SwiGLU by default, GeGLU with gelu_tanh).
// Every tensor holds `dtype` elements: f32, or bf16 (the activation dtype of a bf16 run: read widened, the
// math in fp32, each result rounded once). A float* assigns to the pointers as it is.
struct SwigluParams {
  int64_t rows = 0, ffn = 0;
  GluActivation activation = GluActivation::silu;
  DType dtype = DType::f32;
  const void* gate_up = nullptr;
  void* out = nullptr;
  const void* dout = nullptr;
  void* dgate_up = nullptr;  // backward: written (overwrite)
};

// Dropout on [rows, cols] activations (a residual branch's output, the embeddings): y = x / (1 - rate) where
// the element is kept, 0 where it is dropped, and the backward pass is the same op on the gradient. The mask
// is a function of the data, not of the layout (kernels/dropout_mask.h): row r of the op is local row
// row_begin + r of a micro-batch of sequences of `seq` local positions, i.e. position
// positions[(row_begin + r) % seq] (the identity when positions is null; a context-parallel rank's slice of
// the sequence otherwise) of sample first_sample + (row_begin + r) / seq. `stream` tells the dropout sites of
// a model apart. Every tensor holds `dtype` elements (f32, or bf16 widened and rounded once).
struct DropoutParams {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;
  const void* x = nullptr;  // [rows, cols]
  void* y = nullptr;        // [rows, cols]; may be x
  float rate = 0.0f;        // in [0, 1)
  uint64_t seed = 0;
  uint32_t stream = 0;
  int64_t first_sample = 0, seq = 0, row_begin = 0;
  const int32_t* positions = nullptr;  // [seq] in the op's device memory, or null
};

// LayerNorm over the last dimension, PyTorch's nn.LayerNorm: y = (x - mean) * rstd * weight + bias, with the
// row's mean and biased variance (divided by dim), rstd = 1/sqrt(var + eps); mean and rstd are kept for
// backward. The variance is the mean of (x - mean)^2 (two passes over the row, no E[x^2] - mean^2
// cancellation). The split mirrors RmsNormParams: backward_input writes dx (B); backward_weight accumulates
// (+=) into dweight and, when set, dbias (W). Reductions over rows add fixed 32-row blocks in block order,
// so the same inputs give the same bits on every run and thread count.
struct LayerNormParams {
  int64_t rows = 0, dim = 0;
  const float* x = nullptr;  // [rows, dim]
  const float* weight = nullptr;
  const float* bias = nullptr;  // optional (null: no bias)
  float eps = 1e-5f;
  float* y = nullptr;     // forward output [rows, dim] (may be x)
  float* mean = nullptr;  // [rows]: written by forward (optional there), read by backward
  float* rstd = nullptr;  // [rows]: likewise
  const float* dy = nullptr;
  float* dx = nullptr;       // backward_input: written (overwrite; may be dy or x)
  float* dweight = nullptr;  // backward_weight: accumulated (+=)
  float* dbias = nullptr;    // backward_weight: accumulated (+=), optional (null: not computed)
};

// GELU, element-wise, in the three forms Hugging Face configs name (hidden_act / projector_hidden_act):
//   erf    exact, x * Phi(x) = x/2 * erfc(-x / sqrt(2))          "gelu" (also "gelu_python")
//   tanh   x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))       "gelu_pytorch_tanh" (also "gelu_new",
//                                                                 "gelu_fast": the same function)
//   quick  x * sigmoid(1.702 x)                                  "quick_gelu" (OpenAI CLIP)
// The kernels evaluate 1 + tanh(u) as 2 sigmoid(2u) and Phi through erfc, so no form cancels for negative x.
enum class GeluKind : uint8_t { erf, tanh, quick };

// The kind's Hugging Face name ("gelu", "gelu_pytorch_tanh", "quick_gelu").
constexpr const char* gelu_kind_name(GeluKind kind) {
  return kind == GeluKind::erf ? "gelu" : kind == GeluKind::tanh ? "gelu_pytorch_tanh" : "quick_gelu";
}
// The kind a Hugging Face activation name means; nullopt for any other name (the caller names the culprit
// and lists kGeluKindNames).
constexpr std::optional<GeluKind> gelu_kind_from_name(std::string_view name) {
  if (name == "gelu" || name == "gelu_python") return GeluKind::erf;
  if (name == "gelu_pytorch_tanh" || name == "gelu_new" || name == "gelu_fast") return GeluKind::tanh;
  if (name == "quick_gelu") return GeluKind::quick;
  return std::nullopt;
}
constexpr const char* kGeluKindNames =
    "gelu, gelu_python, gelu_pytorch_tanh, gelu_new, gelu_fast, quick_gelu";

// gelu_forward   out[i] = gelu(x[i])                   (out may be x)
// gelu_backward  dx[i] = dy[i] * gelu'(x[i]), overwritten (dx may be dy or x)
// over n contiguous floats.
struct GeluParams {
  int64_t n = 0;
  GeluKind kind = GeluKind::erf;
  const float* x = nullptr;
  float* out = nullptr;  // forward
  const float* dy = nullptr;
  float* dx = nullptr;  // backward
};

// A bias over the rows of a [rows, n] matrix (a Linear layer's bias after its GEMM):
//   bias_add       y[r, j] += bias[j]
//   bias_backward  dbias[j] += sum over r of dy[r, j], in fixed 32-row blocks added in block order (the same
//                  bits on every run and thread count)
// y and dy have y_ld / dy_ld elements between rows (0 = n; otherwise at least n).
struct BiasParams {
  int64_t rows = 0, n = 0;
  Elements y;  // bias_add: fp32, or bf16 (each sum rounded once)
  int64_t y_ld = 0;
  const float* bias = nullptr;  // bias_add
  ConstElements dy;             // bias_backward: fp32 or bf16 (summed in fp32)
  int64_t dy_ld = 0;
  float* dbias = nullptr;  // bias_backward: accumulated (+=)
};

// Causal grouped-query attention, flash style (never materialises seq x seq). q is [batch, seq, heads,
// head_dim] with q_stride elements between tokens; k is [batch, kv_seq, kv_heads, head_dim] and v [batch,
// kv_seq, kv_heads, v_head_dim]. Query head h reads kv head h / (heads / kv_heads). out is [batch, seq,
// heads, v_head_dim] (out_stride between tokens). lse [batch, heads, seq] holds each row's log-sum-exp of
// scaled scores for backward. v_head_dim (0 = head_dim) may be smaller or larger than head_dim: DeepSeek-V3's
// MLA trains at q/k 192 (128 + 64 rope) and v 128.
//
// Inference over a key/value cache (forward only): the seq queries are the tokens at positions
// q_offset .. q_offset + seq - 1 of sequences whose keys and values hold kv_seq positions, and under the
// causal mask query row t attends to the keys at positions <= q_offset + t (so q_offset + seq <= kv_seq).
// Key j of sequence b, kv head g sits at k + b * k_batch_stride + g * k_head_stride + j * k_stride (v
// alike), which lets k and v live in a cache allocated for more positions than it holds, in either layout:
// heads side by side within a token (head stride head_dim or v_head_dim, the default) or each head's
// positions together (head stride >= positions * head_dim, token stride head_dim). v may alias k (the forward
// only reads them): MLA's absorbed decode runs one kv head of q/k 576 (512 latent + 64 rope) whose values are
// the first 512 columns of each key row (v = k, same strides, v_head_dim 512). lse may be null in the
// forward. Defaults (kv_seq 0 = seq, q_offset 0, head strides 0 = head_dim / v_head_dim, batch strides 0 =
// max(kv_seq * token stride, kv_heads * head stride)) give training's square causal attention; backward
// supports only those. A few queries against a longer cache (decoding) run a kernel of SIMD dot products
// along head_dim that splits long caches into fixed chunks, so its results do not depend on the thread count.
struct AttentionParams {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t v_head_dim = 0;  // columns per head of v, out, dout and dv (0 = head_dim)
  // q, k, v, out, dout, dq, dk and dv hold one dtype: fp32, or bf16 (read widened, each result rounded once);
  // lse, and every sum inside the kernels, are fp32.
  ConstElements q, k, v;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  Elements out;
  int64_t out_stride = 0;
  float* lse = nullptr;
  float scale = 1.0f;
  bool causal = true;
  int64_t kv_seq = 0;                              // keys and values per sequence (0 = seq)
  int64_t q_offset = 0;                            // position of query row 0 among the keys
  int64_t k_batch_stride = 0, v_batch_stride = 0;  // elements between sequences (0 = dense)
  int64_t k_head_stride = 0, v_head_stride = 0;    // elements between kv heads (0 = head_dim / v_head_dim)
  // Sliding window (Mistral): window > 0 lets the query at position q_offset + t see only keys j with
  // j > q_offset + t - window (transformers' sliding_window_overlay), on top of the causal mask when set.
  // Without the causal mask, q_offset places the queries for it in backward too: a block of context
  // parallelism's ring whose keys all precede its queries (kv_seq = seq).
  int64_t window = 0;
  // Logit soft-capping (Gemma 2's attn_logit_softcapping): softcap > 0 turns every scaled score s = scale q.k
  // into softcap * tanh(s / softcap) before the masks and the softmax; lse is over the capped scores, and
  // backward multiplies each score's gradient by 1 - tanh^2.
  float softcap = 0.0f;
  // Backward: reads dout (+ q, k, v, out, lse), writes dq, dk, dv (overwrite), same layouts as q, k, v (dout
  // as out).
  ConstElements dout;
  int64_t dout_stride = 0;
  Elements dq, dk, dv;
  int64_t dq_stride = 0, dk_stride = 0, dv_stride = 0;
  DType dtype() const { return q.dtype(); }
};

// Merges the partial attention of one block of keys into a running result by their log-sum-exps (ring
// attention across a context-parallel group): for each row r = (b, h, t), total = log(exp(lse[r]) +
// exp(lse_b[r])), out[b, t, h, :] = exp(lse[r] - total) out[b, t, h, :] + exp(lse_b[r] - total) out_b[b, t,
// h, :], lse[r] = total; a row whose lse_b is -inf (no key visible) is left as it is. out and out_b are dense
// [batch, seq, heads, v_dim], lse and lse_b [batch, heads, seq]. The weights are computed in double.
struct AttentionMergeParams {
  int64_t batch = 0, seq = 0, heads = 0, v_dim = 0;
  float* out = nullptr;
  float* lse = nullptr;
  const float* out_b = nullptr;
  const float* lse_b = nullptr;
};

// dst[i, j, k] = src[i, j, k] (or += with accumulate) for i < shape[0], j < shape[1], k < shape[2], each
// side addressed by its own element strides: slices of token-major activations packed dense and back, the
// axes of a small tensor transposed, partial gradients added up. src and dst must not overlap.
struct StridedCopyParams {
  int64_t shape[3] = {1, 1, 1};
  ConstElements src;  // fp32 or bf16; a bf16 dst rounds each fp32 value once (and each sum, accumulating)
  int64_t src_stride[3] = {0, 0, 1};
  Elements dst;
  int64_t dst_stride[3] = {0, 0, 1};
  bool accumulate = false;
};

// Appends the keys and values of `tokens` new tokens per sequence to a key/value cache (inference): for
// sequence b, token t and kv head g, the head_dim floats at qkv + (b * tokens + t) * qkv_stride + k_offset +
// g * head_dim go to keys + b * batch_stride + g * head_stride + (position + t) * head_dim, and those at
// v_offset likewise to values.
struct KvAppendParams {
  int64_t batch = 0, tokens = 0, kv_heads = 0, head_dim = 0;
  const float* qkv = nullptr;
  int64_t qkv_stride = 0, k_offset = 0, v_offset = 0;
  float* keys = nullptr;
  float* values = nullptr;
  int64_t batch_stride = 0, head_stride = 0, position = 0;
};

// Embedding lookup. forward: out[i] = weight[ids[i]]. backward_weight: dweight[ids[i]] += dout[i], rows added
// in increasing order. An id outside [0, vocab) is an error, except under vocab_parallel: the weight then
// holds rows [first, first + vocab) of the whole vocabulary, ids are global, and an id outside that range
// gives a zero row (forward) and no gradient (backward) — another rank of the tensor-parallel group holds it.
struct EmbeddingParams {
  int64_t rows = 0, dim = 0, vocab = 0;
  bool vocab_parallel = false;
  int64_t first = 0;
  const int32_t* ids = nullptr;
  ConstElements weight;  // fp32 or bf16 rows; forward widens them exactly into fp32 out
  float* out = nullptr;
  const float* dout = nullptr;
  float* dweight = nullptr;
};

// Softmax cross-entropy fused with the output projection, chunked over the vocabulary: logits = h @ W^T
// are produced `vocab_chunk` columns at a time. Rows whose target is negative are ignored (loss 0, gradient
// 0).
//   forward:  lse[r], loss[r] = lse[r] - logit[r, target[r]]
//   backward: dlogits = (softmax - onehot) * grad_scale (chunk by chunk);
//             dhidden = dlogits @ W (overwrite), dweight += dlogits^T @ h (fp32 accumulate)
// hidden_gemm / weight_gemm are the GEMM operands in gemm_dtype (fp32 pointers when f32; bf16 copies when
// bf16); hidden (fp32) is unused by the CPU kernel but kept for backends that cast on the fly.
struct LinearCrossEntropyParams {
  int64_t rows = 0, dim = 0, vocab = 0, vocab_chunk = 2048;
  DType gemm_dtype = DType::f32;
  const void* hidden_gemm = nullptr;  // [rows, dim]
  const void* weight_gemm = nullptr;  // [vocab, dim]
  const int32_t* targets = nullptr;   // [rows]
  float* lse = nullptr;               // [rows]
  float* loss = nullptr;              // [rows]
  float grad_scale = 1.0f;
  float* dhidden = nullptr;  // [rows, dim]
  float* dweight = nullptr;  // [vocab, dim], accumulated (null: none computed, the head is frozen)
  // Without keep_logits the logits never exist whole: the workspace holds one chunk, and backward computes
  // each chunk's logits again. With it the workspace holds every chunk's ([rows, width] blocks at
  // linear_cross_entropy_chunk_offset, each as aligned as the workspace, so a chunk's GEMM is the same one in
  // both modes): forward leaves them there and backward, given the same params and workspace, reads them
  // instead, one [rows, dim] x [dim, vocab] GEMM less for about rows * vocab floats of memory.
  bool keep_logits = false;
  float* workspace = nullptr;  // linear_cross_entropy_workspace_floats(*this) floats
  // Vocabulary-parallel use: W holds global columns [vocab_start, vocab_start + vocab) of a vocabulary of
  // global_vocab real tokens (0 means vocab_start + vocab); columns at or past global_vocab are padding
  // and take no part. Targets are global ids; a row whose target lies outside this range has no target
  // logit here (target_logit 0, no one-hot in backward): the caller combines the per-range lse and
  // target logits over the group and passes the global lse to backward.
  int64_t vocab_start = 0, global_vocab = 0;
  float* target_logit = nullptr;  // optional out [rows]
  // Optional out [rows]: each row's largest logit over this range's real columns (padding excluded; -inf for
  // a range of padding only), the running max the lse keeps anyway. The all-reduce max over the group gives
  // the row's argmax logit: a top-1 hit is target_logit >= it.
  float* max_logit = nullptr;
  // Logit soft-capping (Gemma 2's final_logit_softcapping): softcap > 0 turns every logit z into
  // softcap * tanh(z / softcap) before the softmax. lse, loss, target_logit, max_logit and kept logits are of
  // the capped logits; backward multiplies each dlogit by 1 - tanh^2.
  float softcap = 0.0f;
};
// rows * vocab_chunk floats (every chunk's block with keep_logits), + rows * vocab_chunk / 2 for bf16
// dlogits.
int64_t linear_cross_entropy_workspace_floats(const LinearCrossEntropyParams& p);
// Where the logits of the chunk starting at column `first` go in the workspace: 0 without keep_logits, else
// first / vocab_chunk blocks of rows * vocab_chunk floats rounded up to 64 (256 bytes).
int64_t linear_cross_entropy_chunk_offset(const LinearCrossEntropyParams& p, int64_t first);
// The fp32 logits area at the start of the workspace (one chunk, or every chunk's block); bf16 dlogits
// follow.
int64_t linear_cross_entropy_logits_floats(const LinearCrossEntropyParams& p);

// Fused AdamW over one contiguous range: decoupled weight decay, bias correction, optional bf16 shadow
// copy of the updated fp32 master weights written in the same pass.
struct AdamWParams {
  int64_t n = 0;
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  uint16_t* param_bf16 = nullptr;  // optional
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;         // 1-based, for bias correction
  float grad_scale = 1.0f;  // grads are multiplied by this first (clipping)
};

// FP8 casts (semantics, saturation and block layouts: fp8/quantize.h, whose functions the CPU table runs). x
// is [rows, cols] fp32 or bf16, read as it is (a bf16 element is widened exactly where it is loaded, so a
// bf16 activation needs no fp32 copy before its cast); codes are one byte each in `fp8` (e4m3 or e5m2).
// Outputs not wanted are null.
//   fp8_cast_transpose    per-tensor `scale`: q [rows, cols] = fp8(x * scale) and/or q_t [cols, rows], its
//                         transpose with the same codes; returns amax of x (max |x|, NaN when any element is
//                         NaN) on the host, computed in the same pass. Either q or q_t may be null. With
//                         amax_accumulate (memory of the op's device) the amax is instead folded into
//                         *amax_accumulate (max, NaN-propagating; it must hold a value >= 0 or NaN) where the
//                         op runs, without waiting for it: the return value is then unspecified. This is how
//                         the delayed recipe gathers a step's amaxes on a GPU without a synchronisation per
//                         cast. With amax_in (memory of the op's device, one float) the scale is computed
//                         where the op runs, from the amax found there, as fp8::compute_scale(*amax_in,
//                         fp8_max(fp8), margin, 1.0f) (an amax of 0, inf or NaN gives 1), and `scale` is
//                         ignored: TransformerEngine's current scaling without a host round trip (amax_to,
//                         then this cast). x's own amax is then not computed: the return value is unspecified
//                         and nothing synchronises (amax_accumulate still works). scale_out / scale_inv_out
//                         (memory of the op's device, optional) receive the scale used and 1 / scale,
//                         whichever its source, for the GEMM (Fp8GemmParams::a_scale_inv_ptr) and for later
//                         casts; they must not overlap amax_in. They are written for an empty x too.
//   fp8_quantize_1x128    q with scale_inv [rows][ceil(cols/128)] (tiles of 128 along cols) and/or q_t [cols,
//   rows]
//                         with scale_inv_t [cols][ceil(rows/128)] (tiles of 128 along rows of x).
//   fp8_quantize_128x128  q with scale_inv [ceil(rows/128)][ceil(cols/128)]; optionally q_t [cols, rows] with
//                         scale_inv_t [ceil(cols/128)][ceil(rows/128)] (the same blocks and scales,
//                         transposed).
// Every code is bitwise the CPU's: fp8(x * scale) with saturating round-to-nearest-even; a tile's scale is
// fp8_max / amax (rounded down to a power of two when power_of_two_scales), 1 for an amax of 0, inf or NaN.
struct Fp8CastParams {
  int64_t rows = 0, cols = 0;
  ConstElements x;
  DType fp8 = DType::e4m3;
  float scale = 1.0f;                // per-tensor casts
  float* amax_accumulate = nullptr;  // per-tensor casts: see above
  const float* amax_in = nullptr;    // per-tensor casts: the scale from this amax, on the device (see above)
  int margin = 0;                    // with amax_in: compute_scale's margin (>= 0)
  float* scale_out = nullptr;        // per-tensor casts, optional: the scale used
  float* scale_inv_out = nullptr;    // per-tensor casts, optional: 1 / the scale used
  bool power_of_two_scales = false;  // block casts
  uint8_t* q = nullptr;
  uint8_t* q_t = nullptr;
  float* scale_inv = nullptr;    // block: q's scales
  float* scale_inv_t = nullptr;  // block: q_t's scales
};

// Mixture-of-experts routing of `tokens` tokens over `experts` experts (DeepSeek-V3's router), from the
// router logits z [tokens, experts] (fp32). Per token:
//   scores    s = sigmoid(z) (score = sigmoid), or softmax(z) over the experts (score = softmax)
//   choice    c = s + bias (bias null: c = s); the bias steers selection only
//   groups    with groups > 1 the experts form `groups` groups of experts / groups consecutive experts; a
//             group's score is the sum of its two largest c; the topk_groups best groups stay, the others'
//             experts are masked
//   top-k     the top_k largest c among the unmasked experts, in decreasing order of c; ties go to the lower
//             expert (and group) index
//   weights   w_j = s[e_j] (the unbiased score), divided by (sum_j s[e_j] + 1e-20) when normalize, times
//   scaling
// Outputs expert_ids [tokens, top_k], weights [tokens, top_k] and scores s [tokens, experts] (backward reads
// them).
//
// Sequence-wise balance loss (seq_len > 0): the tokens are tokens / seq_len sequences of seq_len consecutive
// tokens. Per sequence q, with n_t = sum_e s[t, e]:
//   f[q, i] = experts / (top_k * seq_len) * #{(t, j) : e_{t,j} = i}     (a count: no gradient)
//   P[q, i] = 1 / seq_len * sum_t s[t, i] / n_t
//   balance_loss[q] = sum_i f[q, i] * P[q, i]       (1 for perfectly uniform routing)
// The forward then also writes score_sums n [tokens] and expert_fraction f [sequences, experts] for backward.
//
// Micro-batch balance loss (aux_loss set; the classic GShard / Switch auxiliary loss): the same loss with all
// `tokens` tokens as one group (N = tokens), independently of seq_len (both may be on at once):
//   aux_fraction[i] = experts / (top_k * N) * #{(t, j) : e_{t,j} = i},  P_i = 1 / N * sum_t s[t, i] / n_t
//   aux_loss[0] = sum_i aux_fraction[i] * P_i
// It writes score_sums too (tokens = 0: aux_fraction is all zeros, so that fractions summed over ranks see no
// garbage from an empty rank, and aux_loss is not written).
//
// Backward writes dlogits [tokens, experts] (overwrite): the gradient through the weights (dweights
// [tokens, top_k]) plus balance_scale times that of sum_q balance_loss[q] plus aux_scale times that of
// aux_loss[0] (a scale of 0: that loss adds nothing, and its inputs are not read; either reads score_sums).
enum class MoeScore : uint8_t { sigmoid, softmax };
struct MoeRouterParams {
  int64_t tokens = 0, experts = 0, top_k = 0;
  int64_t groups = 1, topk_groups = 1;
  MoeScore score = MoeScore::sigmoid;
  bool normalize = true;
  float scaling = 1.0f;
  const float* logits = nullptr;
  const float* bias = nullptr;
  int32_t* expert_ids = nullptr;
  float* weights = nullptr;
  float* scores = nullptr;
  int64_t seq_len = 0;
  float* score_sums = nullptr;
  float* expert_fraction = nullptr;
  float* balance_loss = nullptr;
  float* aux_fraction = nullptr;  // [experts]
  float* aux_loss = nullptr;      // [1]; null: no micro-batch balance loss
  const float* dweights = nullptr;
  float balance_scale = 0.0f;
  float aux_scale = 0.0f;
  float* dlogits = nullptr;
};

// Mixture of experts: the token shuffling around the experts and the grouped GEMMs that run them. A layer
// sorts its tokens' top-k assignments by expert (moe_sort_by_expert), copies the hidden rows into that order
// (moe_permute), runs every expert as one GEMM over its contiguous rows (m_grouped_gemm; k_grouped_gemm for
// the weight gradient) and combines each token's rows weighted by the router's gates (moe_unpermute).

// Sorts the top-k expert assignments of `tokens` tokens by expert. expert_ids [tokens * top_k] int32 holds
// assignment (t, j), token t's j-th choice, at index a = t * top_k + j; each id lies in [0, experts) (an id
// outside fails with one line naming the assignment). A token may name one expert twice: each assignment is
// its own row. The order is by expert and, within an expert, by increasing assignment index (stable); it is a
// function of expert_ids alone, the same on every backend.
//   capacity  0: dropless, every assignment gets a row. > 0: each expert keeps its first `capacity`
//             assignments in that order and drops the rest. kept_e: expert e's assignments after the drop.
//   align     >= 1: each expert's segment of sorted rows is padded to a multiple of align (FP8 GEMMs need
//             token counts that are multiples of 16), so every segment starts at a multiple of align. The
//             padding rows follow the expert's kept rows; an expert with no kept rows has an empty segment.
//             1: no padding.
//   pad_to_capacity  with a capacity: every expert's segment is round_up(capacity, align) rows whatever its
//             count, empty experts included (GShard's fixed shapes: R, the GEMMs' shapes and the all-to-all
//             volumes no longer depend on the routing).
//   offsets   [experts + 1] int64: expert e owns sorted rows [offsets[e], offsets[e + 1]), its kept_e rows
//             then its padding: offsets[0] = 0, offsets[e + 1] - offsets[e] = round_up(kept_e, align) (or
//             round_up(capacity, align) under pad_to_capacity), and offsets[experts] = R, the sorted rows
//             (tokens * top_k when dropless with align = 1).
//   counts    optional, [experts] int64: each expert's assignments counted before any drop, without padding
//             (what the load balancing loss and bias updates read).
//   row_of    [tokens * top_k] int32: assignment a's sorted row, -1 when dropped (never a padding row).
//   source    [moe_sorted_rows_bound(params)] int32, the most rows any expert_ids can
//             need: for each sorted row r < R, the assignment it holds (its token is source[r] / top_k), or
//             -1 for a padding row; every entry from R to the end of that size is -1 too. Required whenever
//             that size is not 0 (also with no tokens: then every entry is -1).
// Every output is overwritten, in memory of the op's device: the grouped GEMMs take their offsets in host
// memory, so a GPU's offsets are copied back (R, which sizes the sorted buffers, with them). The support
// query refuses align < 1, pad_to_capacity without a capacity and a bound that does not fit int32.
struct MoeSortParams {
  int64_t tokens = 0, top_k = 0, experts = 0;
  int64_t capacity = 0;
  int64_t align = 1;
  bool pad_to_capacity = false;
  const int32_t* expert_ids = nullptr;
  int32_t* row_of = nullptr;
  int32_t* source = nullptr;
  int64_t* offsets = nullptr;
  int64_t* counts = nullptr;
};

// The entries of moe_sort_by_expert's source: every assignment's row, plus at most align - 1 padding rows
// per expert. Also the most sorted rows R can be.
constexpr int64_t moe_sorted_rows_bound(int64_t tokens, int64_t top_k, int64_t experts, int64_t align) {
  return tokens * top_k + experts * (align - 1);
}
// rows rounded up to a multiple of align.
constexpr int64_t moe_round_up(int64_t rows, int64_t align) { return (rows + align - 1) / align * align; }
// The same for any parameters: under pad_to_capacity exactly R = experts * round_up(capacity, align).
constexpr int64_t moe_sorted_rows_bound(const MoeSortParams& p) {
  if (p.pad_to_capacity && p.capacity > 0) return p.experts * moe_round_up(p.capacity, p.align);
  return moe_sorted_rows_bound(p.tokens, p.top_k, p.experts, p.align);
}
// The rows of the segment of an expert that keeps `kept` assignments (padding included).
constexpr int64_t moe_segment_rows(const MoeSortParams& p, int64_t kept) {
  return moe_round_up(p.pad_to_capacity && p.capacity > 0 ? p.capacity : kept, p.align);
}

// Hidden rows from token order into the expert-sorted order of moe_sort_by_expert and back: rows = R (that
// op's offsets[experts], padding rows included, known on the host; it must fit int32), row_of and source as
// it wrote them. A padding row is a sorted row r with source[r] = -1; no assignment's row_of names it. The
// token side is [tokens, hidden] with x_stride / dx_stride elements between rows (0 = hidden); the sorted
// side is [rows, hidden], dense.
//   moe_permute           out[r] = x[source[r] / top_k] for every r < rows (dispatch: a row per kept
//                         assignment), zeros for a padding row (what the experts' GEMMs then run over).
//   moe_permute_backward  dx[t] = sum of dout[row_of[t * top_k + j]] over j = 0 .. top_k - 1 in increasing
//                         j, dropped assignments (row -1) skipped; overwritten (zeros where all are dropped).
//                         Padding rows of dout are never read. One thread sums one token's rows in that
//                         order: no atomics, the same bits every run.
// Indices are data: the CPU checks them (source[r] in [0, tokens * top_k) or -1 for padding, row_of in
// [-1, rows)) and fails with one line; the CUDA kernels, which cannot report without waiting for the device,
// read and write nothing for an index out of range (-1 in source is padding, not out of range).
// The rows are fp32 or bf16, each tensor its own: a copy to bf16 rounds once (from bf16: exact), and
// moe_permute_backward sums in fp32 and rounds the sum once.
struct MoePermuteParams {
  int64_t tokens = 0, top_k = 0, hidden = 0, rows = 0;
  const int32_t* row_of = nullptr;  // [tokens * top_k]: backward
  const int32_t* source = nullptr;  // [rows]: forward
  ConstElements x;                  // [tokens, hidden], x_stride
  int64_t x_stride = 0;
  Elements out;        // [rows, hidden]
  ConstElements dout;  // [rows, hidden]
  Elements dx;         // [tokens, hidden], dx_stride
  int64_t dx_stride = 0;
};

// The combination of each token's expert outputs, weighted by its gates (fp32 weights [tokens * top_k], a =
// t * top_k + j), and its gradients; shapes, indices and strides as MoePermuteParams (token side [tokens,
// hidden] with out_stride / dout_stride, 0 = hidden; y and dy [rows, hidden], dense, padding rows included).
//   moe_unpermute           out[t] = sum over j = 0 .. top_k - 1 of weights[a] * y[row_of[a]] in
//                           increasing j, dropped assignments skipped; overwritten (zeros where all are
//                           dropped). Padding rows of y are never read.
//   moe_unpermute_backward  dy[r] = weights[a] * dout[a / top_k] for every sorted row r < rows, a =
//   source[r],
//                           and dy[r] = 0 for a padding row (source[r] = -1) (overwritten);
//                           dweights[a] = <dout[t], y[row_of[a]]>, each summed by one thread or block in an
//                           order fixed by hidden alone, 0 for a dropped assignment (overwritten). Either
//                           output may be null (not computed).
// So padding changes nothing but the sorted rows: out, dx and dweights are bitwise those of align = 1.
// y, out, dout and dy are fp32 or bf16, each its own; the weights and every sum stay fp32 (a bf16 out or dy
// is the fp32 result rounded once).
struct MoeUnpermuteParams {
  int64_t tokens = 0, top_k = 0, hidden = 0, rows = 0;
  const int32_t* row_of = nullptr;  // [tokens * top_k]
  const int32_t* source = nullptr;  // [rows]: backward's dy
  const float* weights = nullptr;   // [tokens * top_k]
  ConstElements y;                  // [rows, hidden]
  Elements out;                     // [tokens, hidden], out_stride
  int64_t out_stride = 0;
  ConstElements dout;  // [tokens, hidden], dout_stride
  int64_t dout_stride = 0;
  Elements dy;                // [rows, hidden], optional
  float* dweights = nullptr;  // [tokens * top_k], optional
};

// Grouped GEMMs (DeepGEMM's names: what is grouped comes first), one GEMM per expert over its contiguous rows
// of the expert-sorted tokens. offsets [groups + 1] int64 lies in HOST memory on every backend (the loop over
// groups runs on the host); it must be non-decreasing from offsets[0] >= 0 (checked when the op runs), and
// group g owns rows rows_g = [offsets[g], offsets[g + 1]). Operands and output follow GemmParams exactly:
// ab_dtype f32 or bf16; c_dtype f32, or bf16 with bf16 operands (the fp32 result rounded once); lda, ldb, ldc
// its leading dimensions. Each non-empty group runs one GEMM of its sub-matrices; on the CPU ops::gemm's over
// the pieces grouped_gemm_pieces cuts its rows into, bitwise (m_grouped: each piece's rows of A and C;
// k_grouped: each piece's rows of A and B, accumulated into an fp32 C_g in turn, the first with beta, the
// others with 1; a bf16 C_g, rounded once, takes the group whole).
//   m_grouped_gemm  M grouped (an expert's forward and input gradient): for every g,
//                   C[rows_g, :n] = alpha * A[rows_g, :k] @ op(B_g) + beta * C[rows_g, :n], with A [R, k] and
//                   C [R, n]; B_g = b + g * b_group_stride elements, stored [n, k] with trans_b (y = x W_g^T,
//                   W_g [n, k]) or [k, n] without (dx = dy W_g). Empty groups and rows outside
//                   [offsets[0], offsets[groups]) are not touched. m and c_group_stride are unused.
//   k_grouped_gemm  K grouped (an expert's weight gradient): for every g,
//                   C_g = alpha * A[rows_g, :m]^T @ B[rows_g, :n] + beta * C_g, with A [R, m], B [R, n] and
//                   C_g = c + g * c_group_stride elements stored [m, n]: dW_g [out, in] += dy_g^T x_g is
//                   A = dy, B = x, beta = 1. An empty group's C_g becomes beta * C_g: unchanged with
//                   beta = 1, zeros with beta = 0 (C never read, as GemmParams' beta = 0; a NaN there is
//                   cleared), else scaled in fp32 (a bf16 C rounded once). k, trans_b and b_group_stride
//                   are unused.
struct GroupedGemmParams {
  int64_t groups = 0;
  const int64_t* offsets = nullptr;  // host memory, [groups + 1]
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;        // m_grouped
  int64_t b_group_stride = 0;  // m_grouped: elements between experts' B
  DType ab_dtype = DType::f32;
  void* c = nullptr;  // c_dtype elements
  int64_t ldc = 0;
  int64_t c_group_stride = 0;  // k_grouped: elements between experts' C
  DType c_dtype = DType::f32;
  float alpha = 1.0f;
  float beta = 0.0f;
};

// Shared by both backends' grouped GEMMs. The parameter rules above (false with the reason, naming `op`, in
// *reason when not null): dtypes as GemmParams, groups >= 1, offsets set, positive non-grouped sizes, leading
// dimensions and strides that fit; k_grouped: the groups' C disjoint.
bool supports_grouped_gemm(const char* op, bool k_grouped, const GroupedGemmParams& p, std::string* reason);
// What the kernels check when they run (the offsets are data): fails with one line unless the host offsets
// are non-decreasing from offsets[0] >= 0, and the operands the groups use are set (none are where no group
// has rows, except a k_grouped C that beta != 1 rewrites).
void check_grouped_gemm_offsets(const char* op, bool k_grouped, const GroupedGemmParams& p);
// Group g's GEMM (offsets[g + 1] > offsets[g]): its sub-matrices as GemmParams.
GemmParams m_grouped_gemm_group(const GroupedGemmParams& p, int64_t g);
GemmParams k_grouped_gemm_group(const GroupedGemmParams& p, int64_t g);
// The CPU's pieces of a group of `rows` rows, as (first row, rows) in order: whole chunks of 256 rows, then
// one piece of a multiple of 32, then the rest. oneDNN compiles a kernel per GEMM shape (about 1.4 ms on a
// Xeon with AMX) and the groups' sizes change every micro-batch: run whole, a Mixtral step spent a third of
// its time compiling, and the compiled kernels piled up without bound. In pieces, a layout has at most 39
// shapes.
std::vector<std::pair<int64_t, int64_t>> grouped_gemm_pieces(int64_t rows);
// Piece [first, first + rows) of group g's GEMM (q = m_grouped_gemm_group or k_grouped_gemm_group's): its
// rows of A and C (m_grouped), or of A and B with beta = 1 after the first piece (k_grouped).
GemmParams grouped_gemm_piece(const GemmParams& q, bool k_grouped, int64_t first, int64_t rows);

// The op list (op_list.h) names every op once; everything below follows from it.
enum class OpId : int {
#define FORGE_OP_ID(name, result, params, args) name,
  FORGE_OPS(FORGE_OP_ID)
#undef FORGE_OP_ID
};
// The op's name as the list spells it ("gemm", "rmsnorm_forward", ...).
const char* op_name(OpId id);

// One backend's ops, and for each its support query: supports_<op>(same arguments, reason) is false where the
// backend would refuse the parameters, with the one-line error the op would fail with in *reason (when not
// null). It judges the parameters alone (shapes, dtypes, strides, alignment, which pointers are set): not the
// data (token ids, targets), not whether pointers are device memory or a GPU is present, which the op checks
// when it runs. Every op checks its parameters through the same predicate, so a caller that skips the query
// gets the same line as an error.
struct OpTable {
  const char* name;
#define FORGE_OP_MEMBERS(name, result, params, args) \
  result(*name) params;                              \
  bool(*supports_##name) FORGE_OP_APPEND(params, std::string* reason);
  FORGE_OPS(FORGE_OP_MEMBERS)
#undef FORGE_OP_MEMBERS
};

const OpTable& cpu_table();
// The CUDA backend's table (kernels/cuda; built with FORGE_CUDA). Its ops take device pointers.
const OpTable& cuda_table();
// The table of a device; fails with one line when that backend is not built into this binary. An open op
// profile (profiler.h) or an override comes first.
const OpTable& table(Device device);
// Replaces a (non-host) device's table, null to restore its backend's (the device emulation of
// kernels/emulated_device.h). Install before running work, remove after.
void override_table(Device device, const OpTable* table);

// ops::gemm(p, device), ops::add_inplace(y, x, n, device), ...: the op on `device`'s table; and
// ops::supports_gemm(p, device, &reason), ...: whether that table takes these parameters (see OpTable).
#define FORGE_OP_WRAPPERS(name, result, params, args)                                               \
  inline result name FORGE_OP_APPEND(params, Device d = Device::cpu) { return table(d).name args; } \
  inline bool supports_##name FORGE_OP_APPEND(params, Device d = Device::cpu,                       \
                                              std::string* reason = nullptr) {                      \
    return table(d).supports_##name FORGE_OP_APPEND(args, reason);                                  \
  }
FORGE_OPS(FORGE_OP_WRAPPERS)
#undef FORGE_OP_WRAPPERS

}  // namespace forge::ops
