// GPU FP8 cast bandwidth (bench/gpu/run_all.sh): forge's CUDA casts (kernels/cuda/fp8_cast.cu) on fp32 inputs
// (the weights' masters) and bf16 inputs (a bf16 run's activations, read as they are) of a LLaMA-3-8B layer
// at 8192 tokens, [8192, 4096] (hidden) and [8192, 14336] (ffn), in GB/s of bytes read plus bytes written (x
// once, each FP8 output once, the scales), against
//   - the memory-bandwidth roofline (H200: 4.8 TB/s), and
//   - a measured peer: cudaMemcpyAsync device-to-device of the same input (4 bytes read + 4 written per
//     element), the bandwidth a plain streaming kernel reaches on this device.
// Casts: amax, the per-tensor cast (q, q_t, both; these return the amax to the host, so every call includes
// one synchronisation, as in training), 1x128 (q, q_t, both) and 128x128 (q, q + q_t); from bf16: amax_to,
// the per-tensor cast with its transpose and 1x128 both (what a bf16 step's activations and gradients take).
//
// One sample times `batch` back-to-back calls between two CUDA events; samples alternate between forge and
// the peer; the median sample is reported. Without a usable GPU it prints one line and exits 0.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
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

constexpr const char* kName = "forge_gpubench_fp8cast";
// H200 HBM3e peak.
constexpr double kRooflineGBps = 4800.0;

using bench::next_random;
using bench::Options;

struct Shape {
  const char* name;
  int64_t rows, cols;
};
const Shape kShapes[] = {{"hidden", 8192, 4096}, {"ffn", 8192, 14336}};

// Values of about [-4, 4] with a spread of magnitudes, so that block scales differ from tile to tile.
float random_value(uint64_t& s) {
  const uint64_t r = next_random(s);
  const float magnitude = static_cast<float>(r % 1000001) / 250000.0f;
  return (r >> 32) & 1 ? -magnitude : magnitude;
}

void fill(DeviceBuffer& buffer, uint64_t seed) { bench::fill(buffer, random_value, seed); }

struct Timing {
  double forge_ms, peer_ms;
};

// Median time per call (ms) of forge's call and the peer's, in samples of `batch` calls, alternating.
Timing time_pair(const std::function<void()>& forge_call, const std::function<void()>& peer_call,
                 const Options& o) {
  const std::vector<double> ms = bench::time_calls({forge_call, peer_call}, o);
  return {ms[0], ms[1]};
}

// Device buffers for one shape: x (and its bf16 copy), both code layouts and both scale arrays (sized for
// 1x128, the larger), and the peer's copy destination.
struct Buffers {
  DeviceBuffer x, x16, q, q_t, scale_inv, scale_inv_t, copy, amax_out;
  explicit Buffers(const Shape& sh)
      : x(sh.rows * sh.cols * sizeof(float)),
        x16(sh.rows * sh.cols * sizeof(uint16_t)),
        q(sh.rows * sh.cols),
        q_t(sh.rows * sh.cols),
        scale_inv(sh.rows * ((sh.cols + 127) / 128) * sizeof(float)),
        scale_inv_t(sh.cols * ((sh.rows + 127) / 128) * sizeof(float)),
        copy(sh.rows * sh.cols * sizeof(float)),
        amax_out(sizeof(float)) {}
};

struct Cast {
  const char* name;
  bool q, q_t;
  enum Kind { amax, per_tensor, tile_1x128, block_128x128 } kind;
  bool bf16;  // x in bf16
};
const Cast kCasts[] = {
    {"amax", false, false, Cast::amax, false},
    {"cast_q", true, false, Cast::per_tensor, false},
    {"cast_q_t", false, true, Cast::per_tensor, false},
    {"cast_transpose", true, true, Cast::per_tensor, false},
    {"1x128_q", true, false, Cast::tile_1x128, false},
    {"1x128_q_t", false, true, Cast::tile_1x128, false},
    {"1x128_both", true, true, Cast::tile_1x128, false},
    {"128x128_q", true, false, Cast::block_128x128, false},
    {"128x128_both", true, true, Cast::block_128x128, false},
    {"bf16_amax_to", false, false, Cast::amax, true},
    {"bf16_cast_tr", true, true, Cast::per_tensor, true},
    {"bf16_1x128", true, true, Cast::tile_1x128, true},
};

// Bytes one call moves: x read once, one byte per element per FP8 output, 4 per scale.
double bytes_moved(const Cast& c, const Shape& sh) {
  const double n = static_cast<double>(sh.rows) * sh.cols;
  double bytes = (c.bf16 ? 2 : 4) * n + (c.q ? n : 0) + (c.q_t ? n : 0);
  const double row_blocks = static_cast<double>((sh.rows + 127) / 128), col_blocks = (sh.cols + 127) / 128;
  if (c.kind == Cast::tile_1x128)
    bytes += 4 * ((c.q ? sh.rows * col_blocks : 0) + (c.q_t ? sh.cols * row_blocks : 0));
  if (c.kind == Cast::block_128x128) bytes += 4 * row_blocks * col_blocks * (c.q_t ? 2 : 1);
  return bytes;
}

