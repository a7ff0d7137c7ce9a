// GEMM through oneDNN matmul. Transposes are expressed as strides on the memory descriptors, so NN, NT
// and TN all run without copies; bf16 operands accumulate in fp32 (AVX512-BF16 where the CPU has it).
// Primitives are created once per (shape, layout, dtype, alpha, beta) and cached, the kGemmCacheSize most
// recently used of them: shapes that change from call to call (generation's prompts, FP8 experts' rows) would
// otherwise pile up compiled kernels without bound (the grouped GEMMs cut their groups into a few fixed
// sizes, grouped_gemm.cpp).
//
// On CPUs without native bf16 dot products (no AVX512-BF16, no AMX) oneDNN emulates bf16 matmul at a
// third of its fp32 rate. Every bf16 value is exact in fp32, so there the operands are widened and the
// fp32 kernel computes the same products with fp32 accumulation, at fp32 speed.
//
// A bf16 C (a bf16 run's activations) with beta = 0 on CPUs with native bf16: oneDNN's bf16 dst, rounded
// to nearest even in the kernel's epilogue from the same fp32 accumulators, with no fp32 scratch and no
// separate pass (gemm_test checks it is the fp32-output GEMM rounded, bit for bit, at transformer depths).
// Otherwise (beta != 0 reads the old C, or bf16 emulated through fp32) it goes through fp32 scratch: the
// fp32-output GEMM writes it and one pass rounds it into C.
#include <dnnl.hpp>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "forge/core/cpu_features.h"
#include "forge/core/error.h"
#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

struct GemmKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  DType dtype, c_dtype;
  float alpha, beta;
  auto tie() const { return std::tie(m, n, k, lda, ldb, ldc, trans_a, trans_b, dtype, c_dtype, alpha, beta); }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

struct GemmPrimitive {
  dnnl::memory::desc a, b, c, scratchpad;
  dnnl::matmul matmul;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

GemmPrimitive make_primitive(const GemmKey& key) {
  using dims = dnnl::memory::dims;
  auto dt = key.dtype == DType::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  GemmPrimitive g;
  g.a = dnnl::memory::desc(dims{key.m, key.k}, dt, key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  g.b = dnnl::memory::desc(dims{key.k, key.n}, dt, key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  g.c = dnnl::memory::desc(
      dims{key.m, key.n},
      key.c_dtype == DType::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32,
      dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  // The caller's scratchpad, one per thread (gemm below): the library's own is shared between primitives,
  // and threads running GEMMs at once (tensor-parallel ranks as threads in tests, say) corrupted each
  // other's bf16 matmuls on AVX512-BF16 CPUs.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops post;
    post.append_sum(key.beta);
    attr.set_post_ops(post);
  }
  dnnl::matmul::desc desc(g.a, g.b, g.c);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  g.scratchpad = pd.scratchpad_desc();
  g.matmul = dnnl::matmul(pd);
  return g;
}

// Copies a stored rows x cols bf16 matrix (leading dimension ld) into a dense fp32 one.
void widen_bf16(const void* src, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(rows * cols));
  const auto* in = static_cast<const uint16_t*>(src);
  float* out = dst.data();
#pragma omp parallel for schedule(static) if (rows * cols > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = in + r * ld;
    auto* o = reinterpret_cast<uint32_t*>(out + r * cols);
    for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<uint32_t>(row[c]) << 16;
  }
}

void gemm_bf16_widened(const ops::GemmParams& p) {
  thread_local std::vector<float> a, b;
  widen_bf16(p.a, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, a);
  widen_bf16(p.b, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, b);
  ops::GemmParams q = p;
  q.ab_dtype = DType::f32;
  q.a = a.data(), q.lda = p.trans_a ? p.m : p.k;
  q.b = b.data(), q.ldb = p.trans_b ? p.k : p.n;
  forge::cpu::gemm(q);
}

// The cache: primitives by key, and the keys from the most to the least recently used. Callers hold a
// shared_ptr, so evicting a primitive another thread is running leaves it alive until that call ends.
struct GemmCache {
  std::mutex mutex;
  std::map<GemmKey, std::pair<std::shared_ptr<const GemmPrimitive>, std::list<GemmKey>::iterator>> entries;
  std::list<GemmKey> recency;
};

GemmCache& gemm_cache() {
  static GemmCache cache;
  return cache;
}

std::shared_ptr<const GemmPrimitive> cached_primitive(const GemmKey& key) {
  GemmCache& cache = gemm_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (auto it = cache.entries.find(key); it != cache.entries.end()) {
    cache.recency.splice(cache.recency.begin(), cache.recency, it->second.second);
    return it->second.first;
  }
  auto primitive = std::make_shared<const GemmPrimitive>(make_primitive(key));
  cache.recency.push_front(key);
  cache.entries.emplace(key, std::pair{primitive, cache.recency.begin()});
  if (static_cast<int64_t>(cache.entries.size()) > kGemmCacheSize) {
    cache.entries.erase(cache.recency.back());
    cache.recency.pop_back();
  }
  return primitive;
}

}  // namespace

