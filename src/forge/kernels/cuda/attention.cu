// Grouped-query attention on the CUDA backend: ops::AttentionParams semantics (kernels/ops.h) on device
// memory, the CPU kernels' (cpu/attention.cpp, cpu/attention_decode.cpp) parameter checks and messages.
//
//   forward   stage q (scaled into base-2 logits), k, v as dense zero-padded bf16 copies
//   (attention_tiles.cuh),
//             then the FlashAttention-2 tensor-core kernel (attention_forward.cuh). A few queries against a
//             longer cache (decoding) instead run fp32 kernels that read the cache in place
//             (attention_decode.cuh).
//   backward  stage q, k, v, dout and each row's delta = <dout, out> and lse * log2(e), then the key kernel
//             (dK, dV) and the query kernel (dQ) of attention_backward.cuh: deterministic, no atomics.
//
// The head dimension is padded to 64, 128 or 256 (zeros), so any head_dim up to 256 runs on the same kernels;
// 64 and 128 waste nothing. v (and out, dout, dv) may have another width, v_head_dim: the tensor-core kernels
// then run at the wider of the two, padded, each copy zero past its own width (DeepSeek-V3's 192 / 128 at
// 256). The decode kernels take rows up to 576 wide (MLA's absorbed decode: q/k 576, v 512 aliasing the
// keys). Products are bf16 x bf16 with fp32 accumulation, softmax statistics fp32.
//
// Every check below runs before the first CUDA call, so bad parameters fail the same way with or without a
// GPU.
#include <algorithm>
#include <cstdint>
#include <string>

#include "forge/kernels/cuda/attention_backward.cuh"
#include "forge/kernels/cuda/attention_decode.cuh"
#include "forge/kernels/cuda/attention_forward.cuh"
#include "forge/kernels/cuda/attention_tiles.cuh"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

using attention::kLog2e;
using attention::kRowPadding;

constexpr int64_t kMaxHeadDim = 256;  // the tensor-core kernels' widest tiles
constexpr int64_t kMaxGridYZ = 65535;

std::string str(int64_t x) { return std::to_string(x); }

[[noreturn]] void fail(const std::string& message) { fail_message(message); }
bool refuse(std::string* reason, const std::string& message) {
  if (reason) *reason = message;
  return false;
}

// v_head_dim, kv_seq and the k, v head and batch strides with their defaults filled in (as
// cpu/attention.cpp).
ops::AttentionParams with_defaults(ops::AttentionParams p) {
  if (p.v_head_dim == 0) p.v_head_dim = p.head_dim;
  if (p.kv_seq == 0) p.kv_seq = p.seq;
  if (p.k_head_stride == 0) p.k_head_stride = p.head_dim;
  if (p.v_head_stride == 0) p.v_head_stride = p.v_head_dim;
  if (p.k_batch_stride == 0) p.k_batch_stride = std::max(p.kv_seq * p.k_stride, p.kv_heads * p.k_head_stride);
  if (p.v_batch_stride == 0) p.v_batch_stride = std::max(p.kv_seq * p.v_stride, p.kv_heads * p.v_head_stride);
  return p;
}

// As the CPU: a few queries against a longer cache take the decode kernels; training's square attention
// never. Expects kv_seq resolved.
bool use_decode_kernels(const ops::AttentionParams& p) {
  return p.seq <= attention::kDecodeMaxQueries && (p.kv_seq != p.seq || p.q_offset != 0);
}

