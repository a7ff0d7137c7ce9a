// What every GPU benchmark in bench/gpu shares: the common options (--json, --samples, --warmup, --batch,
// --help), deterministic random device data, and CUDA-event timing that reports the median sample, with
// several callables measured in rotation so that a clock or thermal drift affects forge and its peer alike.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"

namespace forge::cuda::bench {

struct Options {
  std::string json_path;
  std::string dtypes = "all";  // benchmarks that take --dtype
  int samples = 15, warmup = 3, batch = 10;
};
inline Options defaults(int samples, int warmup, int batch) {
  Options o;
  o.samples = samples, o.warmup = warmup, o.batch = batch;
  return o;
}

// Parses the common options over `defaults`; with dtype_choices (e.g. "bf16|fp8|all") also --dtype. Exits 0
// after --help; an unknown argument or a bad value fails with one line naming the program.
inline Options parse_options(int argc, char** argv, const char* program, Options defaults,
                             const char* dtype_choices = nullptr) {
  Options o = defaults;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("{}: {} needs a value", program, arg);
      return argv[++i];
    };
    if (arg == "--json") {
      o.json_path = next();
    } else if (arg == "--dtype" && dtype_choices) {
      o.dtypes = next();
      std::string choices = "|", wanted = "|";
      choices += dtype_choices, choices += '|', wanted += o.dtypes, wanted += '|';
      if (choices.find(wanted) == std::string::npos)
        fail("{}: --dtype is one of {}, not '{}'", program, dtype_choices, o.dtypes);
    } else if (arg == "--samples") {
      o.samples = std::stoi(next());
    } else if (arg == "--warmup") {
      o.warmup = std::stoi(next());
    } else if (arg == "--batch") {
      o.batch = std::stoi(next());
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: %s [--json results.jsonl]%s%s%s [--samples %d] [--warmup %d] [--batch %d]\n", program,
                  dtype_choices ? " [--dtype " : "", dtype_choices ? dtype_choices : "", dtype_choices ? "]" : "",
                  defaults.samples, defaults.warmup, defaults.batch);
      std::exit(0);
    } else {
      fail("{}: unknown argument '{}' (see --help)", program, arg);
    }
  }
  if (o.samples < 1 || o.warmup < 0 || o.batch < 1)
    fail("{}: need --samples >= 1, --warmup >= 0, --batch >= 1", program);
  return o;
}

// xorshift64: the same data on every run.
inline uint64_t next_random(uint64_t& s) {
  s ^= s << 13, s ^= s >> 7, s ^= s << 17;
  return s;
}
// Values uniform in about [-1, 1].
inline float random_unit(uint64_t& s) { return static_cast<float>(next_random(s) % 2000001) / 1e6f - 1.0f; }
inline uint16_t random_bf16(uint64_t& s) { return f32_to_bf16_bits(random_unit(s)); }
// E4M3 codes of values in about [-4, 4] (never NaN): exponent fields 4..8, any mantissa, random sign.
inline uint8_t random_e4m3(uint64_t& s) {
  const uint64_t r = next_random(s);
  const unsigned exponent = 4 + r % 5, mantissa = (r >> 8) & 7, sign = (r >> 16) & 1;
  return static_cast<uint8_t>(sign << 7 | exponent << 3 | mantissa);
}

// Fills a device buffer of T with values from `make`: one host pattern of up to 16M elements, uploaded again
// and again at shifting offsets (generating gigabytes on the host would take longer than the benchmark).
template <typename T>
void fill(DeviceBuffer& buffer, T (*make)(uint64_t&), uint64_t seed) {
  const size_t count = buffer.bytes() / sizeof(T), chunk = std::min<size_t>(count, size_t{1} << 24);
  std::vector<T> pattern(chunk + 64);
  uint64_t state = seed;
  for (auto& v : pattern) v = make(state);
  for (size_t at = 0, round = 0; at < count; at += chunk, ++round) {
    const size_t n = std::min(chunk, count - at);
    FORGE_CUDA_CHECK(cudaMemcpy(buffer.as<T>() + at, pattern.data() + (round * 7) % 64, n * sizeof(T),
                                cudaMemcpyHostToDevice));
  }
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Median milliseconds per call of each callable: samples of `batch` back-to-back calls between two CUDA events
// on forge's stream (the host runs ahead, as in training, so launch overhead is not what is measured), taken in
// rotation among the callables after `warmup` rounds.
inline std::vector<double> time_calls(const std::vector<std::function<void()>>& calls, const Options& o) {
  cudaStream_t s = stream();
  cudaEvent_t start, stop;
  FORGE_CUDA_CHECK(cudaEventCreate(&start));
  FORGE_CUDA_CHECK(cudaEventCreate(&stop));
  auto sample = [&](const std::function<void()>& call) {
    FORGE_CUDA_CHECK(cudaEventRecord(start, s));
    for (int i = 0; i < o.batch; ++i) call();
    FORGE_CUDA_CHECK(cudaEventRecord(stop, s));
    FORGE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    FORGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms) / o.batch;
  };
  for (int i = 0; i < o.warmup; ++i)
    for (const auto& call : calls) sample(call);
  std::vector<std::vector<double>> times(calls.size());
  for (int i = 0; i < o.samples; ++i)
    for (size_t c = 0; c < calls.size(); ++c) times[c].push_back(sample(calls[c]));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<double> medians;
  for (auto& t : times) medians.push_back(median(std::move(t)));
  return medians;
}

}  // namespace forge::cuda::bench
