// GPU GEMM throughput (bench/gpu/run_all.sh): forge's cuBLASLt GEMMs beside a peer in the same run, on the
// forward GEMM y[m,n] = x[m,k] W[n,k]^T (NT) of a LLaMA-3-8B layer at 8192 tokens plus 8192^3, each with an
// fp32 and a bf16 output (C/D; column "out"):
//   bf16  forge::cuda::gemm                  vs cublasGemmEx (bf16 in, CUBLAS_COMPUTE_32F)
//   fp8   forge::cuda::fp8_gemm, per tensor  vs cublasLtMatmul called directly (E4M3 x E4M3, scale
//                                               pointers, the heuristic's first algorithm)
// Both run on forge's stream. One sample times `batch` back-to-back calls between two CUDA events (so the
// host runs ahead as in training and launch overhead is not what is measured); samples alternate between
// forge and the peer; the median sample gives TFLOP/s = 2mnk / time. After timing, both outputs' first rows
// are compared. Without a usable GPU it prints one line and exits 0.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"

namespace forge::cuda {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("forge_gpubench: {} failed: {}", what, cublasGetStatusString(status));
}

using bench::fill;
using bench::Options;
using bench::random_bf16;
using bench::random_e4m3;

struct Shape {
  const char* name;
  int64_t m, n, k;  // y[m,n] = x[m,k] W[n,k]^T
};

// LLaMA-3-8B: hidden 4096, 32 heads and 8 kv heads of 128 (q|k|v = 6144), ffn 14336 (gate|up = 28672).
const Shape kShapes[] = {
    {"qkv", 8192, 6144, 4096},   {"o", 8192, 4096, 4096},      {"gate_up", 8192, 28672, 4096},
    {"down", 8192, 4096, 14336}, {"square", 8192, 8192, 8192},
};

// Median time per call (ms) of forge's call and the peer's, in samples of `batch` calls, alternating.
struct Timing {
  double forge_ms, peer_ms;
};
Timing time_pair(const std::function<void()>& forge_call, const std::function<void()>& peer_call,
                 const Options& o) {
  const std::vector<double> ms = bench::time_calls({forge_call, peer_call}, o);
  return {ms[0], ms[1]};
}

// The first `rows` rows of an [m, n] output in `out` (fp32 or bf16), as floats.
std::vector<float> first_rows(const DeviceBuffer& y, DType out, int64_t n, int64_t rows) {
  std::vector<float> values(rows * n);
  if (out == DType::f32) {
    y.download(values.data(), values.size() * sizeof(float));
  } else {
    std::vector<uint16_t> bits(values.size());
    y.download(bits.data(), bits.size() * sizeof(uint16_t));
    for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_bits_to_f32(bits[i]);
  }
  return values;
}

// max |forge - peer| / max |peer| over the first `rows` rows of two [m, n] outputs in `out`.
double compare_rows(const DeviceBuffer& forge_out, const DeviceBuffer& peer_out, DType out, int64_t n,
                    int64_t rows) {
  const std::vector<float> a = first_rows(forge_out, out, n, rows), b = first_rows(peer_out, out, n, rows);
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double{a[i]} - b[i]));
    ref = std::max(ref, std::abs(double{b[i]}));
  }
  return diff / std::max(ref, 1e-30);
}

struct Row {
  std::string dtype, out, peer;
  Shape shape;
  Timing t;
  double max_rel_diff;
};

