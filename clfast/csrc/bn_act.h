// The BN+act kernels of bn_act.cpp. Tensors are row-major [M, C] matrices (channels-last views); per-channel vectors
// are [C] in the accumulation dtype (fp32, or fp64 for fp64 input).
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace clfast_cpu {
using at::Tensor;
// (mean, biased var) per channel
std::tuple<Tensor, Tensor> stats(const Tensor& x);
// act(x*scale + shift [+ res])
Tensor fwd(const Tensor& x, const Tensor& scale, const Tensor& shift, const std::optional<Tensor>& res, bool relu);
// (dy, sum_dz, sum_dz*x_hat, dres) of fwd with per-channel statistics (mean, invstd); batch-statistics dy if training
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd(const Tensor& dout, const Tensor& x, const Tensor& mean,
                                               const Tensor& invstd, const Tensor& scale, const Tensor& shift,
                                               const std::optional<Tensor>& res, bool relu, bool training,
                                               bool want_dres);
}  // namespace clfast_cpu
