#include "forge/fp8/recipe.h"

#include <gtest/gtest.h>

#include <string>

#include "forge/core/error.h"

namespace forge::fp8::recipe_test {
namespace {

// The message of the forge::Error that fn throws ("" if it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Fp8Recipe, NamesRoundTrip) {
  for (Recipe r : {Recipe::delayed, Recipe::current, Recipe::block})
    EXPECT_EQ(recipe_from_name(recipe_name(r)), r);
  for (Format f : {Format::e4m3, Format::hybrid}) EXPECT_EQ(format_from_name(format_name(f)), f);
  for (AmaxCompute a : {AmaxCompute::max, AmaxCompute::most_recent})
    EXPECT_EQ(amax_compute_from_name(amax_compute_name(a)), a);
  EXPECT_EQ(recipe_name(Recipe::delayed), "delayed");
  EXPECT_EQ(recipe_name(Recipe::current), "current");
  EXPECT_EQ(recipe_name(Recipe::block), "block");
  EXPECT_EQ(format_name(Format::e4m3), "e4m3");
  EXPECT_EQ(format_name(Format::hybrid), "hybrid");
}

TEST(Fp8Recipe, ParseErrorsNameTheBadValue) {
  const std::string recipe = error_of([] { recipe_from_name("delayd"); });
  EXPECT_NE(recipe.find("'delayd'"), std::string::npos) << recipe;
  EXPECT_NE(recipe.find("delayed, current, block"), std::string::npos) << recipe;
  const std::string format = error_of([] { format_from_name("E4M3"); });  // names are case-sensitive
  EXPECT_NE(format.find("'E4M3'"), std::string::npos) << format;
  EXPECT_NE(format.find("e4m3, hybrid"), std::string::npos) << format;
  const std::string amax = error_of([] { amax_compute_from_name(""); });
  EXPECT_NE(amax.find("''"), std::string::npos) << amax;
  EXPECT_NE(amax.find("max, most_recent"), std::string::npos) << amax;
}

TEST(Fp8Recipe, MaxAndRoles) {
  EXPECT_EQ(fp8_max(DType::e4m3), 448.0f);
  EXPECT_EQ(fp8_max(DType::e5m2), 57344.0f);
  const std::string bad = error_of([] { fp8_max(DType::bf16); });
  EXPECT_NE(bad.find("bf16"), std::string::npos) << bad;

  for (TensorRole role : {TensorRole::input, TensorRole::weight, TensorRole::grad_output})
    EXPECT_EQ(dtype_for(Format::e4m3, role), DType::e4m3);
  EXPECT_EQ(dtype_for(Format::hybrid, TensorRole::input), DType::e4m3);
  EXPECT_EQ(dtype_for(Format::hybrid, TensorRole::weight), DType::e4m3);
  EXPECT_EQ(dtype_for(Format::hybrid, TensorRole::grad_output), DType::e5m2);
}

TEST(Fp8Recipe, DefaultsAndValidation) {
  RecipeConfig config;
  EXPECT_EQ(config.amax_history_len, 1024);
  EXPECT_EQ(config.amax_compute, AmaxCompute::max);
  EXPECT_EQ(config.margin, 0);
  EXPECT_EQ(config.tile, 128);
  EXPECT_NO_THROW(validate(config));

  RecipeConfig bad = config;
  bad.amax_history_len = 0;
  EXPECT_NE(error_of([&] { validate(bad); }).find("amax_history_len"), std::string::npos);
  bad = config;
  bad.margin = -1;
  EXPECT_NE(error_of([&] { validate(bad); }).find("margin"), std::string::npos);
  bad = config;
  bad.tile = 64;
  EXPECT_NE(error_of([&] { validate(bad); }).find("tile"), std::string::npos);
}

}  // namespace
}  // namespace forge::fp8::recipe_test
