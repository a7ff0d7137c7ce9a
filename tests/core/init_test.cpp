#include "forge/core/init.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "forge/core/error.h"
#include "forge/core/philox.h"

namespace forge::init_test {
namespace {

constexpr uint64_t kSeed = 1234;
constexpr const char* kName = "layers.0.attention.wq.weight";

bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

std::vector<float> normal(int64_t count, int64_t first, uint64_t seed = kSeed, const char* name = kName) {
  std::vector<float> v(count);
  init_normal(v.data(), count, first, seed, name, 0.5f, 0.02f);
  return v;
}

TEST(Init, NameHashIsFnv1a64) {
  // Published FNV-1a 64 values.
  EXPECT_EQ(name_hash(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(name_hash("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(name_hash("foobar"), 0x85944171f73967e8ull);
}

// Golden values from an independent Python implementation (philox4x32-10 + FNV-1a + Box-Muller with
// math.log/cos in double, rounded with struct.pack('f')), so a PyTorch twin can reproduce initialisation.
TEST(Init, NormalMatchesPythonGoldenValues) {
  EXPECT_EQ(name_hash(kName), 0x2c403a3125427ab5ull);
  const std::vector<float> head = normal(3, 0);
  EXPECT_EQ(head[0], 0x1.f297a2p-2f);
  EXPECT_EQ(head[1], 0x1.09cf64p-1f);
  EXPECT_EQ(head[2], 0x1.ea6adep-2f);
  EXPECT_EQ(normal(1, int64_t{1} << 33)[0], 0x1.eab27ap-2f);  // the high counter word is used
}

// Each element is exactly the documented formula on its own Philox block.
TEST(Init, ElementFollowsTheCounterContract) {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint64_t hash = name_hash("w");
  for (int64_t g : {int64_t{0}, int64_t{5}, int64_t{0x1234567890}}) {
    float got;
    init_normal(&got, 1, g, seed, "w", -1.0f, 3.0f);
    const auto bits =
        philox4x32_10({uint32_t(g), uint32_t(uint64_t(g) >> 32), uint32_t(hash), uint32_t(hash >> 32)},
                      {uint32_t(seed), uint32_t(seed >> 32)});
    EXPECT_EQ(got, static_cast<float>(-1.0 + 3.0 * standard_normal_pair_double(bits[0], bits[1])[0]));
  }
}

TEST(Init, ShardEqualsSliceOfWholeTensor) {
  const int64_t total = 50000;
  const std::vector<float> whole = normal(total, 0);
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 1}, {17, 4113}, {12345, 50000}, {25000, 25001}}) {
    const std::vector<float> shard = normal(b - a, a);
    EXPECT_TRUE(same_bits(shard.data(), whole.data() + a, b - a))
        << "normal shard [" << a << ", " << b << ")";
    std::vector<float> u_whole(total), u_shard(b - a);
    init_uniform(u_whole.data(), total, 0, kSeed, kName, -0.1f, 0.3f);
    init_uniform(u_shard.data(), b - a, a, kSeed, kName, -0.1f, 0.3f);
    EXPECT_TRUE(same_bits(u_shard.data(), u_whole.data() + a, b - a))
        << "uniform shard [" << a << ", " << b << ")";
  }
}

TEST(Init, IndependentOfThreadCount) {
  const int saved = omp_get_max_threads();
  const int64_t n = 40000;  // large enough for the parallel path
  omp_set_num_threads(1);
  const std::vector<float> one = normal(n, 3);
  std::vector<float> u_one(n);
  init_uniform(u_one.data(), n, 3, kSeed, kName, 0.0f, 1.0f);
  omp_set_num_threads(2);
  const std::vector<float> two = normal(n, 3);
  std::vector<float> u_two(n);
  init_uniform(u_two.data(), n, 3, kSeed, kName, 0.0f, 1.0f);
  omp_set_num_threads(saved);
  EXPECT_TRUE(same_bits(one.data(), two.data(), n));
  EXPECT_TRUE(same_bits(u_one.data(), u_two.data(), n));
}

TEST(Init, DifferentNamesAndSeedsDiffer) {
  const int64_t n = 1000;
  const std::vector<float> base = normal(n, 0);
  for (const std::vector<float>& other : {normal(n, 0, kSeed + 1), normal(n, 0, kSeed + (uint64_t{1} << 32)),
                                          normal(n, 0, kSeed, "layers.0.attention.wk.weight"),
                                          normal(n, 0, kSeed, "layers.1.attention.wq.weight")}) {
    int equal = 0;
    for (int64_t i = 0; i < n; ++i) equal += other[i] == base[i];
    EXPECT_LT(equal, 5);  // chance collisions in fp32 are rare; a reused stream would match everywhere
  }
}

TEST(Init, NormalMomentsWithinStatisticalBounds) {
  const int64_t n = 100000;
  const float mean = 0.25f, std = 0.02f;
  std::vector<float> v(n);
  init_normal(v.data(), n, 777, 42, "embedding.weight", mean, std);
  double s1 = 0, s2 = 0;
  for (float x : v) s1 += x, s2 += double(x) * x;
  const double m = s1 / n, var = s2 / n - m * m;
  EXPECT_NEAR(m, mean, 5 * std / std::sqrt(n));
  EXPECT_NEAR(std::sqrt(var), std, 5 * std / std::sqrt(2.0 * n));
}

TEST(Init, UniformRangeAndMoments) {
  const int64_t n = 100000;
  const float lo = -0.5f, hi = 1.5f;
  std::vector<float> v(n);
  init_uniform(v.data(), n, 0, 9, "bias", lo, hi);
  double s1 = 0, s2 = 0;
  for (float x : v) {
    ASSERT_GE(x, lo);
    ASSERT_LT(x, hi);
    s1 += x, s2 += double(x) * x;
  }
  const double m = s1 / n, var = s2 / n - m * m, width = hi - lo;
  EXPECT_NEAR(m, 0.5, 5 * width / std::sqrt(12.0 * n));
  EXPECT_NEAR(var, width * width / 12, 5 * width * width * std::sqrt(1.0 / 180 / n));
  // A degenerate range is a constant.
  init_uniform(v.data(), 10, 0, 9, "bias", 2.0f, 2.0f);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(v[i], 2.0f);
}

TEST(Init, Constant) {
  std::vector<float> v(10000, 0.0f);
  init_constant(v.data(), 9999, -3.5f);
  for (int i = 0; i < 9999; ++i) ASSERT_EQ(v[i], -3.5f);
  EXPECT_EQ(v[9999], 0.0f);
}

TEST(Init, BadArgumentsThrow) {
  std::vector<float> v(4);
  EXPECT_THROW(init_normal(v.data(), -1, 0, 1, "w", 0, 1), Error);
  EXPECT_THROW(init_normal(v.data(), 4, -1, 1, "w", 0, 1), Error);
  EXPECT_THROW(init_normal(v.data(), 4, 0, 1, "w", 0, -1), Error);
  EXPECT_THROW(init_normal(nullptr, 4, 0, 1, "w", 0, 1), Error);
  EXPECT_THROW(init_uniform(v.data(), 4, 0, 1, "w", 1, 0), Error);
  EXPECT_THROW(init_uniform(v.data(), 4, 0, 1, "w", 0, INFINITY), Error);
  EXPECT_THROW(init_constant(v.data(), -2, 0), Error);
  EXPECT_NO_THROW(init_normal(nullptr, 0, 0, 1, "w", 0, 1));
}

}  // namespace
}  // namespace forge::init_test
