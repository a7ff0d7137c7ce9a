// GEMM through oneDNN matmul. Transposes are expressed as strides on the memory descriptors, so NN, NT
// and TN all run without copies; bf16 operands accumulate in fp32 (AVX512-BF16 where the CPU has it).
// Primitives are created once per (shape, layout, dtype, alpha, beta) and cached.
#include <dnnl.hpp>

#include <map>
#include <mutex>
#include <tuple>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

struct GemmKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  DType dtype;
  float alpha, beta;
  auto tie() const { return std::tie(m, n, k, lda, ldb, ldc, trans_a, trans_b, dtype, alpha, beta); }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

struct GemmPrimitive {
  dnnl::memory::desc a, b, c;
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
  g.c = dnnl::memory::desc(dims{key.m, key.n}, dnnl::memory::data_type::f32, dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops post;
    post.append_sum(key.beta);
    attr.set_post_ops(post);
  }
  dnnl::matmul::desc desc(g.a, g.b, g.c);
  dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
  g.matmul = dnnl::matmul(pd);
  return g;
}

}  // namespace

void gemm(const ops::GemmParams& p) {
  FORGE_CHECK(p.ab_dtype == DType::f32 || p.ab_dtype == DType::bf16, "gemm: operands must be fp32 or bf16, got {}",
              dtype_name(p.ab_dtype));
  FORGE_CHECK(p.m > 0 && p.n > 0 && p.k > 0, "gemm: empty problem {}x{}x{}", p.m, p.n, p.k);
  GemmKey key{p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.trans_a, p.trans_b, p.ab_dtype, p.alpha, p.beta};
  static std::mutex mutex;
  static std::map<GemmKey, GemmPrimitive> cache;
  const GemmPrimitive* prim;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, make_primitive(key)).first;
    prim = &it->second;
  }
  auto& engine = cpu_engine();
  thread_local dnnl::stream stream(engine);
  dnnl::memory a(prim->a, engine, const_cast<void*>(p.a));
  dnnl::memory b(prim->b, engine, const_cast<void*>(p.b));
  dnnl::memory c(prim->c, engine, p.c);
  prim->matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream.wait();
}

}  // namespace forge::cpu
