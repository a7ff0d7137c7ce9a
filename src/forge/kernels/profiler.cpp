#include "forge/kernels/profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/kernels/ops.h"

#ifdef FORGE_HAVE_CUDA
#include "forge/kernels/cuda/runtime.h"
#endif

namespace forge::ops {
namespace {

using Clock = std::chrono::steady_clock;

// What one call costs and how its row is named.
struct Cost {
  std::string detail;
  double flops = 0, bytes = 0;
};

double d(int64_t v) { return static_cast<double>(v); }
// Bytes per element of an fp32 or bf16 tensor.
double size_of(ConstElements p) { return d(dtype_size(p.dtype())); }
char layout(bool trans) { return trans ? 'T' : 'N'; }

std::string matrix(int64_t rows, int64_t cols) { return fmt::format("{}x{}", rows, cols); }
std::string vector_of(int64_t n) { return fmt::format("n={}", n); }

// Query-key pairs the mask lets through, per (sequence, head): query t (position q_offset + t) sees keys
// [0, min(kv_seq, q_offset + t + 1)).
double visible_pairs(const AttentionParams& p) {
  const int64_t kv = p.kv_seq > 0 ? p.kv_seq : p.seq;
  if (!p.causal) return d(p.seq) * d(kv);
  // Rows t < kv - q_offset see q_offset + t + 1 keys; the rest see all kv.
  const int64_t partial = std::clamp<int64_t>(kv - p.q_offset, 0, p.seq);
  const double first = d(p.q_offset + 1), last = d(p.q_offset + partial);
  return d(partial) * (first + last) / 2.0 + d(p.seq - partial) * d(kv);
}

Cost attention_cost(const AttentionParams& p, bool backward) {
  const int64_t kv = p.kv_seq > 0 ? p.kv_seq : p.seq;
  const int64_t v_dim = p.v_head_dim > 0 ? p.v_head_dim : p.head_dim;
  // Forward: S = Q K^T (head_dim) and O = P V (v_head_dim), 2 FLOPs per multiply-add each. Backward: S and
  // dQ = dS K, dK = dS^T Q (head_dim), dV = P^T dO and dP = dO V^T (v_head_dim): 2.5 times the forward when
  // the two are equal.
  const double pairs = visible_pairs(p) * d(p.batch) * d(p.heads);
  const double forward = 2.0 * (d(p.head_dim) + d(v_dim)) * pairs;
  const double element = d(dtype_size(p.dtype()));
  const double q = d(p.batch) * d(p.seq) * d(p.heads) * d(p.head_dim) * element;
  const double out = d(p.batch) * d(p.seq) * d(p.heads) * d(v_dim) * element;
  const double kv_bytes = d(p.batch) * d(kv) * d(p.kv_heads) * (d(p.head_dim) + d(v_dim)) * element;
  std::string detail = fmt::format("b{} s{} h{}/{} d{}{}{}", p.batch, p.seq, p.heads, p.kv_heads, p.head_dim,
                                   p.causal ? " causal" : "", p.dtype() == DType::bf16 ? " bf16" : "");
  if (v_dim != p.head_dim) detail += fmt::format(" v{}", v_dim);
  if (kv != p.seq) detail += fmt::format(" kv{}", kv);
  // Forward reads q, k, v and writes out; backward reads q, k, v and dout, writes dq, dk, dv.
  return backward ? Cost{std::move(detail), 2.0 * (3 * d(p.head_dim) + 2 * d(v_dim)) * pairs,
                         2 * q + out + 2 * kv_bytes}
                  : Cost{std::move(detail), forward, q + out + kv_bytes};
}

Cost cast_cost(const Fp8CastParams& p, const char* blocks) {
  const double n = d(p.rows) * d(p.cols);
  std::string what = p.q && p.q_t ? "rows+transpose" : p.q_t ? "transpose" : "rows";
  return {fmt::format("{} {} {} from {}{}", dtype_name(p.fp8), matrix(p.rows, p.cols), what,
                      dtype_name(p.x.dtype()), blocks),
          0, size_of(p.x) * n + n * ((p.q ? 1 : 0) + (p.q_t ? 1 : 0))};
}

// What each op costs, by the op's name (op_list.h): the row's detail, the FLOPs and the bytes of one call.
namespace cost {

Cost gemm(const GemmParams& p) {
  const double ab = d(dtype_size(p.ab_dtype)), c = d(dtype_size(p.c_dtype)) * (p.beta != 0.0f ? 2 : 1);
  return {fmt::format("{} {}{} {}x{}x{} -> {}{}", dtype_name(p.ab_dtype), layout(p.trans_a),
                      layout(p.trans_b), p.m, p.n, p.k, dtype_name(p.c_dtype), p.beta != 0.0f ? " (+=)" : ""),
          2.0 * d(p.m) * d(p.n) * d(p.k), ab * d(p.m) * d(p.k) + ab * d(p.k) * d(p.n) + c * d(p.m) * d(p.n)};
}

Cost fp8_gemm(const Fp8GemmParams& p) {
  const double c = d(dtype_size(p.c_dtype)) * (p.beta != 0.0f ? 2 : 1);
  return {fmt::format("{}x{} {} {}{} {}x{}x{} -> {}{}", dtype_name(p.a_dtype), dtype_name(p.b_dtype),
                      p.scaling == Fp8Scaling::block ? "block" : "per-tensor", layout(p.trans_a),
                      layout(p.trans_b), p.m, p.n, p.k, dtype_name(p.c_dtype), p.beta != 0.0f ? " (+=)" : ""),
          2.0 * d(p.m) * d(p.n) * d(p.k), d(p.m) * d(p.k) + d(p.k) * d(p.n) + c * d(p.m) * d(p.n)};
}

Cost rmsnorm_forward(const RmsNormParams& p) { return {matrix(p.rows, p.dim), 0, 8 * d(p.rows) * d(p.dim)}; }
Cost rmsnorm_backward_input(const RmsNormParams& p) {
  return {matrix(p.rows, p.dim), 0, 12 * d(p.rows) * d(p.dim)};
}
Cost rmsnorm_backward_weight(const RmsNormParams& p) {
  return {matrix(p.rows, p.dim), 0, 8 * d(p.rows) * d(p.dim)};
}

Cost rope(const RopeParams& p) {
  return {fmt::format("b{} s{} h{} d{}{}", p.batch, p.seq, p.heads, p.head_dim, p.inverse ? " inverse" : ""),
          0, 8 * d(p.batch) * d(p.seq) * d(p.heads) * d(p.head_dim)};
}

// Forward reads gate and up and writes out (3 elements per output); backward reads gate, up and dout and
// writes both gradients (5). bf16 tensors move half the bytes (and say so in the detail).
Cost glu(const SwigluParams& p, double elements) {
  const double size = static_cast<double>(dtype_size(p.dtype));
  return {matrix(p.rows, p.ffn) + (p.dtype == DType::f32 ? "" : fmt::format(" {}", dtype_name(p.dtype))), 0,
          elements * size * d(p.rows) * d(p.ffn)};
}
Cost swiglu_forward(const SwigluParams& p) { return glu(p, 3); }
Cost swiglu_backward(const SwigluParams& p) { return glu(p, 5); }

// Reads x and writes y; the mask is computed, not read (one Philox block per four elements).
Cost dropout(const DropoutParams& p) {
  const double size = static_cast<double>(dtype_size(p.dtype));
  return {matrix(p.rows, p.cols) + fmt::format(" p={}", p.rate), 0, 2 * size * d(p.rows) * d(p.cols)};
}

// LayerNorm: the row's two reductions and the normalisation stay in cache, so each pass reads and writes its
// arrays once (weight, bias and the per-row statistics are small).
Cost layernorm_forward(const LayerNormParams& p) {
  return {matrix(p.rows, p.dim), 0, 8 * d(p.rows) * d(p.dim)};
}
Cost layernorm_backward_input(const LayerNormParams& p) {
  return {matrix(p.rows, p.dim), 0, 12 * d(p.rows) * d(p.dim)};
}
Cost layernorm_backward_weight(const LayerNormParams& p) {
  return {matrix(p.rows, p.dim) + (p.dbias ? " +bias" : ""), 0, 8 * d(p.rows) * d(p.dim)};
}

Cost gelu_forward(const GeluParams& p) {
  return {vector_of(p.n) + " " + gelu_kind_name(p.kind), 0, 8 * d(p.n)};
}
Cost gelu_backward(const GeluParams& p) {
  return {vector_of(p.n) + " " + gelu_kind_name(p.kind), 0, 12 * d(p.n)};
}

// bias_add reads and writes y; bias_backward reads dy (the bias itself is one row).
Cost bias_add(const BiasParams& p) { return {matrix(p.rows, p.n), 0, 8 * d(p.rows) * d(p.n)}; }
Cost bias_backward(const BiasParams& p) { return {matrix(p.rows, p.n), 0, 4 * d(p.rows) * d(p.n)}; }

Cost attention_forward(const AttentionParams& p) { return attention_cost(p, false); }
Cost attention_backward(const AttentionParams& p) { return attention_cost(p, true); }

Cost embedding_forward(const EmbeddingParams& p) {
  return {matrix(p.rows, p.dim), 0, 8 * d(p.rows) * d(p.dim)};
}
Cost embedding_backward_weight(const EmbeddingParams& p) {
  return {matrix(p.rows, p.dim), 0, 12 * d(p.rows) * d(p.dim)};
}

Cost linear_cross_entropy_forward(const LinearCrossEntropyParams& p) {
  const double s = d(dtype_size(p.gemm_dtype)), logits = d(p.rows) * d(p.vocab);
  return {fmt::format("{} {}x{}x{}{}", dtype_name(p.gemm_dtype), p.rows, p.vocab, p.dim,
                      p.keep_logits ? " keep" : ""),
          2 * logits * d(p.dim), s * (d(p.rows) + d(p.vocab)) * d(p.dim) + (p.keep_logits ? 4 * logits : 0)};
}

Cost linear_cross_entropy_backward(const LinearCrossEntropyParams& p) {
  const double s = d(dtype_size(p.gemm_dtype)), logits = d(p.rows) * d(p.vocab);
  // dhidden and dweight from the chunk's gradients, and the logits again unless they were kept.
  return {fmt::format("{} {}x{}x{}{}", dtype_name(p.gemm_dtype), p.rows, p.vocab, p.dim,
                      p.keep_logits ? " keep" : ""),
          (p.keep_logits ? 4 : 6) * logits * d(p.dim),
          s * (d(p.rows) + d(p.vocab)) * d(p.dim) + 4 * d(p.rows) * d(p.dim) + 8 * d(p.vocab) * d(p.dim) +
              (p.keep_logits ? 4 * logits : 0)};
}

// Read param, grad, both moments; write param, both moments (and the bf16 copy).
Cost adamw(const AdamWParams& p) { return {vector_of(p.n), 0, d(p.n) * (28 + (p.param_bf16 ? 2 : 0))}; }

Cost add_inplace(Elements y, ConstElements x, int64_t n) {
  return {vector_of(n), 0, (2 * d(dtype_size(y.dtype())) + d(dtype_size(x.dtype()))) * d(n)};
}
Cost sum_squares(const float*, int64_t n) { return {vector_of(n), 0, 4 * d(n)}; }
Cost sum_squares_accumulate(const float*, int64_t n, double*) { return {vector_of(n), 0, 4 * d(n)}; }
Cost scale_inplace(float*, float, int64_t n) { return {vector_of(n), 0, 8 * d(n)}; }
Cost softcap_inplace(float*, float, int64_t n) { return {vector_of(n), 2 * d(n), 8 * d(n)}; }
Cost convert_to_bf16(const float*, uint16_t*, int64_t n) { return {vector_of(n), 0, 6 * d(n)}; }
Cost convert_to_f32(const uint16_t*, float*, int64_t n) { return {vector_of(n), 0, 6 * d(n)}; }
Cost amax(const float*, int64_t n) { return {vector_of(n), 0, 4 * d(n)}; }
Cost amax_to(ConstElements x, int64_t n, float*) { return {vector_of(n), 0, size_of(x) * d(n)}; }

Cost fp8_cast_transpose(const Fp8CastParams& p) { return cast_cost(p, ""); }
Cost fp8_quantize_1x128(const Fp8CastParams& p) { return cast_cost(p, " 1x128"); }
Cost fp8_quantize_128x128(const Fp8CastParams& p) { return cast_cost(p, " 128x128"); }

Cost kv_append(const KvAppendParams& p) {
  return {fmt::format("b{} t{} kv{} d{}", p.batch, p.tokens, p.kv_heads, p.head_dim), 0,
          16 * d(p.batch) * d(p.tokens) * d(p.kv_heads) * d(p.head_dim)};
}

// Each output element read and written, the block's read, per row two exps and a log in double.
Cost attention_merge(const AttentionMergeParams& p) {
  return {fmt::format("b{} s{} h{} dv{}", p.batch, p.seq, p.heads, p.v_dim),
          3 * d(p.batch) * d(p.seq) * d(p.heads) * (d(p.v_dim) + 10),
          12 * d(p.batch) * d(p.seq) * d(p.heads) * d(p.v_dim) + 12 * d(p.batch) * d(p.seq) * d(p.heads)};
}

Cost strided_copy(const StridedCopyParams& p) {
  const double n = d(p.shape[0]) * d(p.shape[1]) * d(p.shape[2]);
  const double src = d(dtype_size(p.src.dtype())), dst = d(dtype_size(p.dst.dtype()));
  return {fmt::format("{}x{}x{}{}", p.shape[0], p.shape[1], p.shape[2], p.accumulate ? " +=" : ""),
          p.accumulate ? n : 0, (src + (p.accumulate ? 2 : 1) * dst) * n};
}

// Scores, group scores and k selection passes over the experts per token; the balance loss reads the scores
// and ids once more.
Cost moe_router_forward(const MoeRouterParams& p) {
  return {fmt::format("t{} e{} k{} g{}/{}{}{}", p.tokens, p.experts, p.top_k, p.topk_groups, p.groups,
                      p.seq_len > 0 ? " balance" : "", p.aux_loss ? " aux" : ""),
          0,
          d(p.tokens) * d(p.experts) * (12 + (p.seq_len > 0 ? 4 : 0) + (p.aux_loss ? 4 : 0)) +
              8 * d(p.tokens) * d(p.top_k)};
}
Cost moe_router_backward(const MoeRouterParams& p) {
  return {fmt::format("t{} e{} k{}", p.tokens, p.experts, p.top_k), 0,
          12 * d(p.tokens) * d(p.experts) + 8 * d(p.tokens) * d(p.top_k)};
}
Cost moe_bias_update(float*, const double*, int64_t experts, float, bool) {
  return {vector_of(experts), 0, 16 * d(experts)};
}

// Mixture of experts. The sort reads the ids and writes row_of, source, offsets and counts; the permutes move
// R rows of hidden floats each way (gathers) plus their indices.
Cost moe_sort_by_expert(const MoeSortParams& p) {
  const double n = d(p.tokens) * d(p.top_k);
  const double padding = d(p.experts) * d(p.align - 1);  // source's -1 entries past the assignments
  return {fmt::format("t{} k{} e{}{}{}", p.tokens, p.top_k, p.experts,
                      p.capacity > 0 ? fmt::format(" cap{}", p.capacity) : std::string(),
                      p.align > 1 ? fmt::format(" align{}", p.align) : std::string()),
          0, 12 * n + 4 * padding + 8 * d(2 * p.experts + 1)};
}

std::string moe_rows(int64_t tokens, int64_t top_k, int64_t hidden, int64_t rows) {
  return fmt::format("t{} k{} h{} r{}", tokens, top_k, hidden, rows);
}

Cost moe_permute(const MoePermuteParams& p) {
  return {moe_rows(p.tokens, p.top_k, p.hidden, p.rows), 0,
          (size_of(p.x) + size_of(p.out)) * d(p.rows) * d(p.hidden) + 4 * d(p.rows)};
}
Cost moe_permute_backward(const MoePermuteParams& p) {
  return {moe_rows(p.tokens, p.top_k, p.hidden, p.rows), d(p.rows) * d(p.hidden),
          (size_of(p.dout) * d(p.rows) + size_of(p.dx) * d(p.tokens)) * d(p.hidden) +
              4 * d(p.tokens) * d(p.top_k)};
}
Cost moe_unpermute(const MoeUnpermuteParams& p) {
  return {
      moe_rows(p.tokens, p.top_k, p.hidden, p.rows), 2 * d(p.rows) * d(p.hidden),
      (size_of(p.y) * d(p.rows) + size_of(p.out) * d(p.tokens)) * d(p.hidden) + 8 * d(p.tokens) * d(p.top_k)};
}
// dy: read dout, write dy (R rows); dweights: read dout and y again, a dot product per kept row.
Cost moe_unpermute_backward(const MoeUnpermuteParams& p) {
  const double rows = d(p.rows) * d(p.hidden);
  return {
      moe_rows(p.tokens, p.top_k, p.hidden, p.rows) + (p.dy ? " dy" : "") + (p.dweights ? " dweights" : ""),
      (p.dy ? rows : 0) + (p.dweights ? 2 * rows : 0),
      (p.dy ? (size_of(p.dout) + size_of(p.dy)) * rows + 8 * d(p.rows) : 0) +
          (p.dweights ? (size_of(p.dout) + size_of(p.y)) * rows + 8 * d(p.tokens) * d(p.top_k) : 0)};
}

// Grouped GEMMs: 2 R n k FLOPs over the R grouped rows (or contraction), the operands each read once, every
// non-empty group's B (m_grouped) or C (k_grouped) once; C read too where beta != 0.
// (Parameters the op will refuse, null offsets included, cost nothing.)
int64_t grouped_rows(const GroupedGemmParams& p) {
  return p.offsets && p.groups > 0 ? p.offsets[p.groups] - p.offsets[0] : 0;
}
bool group_empty(const GroupedGemmParams& p, int64_t g) { return p.offsets[g + 1] <= p.offsets[g]; }

Cost m_grouped_gemm(const GroupedGemmParams& p) {
  const int64_t rows = grouped_rows(p);
  int64_t used = 0;
  for (int64_t g = 0; p.offsets && g < p.groups; ++g) used += group_empty(p, g) ? 0 : 1;
  const double ab = d(dtype_size(p.ab_dtype)), c = d(dtype_size(p.c_dtype)) * (p.beta != 0.0f ? 2 : 1);
  return {fmt::format("{} N{} G{} R{} n{} k{} -> {}{}", dtype_name(p.ab_dtype), layout(p.trans_b), p.groups,
                      rows, p.n, p.k, dtype_name(p.c_dtype), p.beta != 0.0f ? " (+=)" : ""),
          2.0 * d(rows) * d(p.n) * d(p.k),
          ab * d(rows) * d(p.k) + ab * d(used) * d(p.n) * d(p.k) + c * d(rows) * d(p.n)};
}
Cost k_grouped_gemm(const GroupedGemmParams& p) {
  const int64_t rows = grouped_rows(p);
  int64_t written = 0;  // groups whose C is touched: every non-empty one, and empty ones unless beta = 1
  for (int64_t g = 0; p.offsets && g < p.groups; ++g) written += !group_empty(p, g) || p.beta != 1.0f ? 1 : 0;
  const double ab = d(dtype_size(p.ab_dtype)), c = d(dtype_size(p.c_dtype)) * (p.beta != 0.0f ? 2 : 1);
  return {fmt::format("{} TN G{} R{} m{} n{} -> {}{}", dtype_name(p.ab_dtype), p.groups, rows, p.m, p.n,
                      dtype_name(p.c_dtype), p.beta != 0.0f ? " (+=)" : ""),
          2.0 * d(rows) * d(p.m) * d(p.n),
          ab * d(rows) * (d(p.m) + d(p.n)) + c * d(written) * d(p.m) * d(p.n)};
}

}  // namespace cost

// A row's identity: op and detail.
using Key = std::pair<const char*, std::string>;
struct KeyLess {
  bool operator()(const Key& a, const Key& b) const {
    const int c = std::string_view(a.first).compare(b.first);
    return c != 0 ? c < 0 : a.second < b.second;
  }
};

#ifdef FORGE_HAVE_CUDA
struct Pending {
  size_t row;
  cudaEvent_t start, stop;
};
#endif

struct State {
  std::mutex mutex;
  Device device = Device::cpu;
  const OpTable* inner = nullptr;  // the device's own table
  // A device's memsets and copies are timed too: the profile puts a timing interface over the device's memory
  // interface (inner_memory), displacing `displaced` (an emulation's, or null for the backend's) until it
  // ends.
  const DeviceMemory* inner_memory = nullptr;
  const DeviceMemory* displaced = nullptr;
  bool events = false;  // time on the CUDA stream (the CUDA backend's table; not an emulation)
  Clock::time_point begin;
  std::map<Key, size_t, KeyLess> index;
  std::vector<OpProfileRow> rows;
#ifdef FORGE_HAVE_CUDA
  std::vector<Pending> pending;
#endif

