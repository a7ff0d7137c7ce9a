// Empty inputs on every backend (op_harness.h): each op with nothing to do returns without touching memory,
// so null pointers are fine there.
#pragma once

#include <gtest/gtest.h>

#include "forge/core/device.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::empty_inputs {

class EmptyInputs : public testing::OpTest<testing::FixedCase> {};

TEST_P(EmptyInputs, AreNoOps) {
  const Device d = device();
  FORGE_TEST_OP(add_inplace, d, nullptr, nullptr, 0);
  FORGE_TEST_OP(scale_inplace, d, nullptr, 2.0f, 0);
  EXPECT_EQ(FORGE_TEST_OP(sum_squares, d, nullptr, 0), 0.0);
  FORGE_TEST_OP(convert_to_bf16, d, nullptr, nullptr, 0);
  FORGE_TEST_OP(convert_to_f32, d, nullptr, nullptr, 0);
  EXPECT_EQ(FORGE_TEST_OP(amax, d, nullptr, 0), 0.0f);
  ops::RmsNormParams norm;
  norm.rows = 0, norm.dim = 8;
  FORGE_TEST_OP(rmsnorm_forward, d, norm);
  FORGE_TEST_OP(rmsnorm_backward_input, d, norm);
  FORGE_TEST_OP(rmsnorm_backward_weight, d, norm);
  ops::LayerNormParams layernorm;
  layernorm.rows = 0, layernorm.dim = 8;
  FORGE_TEST_OP(layernorm_forward, d, layernorm);
  FORGE_TEST_OP(layernorm_backward_input, d, layernorm);
  FORGE_TEST_OP(layernorm_backward_weight, d, layernorm);
  ops::GeluParams gelu;  // n = 0
  FORGE_TEST_OP(gelu_forward, d, gelu);
  FORGE_TEST_OP(gelu_backward, d, gelu);
  ops::BiasParams bias;
  bias.rows = 0, bias.n = 6;
  FORGE_TEST_OP(bias_add, d, bias);
  FORGE_TEST_OP(bias_backward, d, bias);
  bias.rows = 4, bias.n = 0;
  FORGE_TEST_OP(bias_add, d, bias);
  FORGE_TEST_OP(bias_backward, d, bias);
  ops::RopeParams rope;
  rope.batch = 0, rope.seq = 4, rope.heads = 2, rope.head_dim = 8, rope.token_stride = 16;
  FORGE_TEST_OP(rope, d, rope);
  ops::SwigluParams swiglu;
  swiglu.rows = 0, swiglu.ffn = 5;
  FORGE_TEST_OP(swiglu_forward, d, swiglu);
  FORGE_TEST_OP(swiglu_backward, d, swiglu);
  ops::DropoutParams drop;
  drop.rows = 0, drop.cols = 5, drop.seq = 3, drop.rate = 0.5f;
  FORGE_TEST_OP(dropout, d, drop);
  ops::EmbeddingParams embedding;
  embedding.rows = 0, embedding.dim = 4, embedding.vocab = 3;
  FORGE_TEST_OP(embedding_forward, d, embedding);
  FORGE_TEST_OP(embedding_backward_weight, d, embedding);
  ops::AdamWParams adamw;
  adamw.n = 0;
  FORGE_TEST_OP(adamw, d, adamw);
  ops::KvAppendParams kv;
  kv.batch = 0, kv.tokens = 3, kv.kv_heads = 2, kv.head_dim = 8;
  FORGE_TEST_OP(kv_append, d, kv);
  if (d != Device::cpu) device_memory(d).synchronize();
}

}  // namespace forge::op_tests::empty_inputs
