// Weights must be finite: a NaN or an infinity in a checkpoint poisons every loss computed from it, and
// would otherwise be copied on by convert or trained on silently. Every weight loader calls check_finite on
// what it read.
#pragma once

#include <cstdint>
#include <string_view>

namespace forge::ckpt {

// Throws forge::Error, one line naming the file, the tensor, how many of its n values are NaN or infinite
// and the first of them ("<file>: tensor '<name>' holds 3 non-finite values (NaN or infinity) of 256, the
// first at index 17 (nan); refusing to load it"), unless all n are finite.
void check_finite(const float* data, int64_t n, std::string_view tensor, std::string_view file);

}  // namespace forge::ckpt
