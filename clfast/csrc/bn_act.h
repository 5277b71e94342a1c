// The BN+act kernels of bn_act.cpp. Every tensor argument is read as a row-major [M, C] matrix (see `is_rows`);
// per-channel arrays are opmath (float; double for double tensors) unless typed otherwise. The activation is a code
// of clfast.act.ACTS with its parameter (formulas: act.h).
#pragma once
#include <ATen/core/Tensor.h>

namespace clfast_cpu {
using at::Tensor;

// True when `t`'s memory is a row-major [numel/C, C] matrix: a contiguous 2D tensor, or a channels-last 4D/5D one
bool is_rows(const Tensor& t);

// Per-channel mean and biased variance of x
void stats(const Tensor& x, int64_t c, double* mean, double* var);
// out = act(x*scale + shift [+ res])
void normalize(const Tensor& x, int64_t c, const void* scale, const void* shift, const Tensor* res, int64_t act,
               double act_param, Tensor& out);

// Where the activation's derivative comes from: no activation ('none'), read from out, or from the recomputed
// z = x*scale + shift (+ res)
enum class Mask { none, from_out, recompute };
struct BwdArgs {
  const void* mean; const void* invstd; const void* scale; const void* shift;
  int64_t act = 0;                 // clfast.act code
  double act_param = 0.0;
  Mask mask = Mask::none;
  const Tensor* res = nullptr;     // added to z before the activation (Mask::recompute)
  const Tensor* out = nullptr;     // the forward's output (Mask::from_out)
  bool training = true;            // batch-statistics backward, else given statistics (dy = dz*scale)
  Tensor* dy = nullptr;            // where given, receives dy
  Tensor* dres = nullptr;          // where given, receives dz
  void* sum_dz = nullptr;          // where given, receives sum(dz) per channel
  void* sum_dzx = nullptr;         // where given, receives sum(dz*x_hat) per channel
  // where given (training), the means of dz and dz*x_hat over every rank's rows, used in dy instead of these rows'
  const void* mean_dz = nullptr; const void* mean_dzx = nullptr;
};
// Gradients of normalize given dout (x: normalize's input)
void backward(const Tensor& dout, const Tensor& x, int64_t c, const BwdArgs& args);
}  // namespace clfast_cpu
