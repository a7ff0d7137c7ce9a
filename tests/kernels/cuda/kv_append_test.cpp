// The CUDA kv_append (appending new tokens' keys and values to an inference cache, ops::KvAppendParams)
// against the CPU backend: pure copies, so the whole cache, slots the append must not touch included, is
// bitwise the CPU's. Fused qkv rows with a padded stride, head_dim above the kernel's 128 threads, a prefill
// (several tokens) and a decode step (one token) at a non-zero position.
#include "forge/kernels/ops.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/kernels/cuda/runtime.h"

namespace forge {
namespace {

using cuda::DeviceBuffer;

struct Case {
  int64_t batch, tokens, heads, kv_heads, head_dim, capacity, position;
};

std::string describe(const Case& c) {
  return fmt::format("b{} t{} h{}/{} d{} cap{} pos{}", c.batch, c.tokens, c.heads, c.kv_heads, c.head_dim,
                     c.capacity, c.position);
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

DeviceBuffer upload(const std::vector<float>& host) {
  DeviceBuffer buffer(host.size() * sizeof(float));
  buffer.upload(host.data(), host.size() * sizeof(float));
  return buffer;
}

// Index of the first element whose bits differ, or -1.
int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return static_cast<int64_t>(i);
  return -1;
}

TEST(CudaKvAppend, MatchesCpuBitwise) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  const Case cases[] = {
      {3, 5, 4, 2, 40, 16, 0},   // prefill from an empty cache
      {3, 1, 4, 2, 40, 16, 9},   // one decoding step
      {2, 7, 2, 1, 130, 12, 5},  // head_dim past one block of threads, up to the last slot
  };
  for (const Case& c : cases) {
    const int64_t pad = 3;  // qkv rows padded past q | k | v
    const int64_t qkv_stride = (c.heads + 2 * c.kv_heads) * c.head_dim + pad;
    const int64_t cache_size = c.batch * c.kv_heads * c.capacity * c.head_dim;
    const std::vector<float> qkv = random_floats(static_cast<size_t>(c.batch * c.tokens * qkv_stride), 1);
    // The caches start full of other values: slots outside the append must come back unchanged.
    std::vector<float> keys = random_floats(static_cast<size_t>(cache_size), 2);
    std::vector<float> values = random_floats(static_cast<size_t>(cache_size), 3);

    ops::KvAppendParams p;
    p.batch = c.batch, p.tokens = c.tokens, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.qkv_stride = qkv_stride, p.k_offset = c.heads * c.head_dim, p.v_offset = (c.heads + c.kv_heads) * c.head_dim;
    p.batch_stride = c.kv_heads * c.capacity * c.head_dim, p.head_stride = c.capacity * c.head_dim;
    p.position = c.position;

    DeviceBuffer d_qkv = upload(qkv), d_keys = upload(keys), d_values = upload(values);
    ops::KvAppendParams d = p;
    d.qkv = d_qkv.as<float>(), d.keys = d_keys.as<float>(), d.values = d_values.as<float>();
    ops::cuda_table().kv_append(d);
    std::vector<float> got_keys(keys.size()), got_values(values.size());
    d_keys.download(got_keys.data(), got_keys.size() * sizeof(float));
    d_values.download(got_values.data(), got_values.size() * sizeof(float));

    p.qkv = qkv.data(), p.keys = keys.data(), p.values = values.data();
    ops::cpu_table().kv_append(p);
    EXPECT_EQ(first_difference(got_keys, keys), -1) << describe(c) << ": keys";
    EXPECT_EQ(first_difference(got_values, values), -1) << describe(c) << ": values";
  }
}

TEST(CudaKvAppend, BadShapeIsOneLineNamingTheOp) {
  if (!cuda::available()) GTEST_SKIP() << cuda::describe_device();
  ops::KvAppendParams p;
  p.batch = 1, p.tokens = 1, p.kv_heads = 0, p.head_dim = 8;
  try {
    ops::cuda_table().kv_append(p);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kv_append"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("kv_heads=0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge
