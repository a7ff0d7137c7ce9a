// The op harness: helpers every op test uses to compare a kernel with a double-precision reference and
// to check gradients by central finite differences (evaluated in double on the reference), and the frame in which
// an op test is written once and runs on every backend (below: Backend, OpTest, FORGE_INSTANTIATE_OP_TEST).
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <iomanip>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "forge/core/device.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"

namespace forge::testing {

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// max |a-b| / (atol_floor + max|b|): a relative error against the reference's scale.
inline double relative_error(const float* got, const double* want, size_t n) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  return max_diff / (max_ref + 1e-30);
}
inline double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  return relative_error(got.data(), want.data(), got.size());
}

// Normwise relative distance ||got - want||_2 / ||want||_2 (the bf16 activation tests' measure: errors
// that small add up normwise, triangle inequality).
inline double normwise_error(const float* got, const float* want, size_t n) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

// Scale-free similarity 1 - 2<x,y>/(|x|^2+|y|^2): 0 for identical vectors (used for low precision).
inline double dissimilarity(const float* x, const double* y, size_t n) {
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < n; ++i) {
    xy += x[i] * y[i];
    xx += double(x[i]) * x[i];
    yy += y[i] * y[i];
  }
  return 1.0 - 2.0 * xy / (xx + yy + 1e-300);
}

