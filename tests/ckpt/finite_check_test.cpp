// check_finite: every NaN and infinity is counted, the first one located, and the message is one line naming
// the file and the tensor; finite values of every kind (subnormals, the largest float, -0) pass.
#include "forge/ckpt/finite_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/error.h"

namespace forge::finite_check_test {
using namespace forge::ckpt;
namespace {

std::string error_of(const std::vector<float>& values) {
  try {
    check_finite(values.data(), static_cast<int64_t>(values.size()), "model.norm.weight",
                 "/m/model.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(FiniteCheck, FiniteValuesPass) {
  using limits = std::numeric_limits<float>;
  EXPECT_EQ(error_of({0.0f, -0.0f, 1.0f, limits::max(), -limits::max(), limits::denorm_min(), limits::min()}),
            "");
  EXPECT_EQ(error_of({}), "");
}

TEST(FiniteCheck, CountsEveryNonFiniteValueAndNamesTheFirst) {
  using limits = std::numeric_limits<float>;
  std::vector<float> values(1000, 0.5f);
  values[17] = -limits::infinity();
  values[400] = limits::quiet_NaN();
  values[999] = limits::infinity();
  EXPECT_EQ(error_of(values),
            "/m/model.safetensors: tensor 'model.norm.weight' holds 3 non-finite values (NaN or infinity) of "
            "1000, the first at index 17 (-inf); refusing to load it");
  std::vector<float> one(8, 1.0f);
  one[0] = -limits::quiet_NaN();  // the sign of a NaN does not matter
  EXPECT_EQ(
      error_of(one),
      "/m/model.safetensors: tensor 'model.norm.weight' holds 1 non-finite value (NaN or infinity) of 8, "
      "the first at index 0 (nan); refusing to load it");
  one[0] = 1.0f;
  one[7] = limits::infinity();
  EXPECT_NE(error_of(one).find("the first at index 7 (inf)"), std::string::npos) << error_of(one);
}

}  // namespace
}  // namespace forge::finite_check_test
