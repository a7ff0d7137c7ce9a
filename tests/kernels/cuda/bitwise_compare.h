// Bitwise comparison of a CUDA result with the CPU's for the CUDA kernel tests: one failure per array (not
// per element), naming how many elements differ and the first offender with both bit patterns.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace forge::test {

inline std::string hex(uint32_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

// The bits of a float, or an integer code (FP8 bytes, bf16 words) as it is.
template <typename T>
uint32_t bits_of(T v) {
  if constexpr (sizeof(T) == 4)
    return std::bit_cast<uint32_t>(v);
  else
    return v;
}

// cols > 0 names the first offender as (row, column) of a [rows, cols] layout; 0 by its flat index.
template <typename T>
void expect_bitwise(const std::vector<T>& cuda, const std::vector<T>& cpu, int64_t cols, const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cuda.size(); ++i)
    if (bits_of(cuda[i]) != bits_of(cpu[i]) && bad++ == 0) first = i;
  if (bad == 0) return;
  std::ostringstream where;
  if (cols > 0)
    where << "(" << first / static_cast<size_t>(cols) << ", " << first % static_cast<size_t>(cols) << ")";
  else
    where << first;
  ADD_FAILURE() << what << ": " << bad << " of " << cuda.size() << " differ; first at " << where.str() << ": cuda "
                << hex(bits_of(cuda[first])) << ", cpu " << hex(bits_of(cpu[first]));
}

template <typename T>
void expect_bitwise(const std::vector<T>& cuda, const std::vector<T>& cpu, const std::string& what) {
  expect_bitwise(cuda, cpu, 0, what);
}

}  // namespace forge::test