  size_t row(const char* op, std::string detail) {
    Key key{op, std::move(detail)};
    auto it = index.find(key);
    if (it != index.end()) return it->second;
    rows.push_back(OpProfileRow{op, key.second});
    return index.emplace(std::move(key), rows.size() - 1).first->second;
  }
};

State& state() {
  static State s;
  return s;
}
// The profiled device as an int, -1 when no profile is open: one relaxed load per op when profiling is off.
std::atomic<int> g_profiled{-1};
thread_local int g_depth = 0;  // ops in progress on this thread (only the outermost is timed)

const OpTable& inner() { return *state().inner; }

// Times `call` (the op) as row (op, cost_of().detail) unless it runs inside another timed op. The time is
// kept even when the op throws: the caller reports the error and the profile stays consistent.
template <typename CostFn, typename Call>
auto timed(const char* op, CostFn&& cost_of, Call&& call) {
  if (g_depth > 0) return call();
  struct Depth {
    Depth() { ++g_depth; }
    ~Depth() { --g_depth; }
  } depth;
  State& s = state();
  Cost c = cost_of();
  size_t row;
  {
    std::lock_guard lock(s.mutex);
    row = s.row(op, std::move(c.detail));
    s.rows[row].calls += 1, s.rows[row].flops += c.flops, s.rows[row].bytes += c.bytes;
  }
#ifdef FORGE_HAVE_CUDA
  if (s.events) {
    Pending p{row, nullptr, nullptr};
    FORGE_CUDA_CHECK(cudaEventCreate(&p.start));
    if (const cudaError_t e = cudaEventCreate(&p.stop); e != cudaSuccess) {
      cudaEventDestroy(p.start);
      cuda::fail_cuda(e, "cudaEventCreate(&p.stop)", __FILE__, __LINE__);
    }
    {
      std::lock_guard lock(s.mutex);
      s.pending.push_back(p);  // the state owns both events from here on, whatever the op does
    }
    FORGE_CUDA_CHECK(cudaEventRecord(p.start, cuda::stream()));
    struct StopEvent {
      cudaEvent_t stop;
      ~StopEvent() { cudaEventRecord(stop, cuda::stream()); }  // an error here surfaces in profile_end
    } stop_event{p.stop};
    return call();
  }
#endif
  struct Stopwatch {
    State& s;
    size_t row;
    Clock::time_point t0;
    ~Stopwatch() {
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      std::lock_guard lock(s.mutex);
      s.rows[row].seconds += seconds;
    }
  } stopwatch{s, row, Clock::now()};
  return call();
}

// The timed table: each op through timed() with its cost, each support query forwarded untimed.
const OpTable& profiled() {
#define FORGE_PROFILED_ENTRY(name, result, params, args)                            \
  .name = [] params -> result {                                                     \
    return timed(                                                                   \
        #name, [&] { return cost::name args; }, [&] { return inner().name args; }); \
  },                                                                                \
  .supports_##name = [] FORGE_OP_APPEND(params, std::string * reason) -> bool {     \
    return inner().supports_##name FORGE_OP_APPEND(args, reason);                   \
  },
  static const OpTable table = {.name = "profiled", FORGE_OPS(FORGE_PROFILED_ENTRY)};
#undef FORGE_PROFILED_ENTRY
  return table;
}

void drain(Device device) {
  if (device != Device::cpu) device_memory(device).synchronize();
}

const DeviceMemory& inner_memory() { return *state().inner_memory; }

const char* direction(Device dst, Device src) {
  return dst == Device::cpu ? "device -> host" : src == Device::cpu ? "host -> device" : "device -> device";
}

// The device memory interface while a profile is open: memsets and copies timed like ops, the rest forwarded.
const DeviceMemory& timing_memory() {
  static const DeviceMemory memory{
      "profiled",
      [](size_t bytes) { return inner_memory().alloc(bytes); },
      [](void* p) { inner_memory().free(p); },
      [](void* p, size_t bytes) {
        timed(
            "memset",
            [&] {
              return Cost{"device", 0, static_cast<double>(bytes)};
            },
            [&] { inner_memory().zero(p, bytes); });
      },
      [](void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
        timed(
            "copy",
            [&] {
              return Cost{direction(dst_device, src_device), 0, static_cast<double>(bytes)};
            },
            [&] { inner_memory().copy(dst, dst_device, src, src_device, bytes); });
      },
      [] { inner_memory().synchronize(); },
      [] { return inner_memory().device_count(); },
      [](int ordinal) { inner_memory().select_device(ordinal); },
      [] { return inner_memory().stream(); },
      [] { return inner_memory().peak_allocated(); },
      [] { inner_memory().reset_peak(); },
      [](void* p, size_t bytes) { inner_memory().pin_host(p, bytes); },
      [](void* p) { inner_memory().unpin_host(p); },
  };
  return memory;
}

}  // namespace

const OpTable* profiled_table(Device device) {
  return g_profiled.load(std::memory_order_relaxed) == static_cast<int>(device) ? &profiled() : nullptr;
}

bool profiling() { return g_profiled.load() >= 0; }

std::vector<OpProfileRow> profile_counts() {
  if (!profiling()) return {};
  State& s = state();
  std::lock_guard lock(s.mutex);
  std::vector<OpProfileRow> rows = s.rows;
  for (OpProfileRow& r : rows) r.seconds = 0;
  return rows;
}

void profile_begin(Device device) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (g_profiled.load() >= 0) fail("op profile: one is already open (profile_end closes it)");
  const OpTable& own = table(device);  // fails with one line when the device's backend is not built in
  drain(device);
  s.device = device, s.inner = &own;
#ifdef FORGE_HAVE_CUDA
  s.events = &own == &cuda_table();
#endif
  s.index.clear(), s.rows.clear();
  if (device != Device::cpu) {
    s.inner_memory = &device_memory(device);
    s.displaced = override_device_memory(device, &timing_memory());
  }
  s.begin = Clock::now();
  g_profiled.store(static_cast<int>(device));
}

