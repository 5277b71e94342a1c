// The BN+act kernels of bn_act.cpp. Every tensor argument is read as a row-major [M, C] matrix (see `is_rows`);
// per-channel arrays are opmath (float; double for double tensors) unless typed otherwise.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace clfast_cpu {
using at::Tensor;

// True when `t`'s memory is a row-major [numel/C, C] matrix: a contiguous 2D tensor, or a channels-last 4D/5D one
bool is_rows(const Tensor& t);

// Per-channel mean and biased variance of x
void stats(const Tensor& x, int64_t c, double* mean, double* var);
// out = act(x*scale + shift [+ res])
void normalize(const Tensor& x, int64_t c, const void* scale, const void* shift, const Tensor* res, bool relu,
               Tensor& out);

// Where the ReLU mask of the backward comes from: no ReLU, x*scale + shift (+ res) > 0, or out > 0
enum class Mask { none, recompute, from_out };
struct BwdArgs {
  const void* mean; const void* invstd; const void* scale; const void* shift;
  Mask mask = Mask::none;
  const Tensor* res = nullptr;     // added before the ReLU (Mask::recompute)
  const Tensor* out = nullptr;     // the forward's output (Mask::from_out)
  bool training = true;            // batch-statistics backward, else running-statistics (dy = dz*scale)
  Tensor* dres = nullptr;          // where given, receives the masked gradient dz
  void* sum_dz = nullptr;          // where given, receives sum(dz) per channel
  void* sum_dzx = nullptr;         // where given, receives sum(dz*x_hat) per channel
};
// dy of normalize's input, given dout
void backward(const Tensor& dout, const Tensor& x, int64_t c, const BwdArgs& args, Tensor& dy);

// The same as ops on [M, C] matrices (registered as clfast_cpu::stats / fwd / bwd)
std::tuple<Tensor, Tensor> stats_op(const Tensor& x);
Tensor fwd_op(const Tensor& x, const Tensor& scale, const Tensor& shift, const std::optional<Tensor>& res, bool relu);
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd_op(const Tensor& dout, const Tensor& x, const Tensor& mean,
                                                  const Tensor& invstd, const Tensor& scale, const Tensor& shift,
                                                  const std::optional<Tensor>& res, bool relu, bool training,
                                                  bool want_dres);
}  // namespace clfast_cpu
