// m_grouped_gemm / k_grouped_gemm (ops.h, GroupedGemmParams): a loop over the groups, each non-empty one the
// CPU GEMM (gemm_onednn.cpp) on its contiguous segment, in the pieces of a few fixed sizes that
// ops::grouped_gemm_pieces cuts it into (oneDNN compiles a kernel per shape), so a grouped GEMM is bitwise
// those ops::gemm calls (bf16 operands and bf16 C included) and the GEMM's own threading does the work. Also
// the group arithmetic both backends share (the ops:: functions below).
#include <cstring>
#include <utility>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::ops {

bool supports_grouped_gemm(const char* op, bool k_grouped, const GroupedGemmParams& p, std::string* reason) {
  if (p.ab_dtype != DType::f32 && p.ab_dtype != DType::bf16)
    return refuse(reason, "{}: operands must be fp32 or bf16, got {}", op, dtype_name(p.ab_dtype));
  if (!supports_gemm_output(op, p.c_dtype, p.ab_dtype, reason)) return false;
  if (p.groups <= 0) return refuse(reason, "{}: groups must be positive, got {}", op, p.groups);
  if (!p.offsets) return refuse(reason, "{}: offsets (host memory, groups + 1 entries) is null", op);
  if (k_grouped) {
    if (p.m <= 0 || p.n <= 0) return refuse(reason, "{}: empty problem m={} n={}", op, p.m, p.n);
    if (p.lda < p.m) return refuse(reason, "{}: lda {} is smaller than m {}", op, p.lda, p.m);
    if (p.ldb < p.n) return refuse(reason, "{}: ldb {} is smaller than n {}", op, p.ldb, p.n);
    if (p.ldc < p.n) return refuse(reason, "{}: ldc {} is smaller than n {}", op, p.ldc, p.n);
    const int64_t group_elements = (p.m - 1) * p.ldc + p.n;
    if (p.groups > 1 && p.c_group_stride < group_elements)
      return refuse(reason,
                    "{}: c_group_stride {} is smaller than one group's C ({} elements): the groups overlap",
                    op, p.c_group_stride, group_elements);
    return true;
  }
  if (p.n <= 0 || p.k <= 0) return refuse(reason, "{}: empty problem n={} k={}", op, p.n, p.k);
  const int64_t b_cols = p.trans_b ? p.k : p.n;
  if (p.lda < p.k) return refuse(reason, "{}: lda {} is smaller than k {}", op, p.lda, p.k);
  if (p.ldb < b_cols)
    return refuse(reason, "{}: ldb {} is smaller than B's {} stored columns", op, p.ldb, b_cols);
  if (p.ldc < p.n) return refuse(reason, "{}: ldc {} is smaller than n {}", op, p.ldc, p.n);
  if (p.b_group_stride < 0) return refuse(reason, "{}: negative b_group_stride {}", op, p.b_group_stride);
  return true;
}

void check_grouped_gemm_offsets(const char* op, bool k_grouped, const GroupedGemmParams& p) {
  if (p.offsets[0] < 0) fail("{}: offsets[0] = {} is negative", op, p.offsets[0]);
  for (int64_t g = 0; g < p.groups; ++g)
    if (p.offsets[g + 1] < p.offsets[g])
      fail("{}: offsets must not decrease: offsets[{}] = {} < offsets[{}] = {}", op, g + 1, p.offsets[g + 1],
           g, p.offsets[g]);
  // Which operands the groups use: with no rows at all, A and B (and an m_grouped C) are never touched.
  const bool rows = p.offsets[p.groups] > p.offsets[0];
  if (rows && (!p.a || !p.b || !p.c)) fail("{}: null operand pointer (a, b or c)", op);
  if (k_grouped && p.beta != 1.0f && !p.c)
    fail("{}: c is null (beta = {} writes every group's C)", op, p.beta);
}

namespace {
const void* advance(const void* base, int64_t elements, DType dtype) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(dtype_size(dtype));
}
}  // namespace

GemmParams m_grouped_gemm_group(const GroupedGemmParams& p, int64_t g) {
  GemmParams q;
  q.m = p.offsets[g + 1] - p.offsets[g], q.n = p.n, q.k = p.k;
  q.a = advance(p.a, p.offsets[g] * p.lda, p.ab_dtype), q.lda = p.lda;
  q.b = advance(p.b, g * p.b_group_stride, p.ab_dtype), q.ldb = p.ldb, q.trans_b = p.trans_b;
  q.ab_dtype = p.ab_dtype;
  q.c = const_cast<void*>(advance(p.c, p.offsets[g] * p.ldc, p.c_dtype)), q.ldc = p.ldc,
  q.c_dtype = p.c_dtype;
  q.alpha = p.alpha, q.beta = p.beta;
  return q;
}

