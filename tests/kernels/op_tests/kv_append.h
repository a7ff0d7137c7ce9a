// kv_append (appending new tokens' keys and values to an inference cache, ops::KvAppendParams), written once
// for every backend (op_harness.h). The op copies, so every backend's cache, the slots the append must not
// touch included, is bitwise the expected one: on the CPU a reference scatter written here, elsewhere the CPU
// kernel on the same inputs. Fused qkv rows with a padded stride, head_dim above the CUDA kernel's 128
// threads, a prefill (several tokens) and a decode step (one token) at a non-zero position.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::kv_append {

using testing::DeviceArray;

// `tokens` new tokens of `batch` sequences appended at `position` to head-major caches
// [batch, kv_heads, capacity, head_dim]; qkv rows hold q | k | v (heads, kv_heads, kv_heads heads) and
// padding.
struct Case {
  int64_t batch, tokens, heads, kv_heads, head_dim, capacity, position;
  std::string name() const {
    return fmt::format("b{}_t{}_h{}_kvh{}_d{}_cap{}_pos{}", batch, tokens, heads, kv_heads, head_dim,
                       capacity, position);
  }
  static constexpr int64_t kPad = 3;  // qkv rows padded past q | k | v
  int64_t qkv_stride() const { return (heads + 2 * kv_heads) * head_dim + kPad; }
  int64_t cache_size() const { return batch * kv_heads * capacity * head_dim; }
};

inline const std::vector<Case> kCases = {
    {3, 5, 4, 2, 40, 16, 0},   // prefill from an empty cache
    {3, 1, 4, 2, 40, 16, 9},   // one decoding step
    {2, 7, 2, 1, 130, 12, 5},  // head_dim past one block of threads, up to the last slot
};

struct Problem {
  Case c;
  std::vector<float> qkv, keys, values;
  // The caches start full of other values: slots outside the append must come back unchanged.
  Problem(const Case& c_, uint32_t seed) : c(c_) {
    qkv = testing::random_floats(c.batch * c.tokens * c.qkv_stride(), seed, -3, 3);
    keys = testing::random_floats(c.cache_size(), seed + 1, -3, 3);
    values = testing::random_floats(c.cache_size(), seed + 2, -3, 3);
  }
  ops::KvAppendParams params() const {
    ops::KvAppendParams p;
    p.batch = c.batch, p.tokens = c.tokens, p.kv_heads = c.kv_heads, p.head_dim = c.head_dim;
    p.qkv_stride = c.qkv_stride(), p.k_offset = c.heads * c.head_dim,
    p.v_offset = (c.heads + c.kv_heads) * c.head_dim;
    p.batch_stride = c.kv_heads * c.capacity * c.head_dim, p.head_stride = c.capacity * c.head_dim;
    p.position = c.position;
    return p;
  }
  // The caches after the append, element by element from the definition in ops.h.
  void reference(std::vector<float>& k, std::vector<float>& v) const {
    k = keys, v = values;
    const ops::KvAppendParams p = params();
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.tokens; ++t)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          for (int64_t i = 0; i < c.head_dim; ++i) {
            const int64_t from = (b * c.tokens + t) * p.qkv_stride + g * c.head_dim + i;
            const int64_t to = b * p.batch_stride + g * p.head_stride + (c.position + t) * c.head_dim + i;
            k[to] = qkv[from + p.k_offset];
            v[to] = qkv[from + p.v_offset];
          }
  }
};

class KvAppendOp : public testing::OpTest<Case> {
 protected:
  // The caches after the append on `on`.
  static void append(Device on, const Problem& pr, std::vector<float>& k, std::vector<float>& v) {
    DeviceArray<float> qkv(on, pr.qkv), keys(on, pr.keys), values(on, pr.values);
    ops::KvAppendParams p = pr.params();
    p.qkv = qkv.data(), p.keys = keys.data(), p.values = values.data();
    FORGE_TEST_OP(kv_append, on, p);
    k = keys.download(), v = values.download();
  }
};

TEST_P(KvAppendOp, CopiesIntoTheCache) {
  const Case& c = test_case();
  const Problem pr(c, 1);
  std::vector<float> want_keys, want_values;
  if (on_cpu())
    pr.reference(want_keys, want_values);
  else
    append(Device::cpu, pr, want_keys, want_values);
  std::vector<float> keys, values;
  append(device(), pr, keys, values);
  testing::expect_bitwise_equal(keys, want_keys, "kv_append " + c.name() + ": keys");
  testing::expect_bitwise_equal(values, want_values, "kv_append " + c.name() + ": values");
}

class KvAppendFixed : public testing::OpTest<testing::FixedCase> {};

// A bad shape is refused on every backend with one line naming the op and the culprit.
TEST_P(KvAppendFixed, BadShapeIsOneLineNamingTheOp) {
  ops::KvAppendParams p;
  p.batch = 1, p.tokens = 1, p.kv_heads = 0, p.head_dim = 8;
  testing::expect_error_containing([&] { ops::kv_append(p, device()); }, {"kv_append", "kv_heads=0"});
}

}  // namespace forge::op_tests::kv_append