// Central finite differences of a scalar double-precision function f(x) at x; returns df/dx.
inline std::vector<double> finite_difference(const std::function<double(const std::vector<double>&)>& f,
                                             std::vector<double> x, double h = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double up = f(x);
    x[i] = saved - h;
    double down = f(x);
    x[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// <w, y>: projects an output onto fixed random weights so a vector-valued op becomes a scalar loss whose
// gradient with respect to the output is w (the dy fed to the backward kernel).
inline double dot(const std::vector<double>& w, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < w.size(); ++i) s += w[i] * y[i];
  return s;
}

// Expects f() to throw forge::Error with a one-line message containing every fragment (the culprit).
template <typename F>
void expect_error_containing(F&& f, std::initializer_list<std::string_view> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (std::string_view fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << message;
  }
}

// Runs f with the OpenMP thread count set to `threads` (for thread-count invariance checks).
template <typename F>
void with_threads(int threads, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

// Whether this CPU's fp32 GEMM of [m, k] x [k, n] gives other bits with 1 and 2 threads. oneDNN's AVX-512
// kernels do not; its AVX2 ones may split k between threads, which reorders the sum. Tests of bitwise
// thread-count invariance of ops built on GEMMs hold only where the GEMM itself is invariant.
inline bool gemm_bits_depend_on_thread_count(int64_t m, int64_t n, int64_t k) {
  const std::vector<float> a = random_floats(m * k, 11), b = random_floats(k * n, 12);
  std::vector<float> c1(m * n), c2(m * n);
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = a.data(), p.lda = k, p.b = b.data(), p.ldb = n, p.ldc = n;
  p.c = c1.data();
  with_threads(1, [&] { ops::gemm(p); });
  p.c = c2.data();
  with_threads(2, [&] { ops::gemm(p); });
  return std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) != 0;
}

// A GEMM-like op (ops::gemm, ops::fp8_gemm) with a bf16 output against the same op with an fp32 one. c16 is the
// bf16 C [m, p.ldc] (NaN where beta = 0 must not read it); run(p) runs the op. It runs once into an fp32 C
// holding c16's exact values, then into c16 with c_dtype bf16: every element must be the fp32 result rounded,
// bitwise, and each row's padding columns [n, ldc) untouched.
template <typename Params, typename Run>
void expect_bf16_output_is_fp32_rounded(Params p, std::vector<uint16_t> c16, Run run) {
  std::vector<float> c32(c16.size());
  for (size_t i = 0; i < c16.size(); ++i) c32[i] = bf16_bits_to_f32(c16[i]);
  const std::vector<uint16_t> before = c16;
  Params f32 = p;
  f32.c = c32.data();
  run(f32);
  p.c = c16.data(), p.c_dtype = DType::bf16;
  run(p);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j)
      ASSERT_EQ(c16[i * p.ldc + j], f32_to_bf16_bits(c32[i * p.ldc + j]))
          << "C[" << i << "," << j << "]: bf16 output " << bf16_bits_to_f32(c16[i * p.ldc + j]) << ", fp32 output "
          << c32[i * p.ldc + j];
    EXPECT_EQ(std::memcmp(&c16[i * p.ldc + p.n], &before[i * p.ldc + p.n], (p.ldc - p.n) * sizeof(uint16_t)), 0)
        << "padding of row " << i << " was written";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Op tests written once, run on every backend (tests/kernels/op_tests/*.h).
//
// An op test is a TEST_P of an OpTest<Case> fixture over (backend, case), a case being the shapes and parameters
// of one problem. On Backend::cpu it checks the CPU kernel against the double-precision reference (gradients by
// finite differences); on any other backend it runs the same case there and compares with the CPU kernel on the
// same inputs, within what the arithmetic allows that backend's kernels. The test is written once, in a header;
// each binary instantiates it for the backends it tests (FORGE_INSTANTIATE_OP_TEST):
//   test_kernels (label unit)  cpu, and emulated: the device emulation (kernels/emulated_device.h) runs the CPU
//                              kernels behind the CUDA backend's parameter limits and device-memory discipline, so
//                              its results equal the CPU's bitwise, but the device half of every test (uploads,
//                              device pointers, the CUDA backend's support for the case, downloads) runs in CI;
//   test_cuda (label cuda)     gpu: the CUDA kernels (skipped where no GPU is usable).
// A case is meant to run on every backend: one a backend's support query refuses fails, naming the reason
// (FORGE_TEST_OP).

enum class Backend { cpu, emulated, gpu };

inline const char* backend_name(Backend backend) {
  return backend == Backend::cpu ? "Cpu" : backend == Backend::emulated ? "Emulated" : "Gpu";
}

template <typename Case>
class OpTest : public ::testing::TestWithParam<std::tuple<Backend, Case>> {
 public:
  using CaseType = Case;

 protected:
  void SetUp() override {
    if (backend() == Backend::gpu && !device_usable(Device::cuda)) GTEST_SKIP() << "no usable GPU";
    if (backend() == Backend::emulated) emulation_.emplace();
  }
  void TearDown() override {
    if (emulation_) {
      EXPECT_EQ(EmulatedDevice::live_allocations(), 0) << "device memory outlived the test";
    }
    emulation_.reset();
  }
  Backend backend() const { return std::get<0>(this->GetParam()); }
  const Case& test_case() const { return std::get<1>(this->GetParam()); }
  bool on_cpu() const { return backend() == Backend::cpu; }
  // Where the ops under test run: the host for the CPU, Device::cuda (the GPU or the emulation) otherwise.
  Device device() const { return on_cpu() ? Device::cpu : Device::cuda; }

 private:
  std::optional<EmulatedDevice> emulation_;
};

// The case of an op test whose body holds its own inputs (fixed values): one instance per backend.
struct FixedCase {
  std::string name() const { return "fixed"; }
};
inline const std::vector<FixedCase> kFixedCase = {FixedCase{}};

// "<Backend>_<case.name()>": the case names itself with letters, digits and underscores.
template <typename Suite>
std::string op_test_name(const ::testing::TestParamInfo<typename Suite::ParamType>& info) {
  return std::string(backend_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name();
}

// n elements of T on a device, `offset` elements past the start of their allocation (offset > 0: a pointer less
// aligned than an allocation's). Host memory for the CPU; device memory otherwise, reached only by copies (the
// emulation faults on any other host access).
template <typename T>
class DeviceArray {
 public:
  DeviceArray(Device device, size_t n, size_t offset = 0) : device_(device), n_(n), offset_(offset) {
    if (device == Device::cpu)
      host_.resize(n + offset);
    else if (n + offset > 0)
      base_ = static_cast<T*>(device_memory(device).alloc((n + offset) * sizeof(T)));
  }
  DeviceArray(Device device, const std::vector<T>& values, size_t offset = 0)
      : DeviceArray(device, values.size(), offset) {
    upload(values);
  }
  ~DeviceArray() {
    if (base_) device_memory(device_).free(base_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() { return n_ == 0 ? nullptr : (device_ == Device::cpu ? host_.data() : base_) + offset_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& values) {
    EXPECT_EQ(values.size(), n_);
    if (n_ > 0) copy(data(), device_, values.data(), Device::cpu, n_);
  }
  std::vector<T> download() {
    std::vector<T> values(n_);
    if (n_ > 0) copy(values.data(), Device::cpu, data(), device_, n_);
    return values;
  }

 private:
  static void copy(T* dst, Device dst_device, const T* src, Device src_device, size_t n) {
    if (dst_device == Device::cpu && src_device == Device::cpu)
      std::memcpy(dst, src, n * sizeof(T));
    else
      device_memory(dst_device == Device::cpu ? src_device : dst_device)
          .copy(dst, dst_device, src, src_device, n * sizeof(T));
  }

  Device device_;
  size_t n_, offset_;
  std::vector<T> host_;
  T* base_ = nullptr;
};

// ops::op(args..., device), after the backend's support query has agreed to the arguments (a refusal fails the
// test with the backend's reason); the op's result. FORGE_TEST_OP(rmsnorm_forward, device(), p).
#define FORGE_TEST_OP(op, device, ...)                                                     \
  [&] {                                                                                    \
    std::string why_;                                                                      \
    EXPECT_TRUE(::forge::ops::supports_##op(__VA_ARGS__, device, &why_)) << #op ": " << why_; \
    return ::forge::ops::op(__VA_ARGS__, device);                                          \
  }()

// Comparisons of another backend's results with the CPU's.

// Unit roundoff of fp32.
constexpr double kU = 1.0 / (1 << 24);

// Relative error bound of a sum of `terms` addends (or fused multiply-adds) summed in a different order by
// each backend: neither adds more than terms / 4 + 64 values one after another (the CPU's SIMD lanes hold at
// least four partial sums; the GPU's tree is shallower), and each addition rounds once.
inline double reduction_tolerance(int64_t terms) { return (static_cast<double>(terms) / 4 + 64) * kU; }

inline std::string show(float x) {
  std::ostringstream out;
  out << std::setprecision(9) << x << " (0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
  return out.str();
}

// One EXPECT per array (not per element), naming the first offender.
template <typename Ok>
void expect_all(const std::vector<float>& got, const std::vector<float>& cpu, const std::string& what, Ok ok) {
  ASSERT_EQ(got.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!ok(i) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ; first at " << first
                     << ": got " << show(got[first]) << ", cpu " << show(cpu[first]);
}

inline void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& cpu,
                                 const std::string& what) {
  expect_all(got, cpu, what,
             [&](size_t i) { return std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(cpu[i]); });
}

// |got - cpu| <= tolerance(i), a bound in absolute terms.
template <typename Tolerance>
void expect_close(const std::vector<float>& got, const std::vector<float>& cpu, const std::string& what,
                  Tolerance tolerance) {
  expect_all(got, cpu, what,
             [&](size_t i) { return std::abs(double{got[i]} - double{cpu[i]}) <= tolerance(i); });
}

}  // namespace forge::testing

// Instantiates the op test `suite` (an OpTest<Case>) over `cases` (a container of Case) on the backends listed
// after it, each test named Ops/<suite>.<test>/<Backend>_<case name>.
#define FORGE_INSTANTIATE_OP_TEST(suite, cases, ...) FORGE_INSTANTIATE_OP_TEST_NAMED(Ops, suite, cases, __VA_ARGS__)
// The same under another instantiation name: a second case list for the same tests.
#define FORGE_INSTANTIATE_OP_TEST_NAMED(name, suite, cases, ...)                                    \
  INSTANTIATE_TEST_SUITE_P(name, suite,                                                            \
                           ::testing::Combine(::testing::Values(__VA_ARGS__), ::testing::ValuesIn(cases)), \
                           ::forge::testing::op_test_name<suite>)