GemmParams k_grouped_gemm_group(const GroupedGemmParams& p, int64_t g) {
  GemmParams q;
  q.m = p.m, q.n = p.n, q.k = p.offsets[g + 1] - p.offsets[g];
  q.a = advance(p.a, p.offsets[g] * p.lda, p.ab_dtype), q.lda = p.lda, q.trans_a = true;
  q.b = advance(p.b, p.offsets[g] * p.ldb, p.ab_dtype), q.ldb = p.ldb;
  q.ab_dtype = p.ab_dtype;
  q.c = const_cast<void*>(advance(p.c, g * p.c_group_stride, p.c_dtype)), q.ldc = p.ldc,
  q.c_dtype = p.c_dtype;
  q.alpha = p.alpha, q.beta = p.beta;
  return q;
}

std::vector<std::pair<int64_t, int64_t>> grouped_gemm_pieces(int64_t rows) {
  constexpr int64_t kChunk = 256, kStep = 32;
  std::vector<std::pair<int64_t, int64_t>> pieces;
  int64_t first = 0;
  for (; rows - first >= kChunk; first += kChunk) pieces.emplace_back(first, kChunk);
  if (const int64_t steps = (rows - first) / kStep * kStep; steps > 0)
    pieces.emplace_back(first, steps), first += steps;
  if (rows > first) pieces.emplace_back(first, rows - first);
  return pieces;
}

GemmParams grouped_gemm_piece(const GemmParams& q, bool k_grouped, int64_t first, int64_t rows) {
  GemmParams piece = q;
  piece.a = advance(q.a, first * q.lda, q.ab_dtype);
  if (k_grouped) {
    piece.k = rows;
    piece.b = advance(q.b, first * q.ldb, q.ab_dtype);
    if (first > 0) piece.beta = 1.0f;
  } else {
    piece.m = rows;
    piece.c = const_cast<void*>(advance(q.c, first * q.ldc, q.c_dtype));
  }
  return piece;
}

}  // namespace forge::ops

namespace forge::cpu {
namespace {

// An empty group of k_grouped_gemm: C_g = beta * C_g (zeros for beta = 0, never reading C; a bf16 C scaled in
// fp32 and rounded once).
void scale_group_output(const ops::GroupedGemmParams& p, int64_t g) {
  if (p.beta == 1.0f) return;
  const int64_t esize = static_cast<int64_t>(dtype_size(p.c_dtype));
  char* c = static_cast<char*>(p.c) + g * p.c_group_stride * esize;
  for (int64_t i = 0; i < p.m; ++i) {
    char* row = c + i * p.ldc * esize;
    if (p.beta == 0.0f) {
      std::memset(row, 0, static_cast<size_t>(p.n * esize));
    } else if (p.c_dtype == DType::f32) {
      auto* x = reinterpret_cast<float*>(row);
      for (int64_t j = 0; j < p.n; ++j) x[j] *= p.beta;
    } else {
      auto* x = reinterpret_cast<uint16_t*>(row);
      for (int64_t j = 0; j < p.n; ++j) x[j] = f32_to_bf16_bits(bf16_bits_to_f32(x[j]) * p.beta);
    }
  }
}

}  // namespace

bool supports_m_grouped_gemm(const ops::GroupedGemmParams& p, std::string* reason) {
  return ops::supports_grouped_gemm("m_grouped_gemm", false, p, reason);
}
bool supports_k_grouped_gemm(const ops::GroupedGemmParams& p, std::string* reason) {
  return ops::supports_grouped_gemm("k_grouped_gemm", true, p, reason);
}

namespace {
// Group g's GEMM q in its pieces (a k_grouped bf16 C whole: pieces would round it after each).
void gemm_in_pieces(const ops::GemmParams& q, bool k_grouped, int64_t rows) {
  if (k_grouped && q.c_dtype == DType::bf16) return cpu::gemm(q);
  for (const auto& [first, count] : ops::grouped_gemm_pieces(rows))
    cpu::gemm(ops::grouped_gemm_piece(q, k_grouped, first, count));
}
}  // namespace

void m_grouped_gemm(const ops::GroupedGemmParams& p) {
  if (std::string why; !supports_m_grouped_gemm(p, &why)) fail("{}", why);
  ops::check_grouped_gemm_offsets("m_grouped_gemm", false, p);
  for (int64_t g = 0; g < p.groups; ++g)
    if (p.offsets[g + 1] > p.offsets[g])
      gemm_in_pieces(ops::m_grouped_gemm_group(p, g), false, p.offsets[g + 1] - p.offsets[g]);
}

void k_grouped_gemm(const ops::GroupedGemmParams& p) {
  if (std::string why; !supports_k_grouped_gemm(p, &why)) fail("{}", why);
  ops::check_grouped_gemm_offsets("k_grouped_gemm", true, p);
  for (int64_t g = 0; g < p.groups; ++g) {
    if (p.offsets[g + 1] > p.offsets[g])
      gemm_in_pieces(ops::k_grouped_gemm_group(p, g), true, p.offsets[g + 1] - p.offsets[g]);
    else
      scale_group_output(p, g);
  }
}

}  // namespace forge::cpu
