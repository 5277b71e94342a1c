// The BN+act kernels' backward (templates: bn_act_backward.h): `backward`, and its float and double instances; the
// bfloat16 and half ones are bn_act_backward_half.cpp's.
#include "bn_act_backward.h"  // first: it includes act.h, whose simd.h picks the CPU capability of ATen's vec headers
#include <ATen/Dispatch.h>

namespace clfast_cpu::bwd {
template CLFAST_BACKWARD_TYPED(float);
template CLFAST_BACKWARD_TYPED(double);
}  // namespace clfast_cpu::bwd

namespace clfast_cpu {

using rows::check_rows;

void backward(const Tensor& dout, const Tensor& x, int64_t c, const BwdArgs& a) {
  check_rows(x, x, c, "x");
  check_rows(dout, x, c, "dout");
  if (a.dy) check_rows(*a.dy, x, c, "dy");
  if (a.dres) check_rows(*a.dres, x, c, "dres");
  TORCH_CHECK(a.mask != Mask::from_out || a.out, "clfast_cpu: Mask::from_out needs out");
  TORCH_CHECK(a.mask != Mask::from_out || act::grad_from_out(a.act, a.act_param),
              "clfast_cpu: the derivative of activation ", a.act, " (param ", a.act_param,
              ") cannot be read from its output");
  if (a.out) check_rows(*a.out, x, c, "out");
  if (a.res) check_rows(*a.res, x, c, "res");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_backward", [&] {
    bwd::backward_typed<scalar_t>(dout, x, c, a);
  });
}

}  // namespace clfast_cpu
