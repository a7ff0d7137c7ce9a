// moe_permute / moe_unpermute and their backward passes (ops.h, MoePermuteParams, MoeUnpermuteParams): rows
// move between token order and the expert-sorted order by moe_sort_by_expert's indices. Every output element
// is written by one thread, which sums a token's top_k rows in increasing j: gathers only, no scatter, so no
// races and the same bits for any thread count. The indices are checked before the parallel loops (an
// exception must not escape an OpenMP region). A padding row of the sorted side (source -1) is written as
// zeros and never read.
#include <cstring>
#include <limits>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 14;

bool shape_ok(const char* op, int64_t tokens, int64_t top_k, int64_t hidden, int64_t rows,
              std::string* reason) {
  if (tokens < 0 || top_k <= 0 || hidden <= 0 || rows < 0)
    return ops::refuse(reason, "{}: bad shape tokens={} top_k={} hidden={} rows={}", op, tokens, top_k,
                       hidden, rows);
  // Padding may take rows past tokens * top_k (ops::moe_sorted_rows_bound); row_of indexes them as int32.
  if (rows > std::numeric_limits<int32_t>::max())
    return ops::refuse(reason, "{}: rows {} does not fit the int32 row indices", op, rows);
  return true;
}

bool stride_ok(const char* op, const char* name, int64_t stride, int64_t hidden, std::string* reason) {
  if (stride == 0 || stride >= hidden) return true;
  return ops::refuse(reason, "{}: {} {} is smaller than hidden {}", op, name, stride, hidden);
}

bool set(const void* pointer, const char* op, const char* name, std::string* reason) {
  return pointer != nullptr || ops::refuse(reason, "{}: {} is null", op, name);
}

int64_t or_hidden(int64_t stride, int64_t hidden) { return stride > 0 ? stride : hidden; }

// The data: every sorted row's assignment (-1: padding), and every assignment's row (-1: dropped).
void check_source(const char* op, const int32_t* source, int64_t rows, int64_t assignments) {
  for (int64_t r = 0; r < rows; ++r)
    if (source[r] < -1 || source[r] >= assignments)
      fail("{}: source[{}] = {} is outside the assignments [0, {}) (or -1, padding)", op, r, source[r],
           assignments);
}
void check_row_of(const char* op, const int32_t* row_of, int64_t assignments, int64_t rows) {
  for (int64_t a = 0; a < assignments; ++a)
    if (row_of[a] < -1 || row_of[a] >= rows)
      fail("{}: row_of[{}] = {} is outside the sorted rows [0, {}) (or -1, dropped)", op, a, row_of[a], rows);
}

}  // namespace

bool supports_moe_permute(const ops::MoePermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_permute";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "x_stride", p.x_stride, p.hidden, reason))
    return false;
  return p.rows == 0 ||
         (set(p.source, op, "source", reason) && set(p.x, op, "x", reason) && set(p.out, op, "out", reason));
}

bool supports_moe_permute_backward(const ops::MoePermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_permute_backward";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "dx_stride", p.dx_stride, p.hidden, reason))
    return false;
  return p.tokens == 0 || (set(p.row_of, op, "row_of", reason) && set(p.dx, op, "dx", reason) &&
                           (p.rows == 0 || set(p.dout, op, "dout", reason)));
}

bool supports_moe_unpermute(const ops::MoeUnpermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_unpermute";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "out_stride", p.out_stride, p.hidden, reason))
    return false;
  return p.tokens == 0 || (set(p.row_of, op, "row_of", reason) && set(p.weights, op, "weights", reason) &&
                           set(p.out, op, "out", reason) && (p.rows == 0 || set(p.y, op, "y", reason)));
}

