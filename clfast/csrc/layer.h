// The CPU backend of the fused layer act(bn(conv(x)) [+ residual]) (conv_bn_act.cpp; the contract: clfast/KERNELS.md):
// one whole layer per direction, called below autograd and autocast (the caller has cast the dtypes).
#pragma once
#include <ATen/core/Tensor.h>
#include <array>
#include <optional>
#include <tuple>

namespace clfast_cpu {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

// (out, y, params): out = act(bn(conv(x)) [+ residual]) with the batch's statistics when mean/var are not given;
// y the conv output where keep_y (else empty); params the [5, C] rows mean, invstd, scale, shift, biased var
std::tuple<Tensor, Tensor, Tensor> layer_fwd(
    const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& bn_weight, const OptTensor& bn_bias,
    const OptTensor& residual, const OptTensor& mean, const OptTensor& var, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double eps, int64_t act, double act_param,
    bool keep_y, const OptTensor& y_given);

// (dx, dweight, dbias, dbn_weight, dbn_bias, dresidual), empty where `needs` (in that order) says no
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layer_bwd(
    const Tensor& dout, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const Tensor& y_saved,
    const Tensor& params, const OptTensor& residual, const Tensor& out, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, bool training, int64_t act, double act_param, std::array<bool, 6> needs,
    const OptTensor& grad_means);
}  // namespace clfast_cpu
