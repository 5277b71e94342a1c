// One fused conv-BN(+add)(-ReLU) layer on the CPU per call: the conv (oneDNN through ATen) and the bn_act.cpp
// kernels, with the running statistics updated in place. Eager training pays one Python-to-C++ call per direction
// instead of a dozen small tensor ops (the Python glue cost more than the kernels saved).
// Also registers every `clfast_cpu` op (the kernels' too).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <array>
#include <optional>
#include <tuple>
#include "bn_act.h"

using at::Tensor;
using at::IntArrayRef;
using OptTensor = std::optional<Tensor>;

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// The [M, C] rows of an N,C,... tensor, copied into channels-last order only when it is not laid out so
Tensor rows_of(const Tensor& t) {
  std::vector<int64_t> perm{0};
  for (int64_t d = 2; d < t.dim(); ++d) perm.push_back(d);
  perm.push_back(1);
  Tensor r = t.permute(perm);
  if (!r.is_contiguous()) r = r.contiguous();
  return r.view({-1, t.size(1)});
}

// [M, C] rows back to `like`'s N,C,... shape: a channels-last view
Tensor from_rows(const Tensor& r, const Tensor& like) {
  std::vector<int64_t> shape{like.size(0)}, perm{0, like.dim() - 1};
  for (int64_t d = 2; d < like.dim(); ++d) shape.push_back(like.size(d));
  shape.push_back(like.size(1));
  for (int64_t d = 1; d < like.dim() - 1; ++d) perm.push_back(d);
  return r.view(shape).permute(perm);
}

Tensor conv(const Tensor& x, const Tensor& w, const OptTensor& b, IntArrayRef stride, IntArrayRef padding,
            IntArrayRef dilation, int64_t groups) {
  return at::convolution(x, w, b, stride, padding, dilation, false, {0, 0}, groups);
}

// -> (out, y if keep_y, mean, invstd, scale, shift). Batch statistics when `batch_stats` (updating running_mean/var
// with `factor` when given), the running ones otherwise.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> conv_bn_act_fwd(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight, const OptTensor& bn_bias,
    const OptTensor& residual, const OptTensor& running_mean, const OptTensor& running_var, IntArrayRef stride,
    IntArrayRef padding, IntArrayRef dilation, int64_t groups, double eps, double factor, bool batch_stats,
    bool update_running, bool relu, bool keep_y) {
  Tensor y = conv(x, weight, bias, stride, padding, dilation, groups);
  Tensor rows = rows_of(y);
  y = from_rows(rows, y);  // channels-last even when the conv returned another layout
  const auto acc = y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor mean, var;
  if (batch_stats) {
    const int64_t m = rows.size(0);
    TORCH_CHECK_VALUE(m > 1, "Expected more than 1 value per channel when training, got input size torch.Size(",
                      y.sizes(), ")");
    std::tie(mean, var) = clfast_cpu::stats(rows);
    if (update_running) {
      at::NoGradGuard no_grad;
      running_mean->lerp_(mean.to(running_mean->scalar_type()), factor);
      running_var->lerp_((var * (double(m) / double(m - 1))).to(running_var->scalar_type()), factor);
    }
  } else {  // copies: a later in-place update of the running statistics must not change what backward uses
    mean = running_mean->to(acc, false, true);
    var = running_var->to(acc, false, true);
  }
  Tensor invstd = (var + eps).rsqrt();
  Tensor scale = given(bn_weight) ? invstd * bn_weight->to(acc) : invstd;
  Tensor shift = -mean * scale;
  if (given(bn_bias)) shift = shift + bn_bias->to(acc);
  OptTensor res_rows;
  if (given(residual)) res_rows = rows_of(residual->to(y.scalar_type()));
  Tensor out = from_rows(clfast_cpu::fwd(rows, scale, shift, res_rows, relu), y);
  return {out, keep_y ? y : Tensor(), mean, invstd, scale, shift};
}

// -> (dx, dweight, dbias, dbn_weight, dbn_bias, dresidual); undefined (None) where not asked for. `y` undefined
// recomputes the conv (memory mode). `out` given takes the ReLU mask from the output, which is then applied before the
// BN backward and is also the residual's gradient.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> conv_bn_act_bwd(
    const Tensor& dout, const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& y_saved,
    const Tensor& mean, const Tensor& invstd, const Tensor& scale, const Tensor& shift, const OptTensor& out,
    IntArrayRef stride, IntArrayRef padding, IntArrayRef dilation, int64_t groups, bool relu, bool training,
    bool has_residual, std::array<bool, 3> conv_mask, bool want_dbn_weight, bool want_dbn_bias) {
  Tensor y = given(y_saved) ? *y_saved : conv(x, weight, bias, stride, padding, dilation, groups);
  Tensor g = dout, dres;
  if (given(out)) {
    g = at::threshold_backward(dout, *out, 0);
    relu = false;
  }
  if (has_residual) dres = g;
  if (g.scalar_type() != y.scalar_type()) g = g.to(y.scalar_type());
  auto [dy_rows, sum_dz, sum_dzx, unused] =
      clfast_cpu::bwd(rows_of(g), rows_of(y), mean, invstd, scale, shift, std::nullopt, relu, training, false);
  Tensor dy = from_rows(dy_rows, y);
  y = Tensor(); g = Tensor();  // free the recomputed conv output before the conv backward allocates
  Tensor dx, dw, db;
  if (conv_mask[0] || conv_mask[1] || conv_mask[2]) {
    const bool has_bias = given(bias);
    std::vector<int64_t> bias_sizes{weight.size(0)};
    std::tie(dx, dw, db) = at::convolution_backward(
        dy, x, weight, has_bias ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(), stride, padding,
        dilation, false, {0, 0}, groups, {conv_mask[0], conv_mask[1], conv_mask[2] && has_bias});
  }
  return {dx, dw, db, want_dbn_weight ? sum_dzx : Tensor(), want_dbn_bias ? sum_dz : Tensor(), dres};
}

}  // namespace

TORCH_LIBRARY(clfast_cpu, m) {
  m.def("stats(Tensor x) -> (Tensor, Tensor)", &clfast_cpu::stats);
  m.def("fwd(Tensor x, Tensor scale, Tensor shift, Tensor? res, bool relu) -> Tensor", &clfast_cpu::fwd);
  m.def("bwd(Tensor dout, Tensor x, Tensor mean, Tensor invstd, Tensor scale, Tensor shift, Tensor? res, "
        "bool relu, bool training, bool want_dres) -> (Tensor, Tensor, Tensor, Tensor)", &clfast_cpu::bwd);
  m.def("conv_bn_act_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, Tensor? residual, "
        "Tensor(a!)? running_mean, Tensor(b!)? running_var, int[] stride, int[] padding, int[] dilation, int groups, "
        "float eps, float factor, bool batch_stats, bool update_running, bool relu, bool keep_y) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", &conv_bn_act_fwd);
  m.def("conv_bn_act_bwd(Tensor dout, Tensor x, Tensor weight, Tensor? bias, Tensor? y, Tensor mean, Tensor invstd, "
        "Tensor scale, Tensor shift, Tensor? out, int[] stride, int[] padding, int[] dilation, int groups, bool relu, "
        "bool training, bool has_residual, bool[3] conv_mask, bool want_dbn_weight, bool want_dbn_bias) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", &conv_bn_act_bwd);
}
