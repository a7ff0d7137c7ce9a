// GPU attention throughput (bench/gpu/run_all.sh): forge::cuda::attention_forward and attention_backward on
// causal grouped-query attention at the LLaMA-3-8B shape (32 heads, 8 kv heads, head_dim 128) for batch 1 and
// 2 at 4096 tokens and batch 1 at 8192, in training's layout (q, k, v inside one fused fp32 qkv buffer; dq,
// dk, dv likewise). One sample times `batch` back-to-back calls between two CUDA events on forge's stream;
// the median sample gives TFLOP/s with the usual counts: forward 4 b h s^2 d / 2 (causal), backward 2.5x
// that. Each op includes its bf16 staging passes (attention.cu). There is no peer in this bench: the rate is
// also printed as a fraction of the H100/H200 dense bf16 tensor-core peak (989 TFLOP/s). After timing,
// outputs and gradients are checked for non-finite values. Without a usable GPU it prints one line and exits
// 0.
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

#include "forge/core/error.h"
#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/runtime.h"
#include "forge/kernels/ops.h"
#include "bench_support.h"

namespace forge::cuda {
namespace {

constexpr double kPeakTflops = 989.0;  // dense bf16, H100 / H200 SXM

using bench::Options;

struct Shape {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

// LLaMA-3-8B attention: 32 query heads, 8 kv heads of 128.
const Shape kShapes[] = {{1, 4096, 32, 8, 128}, {2, 4096, 32, 8, 128}, {1, 8192, 32, 8, 128}};

void fill(DeviceBuffer& buffer, uint64_t seed) { bench::fill(buffer, bench::random_unit, seed); }

// Median time per call (ms), samples of `batch` calls.
double time_call(const std::function<void()>& call, const Options& o) { return bench::time_calls({call}, o)[0]; }

// Number of non-finite values in a device array of floats.
size_t non_finite(const float* device, size_t n) {
  std::vector<float> host(n);
  FORGE_CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return static_cast<size_t>(
      std::count_if(host.begin(), host.end(), [](float x) { return !std::isfinite(x); }));
}

struct Row {
  double forward_ms, backward_ms;
  size_t bad_values;
};

Row bench(const Shape& sh, const Options& o) {
  const int64_t width = (sh.heads + 2 * sh.kv_heads) * sh.head_dim, q_width = sh.heads * sh.head_dim;
  const int64_t tokens = sh.batch * sh.seq;
  DeviceBuffer qkv(tokens * width * 4), out(tokens * q_width * 4), lse(sh.batch * sh.heads * sh.seq * 4),
      dout(tokens * q_width * 4), dqkv(tokens * width * 4);
  fill(qkv, 1), fill(dout, 2);
  ops::AttentionParams p;
  p.batch = sh.batch, p.seq = sh.seq, p.heads = sh.heads, p.kv_heads = sh.kv_heads, p.head_dim = sh.head_dim;
  p.q = qkv.as<float>(), p.k = p.q + q_width, p.v = p.k + sh.kv_heads * sh.head_dim;
  p.q_stride = p.k_stride = p.v_stride = width;
  p.out = out.as<float>(), p.out_stride = q_width, p.lse = lse.as<float>();
  p.scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  p.causal = true;
  p.dout = dout.as<float>(), p.dout_stride = q_width;
  p.dq = dqkv.as<float>(), p.dk = p.dq + q_width, p.dv = p.dk + sh.kv_heads * sh.head_dim;
  p.dq_stride = p.dk_stride = p.dv_stride = width;
  Row r{};
  r.forward_ms = time_call([&] { cuda::attention_forward(p); }, o);
  r.backward_ms = time_call([&] { cuda::attention_backward(p); }, o);
  synchronize();
  r.bad_values = non_finite(out.as<float>(), tokens * q_width) +
                 non_finite(dqkv.as<float>(), tokens * width) +
                 non_finite(lse.as<float>(), sh.batch * sh.heads * sh.seq);
  return r;
}

double forward_flops(const Shape& sh) {
  return 4.0 * sh.batch * sh.heads * double(sh.seq) * double(sh.seq) * sh.head_dim / 2;  // causal
}

int run(const Options& o) {
  if (!available()) {
    std::printf("forge_gpubench_attention: %s: nothing measured\n", describe_device().c_str());
    return 0;
  }
  const std::string device = describe_device();
  std::printf(
      "forge_gpubench_attention on %s: causal GQA, fused fp32 qkv, median of %d samples of %d calls\n",
      device.c_str(), o.samples, o.batch);
  std::FILE* json = nullptr;
  if (!o.json_path.empty()) {
    json = std::fopen(o.json_path.c_str(), "w");
    if (!json) fail("forge_gpubench_attention: cannot write {}", o.json_path);
  }
  std::printf("%-9s %5s %6s %5s %8s %5s  %10s %8s %6s\n", "pass", "batch", "seq", "heads", "kv_heads", "dim",
              "ms", "TFLOP/s", "peak");
  int failures = 0;
  for (const Shape& sh : kShapes) {
    try {
      const Row r = bench(sh, o);
      if (r.bad_values != 0) {
        ++failures;
        std::printf("b%lld seq%lld: %zu non-finite values in out, lse or gradients\n",
                    static_cast<long long>(sh.batch), static_cast<long long>(sh.seq), r.bad_values);
      }
      for (const char* pass : {"forward", "backward"}) {
        const bool fwd = std::string(pass) == "forward";
        const double ms = fwd ? r.forward_ms : r.backward_ms;
        const double flops = forward_flops(sh) * (fwd ? 1.0 : 2.5), tflops = flops / (ms * 1e-3) / 1e12;
        std::printf("%-9s %5lld %6lld %5lld %8lld %5lld  %10.3f %8.1f %5.1f%%\n", pass,
                    static_cast<long long>(sh.batch), static_cast<long long>(sh.seq),
                    static_cast<long long>(sh.heads), static_cast<long long>(sh.kv_heads),
                    static_cast<long long>(sh.head_dim), ms, tflops, 100 * tflops / kPeakTflops);
        std::fflush(stdout);
        if (json)
          std::fprintf(
              json, "%s\n",
              fmt::format("{{\"bench\": \"attention\", \"pass\": \"{}\", \"causal\": true, \"batch\": {}, "
                          "\"seq\": {}, \"heads\": {}, \"kv_heads\": {}, \"head_dim\": {}, \"ms\": {:.5f}, "
                          "\"tflops\": {:.2f}, \"peak_tflops\": {:.0f}, \"peak_fraction\": {:.4f}, "
                          "\"non_finite\": {}, \"samples\": {}, \"calls_per_sample\": {}, "
                          "\"device\": \"{}\"}}",
                          pass, sh.batch, sh.seq, sh.heads, sh.kv_heads, sh.head_dim, ms, tflops, kPeakTflops,
                          tflops / kPeakTflops, r.bad_values, o.samples, o.batch, device)
                  .c_str());
      }
    } catch (const Error& e) {
      ++failures;
      std::printf("b%lld seq%lld FAILED: %s\n", static_cast<long long>(sh.batch),
                  static_cast<long long>(sh.seq), e.what());
      std::fflush(stdout);
    }
  }
  if (json) std::fclose(json);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace forge::cuda

int main(int argc, char** argv) {
  try {
    namespace bench = forge::cuda::bench;
    return forge::cuda::run(bench::parse_options(argc, argv, "forge_gpubench_attention", bench::defaults(10, 2, 5)));
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