cudaDataType_t cuda_type(DType out) { return out == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

Row bench_bf16(const Shape& sh, DType out, cublasHandle_t handle, const Options& o) {
  const size_t y_bytes = sh.m * sh.n * dtype_size(out);
  DeviceBuffer x(sh.m * sh.k * 2), w(sh.n * sh.k * 2), y_forge(y_bytes), y_peer(y_bytes);
  fill(x, random_bf16, 1), fill(w, random_bf16, 2);
  ops::GemmParams p;
  p.m = sh.m, p.n = sh.n, p.k = sh.k;
  p.a = x.data(), p.lda = sh.k;
  p.b = w.data(), p.ldb = sh.k, p.trans_b = true;
  p.ab_dtype = DType::bf16;
  p.c = y_forge.data(), p.ldc = sh.n, p.c_dtype = out;
  const float alpha = 1, beta = 0;
  auto forge_call = [&] { cuda::gemm(p); };
  // Column-major: y^T[n,m] = W^T^T x^T, i.e. op(A) = W stored k x n (transposed), B = x stored k x m.
  auto peer_call = [&] {
    check_cublas(
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(sh.n), static_cast<int>(sh.m),
                     static_cast<int>(sh.k), &alpha, w.data(), CUDA_R_16BF, static_cast<int>(sh.k), x.data(),
                     CUDA_R_16BF, static_cast<int>(sh.k), &beta, y_peer.data(), cuda_type(out),
                     static_cast<int>(sh.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  };
  const Timing t = time_pair(forge_call, peer_call, o);
  const double diff = compare_rows(y_forge, y_peer, out, sh.n, 16);
  return {"bf16", std::string(dtype_name(out)), "cublasGemmEx", sh, t, diff};
}

// cublasLtMatmul for E4M3 x E4M3 -> fp32 or bf16 (C = D) in the TN layout, set up once per shape as a user of
// cuBLASLt would.
class LtFp8Peer {
 public:
  // w_scale, x_scale: device floats, each in its own allocation (cuBLASLt 13.1 refuses scale pointers that
  // are not aligned: two floats of one array ran into CUBLAS_STATUS_NOT_SUPPORTED on an H200).
  LtFp8Peer(cublasLtHandle_t handle, const Shape& sh, const void* x, const void* w, void* y, DType out,
            const float* w_scale, const float* x_scale)
      : handle_(handle), x_(x), w_(w), y_(y), workspace_(size_t{32} << 20) {
    auto check = [](cublasStatus_t s, const char* what) {
      if (s != CUBLAS_STATUS_SUCCESS) fail("forge_gpubench: {} failed: {}", what, cublasLtGetStatusString(s));
    };
    check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const int32_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "TRANSA");
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n), "TRANSB");
    const void* a_scale = w_scale;  // cuBLASLt's A is W
    const void* b_scale = x_scale;
    check(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale),
        "A_SCALE_POINTER");
    check(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale),
        "B_SCALE_POINTER");
    check(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, sh.k, sh.n, sh.k), "layout A");
    check(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, sh.k, sh.m, sh.k), "layout B");
    check(cublasLtMatrixLayoutCreate(&c_, cuda_type(out), sh.n, sh.m, sh.n), "layout C");
    cublasLtMatmulPreference_t pref;
    check(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const uint64_t bytes = workspace_.bytes();
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                                               sizeof bytes),
          "workspace preference");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, c_, pref, 1, &result, &found),
          "heuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) fail("forge_gpubench: cuBLASLt has no FP8 algorithm for {}x{}x{}", sh.m, sh.n, sh.k);
    algo_ = result.algo;
  }
  ~LtFp8Peer() {
    cublasLtMatrixLayoutDestroy(a_), cublasLtMatrixLayoutDestroy(b_), cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatmulDescDestroy(desc_);
  }
  void operator()() const {
    const float alpha = 1, beta = 0;
    const cublasStatus_t s = cublasLtMatmul(handle_, desc_, &alpha, w_, a_, x_, b_, &beta, y_, c_, y_, c_,
                                            &algo_, workspace_.data(), workspace_.bytes(), stream());
    if (s != CUBLAS_STATUS_SUCCESS)
      fail("forge_gpubench: cublasLtMatmul failed: {}", cublasLtGetStatusString(s));
  }

 private:
  cublasLtHandle_t handle_;
  const void *x_, *w_;
  void* y_;
  DeviceBuffer workspace_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

Row bench_fp8(const Shape& sh, DType out, cublasLtHandle_t lt, const Options& o) {
  const size_t y_bytes = sh.m * sh.n * dtype_size(out);
  DeviceBuffer x(sh.m * sh.k), w(sh.n * sh.k), y_forge(y_bytes), y_peer(y_bytes), w_scale(4), x_scale(4);
  fill(x, random_e4m3, 3), fill(w, random_e4m3, 4);
  const float w_scale_value = 0.5f, x_scale_value = 0.25f;  // the peer's A (= W) and B (= x) scales
  w_scale.upload(&w_scale_value, sizeof(float)), x_scale.upload(&x_scale_value, sizeof(float));
  ops::Fp8GemmParams p;
  p.m = sh.m, p.n = sh.n, p.k = sh.k;
  p.a = x.as<uint8_t>(), p.lda = sh.k, p.a_dtype = DType::e4m3;
  p.b = w.as<uint8_t>(), p.ldb = sh.k, p.trans_b = true, p.b_dtype = DType::e4m3;
  p.c = y_forge.data(), p.ldc = sh.n, p.c_dtype = out;
  p.a_scale_inv = 0.25f, p.b_scale_inv = 0.5f;
  const LtFp8Peer peer(lt, sh, x.data(), w.data(), y_peer.data(), out, w_scale.as<float>(),
                       x_scale.as<float>());
  auto forge_call = [&] { cuda::fp8_gemm(p); };
  auto peer_call = [&] { peer(); };
  const Timing t = time_pair(forge_call, peer_call, o);
  const double diff = compare_rows(y_forge, y_peer, out, sh.n, 16);
  return {"fp8", std::string(dtype_name(out)), "cublasLtMatmul", sh, t, diff};
}