// cpu/attention.cpp's predicate, message for message, plus this backend's own limits.
bool supports(const ops::AttentionParams& p, bool backward, std::string* reason) {
  if (!(p.batch > 0 && p.seq > 0 && p.heads > 0 && p.kv_heads > 0 && p.head_dim > 0))
    return refuse(reason, "attention: empty shape batch=" + str(p.batch) + " seq=" + str(p.seq) + " heads=" +
                              str(p.heads) + " kv_heads=" + str(p.kv_heads) + " head_dim=" + str(p.head_dim));
  if (p.heads % p.kv_heads != 0)
    return refuse(reason,
                  "attention: heads " + str(p.heads) + " not a multiple of kv_heads " + str(p.kv_heads));
  if (p.v_head_dim < 0) return refuse(reason, "attention: negative v_head_dim " + str(p.v_head_dim));
  if (p.window < 0) return refuse(reason, "attention: negative window " + str(p.window));
  // The CUDA kernels mask causally only: a window that hides keys is refused rather than computed over them
  // all (one as long as the sequence hides none).
  if (p.window > 0 && p.window < p.q_offset + p.seq)
    return refuse(reason, "attention: a sliding window (window " + str(p.window) +
                              ") is not implemented by the CUDA attention kernels; run on the CPU");
  if (p.softcap != 0.0f)
    return refuse(reason, "attention: logit soft-capping (softcap " + std::to_string(p.softcap) +
                              ") is not implemented by the CUDA attention kernels; run on the CPU");
  const int64_t v_dim = p.v_head_dim == 0 ? p.head_dim : p.v_head_dim;
  if (!(p.kv_seq >= 0 && p.q_offset >= 0 && p.k_batch_stride >= 0 && p.v_batch_stride >= 0 &&
        p.k_head_stride >= 0 && p.v_head_stride >= 0))
    return refuse(reason, "attention: negative kv_seq " + str(p.kv_seq) + ", q_offset " + str(p.q_offset) +
                              " or stride");
  const int64_t kv_seq = p.kv_seq == 0 ? p.seq : p.kv_seq;
  if (p.causal && p.q_offset + p.seq > kv_seq)
    return refuse(reason, "attention: queries at positions " + str(p.q_offset) + ".." +
                              str(p.q_offset + p.seq - 1) + " need their keys, but kv_seq is " + str(kv_seq));
  if (!(p.q_offset + p.seq < (int64_t{1} << 24) && kv_seq < (int64_t{1} << 24)))
    return refuse(reason, "attention: seq " + str(p.q_offset + p.seq) + " / kv_seq " + str(kv_seq) +
                              " too long (positions are compared as floats)");
  if (!(p.q && p.k && p.v && p.out)) return refuse(reason, "attention: q, k, v and out must be set");
  if (!(p.k.dtype() == p.dtype() && p.v.dtype() == p.dtype() && p.out.dtype() == p.dtype()))
    return refuse(reason, "attention: q, k, v and out must hold one dtype (q " +
                              std::string(dtype_name(p.q.dtype())) + ", k " +
                              std::string(dtype_name(p.k.dtype())) + ", v " +
                              std::string(dtype_name(p.v.dtype())) + ", out " +
                              std::string(dtype_name(p.out.dtype())) + ")");
  if (!(p.lse || !backward)) return refuse(reason, "attention backward: lse must be set");
  const int64_t q_width = p.heads * p.head_dim, kv_width = p.kv_heads * p.head_dim;
  const int64_t out_width = p.heads * v_dim, v_width = p.kv_heads * v_dim;
  if (!(p.q_stride >= q_width && p.out_stride >= out_width))
    return refuse(reason, "attention: q_stride " + str(p.q_stride) + " / out_stride " + str(p.out_stride) +
                              " < " + str(q_width) + " / " + str(out_width));
  const int64_t k_head = p.k_head_stride == 0 ? p.head_dim : p.k_head_stride;
  const int64_t v_head = p.v_head_stride == 0 ? v_dim : p.v_head_stride;
  if (!(k_head >= p.head_dim && v_head >= v_dim))
    return refuse(reason, "attention: head strides " + str(k_head) + " / " + str(v_head) + " < head_dim " +
                              str(p.head_dim) + " / v_head_dim " + str(v_dim));
  // (One key per sequence: its token stride is never stepped, so a cache of one position, whose heads lie
  // head_dim apart, passes whichever layout it reads as.)
  if (!(kv_seq == 1 || (p.k_stride >= (k_head == p.head_dim ? kv_width : p.head_dim) &&
                        p.v_stride >= (v_head == v_dim ? v_width : v_dim))))
    return refuse(reason, "attention: k_stride " + str(p.k_stride) + " / v_stride " + str(p.v_stride) +
                              " too small for " + str(p.kv_heads) + " kv heads of " + str(p.head_dim) +
                              " / " + str(v_dim));
  if (!(p.batch == 1 ||
        ((p.k_batch_stride == 0 || p.k_batch_stride >= std::max(kv_seq * p.k_stride, p.kv_heads * k_head)) &&
         (p.v_batch_stride == 0 || p.v_batch_stride >= std::max(kv_seq * p.v_stride, p.kv_heads * v_head)))))
    return refuse(reason, "attention: batch strides " + str(p.k_batch_stride) + " / " +
                              str(p.v_batch_stride) + " overlap sequences of " + str(kv_seq) + " keys");
  // This backend's limits: the widest rows of each kernel family, and the decode grid's y and z extents
  // (heads and batch).
  ops::AttentionParams resolved = p;
  resolved.kv_seq = kv_seq;
  if (!backward && use_decode_kernels(resolved)) {
    if (p.dtype() != DType::f32)
      return refuse(reason,
                    "attention: decoding over a key/value cache takes fp32 queries, keys and values, not " +
                        std::string(dtype_name(p.dtype())));
    if (p.head_dim > attention::kDecodeMaxHeadDim || v_dim > attention::kDecodeMaxHeadDim)
      return refuse(reason, "attention: head_dim " + str(p.head_dim) + " / v_head_dim " + str(v_dim) + " > " +
                                str(attention::kDecodeMaxHeadDim) +
                                " is not supported by the CUDA backend's decode kernels");
  } else if (p.head_dim > kMaxHeadDim || v_dim > kMaxHeadDim) {
    const std::string what =
        p.head_dim > kMaxHeadDim ? "head_dim " + str(p.head_dim) : "v_head_dim " + str(v_dim);
    return refuse(reason, "attention: " + what + " > " + str(kMaxHeadDim) +
                              " is not supported on the CUDA backend (by its tensor-core kernels; the decode "
                              "kernels, for up to " +
                              str(attention::kDecodeMaxQueries) +
                              " queries against a longer cache, take up to " +
                              str(attention::kDecodeMaxHeadDim) + ")");
  }
  if (p.heads > kMaxGridYZ || p.batch > kMaxGridYZ)
    return refuse(reason, "attention: heads " + str(p.heads) + " / batch " + str(p.batch) +
                              " exceed the CUDA grid's " + str(kMaxGridYZ));
  if (!backward) return true;
  if (!(kv_seq == p.seq && p.q_offset == 0 && k_head == p.head_dim && v_head == v_dim &&
        (p.k_batch_stride == 0 || p.k_batch_stride == p.seq * p.k_stride) &&
        (p.v_batch_stride == 0 || p.v_batch_stride == p.seq * p.v_stride)))
    return refuse(reason,
                  "attention backward: only square attention (no kv_seq, q_offset, head or batch strides) is "
                  "supported");
  if (!(p.dout && p.dq && p.dk && p.dv))
    return refuse(reason, "attention backward: dout, dq, dk and dv must be set");
  if (!(p.dout.dtype() == p.dtype() && p.dq.dtype() == p.dtype() && p.dk.dtype() == p.dtype() &&
        p.dv.dtype() == p.dtype()))
    return refuse(reason, "attention backward: dout, dq, dk and dv must hold q's dtype " +
                              std::string(dtype_name(p.dtype())));
  if (!(p.dout_stride >= out_width && p.dq_stride >= q_width))
    return refuse(reason, "attention backward: dout_stride " + str(p.dout_stride) + " / dq_stride " +
                              str(p.dq_stride) + " < " + str(out_width) + " / " + str(q_width));
  if (!(p.dk_stride >= kv_width && p.dv_stride >= v_width))
    return refuse(reason, "attention backward: dk_stride " + str(p.dk_stride) + " / dv_stride " +
                              str(p.dv_stride) + " < " + str(kv_width) + " / " + str(v_width));
  return true;
}

