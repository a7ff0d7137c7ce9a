// A model too big for the machine is refused by LlamaModel's constructor, before anything is allocated, with
// one line naming its config and the memory it needs (not std::bad_alloc or the OOM killer).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/llama/llama_model.h"
#include "op_harness.h"

namespace forge::llama_memory_test {
using namespace forge::models;
namespace {

TEST(LlamaModel, RefusesAModelTooBigForTheMachineBeforeAllocating) {
  // 2^48 parameters, every size within forge's bounds: 1 PiB of fp32 weights, more than any machine has.
  const LlamaConfig huge = LlamaConfig::from_json({{"hidden_size", 65536},
                                                   {"intermediate_size", 262144},
                                                   {"num_hidden_layers", 4096},
                                                   {"num_attention_heads", 512},
                                                   {"num_key_value_heads", 512},
                                                   {"vocab_size", 1 << 20}},
                                                  "huge/config.json");
  for (const bool with_grads : {true, false})
    testing::expect_error_containing(
        [&] {
          LlamaModel model(huge, {DType::f32, nn::Recompute::none}, 0.02f, with_grads);
        },
        {"huge/config.json: the model needs",
         with_grads ? "PiB for its weights, gradients and optimizer state" : "1.0 PiB for its weights (",
         "this machine has"});
}

}  // namespace
}  // namespace forge::llama_memory_test
