// What the CPU this process runs on can do, for choices that depend on it (the compute dtype).
#pragma once

namespace forge {

// True when the CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16). Without them oneDNN
// emulates bf16 GEMMs by widening to fp32, which is slower than fp32 GEMMs themselves.
bool cpu_has_native_bf16();

}  // namespace forge
