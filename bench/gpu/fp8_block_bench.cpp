// Block-scaled FP8 GEMM throughput (bench/gpu/run_all.sh): forge's kernel (kernels/cuda/fp8_block_gemm.cu,
// DeepSeek-V3 scaling: 1x128 tiles of x, 128x128 blocks of W) beside its closest peer and forge's bf16 GEMM,
// on the forward GEMM y[m,n] = x[m,k] W[n,k]^T (fp32 output) of a LLaMA-3-8B layer at 8192 tokens:
//   forge block   cuda::fp8_gemm, scaling = block (E4M3 x E4M3)
//   peer          cublasLtMatmul, per-tensor FP8 (E4M3 x E4M3, fp32 out, scale pointers, the heuristic's
//   first
//                 algorithm): same operands and work, one scale per operand instead of one per block
//   bf16          cuda::gemm with bf16 operands (cuBLASLt), the precision FP8 replaces
// All run on forge's stream. One sample times `batch` back-to-back calls between two CUDA events; samples
// rotate among the three; the median sample gives TFLOP/s = 2mnk / time, also as a fraction of the H200's
// 1979 TFLOP/s dense FP8 peak. Every block scale is the same (a_scales 0.25, b_scales 0.5), so the block
// kernel and the per-tensor peer compute the same product: their outputs' first rows are compared after
// timing. Without a usable GPU it prints one line and exits 0.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
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

constexpr double kFp8PeakTflops = 1979.0;  // H100/H200 SXM, dense FP8

using bench::fill;
using bench::Options;
using bench::random_bf16;
using bench::random_e4m3;
using bench::time_calls;

struct Shape {
  const char* name;
  int64_t m, n, k;  // y[m,n] = x[m,k] W[n,k]^T
};

// LLaMA-3-8B at 8192 tokens: hidden 4096, q|k|v 6144, gate|up 28672, ffn 14336.
const Shape kShapes[] = {
    {"qkv", 8192, 6144, 4096},
    {"o", 8192, 4096, 4096},
    {"gate_up", 8192, 28672, 4096},
    {"down", 8192, 4096, 14336},
};

void fill_value(DeviceBuffer& buffer, float value) {
  std::vector<float> host(buffer.bytes() / sizeof(float), value);
  buffer.upload(host.data(), host.size() * sizeof(float));
}

// max |a - b| / max |b| over the first `rows` rows of two [m, n] fp32 outputs.
double compare_rows(const DeviceBuffer& a_out, const DeviceBuffer& b_out, int64_t n, int64_t rows) {
  std::vector<float> a(rows * n), b(rows * n);
  a_out.download(a.data(), a.size() * sizeof(float));
  b_out.download(b.data(), b.size() * sizeof(float));
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double{a[i]} - b[i]));
    ref = std::max(ref, std::abs(double{b[i]}));
  }
  return diff / std::max(ref, 1e-30);
}

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail("forge_gpubench_fp8block: {} failed: {}", what, cublasLtGetStatusString(s));
}