double tflops(const Shape& sh, double ms) { return 2.0 * sh.m * sh.n * sh.k / (ms * 1e-3) / 1e12; }

int run(const Options& o) {
  if (!available()) {
    std::printf("forge_gpubench: %s: nothing measured\n", describe_device().c_str());
    return 0;
  }
  const std::string device = describe_device();
  std::printf("forge_gpubench on %s: median of %d samples of %d calls, y = x W^T, fp32 and bf16 outputs\n",
              device.c_str(), o.samples, o.batch);
  std::FILE* json = nullptr;
  if (!o.json_path.empty()) {
    json = std::fopen(o.json_path.c_str(), "w");
    if (!json) fail("forge_gpubench: cannot write {}", o.json_path);
  }
  cublasHandle_t handle;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  check_cublas(cublasSetStream(handle, stream()), "cublasSetStream");
  cublasLtHandle_t lt;
  check_cublas(cublasLtCreate(&lt), "cublasLtCreate");

  std::printf("%-5s %-4s %-8s %6s %6s %6s  %12s  %-15s %12s  %10s  %12s\n", "dtype", "out", "shape", "m", "n",
              "k", "forge TFLOP/s", "peer", "peer TFLOP/s", "forge/peer", "max rel diff");
  int failures = 0;
  for (const char* dtype : {"bf16", "fp8"}) {
    if (o.dtypes != "all" && o.dtypes != dtype) continue;
    for (const DType out : {DType::f32, DType::bf16}) {
      const std::string out_name(dtype_name(out));
      for (const Shape& sh : kShapes) {
        try {
          const Row r =
              std::string(dtype) == "bf16" ? bench_bf16(sh, out, handle, o) : bench_fp8(sh, out, lt, o);
          const double f = tflops(sh, r.t.forge_ms), q = tflops(sh, r.t.peer_ms);
          std::printf("%-5s %-4s %-8s %6lld %6lld %6lld  %12.1f  %-15s %12.1f  %10.3f  %12.2e\n", dtype,
                      out_name.c_str(), sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n),
                      static_cast<long long>(sh.k), f, r.peer.c_str(), q, f / q, r.max_rel_diff);
          std::fflush(stdout);
          if (json)
            std::fprintf(
                json, "%s\n",
                fmt::format(
                    "{{\"bench\": \"gemm\", \"dtype\": \"{}\", \"out\": \"{}\", \"shape\": \"{}\", "
                    "\"m\": {}, \"n\": {}, \"k\": {}, \"forge_ms\": {:.5f}, \"forge_tflops\": {:.2f}, "
                    "\"peer\": \"{}\", \"peer_ms\": {:.5f}, \"peer_tflops\": {:.2f}, \"ratio\": {:.4f}, "
                    "\"max_rel_diff\": {:.3e}, \"samples\": {}, \"batch\": {}, \"device\": \"{}\"}}",
                    dtype, r.out, sh.name, sh.m, sh.n, sh.k, r.t.forge_ms, f, r.peer, r.t.peer_ms, q, f / q,
                    r.max_rel_diff, o.samples, o.batch, device)
                    .c_str());
        } catch (const Error& e) {
          ++failures;
          std::printf("%-5s %-4s %-8s FAILED: %s\n", dtype, out_name.c_str(), sh.name, e.what());
          std::fflush(stdout);
        }
      }
    }
  }
  if (json) std::fclose(json);
  cublasLtDestroy(lt);
  cublasDestroy(handle);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace forge::cuda

int main(int argc, char** argv) {
  try {
    return forge::cuda::run(
        forge::cuda::bench::parse_options(argc, argv, "forge_gpubench", {}, "bf16|fp8|all"));
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