bool supports_moe_unpermute_backward(const ops::MoeUnpermuteParams& p, std::string* reason) {
  constexpr const char* op = "moe_unpermute_backward";
  if (!shape_ok(op, p.tokens, p.top_k, p.hidden, p.rows, reason) ||
      !stride_ok(op, "dout_stride", p.dout_stride, p.hidden, reason))
    return false;
  if (p.rows > 0 && p.dy &&
      !(set(p.source, op, "source", reason) && set(p.weights, op, "weights", reason) &&
        set(p.dout, op, "dout", reason)))
    return false;
  if (p.tokens > 0 && p.dweights &&
      !(set(p.row_of, op, "row_of", reason) && set(p.dout, op, "dout", reason) &&
        (p.rows == 0 || set(p.y, op, "y", reason))))
    return false;
  return true;
}

void moe_permute(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute(p, &why)) fail("{}", why);
  check_source("moe_permute", p.source, p.rows, p.tokens * p.top_k);
  const int64_t hidden = p.hidden, x_stride = or_hidden(p.x_stride, hidden);
#pragma omp parallel for schedule(static) if (p.rows * hidden > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    if (p.source[r] < 0)
      std::memset(p.out + r * hidden, 0, hidden * sizeof(float));
    else
      std::memcpy(p.out + r * hidden, p.x + (p.source[r] / p.top_k) * x_stride, hidden * sizeof(float));
  }
}

void moe_permute_backward(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute_backward(p, &why)) fail("{}", why);
  check_row_of("moe_permute_backward", p.row_of, p.tokens * p.top_k, p.rows);
  const int64_t hidden = p.hidden, top_k = p.top_k, dx_stride = or_hidden(p.dx_stride, hidden);
#pragma omp parallel for schedule(static) if (p.tokens * top_k * hidden > kParallelElements)
  for (int64_t t = 0; t < p.tokens; ++t) {
    float* dx = p.dx + t * dx_stride;
    std::memset(dx, 0, hidden * sizeof(float));
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = p.row_of[t * top_k + j];
      if (row < 0) continue;
      const float* dout = p.dout + int64_t{row} * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dx[i] += dout[i];
    }
  }
}

void moe_unpermute(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute(p, &why)) fail("{}", why);
  check_row_of("moe_unpermute", p.row_of, p.tokens * p.top_k, p.rows);
  const int64_t hidden = p.hidden, top_k = p.top_k, out_stride = or_hidden(p.out_stride, hidden);
#pragma omp parallel for schedule(static) if (p.tokens * top_k * hidden > kParallelElements)
  for (int64_t t = 0; t < p.tokens; ++t) {
    float* out = p.out + t * out_stride;
    std::memset(out, 0, hidden * sizeof(float));
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t row = p.row_of[t * top_k + j];
      if (row < 0) continue;
      const float w = p.weights[t * top_k + j];
      const float* y = p.y + int64_t{row} * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) out[i] += w * y[i];
    }
  }
}

void moe_unpermute_backward(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute_backward(p, &why)) fail("{}", why);
  constexpr const char* op = "moe_unpermute_backward";
  const int64_t hidden = p.hidden, top_k = p.top_k, assignments = p.tokens * top_k;
  const int64_t dout_stride = or_hidden(p.dout_stride, hidden);
  if (p.dy) {
    check_source(op, p.source, p.rows, assignments);
#pragma omp parallel for schedule(static) if (p.rows * hidden > kParallelElements)
    for (int64_t r = 0; r < p.rows; ++r) {
      const int32_t a = p.source[r];
      float* dy = p.dy + r * hidden;
      if (a < 0) {
        std::memset(dy, 0, hidden * sizeof(float));
        continue;
      }
      const float w = p.weights[a];
      const float* dout = p.dout + (a / top_k) * dout_stride;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dy[i] = w * dout[i];
    }
  }
  if (p.dweights) {
    check_row_of(op, p.row_of, assignments, p.rows);
#pragma omp parallel for schedule(static) if (assignments * hidden > kParallelElements)
    for (int64_t a = 0; a < assignments; ++a) {
      const int32_t row = p.row_of[a];
      if (row < 0) {
        p.dweights[a] = 0.0f;
        continue;
      }
      const float* dout = p.dout + (a / top_k) * dout_stride;
      const float* y = p.y + int64_t{row} * hidden;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < hidden; ++i) dot += dout[i] * y[i];
      p.dweights[a] = dot;
    }
  }
}

}  // namespace forge::cpu