// cublasLtMatmul, E4M3 x E4M3 -> fp32, per-tensor scales, TN in cuBLASLt's column-major terms (its A = W
// [k x n], transposed; its B = x [k x m]); set up once per shape as a user of cuBLASLt would.
class LtPerTensorPeer {
 public:
  // a_scale, b_scale: device floats, each in its own allocation (cuBLASLt 13.1 refuses scale pointers that
  // are not aligned: two floats of one array ran into CUBLAS_STATUS_NOT_SUPPORTED on an H200).
  LtPerTensorPeer(cublasLtHandle_t handle, const Shape& sh, const void* x, const void* w, float* y,
                  const float* w_scale, const float* x_scale)
      : handle_(handle), x_(x), w_(w), y_(y), workspace_(size_t{32} << 20) {
    check_lt(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const int32_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n), "TRANSB");
    const void* a_scale = w_scale;  // cuBLASLt's A is W
    const void* b_scale = x_scale;
    check_lt(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale),
        "A_SCALE_POINTER");
    check_lt(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale),
        "B_SCALE_POINTER");
    check_lt(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, sh.k, sh.n, sh.k), "layout A");
    check_lt(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, sh.k, sh.m, sh.k), "layout B");
    check_lt(cublasLtMatrixLayoutCreate(&c_, CUDA_R_32F, sh.n, sh.m, sh.n), "layout C");
    cublasLtMatmulPreference_t preference;
    check_lt(cublasLtMatmulPreferenceCreate(&preference), "preference");
    const uint64_t bytes = workspace_.bytes();
    check_lt(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &bytes, sizeof bytes),
             "workspace preference");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, c_, preference, 1, &result, &found),
             "heuristic");
    cublasLtMatmulPreferenceDestroy(preference);
    if (found == 0)
      fail("forge_gpubench_fp8block: cuBLASLt has no FP8 algorithm for {}x{}x{}", sh.m, sh.n, sh.k);
    algo_ = result.algo;
  }
  ~LtPerTensorPeer() {
    cublasLtMatrixLayoutDestroy(a_), cublasLtMatrixLayoutDestroy(b_), cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatmulDescDestroy(desc_);
  }
  LtPerTensorPeer(const LtPerTensorPeer&) = delete;
  LtPerTensorPeer& operator=(const LtPerTensorPeer&) = delete;

  void operator()() const {
    const float alpha = 1, beta = 0;
    check_lt(cublasLtMatmul(handle_, desc_, &alpha, w_, a_, x_, b_, &beta, y_, c_, y_, c_, &algo_,
                            workspace_.data(), workspace_.bytes(), stream()),
             "cublasLtMatmul");
  }

 private:
  cublasLtHandle_t handle_;
  const void *x_, *w_;
  float* y_;
  DeviceBuffer workspace_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

struct Row {
  Shape shape;
  double block_ms, peer_ms, bf16_ms;
  double max_rel_diff;  // block vs per-tensor peer, first rows
};

Row bench_shape(const Shape& sh, cublasLtHandle_t lt, const Options& o) {
  const int64_t k_blocks = (sh.k + 127) / 128, n_blocks = (sh.n + 127) / 128;
  DeviceBuffer x(sh.m * sh.k), w(sh.n * sh.k), x16(sh.m * sh.k * 2), w16(sh.n * sh.k * 2);
  DeviceBuffer a_scales(sh.m * k_blocks * 4), b_scales(n_blocks * k_blocks * 4), peer_w_scale(4),
      peer_x_scale(4);
  DeviceBuffer y_block(sh.m * sh.n * 4), y_peer(sh.m * sh.n * 4), y_bf16(sh.m * sh.n * 4);
  fill(x, random_e4m3, 3), fill(w, random_e4m3, 4);
  fill(x16, random_bf16, 5), fill(w16, random_bf16, 6);
  fill_value(a_scales, 0.25f), fill_value(b_scales, 0.5f);
  const float peer_w_scale_value = 0.5f, peer_x_scale_value = 0.25f;
  peer_w_scale.upload(&peer_w_scale_value, sizeof(float)),
      peer_x_scale.upload(&peer_x_scale_value, sizeof(float));

  ops::Fp8GemmParams block;
  block.m = sh.m, block.n = sh.n, block.k = sh.k;
  block.a = x.as<uint8_t>(), block.lda = sh.k, block.a_dtype = DType::e4m3;
  block.b = w.as<uint8_t>(), block.ldb = sh.k, block.trans_b = true, block.b_dtype = DType::e4m3;
  block.c = y_block.as<float>(), block.ldc = sh.n;
  block.scaling = ops::Fp8Scaling::block;
  block.a_scales = a_scales.as<float>(), block.b_scales = b_scales.as<float>();
  block.b_block = ops::Fp8BlockScales::block_128x128;

  ops::GemmParams bf16;
  bf16.m = sh.m, bf16.n = sh.n, bf16.k = sh.k;
  bf16.a = x16.data(), bf16.lda = sh.k;
  bf16.b = w16.data(), bf16.ldb = sh.k, bf16.trans_b = true;
  bf16.ab_dtype = DType::bf16;
  bf16.c = y_bf16.as<float>(), bf16.ldc = sh.n;

  const LtPerTensorPeer peer(lt, sh, x.data(), w.data(), y_peer.as<float>(), peer_w_scale.as<float>(),
                             peer_x_scale.as<float>());
  const std::vector<double> ms =
      time_calls({[&] { cuda::fp8_gemm(block); }, [&] { peer(); }, [&] { cuda::gemm(bf16); }}, o);
  return {sh, ms[0], ms[1], ms[2], compare_rows(y_block, y_peer, sh.n, 16)};
}

