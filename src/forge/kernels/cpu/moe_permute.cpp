// moe_permute / moe_unpermute and their backward passes (ops.h, MoePermuteParams, MoeUnpermuteParams): rows
// move between token order and the expert-sorted order by moe_sort_by_expert's indices. Every output element
// is written by one thread, which sums a token's top_k rows in increasing j: gathers only, no scatter, so no
// races and the same bits for any thread count. The indices are checked before the parallel loops (an
// exception must not escape an OpenMP region). A padding row of the sorted side (source -1) is written as
// zeros and never read.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/element_access.h"

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
bool set(ConstElements pointer, const char* op, const char* name, std::string* reason) {
  return set(pointer.get(), op, name, reason);
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

namespace {

template <typename X, typename Out>
void permute_rows(const ops::MoePermuteParams& p, const X* x, Out* out) {
  const int64_t hidden = p.hidden, x_stride = or_hidden(p.x_stride, hidden);
#pragma omp parallel for schedule(static) if (p.rows * hidden > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    Out* row = out + r * hidden;
    if (p.source[r] < 0) {
      std::memset(row, 0, hidden * sizeof(Out));
    } else if constexpr (std::is_same_v<X, Out>) {
      std::memcpy(row, x + (p.source[r] / p.top_k) * x_stride, hidden * sizeof(Out));
    } else {
      const X* from = x + (p.source[r] / p.top_k) * x_stride;
      for (int64_t i = 0; i < hidden; ++i) store_float(row, i, load_float(from, i));
    }
  }
}

// Each token's top_k sorted rows, weighted (weights null: not), summed in fp32 in increasing j and rounded
// once to the destination's type: moe_permute_backward's dx and moe_unpermute's out.
template <typename Src, typename Dst>
void sum_rows(int64_t tokens, int64_t top_k, int64_t hidden, const int32_t* row_of, const float* weights,
              const Src* src, Dst* dst, int64_t dst_stride) {
#pragma omp parallel if (tokens * top_k * hidden > kParallelElements)
  {
    std::vector<float> sum(static_cast<size_t>(hidden));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t row = row_of[t * top_k + j];
        if (row < 0) continue;
        const Src* from = src + int64_t{row} * hidden;
        if (weights) {
          const float w = weights[t * top_k + j];
#pragma omp simd
          for (int64_t i = 0; i < hidden; ++i) sum[i] += w * load_float(from, i);
        } else {
#pragma omp simd
          for (int64_t i = 0; i < hidden; ++i) sum[i] += load_float(from, i);
        }
      }
      Dst* out = dst + t * dst_stride;
      for (int64_t i = 0; i < hidden; ++i) store_float(out, i, sum[i]);
    }
  }
}

template <typename Dout, typename Dy>
void unpermute_rows_backward_dy(const ops::MoeUnpermuteParams& p, const Dout* dout, Dy* dy) {
  const int64_t hidden = p.hidden, top_k = p.top_k, dout_stride = or_hidden(p.dout_stride, hidden);
#pragma omp parallel for schedule(static) if (p.rows * hidden > kParallelElements)
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t a = p.source[r];
    Dy* row = dy + r * hidden;
    if (a < 0) {
      std::memset(row, 0, hidden * sizeof(Dy));
      continue;
    }
    const float w = p.weights[a];
    const Dout* d = dout + (a / top_k) * dout_stride;
    for (int64_t i = 0; i < hidden; ++i) store_float(row, i, w * load_float(d, i));
  }
}

template <typename Dout, typename Y>
void unpermute_rows_backward_weights(const ops::MoeUnpermuteParams& p, const Dout* dout, const Y* y) {
  const int64_t hidden = p.hidden, top_k = p.top_k, assignments = p.tokens * top_k;
  const int64_t dout_stride = or_hidden(p.dout_stride, hidden);
#pragma omp parallel for schedule(static) if (assignments * hidden > kParallelElements)
  for (int64_t a = 0; a < assignments; ++a) {
    const int32_t row = p.row_of[a];
    if (row < 0) {
      p.dweights[a] = 0.0f;
      continue;
    }
    const Dout* d = dout + (a / top_k) * dout_stride;
    const Y* yr = y + int64_t{row} * hidden;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < hidden; ++i) dot += load_float(d, i) * load_float(yr, i);
    p.dweights[a] = dot;
  }
}

}  // namespace

void moe_permute(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute(p, &why)) fail("{}", why);
  check_source("moe_permute", p.source, p.rows, p.tokens * p.top_k);
  if (p.rows == 0) return;
  visit(p.x, [&](const auto* x) { visit(p.out, [&](auto* out) { permute_rows(p, x, out); }); });
}

void moe_permute_backward(const ops::MoePermuteParams& p) {
  if (std::string why; !supports_moe_permute_backward(p, &why)) fail("{}", why);
  check_row_of("moe_permute_backward", p.row_of, p.tokens * p.top_k, p.rows);
  if (p.tokens == 0) return;
  visit(p.dout, [&](const auto* d) {
    visit(p.dx, [&](auto* dx) {
      sum_rows(p.tokens, p.top_k, p.hidden, p.row_of, nullptr, d, dx, or_hidden(p.dx_stride, p.hidden));
    });
  });
}

void moe_unpermute(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute(p, &why)) fail("{}", why);
  check_row_of("moe_unpermute", p.row_of, p.tokens * p.top_k, p.rows);
  if (p.tokens == 0) return;
  visit(p.y, [&](const auto* y) {
    visit(p.out, [&](auto* out) {
      sum_rows(p.tokens, p.top_k, p.hidden, p.row_of, p.weights, y, out, or_hidden(p.out_stride, p.hidden));
    });
  });
}

void moe_unpermute_backward(const ops::MoeUnpermuteParams& p) {
  if (std::string why; !supports_moe_unpermute_backward(p, &why)) fail("{}", why);
  constexpr const char* op = "moe_unpermute_backward";
  const int64_t assignments = p.tokens * p.top_k;
  if (p.dy && p.rows > 0) {
    check_source(op, p.source, p.rows, assignments);
    visit(p.dout,
          [&](const auto* d) { visit(p.dy, [&](auto* dy) { unpermute_rows_backward_dy(p, d, dy); }); });
  }
  if (p.dweights && assignments > 0) {
    check_row_of(op, p.row_of, assignments, p.rows);
    visit(p.dout, [&](const auto* d) {
      visit(p.y, [&](const auto* y) { unpermute_rows_backward_weights(p, d, y); });
    });
  }
}

}  // namespace forge::cpu
