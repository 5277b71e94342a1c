// The bfloat16 and half instances of the BN+act kernels' backward (bn_act_backward.h), apart from the float and
// double ones (bn_act_backward.cpp) so that the two files compile side by side.
#include "bn_act_backward.h"  // first: it includes act.h, whose simd.h picks the CPU capability of ATen's vec headers

namespace clfast_cpu::bwd {
template CLFAST_BACKWARD_TYPED(c10::BFloat16);
template CLFAST_BACKWARD_TYPED(c10::Half);
}  // namespace clfast_cpu::bwd
