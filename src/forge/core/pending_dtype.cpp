// TEMPORARY: replaced by dtype.cpp (being written). Delete this file when dtype.cpp lands.
#include "forge/core/dtype.h"
#include "forge/core/error.h"
namespace forge {
size_t dtype_size(DType d) {
  switch (d) {
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    case DType::e4m3: case DType::e5m2: case DType::u8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}
std::string_view dtype_name(DType) { return "?"; }
}  // namespace forge
#include <cstring>
namespace forge {
uint16_t f32_to_bf16_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
float bf16_bits_to_f32(uint16_t b) { uint32_t u = uint32_t(b) << 16; float x; std::memcpy(&x, &u, 4); return x; }
}  // namespace forge
