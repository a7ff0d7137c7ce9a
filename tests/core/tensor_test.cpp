#include "forge/core/tensor.h"

#include <gtest/gtest.h>

#include <string>

#include "forge/core/device.h"

namespace forge::tensor_test {
namespace {

TEST(Tensor, EmptyHasShapeDtypeAndAlignment) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::bf16);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.bytes(), 48u);
  EXPECT_EQ(t.dtype(), DType::bf16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_EQ(Tensor::empty({0, 5}, DType::f32).numel(), 0);
}

TEST(Tensor, ZerosAreZero) {
  Tensor t = Tensor::zeros({7, 5}, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.f32()[i], 0.0f);
}

TEST(Tensor, ViewAndReshapeShareStorage) {
  Tensor t = Tensor::zeros({4, 6}, DType::f32);
  Tensor row2 = t.view(12, {6});
  row2.f32()[1] = 5.0f;
  EXPECT_EQ(t.f32()[13], 5.0f);
  Tensor r = t.reshape({2, 12});
  EXPECT_EQ(r.shape(), (Shape{2, 12}));
  EXPECT_EQ(r.f32()[13], 5.0f);
  Tensor nested = row2.view(2, {2, 2});  // a view of a view keeps the offset
  nested.f32()[0] = 7.0f;
  EXPECT_EQ(t.f32()[14], 7.0f);
}

TEST(Tensor, CloneIsADeepCopy) {
  Tensor t = Tensor::zeros({3}, DType::i32);
  t.i32()[2] = 9;
  Tensor c = t.clone();
  t.i32()[2] = 1;
  EXPECT_EQ(c.i32()[2], 9);
  EXPECT_EQ(c.shape(), t.shape());
  EXPECT_EQ(c.dtype(), DType::i32);
}

TEST(Tensor, BadShapesAndAccessThrow) {
  EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), Error);
  Tensor t = Tensor::zeros({4, 6}, DType::f32);
  EXPECT_THROW(t.reshape({5, 5}), Error);
  EXPECT_THROW(t.view(20, {5}), Error);
  EXPECT_THROW(t.view(-1, {2}), Error);
  EXPECT_THROW(t.bf16(), Error);  // wrong dtype accessor
  Tensor other = Tensor::zeros({5}, DType::f32);
  EXPECT_THROW(t.copy_from(other), Error);
  try {
    Tensor::empty({3, -2}, DType::f32);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[3, -2]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::tensor_test

namespace forge::tensor_test {
namespace {

TEST(Tensor, ToTheSameDeviceIsTheTensorItself) {
  Tensor t = Tensor::zeros({3, 4}, DType::f32);
  const Tensor same = t.to(Device::cpu);
  EXPECT_EQ(same.raw(), t.raw());  // no copy
  EXPECT_FALSE(Tensor().to(Device::cpu).defined());
}

TEST(Device, NamesAndRefusals) {
  EXPECT_EQ(device_from_name("cpu"), Device::cpu);
  EXPECT_EQ(device_from_name("cuda"), Device::cuda);
  EXPECT_STREQ(device_name(Device::cuda), "cuda");
  EXPECT_TRUE(device_usable(Device::cpu));
  try {
    device_from_name("tpu");
    FAIL() << "tpu accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown device 'tpu'"), std::string::npos) << e.what();
  }
  // The host needs no device interface; a device without a usable GPU is one clear error, not a crash.
  EXPECT_THROW(device_memory(Device::cpu), Error);
  if (!device_usable(Device::cuda)) {
    try {
      Tensor::empty({16}, DType::f32, Device::cuda);
      FAIL() << "a CUDA tensor without a GPU";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("no usable GPU") != std::string::npos ||
                  what.find("CUDA backend") != std::string::npos)
          << what;
    }
  }
}

}  // namespace
}  // namespace forge::tensor_test