void check_params(const ops::AttentionParams& p, bool backward) {
  if (std::string why; !supports(p, backward, &why)) fail(why);
}

int padded_head_dim(int64_t head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }
int64_t padded_rows(int64_t rows) { return (rows + kRowPadding - 1) / kRowPadding * kRowPadding; }
// Whether rows of `x` starting at multiples of 4 elements take 4-element vector loads (16 bytes of fp32, 8
// of bf16).
bool aligned4(ConstElements x) {
  return reinterpret_cast<uintptr_t>(x.get()) % (4 * dtype_size(x.dtype())) == 0;
}

// A bf16 copy [batch, heads, padded_rows(tokens), dim] of fp32 or bf16 rows at src + b * batch_stride +
// h * head_stride + t * token_stride.
attention::StagingParams staging(ConstElements src, int64_t batch_stride, int64_t head_stride,
                                 int64_t token_stride, int64_t batch, int64_t heads, int64_t tokens,
                                 int64_t head_dim, int dim, float factor, uint16_t* dst) {
  attention::StagingParams s;
  s.src = src.get(), s.src_bf16 = src.dtype() == DType::bf16;
  s.batch_stride = batch_stride, s.head_stride = head_stride, s.token_stride = token_stride;
  s.batch = batch, s.heads = heads, s.tokens = tokens, s.padded_tokens = padded_rows(tokens);
  s.head_dim = static_cast<int>(head_dim), s.padded_dim = dim, s.factor = factor, s.dst = dst;
  s.vector_loads = aligned4(src) && batch_stride % 4 == 0 && head_stride % 4 == 0 && token_stride % 4 == 0;
  return s;
}