std::function<void()> forge_call(const Cast& c, const Shape& sh, const Buffers& b) {
  ops::Fp8CastParams p;
  p.rows = sh.rows, p.cols = sh.cols, p.fp8 = DType::e4m3, p.scale = 0.75f;
  if (c.bf16)
    p.x = b.x16.as<uint16_t>();
  else
    p.x = b.x.as<float>();
  p.q = c.q ? b.q.as<uint8_t>() : nullptr;
  p.q_t = c.q_t ? b.q_t.as<uint8_t>() : nullptr;
  p.scale_inv = c.q ? b.scale_inv.as<float>() : nullptr;
  p.scale_inv_t = c.q_t ? b.scale_inv_t.as<float>() : nullptr;
  switch (c.kind) {
    case Cast::amax:
      // fp32: the host-returning amax (one synchronisation); bf16: amax_to, into device memory in stream
      // order, as current scaling runs it on activations.
      if (c.bf16) return [p, out = b.amax_out.as<float>()] { cuda::amax_to(p.x, p.rows * p.cols, out); };
      return [p] { cuda::amax(p.x.f32(), p.rows * p.cols); };
    case Cast::per_tensor:
      return [p] { cuda::fp8_cast_transpose(p); };
    case Cast::tile_1x128:
      return [p] { cuda::fp8_quantize_1x128(p); };
    case Cast::block_128x128:
      return [p] { cuda::fp8_quantize_128x128(p); };
  }
  fail("{}: unknown cast", kName);
}

int run(const Options& o) {
  if (!available()) {
    std::printf("%s: %s: nothing measured\n", kName, describe_device().c_str());
    return 0;
  }
  const std::string device = describe_device();
  std::printf(
      "%s on %s: median of %d samples of %d calls; GB/s of bytes read + written; roofline %.0f GB/s; "
      "peer cudaMemcpyAsync D2D of x\n",
      kName, device.c_str(), o.samples, o.batch, kRooflineGBps);
  std::FILE* json = nullptr;
  if (!o.json_path.empty()) {
    json = std::fopen(o.json_path.c_str(), "w");
    if (!json) fail("{}: cannot write {}", kName, o.json_path);
  }
  std::printf("%-14s %-7s %6s %6s  %9s %9s %9s  %9s %9s\n", "cast", "shape", "rows", "cols", "forge ms",
              "GB/s", "roofline", "peer GB/s", "vs peer");
  int failures = 0;
  for (const Shape& sh : kShapes) {
    try {
      Buffers b(sh);
      fill(b.x, 1);
      cuda::convert_to_bf16(b.x.as<float>(), b.x16.as<uint16_t>(), sh.rows * sh.cols);
      const size_t x_bytes = static_cast<size_t>(sh.rows * sh.cols) * sizeof(float);
      auto peer_call = [&] {
        FORGE_CUDA_CHECK(
            cudaMemcpyAsync(b.copy.data(), b.x.data(), x_bytes, cudaMemcpyDeviceToDevice, stream()));
      };
      for (const Cast& c : kCasts) {
        const Timing t = time_pair(forge_call(c, sh, b), peer_call, o);
        const double gbps = bytes_moved(c, sh) / (t.forge_ms * 1e-3) / 1e9;
        const double peer_gbps = 2.0 * static_cast<double>(x_bytes) / (t.peer_ms * 1e-3) / 1e9;
        std::printf("%-14s %-7s %6lld %6lld  %9.4f %9.1f %8.1f%%  %9.1f %8.1f%%\n", c.name, sh.name,
                    static_cast<long long>(sh.rows), static_cast<long long>(sh.cols), t.forge_ms, gbps,
                    100.0 * gbps / kRooflineGBps, peer_gbps, 100.0 * gbps / peer_gbps);
        std::fflush(stdout);
        if (json)
          std::fprintf(
              json, "%s\n",
              fmt::format(
                  "{{\"bench\": \"fp8_cast\", \"cast\": \"{}\", \"shape\": \"{}\", \"rows\": {}, "
                  "\"cols\": {}, \"x\": \"{}\", \"fp8\": \"e4m3\", \"bytes\": {:.0f}, \"forge_ms\": {:.5f}, "
                  "\"forge_gbps\": {:.1f}, \"roofline_gbps\": {:.0f}, \"roofline_fraction\": {:.4f}, "
                  "\"peer\": \"cudaMemcpyAsync D2D\", \"peer_ms\": {:.5f}, \"peer_gbps\": {:.1f}, "
                  "\"ratio\": {:.4f}, \"samples\": {}, \"batch\": {}, \"device\": \"{}\"}}",
                  c.name, sh.name, sh.rows, sh.cols, c.bf16 ? "bf16" : "fp32", bytes_moved(c, sh), t.forge_ms,
                  gbps, kRooflineGBps, gbps / kRooflineGBps, t.peer_ms, peer_gbps, gbps / peer_gbps,
                  o.samples, o.batch, device)
                  .c_str());
      }
    } catch (const Error& e) {
      ++failures;
      std::printf("%-7s FAILED: %s\n", sh.name, e.what());
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
    return forge::cuda::run(forge::cuda::bench::parse_options(argc, argv, "forge_gpubench_fp8cast", {}));
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