OpProfile profile_end() {
  State& s = state();
  if (g_profiled.load() < 0) fail("op profile: profile_end without profile_begin");
  g_profiled.store(-1);  // later ops run untimed; the ones in flight finish on the device
  OpProfile out;
  out.device = s.device;
  drain(s.device);
  if (s.device != Device::cpu) override_device_memory(s.device, s.displaced);
  out.wall_seconds = std::chrono::duration<double>(Clock::now() - s.begin).count();
  std::lock_guard lock(s.mutex);
#ifdef FORGE_HAVE_CUDA
  // Every event has completed (the device is drained). Read them all, then release them all, even on error.
  std::vector<Pending> pending = std::move(s.pending);
  s.pending.clear();
  cudaError_t first_error = cudaSuccess;
  for (const Pending& p : pending) {
    float ms = 0;
    const cudaError_t e = cudaEventElapsedTime(&ms, p.start, p.stop);
    if (e == cudaSuccess)
      s.rows[p.row].seconds += ms / 1e3;
    else if (first_error == cudaSuccess)
      first_error = e;
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.stop);
  }
  if (first_error != cudaSuccess)
    cuda::fail_cuda(first_error, "cudaEventElapsedTime (op profile)", __FILE__, __LINE__);
#endif
  out.rows = std::move(s.rows);
  s.rows.clear(), s.index.clear();
  std::stable_sort(out.rows.begin(), out.rows.end(),
                   [](const OpProfileRow& a, const OpProfileRow& b) { return a.seconds > b.seconds; });
  for (const OpProfileRow& r : out.rows) out.op_seconds += r.seconds;
  return out;
}