double tflops(const Shape& sh, double ms) { return 2.0 * sh.m * sh.n * sh.k / (ms * 1e-3) / 1e12; }

int run(const Options& o) {
  if (!available()) {
    std::printf("forge_gpubench_fp8block: %s: nothing measured\n", describe_device().c_str());
    return 0;
  }
  if (compute_capability() < 89) {
    std::printf("forge_gpubench_fp8block: no FP8 tensor cores on %s: nothing measured\n",
                describe_device().c_str());
    return 0;
  }
  const std::string device = describe_device();
  std::printf(
      "forge_gpubench_fp8block on %s: median of %d samples of %d calls, y = x W^T, E4M3, fp32 output; %% = "
      "of %.0f "
      "TFLOP/s FP8 peak\n",
      device.c_str(), o.samples, o.batch, kFp8PeakTflops);
  std::FILE* json = nullptr;
  if (!o.json_path.empty()) {
    json = std::fopen(o.json_path.c_str(), "w");
    if (!json) fail("forge_gpubench_fp8block: cannot write {}", o.json_path);
  }
  cublasLtHandle_t lt;
  check_lt(cublasLtCreate(&lt), "cublasLtCreate");

  std::printf("%-8s %6s %6s %6s  %18s  %22s  %13s  %9s  %9s  %12s\n", "shape", "m", "n", "k",
              "block TFLOP/s (%)", "cuBLASLt tensor (%)", "bf16 TFLOP/s", "vs tensor", "vs bf16",
              "max rel diff");
  int failures = 0;
  for (const Shape& sh : kShapes) {
    try {
      const Row r = bench_shape(sh, lt, o);
      const double block = tflops(sh, r.block_ms), peer = tflops(sh, r.peer_ms), bf16 = tflops(sh, r.bf16_ms);
      std::printf(
          "%-8s %6lld %6lld %6lld  %10.1f (%4.1f%%)  %14.1f (%4.1f%%)  %13.1f  %9.3f  %9.3f  %12.2e\n",
          sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n), static_cast<long long>(sh.k),
          block, 100 * block / kFp8PeakTflops, peer, 100 * peer / kFp8PeakTflops, bf16, block / peer,
          block / bf16, r.max_rel_diff);
      std::fflush(stdout);
      if (json)
        std::fprintf(
            json, "%s\n",
            fmt::format(
                "{{\"bench\": \"fp8_block_gemm\", \"shape\": \"{}\", \"m\": {}, \"n\": {}, \"k\": {}, "
                "\"block_ms\": {:.5f}, \"block_tflops\": {:.2f}, \"block_peak_fraction\": {:.4f}, "
                "\"peer\": \"cublasLt_fp8_per_tensor\", \"peer_ms\": {:.5f}, \"peer_tflops\": {:.2f}, "
                "\"peer_peak_fraction\": {:.4f}, \"bf16_ms\": {:.5f}, \"bf16_tflops\": {:.2f}, "
                "\"block_vs_peer\": {:.4f}, \"block_vs_bf16\": {:.4f}, \"max_rel_diff\": {:.3e}, "
                "\"samples\": {}, \"batch\": {}, \"device\": \"{}\"}}",
                sh.name, sh.m, sh.n, sh.k, r.block_ms, block, block / kFp8PeakTflops, r.peer_ms, peer,
                peer / kFp8PeakTflops, r.bf16_ms, bf16, block / peer, block / bf16, r.max_rel_diff, o.samples,
                o.batch, device)
                .c_str());
    } catch (const Error& e) {
      ++failures;
      std::printf("%-8s FAILED: %s\n", sh.name, e.what());
      std::fflush(stdout);
    }
  }
  if (json) std::fclose(json);
  cublasLtDestroy(lt);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace forge::cuda

int main(int argc, char** argv) {
  try {
    return forge::cuda::run(forge::cuda::bench::parse_options(argc, argv, "forge_gpubench_fp8block", {}));
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
