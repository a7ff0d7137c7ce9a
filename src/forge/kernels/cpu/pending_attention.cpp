// TEMPORARY: replaced by attention.cpp (being written). Delete this file when attention.cpp lands.
#include "forge/kernels/cpu/cpu_kernels.h"
namespace forge::cpu {
void attention_forward(const ops::AttentionParams&) { fail("attention_forward: not built yet"); }
void attention_backward(const ops::AttentionParams&) { fail("attention_backward: not built yet"); }
}  // namespace forge::cpu