void stage(const attention::StagingParams& s) {
  const int64_t rows = s.batch * s.heads * s.padded_tokens;
  attention::stage_rows_bf16_kernel<<<detail::grid_blocks(rows, attention::kStagingThreads / 32),
                                      attention::kStagingThreads, 0, stream()>>>(s);
  FORGE_CUDA_CHECK_LAUNCH("attention staging");
}

// Kernels with more than 48 KiB of dynamic shared memory must say so once before their first launch.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, int bytes) {
  FORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

unsigned grid_x(int64_t blocks, const char* what) {
  if (blocks > 0x7fffffff) fail(std::string("attention: ") + what + " grid of " + str(blocks) + " blocks");
  return static_cast<unsigned>(blocks);
}

template <int D>
void launch_forward(const attention::ForwardParams& f) {
  constexpr int bytes = attention::ForwardShape<D>::kSharedBytes;
  static const bool configured = (allow_shared_memory(attention::attention_forward_kernel<D>, bytes), true);
  (void)configured;
  const int64_t blocks = (f.seq + attention::kForwardRows - 1) / attention::kForwardRows * f.batch * f.heads;
  attention::attention_forward_kernel<D>
      <<<grid_x(blocks, "forward"), attention::kForwardThreads, bytes, stream()>>>(f);
  FORGE_CUDA_CHECK_LAUNCH("attention_forward");
}

template <int D>
void launch_backward(const attention::BackwardParams& bp) {
  using Shape = attention::BackwardShape<D>;
  static const bool configured =
      (allow_shared_memory(attention::attention_key_kernel<D>, Shape::kKeySharedBytes),
       allow_shared_memory(attention::attention_query_kernel<D>, Shape::kQuerySharedBytes), true);
  (void)configured;
  const int64_t key_blocks =
      (bp.seq + Shape::kKeysPerCta - 1) / Shape::kKeysPerCta * Shape::kSplits * bp.batch * bp.kv_heads;
  attention::attention_key_kernel<D>
      <<<grid_x(key_blocks, "key"), Shape::kWarps * 32, Shape::kKeySharedBytes, stream()>>>(bp);
  FORGE_CUDA_CHECK_LAUNCH("attention_backward (dK, dV)");
  const int64_t query_blocks =
      (bp.seq + attention::kQueryRows - 1) / attention::kQueryRows * bp.batch * bp.heads;
  attention::attention_query_kernel<D>
      <<<grid_x(query_blocks, "query"), attention::kQueryThreads, Shape::kQuerySharedBytes, stream()>>>(bp);
  FORGE_CUDA_CHECK_LAUNCH("attention_backward (dQ)");
}