int64_t gemm_cache_entries() {
  GemmCache& cache = gemm_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.entries.size());
}

bool supports_gemm(const ops::GemmParams& p, std::string* reason) {
  if (p.ab_dtype != DType::f32 && p.ab_dtype != DType::bf16)
    return ops::refuse(reason, "gemm: operands must be fp32 or bf16, got {}", dtype_name(p.ab_dtype));
  if (!ops::supports_gemm_output("gemm", p.c_dtype, p.ab_dtype, reason)) return false;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0)
    return ops::refuse(reason, "gemm: empty problem {}x{}x{}", p.m, p.n, p.k);
  return true;
}

void gemm(const ops::GemmParams& p) {
  if (std::string why; !supports_gemm(p, &why)) fail("{}", why);
  static const bool native_bf16 = cpu_has_native_bf16();
  if (p.c_dtype == DType::bf16 && !(native_bf16 && p.beta == 0.0f))
    return gemm_through_fp32_output(p, [](const ops::GemmParams& q) { cpu::gemm(q); });
  if (p.ab_dtype == DType::bf16 && !native_bf16) return gemm_bf16_widened(p);
  GemmKey key{p.m,       p.n,       p.k,        p.lda,     p.ldb,   p.ldc,
              p.trans_a, p.trans_b, p.ab_dtype, p.c_dtype, p.alpha, p.beta};
  const std::shared_ptr<const GemmPrimitive> prim = cached_primitive(key);
  auto& engine = cpu_engine();
  thread_local dnnl::stream stream(engine);
  dnnl::memory a(prim->a, engine, const_cast<void*>(p.a));
  dnnl::memory b(prim->b, engine, const_cast<void*>(p.b));
  dnnl::memory c(prim->c, engine, p.c);
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < prim->scratchpad.get_size()) scratch.resize(prim->scratchpad.get_size());
  dnnl::memory scratchpad(prim->scratchpad, engine, scratch.data());
  prim->matmul.execute(
      stream,
      {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, scratchpad}});
  stream.wait();
}

}  // namespace forge::cpu

namespace forge::ops {

bool supports_gemm_output(const char* op, DType c_dtype, DType operand_dtype, std::string* reason) {
  if (c_dtype != DType::f32 && c_dtype != DType::bf16)
    return refuse(reason, "{}: c_dtype must be fp32 or bf16, got {}", op, dtype_name(c_dtype));
  // The CUDA backend cannot write bf16 from fp32 operands (cuBLASLt has no such matmul); the CPU refuses too,
  // so that a program behaves the same on both.
  if (c_dtype == DType::bf16 && operand_dtype == DType::f32)
    return refuse(reason, "{}: c_dtype bf16 needs bf16 operands, got {} (fp32 operands write an fp32 C)", op,
                  dtype_name(operand_dtype));
  return true;
}

}  // namespace forge::ops
