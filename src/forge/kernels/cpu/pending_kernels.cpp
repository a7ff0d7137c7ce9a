// TEMPORARY: each function moves to its own file as it is written; delete this file when empty.
#include "forge/kernels/cpu/cpu_kernels.h"
namespace forge::cpu {
void rmsnorm_forward(const ops::RmsNormParams&) { fail("not built yet"); }
void rmsnorm_backward_input(const ops::RmsNormParams&) { fail("not built yet"); }
void rmsnorm_backward_weight(const ops::RmsNormParams&) { fail("not built yet"); }
void rope(const ops::RopeParams&) { fail("not built yet"); }
void swiglu_forward(const ops::SwigluParams&) { fail("not built yet"); }
void swiglu_backward(const ops::SwigluParams&) { fail("not built yet"); }
void embedding_forward(const ops::EmbeddingParams&) { fail("not built yet"); }
void embedding_backward_weight(const ops::EmbeddingParams&) { fail("not built yet"); }
void linear_cross_entropy_forward(const ops::LinearCrossEntropyParams&) { fail("not built yet"); }
void linear_cross_entropy_backward(const ops::LinearCrossEntropyParams&) { fail("not built yet"); }
void adamw(const ops::AdamWParams&) { fail("not built yet"); }
void add_inplace(float*, const float*, int64_t) { fail("not built yet"); }
double sum_squares(const float*, int64_t) { fail("not built yet"); }
void scale_inplace(float*, float, int64_t) { fail("not built yet"); }
}  // namespace forge::cpu
namespace forge::ops {
int64_t linear_cross_entropy_workspace_floats(const LinearCrossEntropyParams&) { fail("not built yet"); }
}  // namespace forge::ops