void forward_decode(const ops::AttentionParams& p) {
  attention::DecodeParams d;
  d.q = p.q.f32(), d.q_stride = p.q_stride, d.k = p.k.f32(), d.v = p.v.f32();
  d.k_stride = p.k_stride, d.v_stride = p.v_stride, d.k_head_stride = p.k_head_stride;
  d.v_head_stride = p.v_head_stride, d.k_batch_stride = p.k_batch_stride, d.v_batch_stride = p.v_batch_stride;
  d.out = p.out.f32(), d.out_stride = p.out_stride, d.lse = p.lse;
  d.heads = p.heads, d.group = p.heads / p.kv_heads, d.seq = p.seq, d.kv_seq = p.kv_seq,
  d.q_offset = p.q_offset;
  d.key_end = p.causal ? std::min(p.kv_seq, p.q_offset + p.seq) : p.kv_seq;
  d.chunks = (d.key_end + attention::kDecodeKeys - 1) / attention::kDecodeKeys;
  d.head_dim = static_cast<int>(p.head_dim), d.v_head_dim = static_cast<int>(p.v_head_dim);
  d.factor = p.scale * kLog2e, d.causal = p.causal;
  const int64_t items = p.batch * p.heads * d.chunks * p.seq;
  const size_t partial_bytes = detail::align_bytes(static_cast<size_t>(items * p.v_head_dim) * sizeof(float));
  const size_t stats_bytes = detail::align_bytes(static_cast<size_t>(items) * sizeof(float));
  detail::StreamScratch scratch(partial_bytes + 2 * stats_bytes);
  d.partial = scratch.as<float>();
  d.partial_max = scratch.as<float>(partial_bytes);
  d.partial_sum = scratch.as<float>(partial_bytes + stats_bytes);
  const dim3 chunk_grid(grid_x(d.chunks, "decode"), static_cast<unsigned>(p.heads),
                        static_cast<unsigned>(p.batch));
  attention::attention_decode_chunk_kernel<<<chunk_grid, attention::kDecodeKeys,
                                             attention::decode_shared_bytes(p.seq, p.head_dim), stream()>>>(
      d);
  FORGE_CUDA_CHECK_LAUNCH("attention_forward (decode chunks)");
  const dim3 row_grid(static_cast<unsigned>(p.seq), static_cast<unsigned>(p.heads),
                      static_cast<unsigned>(p.batch));
  attention::attention_decode_combine_kernel<<<row_grid, attention::kDecodeKeys, 0, stream()>>>(d);
  FORGE_CUDA_CHECK_LAUNCH("attention_forward (decode combine)");
}

}  // namespace

bool supports_attention_forward(const ops::AttentionParams& p, std::string* reason) {
  return supports(p, false, reason);
}
bool supports_attention_backward(const ops::AttentionParams& p, std::string* reason) {
  return supports(p, true, reason);
}

void attention_forward(const ops::AttentionParams& params) {
  check_params(params, false);
  const ops::AttentionParams p = with_defaults(params);
  if (use_decode_kernels(p)) return forward_decode(p);

  const int dim = padded_head_dim(std::max(p.head_dim, p.v_head_dim));
  const int64_t padded_seq = padded_rows(p.seq), padded_kv_seq = padded_rows(p.kv_seq);
  const size_t q_bytes = detail::align_bytes(static_cast<size_t>(p.batch * p.heads * padded_seq * dim) * 2);
  const size_t kv_bytes =
      detail::align_bytes(static_cast<size_t>(p.batch * p.kv_heads * padded_kv_seq * dim) * 2);
  detail::StreamScratch scratch(q_bytes + 2 * kv_bytes);
  uint16_t* q = scratch.as<uint16_t>();
  uint16_t* k = scratch.as<uint16_t>(q_bytes);
  uint16_t* v = scratch.as<uint16_t>(q_bytes + kv_bytes);
  stage(staging(p.q, p.seq * p.q_stride, p.head_dim, p.q_stride, p.batch, p.heads, p.seq, p.head_dim, dim,
                p.scale * kLog2e, q));
  stage(staging(p.k, p.k_batch_stride, p.k_head_stride, p.k_stride, p.batch, p.kv_heads, p.kv_seq, p.head_dim,
                dim, 1.0f, k));
  stage(staging(p.v, p.v_batch_stride, p.v_head_stride, p.v_stride, p.batch, p.kv_heads, p.kv_seq,
                p.v_head_dim, dim, 1.0f, v));

  attention::ForwardParams f;
  f.q = q, f.k = k, f.v = v, f.out = p.out.get(), f.out_bf16 = p.out.dtype() == DType::bf16;
  f.out_stride = p.out_stride, f.lse = p.lse;
  f.batch = p.batch, f.heads = p.heads, f.kv_heads = p.kv_heads, f.group = p.heads / p.kv_heads,
  f.seq = p.seq, f.kv_seq = p.kv_seq;
  f.q_offset = p.q_offset, f.padded_seq = padded_seq, f.padded_kv_seq = padded_kv_seq;
  f.head_dim = static_cast<int>(p.head_dim), f.v_head_dim = static_cast<int>(p.v_head_dim);
  f.causal = p.causal;
  switch (dim) {
    case 64:
      return launch_forward<64>(f);
    case 128:
      return launch_forward<128>(f);
    default:
      return launch_forward<256>(f);
  }
}

