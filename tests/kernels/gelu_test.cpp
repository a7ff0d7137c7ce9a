// GELU: the op tests (op_tests/gelu.h) on the CPU and the device emulation, the Hugging Face names of the
// kinds, and results independent of the OpenMP thread count.
#include "kernels/op_tests/gelu.h"

#include <gtest/gtest.h>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::gelu::gelu_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(GeluOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(GeluSaturation, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(GeluKnownValues, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

TEST(Gelu, KindsByHuggingFaceName) {
  struct Name {
    const char* name;
    ops::GeluKind kind;
  };
  for (const Name& n : {Name{"gelu", ops::GeluKind::erf}, Name{"gelu_python", ops::GeluKind::erf},
                        Name{"gelu_pytorch_tanh", ops::GeluKind::tanh}, Name{"gelu_new", ops::GeluKind::tanh},
                        Name{"gelu_fast", ops::GeluKind::tanh}, Name{"quick_gelu", ops::GeluKind::quick}}) {
    EXPECT_EQ(ops::gelu_kind_from_name(n.name), n.kind) << n.name;
    EXPECT_NE(std::string(ops::kGeluKindNames).find(n.name), std::string::npos) << n.name;
  }
  for (ops::GeluKind kind : {ops::GeluKind::erf, ops::GeluKind::tanh, ops::GeluKind::quick})
    EXPECT_EQ(ops::gelu_kind_from_name(ops::gelu_kind_name(kind)), kind) << ops::gelu_kind_name(kind);
  EXPECT_FALSE(ops::gelu_kind_from_name("relu").has_value());
  EXPECT_FALSE(ops::gelu_kind_from_name("GELU").has_value());  // Hugging Face's names are lower case
  EXPECT_FALSE(ops::gelu_kind_from_name("").has_value());
}

TEST(Gelu, ResultsDoNotDependOnThreadCount) {
  for (ops::GeluKind kind : {ops::GeluKind::erf, ops::GeluKind::tanh, ops::GeluKind::quick}) {
    const Problem pr({40000, kind}, 7);
    std::vector<float> out1(pr.n), out2(pr.n), dx1(pr.n), dx2(pr.n);
    ops::GeluParams p;
    p.n = pr.n, p.kind = kind, p.x = pr.x.data(), p.dy = pr.dy.data();
    auto run = [&](std::vector<float>& out, std::vector<float>& dx) {
      p.out = out.data(), p.dx = dx.data();
      ops::gelu_forward(p);
      ops::gelu_backward(p);
    };
    testing::with_threads(1, [&] { run(out1, dx1); });
    testing::with_threads(2, [&] { run(out2, dx2); });
    testing::expect_bitwise_equal(out1, out2, pr.what("gelu_forward"));
    testing::expect_bitwise_equal(dx1, dx2, pr.what("gelu_backward"));
  }
}

}  // namespace
}  // namespace forge::op_tests::gelu::gelu_test
