// The `forge bench` measurement (train/throughput.h): a step of grad_accum micro-batches trains on the same
// sequences as one micro-batch of all of them, so losses agree up to the order of fp32 sums, and bad sizes
// are one clear error.
#include "forge/train/throughput.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "forge/core/device.h"
#include "forge/core/error.h"
#include "forge/fp8/recipe.h"
#include "forge/kernels/emulated_device.h"
#include "forge/models/llama/llama_model.h"
#include "forge/train/device_emulation.h"

namespace forge::throughput_test {
using namespace forge::models;
using namespace forge::train;
namespace {

LlamaConfig tiny() {
  return LlamaConfig::from_json(nlohmann::json{{"hidden_size", 32},
                                               {"intermediate_size", 64},
                                               {"num_hidden_layers", 2},
                                               {"num_attention_heads", 4},
                                               {"num_key_value_heads", 2},
                                               {"vocab_size", 97}},
                                "tiny.json");
}

TEST(Throughput, AccumulatedMicroBatchesTrainLikeOneBatch) {
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;  // the two schedules then differ only in the order of fp32 sums
  const ThroughputResult whole = measure_training_throughput(tiny(), options, 4, 16, 0, 3);
  const ThroughputResult split = measure_training_throughput(tiny(), options, 2, 16, 0, 3, std::nullopt, 2);
  ASSERT_EQ(whole.losses.size(), 3u);
  ASSERT_EQ(split.losses.size(), 3u);
  // Step 1 is the loss of the initial weights on the same 64 tokens; later steps follow the same updates
  // (gradients equal to ~1e-6 relative, through AdamW's normalised steps).
  for (size_t s = 0; s < 3; ++s)
    EXPECT_NEAR(split.losses[s], whole.losses[s], 1e-4 * whole.losses[s]) << "step " << s + 1;
  EXPECT_LT(whole.losses[2], whole.losses[0]);  // the same tokens every step: the loss falls
  EXPECT_GT(split.tokens_per_s, 0);
  // A step of 2 x 2 sequences of 16 tokens: tokens/s counts all four.
  EXPECT_NEAR(split.tokens_per_s * split.seconds_per_step, 64.0, 1e-6);
}

TEST(Throughput, ProfileStepsFollowTheTimedOnes) {
  nn::ComputeOptions options;
  options.gemm_dtype = DType::f32;
  const ThroughputResult r = measure_training_throughput(tiny(), options, 2, 16, 1, 2, std::nullopt, 2, 1);
  EXPECT_TRUE(r.profile_error.empty()) << r.profile_error;
  ASSERT_TRUE(r.profile.has_value());
  EXPECT_EQ(r.profile_steps, 1);
  EXPECT_EQ(r.losses.size(), 4u);  // warm-up, two timed steps, the profiled one
  // A micro-batch runs 12 GEMMs per layer (4 Linears: forward, backward input, backward weight); the loss
  // head is its own op. Two layers, two micro-batches.
  int64_t gemms = 0, heads = 0, adamw = 0;
  for (const ops::OpProfileRow& row : r.profile->rows) {
    if (row.op == "gemm") gemms += row.calls;
    if (row.op == "linear_cross_entropy_forward") heads += row.calls;
    if (row.op == "adamw") adamw += row.calls;
  }
  EXPECT_EQ(gemms, 12 * 2 * 2) << ops::format_profile(*r.profile);
  EXPECT_EQ(heads, 2);
  EXPECT_GT(adamw, 0);
  EXPECT_LE(r.profile->op_seconds, r.profile->wall_seconds);
  EXPECT_FALSE(ops::profiling());
}

// On a GPU every read-back makes the host wait for the device's queue. A training step on the device (under
// the device emulation, which counts the traffic) reads back one loss per micro-batch and the gradient norm
// once, plus the step's amaxes under delayed scaling, and uploads each micro-batch's inputs and targets:
// nothing per layer or per op. A change that adds a synchronisation to the step fails here.
TEST(Throughput, DeviceStepsWaitForTheDeviceOncePerMicroBatch) {
  for (const char* recipe : {"off", "delayed", "current", "block"})
    for (int64_t accum : {1, 2}) {
      auto traffic_of = [&](int steps) {
        DeviceEmulation emulation;
        nn::ComputeOptions options;
        options.device = Device::cuda;
        std::optional<nn::Fp8Options> fp8;
        if (std::string(recipe) != "off") fp8.emplace().recipe.recipe = fp8::recipe_from_name(recipe);
        measure_training_throughput(tiny(), options, 2, 16, 0, steps, fp8, accum);
        return EmulatedDevice::traffic();
      };
      const EmulatedDevice::Traffic one = traffic_of(1), two = traffic_of(2);
      const std::string what = std::string(recipe) + " accum " + std::to_string(accum) + ", per step: ";
      const bool delayed = std::string(recipe) == "delayed";
      EXPECT_EQ(two.to_host - one.to_host, accum + (delayed ? 1 : 0)) << what << "device-to-host copies";
      EXPECT_EQ(two.to_device - one.to_device, 2 * accum) << what << "host-to-device copies";
      EXPECT_EQ(two.host_results - one.host_results, 1) << what << "ops returning a host value";
      EXPECT_EQ(two.synchronizations - one.synchronizations, 0) << what << "synchronisations";
      EXPECT_EQ(two.device_to_device - one.device_to_device, 0) << what << "device copies";
    }
}

TEST(Throughput, NonPositiveSizesAreOneError) {
  try {
    measure_training_throughput(tiny(), nn::ComputeOptions{}, 2, 16, 0, 1, std::nullopt, 0);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "bench: batch, seq, steps and grad_accum must be positive");
  }
  try {
    measure_training_throughput(tiny(), nn::ComputeOptions{}, 2, 16, 0, 1, std::nullopt, 1, -1);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "bench: profile steps must be 0 (no profile) or positive, got -1");
  }
}

}  // namespace
}  // namespace forge::throughput_test