void attention_backward(const ops::AttentionParams& params) {
  check_params(params, true);
  const ops::AttentionParams p = with_defaults(params);
  const int dim = padded_head_dim(std::max(p.head_dim, p.v_head_dim));
  const int64_t padded_seq = padded_rows(p.seq);
  const size_t q_bytes = detail::align_bytes(static_cast<size_t>(p.batch * p.heads * padded_seq * dim) * 2);
  const size_t kv_bytes =
      detail::align_bytes(static_cast<size_t>(p.batch * p.kv_heads * padded_seq * dim) * 2);
  const size_t row_bytes = detail::align_bytes(static_cast<size_t>(p.batch * p.heads * padded_seq) * 4);
  detail::StreamScratch scratch(2 * q_bytes + 2 * kv_bytes + 2 * row_bytes);
  uint16_t* q = scratch.as<uint16_t>();
  uint16_t* dout = scratch.as<uint16_t>(q_bytes);
  uint16_t* k = scratch.as<uint16_t>(2 * q_bytes);
  uint16_t* v = scratch.as<uint16_t>(2 * q_bytes + kv_bytes);
  float* lse2 = scratch.as<float>(2 * q_bytes + 2 * kv_bytes);
  float* delta = scratch.as<float>(2 * q_bytes + 2 * kv_bytes + row_bytes);
  stage(staging(p.q, p.seq * p.q_stride, p.head_dim, p.q_stride, p.batch, p.heads, p.seq, p.head_dim, dim,
                p.scale * kLog2e, q));
  stage(staging(p.k, p.k_batch_stride, p.k_head_stride, p.k_stride, p.batch, p.kv_heads, p.seq, p.head_dim,
                dim, 1.0f, k));
  stage(staging(p.v, p.v_batch_stride, p.v_head_stride, p.v_stride, p.batch, p.kv_heads, p.seq, p.v_head_dim,
                dim, 1.0f, v));
  attention::StagingParams s = staging(p.dout, p.seq * p.dout_stride, p.v_head_dim, p.dout_stride, p.batch,
                                       p.heads, p.seq, p.v_head_dim, dim, 1.0f, dout);
  s.dot = p.out.get(), s.dot_bf16 = p.out.dtype() == DType::bf16, s.dot_token_stride = p.out_stride;
  s.dot_vector_loads = aligned4(p.out) && p.out_stride % 4 == 0 && p.v_head_dim % 4 == 0;
  s.lse = p.lse, s.delta = delta, s.lse2 = lse2;
  stage(s);

  attention::BackwardParams bp;
  bp.q = q, bp.dout = dout, bp.k = k, bp.v = v, bp.lse2 = lse2, bp.delta = delta;
  bp.dq = p.dq.get(), bp.dk = p.dk.get(), bp.dv = p.dv.get(), bp.grads_bf16 = p.dtype() == DType::bf16;
  bp.dq_stride = p.dq_stride, bp.dk_stride = p.dk_stride, bp.dv_stride = p.dv_stride;
  bp.batch = p.batch, bp.heads = p.heads, bp.kv_heads = p.kv_heads, bp.group = p.heads / p.kv_heads,
  bp.seq = p.seq;
  bp.padded_seq = padded_seq, bp.head_dim = static_cast<int>(p.head_dim);
  bp.v_head_dim = static_cast<int>(p.v_head_dim), bp.scale = p.scale;
  bp.causal = p.causal;
  switch (dim) {
    case 64:
      return launch_backward<64>(bp);
    case 128:
      return launch_backward<128>(bp);
    default:
      return launch_backward<256>(bp);
  }
}

}  // namespace forge::cuda