std::string format_profile(const OpProfile& profile, int steps, double min_share) {
  if (steps <= 0) fail("format_profile: steps must be positive, got {}", steps);
  const bool gpu = profile.device != Device::cpu;
  // GPUs in TFLOP/s, CPUs in GFLOP/s: three significant digits either way.
  const double flop_unit = gpu ? 1e12 : 1e9;
  const double wall = profile.wall_seconds > 0 ? profile.wall_seconds : 1;
  // The FLOPs the ops executed (recomputation included) over the wall time: the hardware FLOP rate, beside
  // which the model FLOP rate (MFU's numerator) shows what recomputation and uncounted work cost.
  double flops = 0;
  for (const OpProfileRow& r : profile.rows) flops += r.flops;
  std::string out = fmt::format(
      "op profile ({}, {} step{}): wall {:.2f} ms/step, ops {:.2f} ms/step ({:.1f}%), {:.4g} {} executed per "
      "step, {:.4g} {}/s over the wall\n",
      device_name(profile.device), steps, steps == 1 ? "" : "s", 1e3 * profile.wall_seconds / steps,
      1e3 * profile.op_seconds / steps, 100 * profile.op_seconds / wall, flops / steps / flop_unit,
      gpu ? "TFLOP" : "GFLOP", flops / wall / flop_unit, gpu ? "TFLOP" : "GFLOP");
  out += fmt::format("  {:>9} {:>6} {:>6} {:>8} {:>7}  {:<30} {}\n", "ms/step", "share", "calls",
                     gpu ? "TFLOP/s" : "GFLOP/s", "GB/s", "op", "detail");
  auto rate = [](double amount, double seconds, double unit) {
    return amount > 0 && seconds > 0 ? fmt::format("{:.1f}", amount / seconds / unit) : std::string("-");
  };
  int64_t rest_rows = 0, rest_calls = 0;
  double rest_seconds = 0;
  for (const OpProfileRow& r : profile.rows) {
    if (r.seconds / wall < min_share) {
      rest_rows += 1, rest_calls += r.calls, rest_seconds += r.seconds;
      continue;
    }
    out += fmt::format("  {:>9.3f} {:>5.1f}% {:>6} {:>8} {:>7}  {:<30} {}\n", 1e3 * r.seconds / steps,
                       100 * r.seconds / wall, r.calls / steps, rate(r.flops, r.seconds, flop_unit),
                       rate(r.bytes, r.seconds, 1e9), r.op, r.detail);
  }
  if (rest_rows > 0)
    out +=
        fmt::format("  {:>9.3f} {:>5.1f}% {:>6} {:>8} {:>7}  {} smaller rows\n", 1e3 * rest_seconds / steps,
                    100 * rest_seconds / wall, rest_calls / steps, "", "", rest_rows);
  const double unattributed = std::max(0.0, profile.wall_seconds - profile.op_seconds);
  out += fmt::format("  {:>9.3f} {:>5.1f}% {:>6} {:>8} {:>7}  unattributed: {}\n", 1e3 * unattributed / steps,
                     100 * unattributed / wall, "", "", "",
                     gpu ? "the device idle (waiting for the host) or in collectives"
                         : "host work outside the ops: memsets, collectives, data, bookkeeping");
  return out;
}

std::string profile_json(const OpProfile& profile, int steps) {
  if (steps <= 0) fail("profile_json: steps must be positive, got {}", steps);
  nlohmann::json rows = nlohmann::json::array();
  for (const OpProfileRow& r : profile.rows)
    rows.push_back({{"op", r.op},
                    {"detail", r.detail},
                    {"calls", r.calls / steps},
                    {"seconds", r.seconds / steps},
                    {"flops", r.flops / steps},
                    {"bytes", r.bytes / steps}});
  nlohmann::json j = {{"device", device_name(profile.device)},
                      {"steps", steps},
                      {"wall_seconds", profile.wall_seconds / steps},
                      {"op_seconds", profile.op_seconds / steps},
                      {"rows", std::move(rows)}};
  return j.dump();
}

}  // namespace forge::ops
