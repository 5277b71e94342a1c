// A whole fused conv-BN(+add)(-ReLU) layer on the CPU as one op with a C++ autograd node: the conv (oneDNN through
// ATen) and the bn_act.cpp kernels, running statistics updated as BatchNorm2d does. Per layer and direction it makes
// two or three tensor-op calls where the Python glue made a dozen: right after a conv every such call is slow (cold
// caches), and on a CPU ResNet-50 step they cost about what the kernels saved.
// Also registers every `clfast_cpu` op.
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <optional>
#include <vector>
#include "bn_act.h"

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

struct Geometry { std::vector<int64_t> stride, padding, dilation; int64_t groups; };

struct BnState {  // what BatchNorm2d.forward passes to F.batch_norm, and its running-average bookkeeping
  OptTensor running_mean, running_var, num_batches_tracked;
  double eps;
  std::optional<double> momentum;
  bool training;
};

Tensor conv(const Tensor& x, const Tensor& w, const Tensor& b, const Geometry& g) {
  return at::convolution(x, w, b.defined() ? OptTensor(b) : std::nullopt, g.stride, g.padding, g.dilation, false,
                         {0, 0}, g.groups);
}

Tensor channels_last(const Tensor& t) {
  return clfast_cpu::is_rows(t) ? t : t.contiguous(at::MemoryFormat::ChannelsLast);
}

// Per-channel values of an optional [C] tensor as doubles (`dflt` where absent), without tensor-op calls
std::vector<double> doubles(const OptTensor& t, int64_t c, double dflt) {
  std::vector<double> v(c, dflt);
  if (!given(t)) return v;
  const Tensor tc = t->contiguous();
  TORCH_CHECK(tc.numel() == c, "clfast: per-channel tensor has ", tc.numel(), " values, expected ", c);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tc.scalar_type(), "clfast_doubles", [&] {
    const scalar_t* p = tc.const_data_ptr<scalar_t>();
    for (int64_t j = 0; j < c; ++j) v[j] = double(p[j]);
  });
  return v;
}

void store(Tensor& t, const std::vector<double>& v) {
  if (!t.is_contiguous()) { t.copy_(at::tensor(v, t.options().dtype(at::kDouble))); return; }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "clfast_store", [&] {
    scalar_t* p = t.data_ptr<scalar_t>();
    for (size_t j = 0; j < v.size(); ++j) p[j] = scalar_t(v[j]);
  });
  t.unsafeGetTensorImpl()->bump_version();  // as an in-place op would
}

// BatchNorm2d's bookkeeping: bump num_batches_tracked, then the running averages with the unbiased variance
void update_running(const BnState& bn, const std::vector<double>& mean, const std::vector<double>& var, int64_t m) {
  double factor = bn.momentum.value_or(0.0);
  if (given(bn.num_batches_tracked)) {
    Tensor nbt = *bn.num_batches_tracked;
    if (nbt.scalar_type() == at::kLong && nbt.numel() == 1) {  // no tensor-op call for the common case
      ++*nbt.data_ptr<int64_t>();
      nbt.unsafeGetTensorImpl()->bump_version();
    } else nbt.add_(1);
    if (!bn.momentum) factor = 1.0 / nbt.item<double>();
  }
  if (!given(bn.running_mean) || !given(bn.running_var)) return;
  const int64_t c = int64_t(mean.size());
  std::vector<double> rm = doubles(bn.running_mean, c, 0.0), rv = doubles(bn.running_var, c, 0.0);
  const double unbias = double(m) / double(m - 1);
  for (int64_t j = 0; j < c; ++j) {
    rm[j] += factor * (mean[j] - rm[j]);
    rv[j] += factor * (var[j] * unbias - rv[j]);
  }
  Tensor rmt = *bn.running_mean, rvt = *bn.running_var;
  store(rmt, rm); store(rvt, rv);
}

enum Flags : int64_t { kRelu = 1, kBatchStats = 2, kResidual = 4, kNeedX = 8, kNeedW = 16, kNeedB = 32,
                       kNeedBnW = 64, kNeedBnB = 128 };

struct ConvBNAct : public torch::autograd::Function<ConvBNAct> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& residual,
                        const BnState& bn, const Geometry& geom, bool relu, bool memory) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // dtypes were set by the caller
    const Tensor b = given(bias) ? *bias : Tensor();
    const Tensor y = channels_last(conv(x, weight, b, geom));
    const int64_t c = y.size(1), m = y.numel() / c;
    TORCH_CHECK_VALUE(!given(residual) || residual->sizes() == y.sizes(), "residual shape ", residual->sizes(),
                      " must equal the conv output's ", y.sizes());
    // batch statistics as BatchNorm2d: in training, or without running statistics
    const bool batch_stats = bn.training || (!given(bn.running_mean) && !given(bn.running_var));
    std::vector<double> mean(c), var(c);
    if (batch_stats) {
      TORCH_CHECK_VALUE(m > 1, "Expected more than 1 value per channel when training, got input size torch.Size(",
                        y.sizes(), ")");
      clfast_cpu::stats(y, c, mean.data(), var.data());
      update_running(bn, mean, var, m);
    } else {
      mean = doubles(bn.running_mean, c, 0.0);
      var = doubles(bn.running_var, c, 1.0);
    }
    const std::vector<double> w = doubles(bn_weight, c, 1.0), bb = doubles(bn_bias, c, 0.0);
    const auto acc = y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    Tensor params = at::empty({4, c}, y.options().dtype(acc));  // mean, invstd, scale, shift
    AT_DISPATCH_FLOATING_TYPES(acc, "clfast_params", [&] {
      scalar_t* p = params.data_ptr<scalar_t>();
      for (int64_t j = 0; j < c; ++j) {
        const double invstd = 1.0 / std::sqrt(var[j] + bn.eps), scale = invstd * w[j];
        p[j] = scalar_t(mean[j]); p[c + j] = scalar_t(invstd);
        p[2 * c + j] = scalar_t(scale); p[3 * c + j] = scalar_t(bb[j] - mean[j] * scale);
      }
    });
    Tensor res;
    if (given(residual)) res = channels_last(residual->scalar_type() == y.scalar_type() ? *residual
                                                                                        : residual->to(y.scalar_type()));
    Tensor out = at::empty_like(y);
    const char* pp = static_cast<const char*>(params.const_data_ptr());
    const size_t row = size_t(c) * params.element_size();
    clfast_cpu::normalize(y, c, pp + 2 * row, pp + 3 * row, res.defined() ? &res : nullptr, relu, out);
    // With a residual and a ReLU the mask is read from the output (which the next layer keeps anyway) rather than
    // recomputed from y + residual: a downsample branch's output is then not kept alive for backward.
    const bool mask_from_out = relu && res.defined();
    ctx->save_for_backward({x, weight, b, memory ? Tensor() : y, params, mask_from_out ? out : Tensor()});
    auto needs = [](const OptTensor& t) { return given(t) && t->requires_grad(); };
    const int64_t flags = (relu ? kRelu : 0) | (batch_stats ? kBatchStats : 0) | (res.defined() ? kResidual : 0) |
                          (x.requires_grad() ? kNeedX : 0) | (weight.requires_grad() ? kNeedW : 0) |
                          (needs(bias) ? kNeedB : 0) | (needs(bn_weight) ? kNeedBnW : 0) | (needs(bn_bias) ? kNeedBnB : 0);
    ctx->saved_data["flags"] = flags;
    ctx->saved_data["geom"] = std::vector<int64_t>{geom.stride[0], geom.stride[1], geom.padding[0], geom.padding[1],
                                                   geom.dilation[0], geom.dilation[1], geom.groups};
    ctx->saved_data["bn_dtypes"] = std::vector<int64_t>{
        int64_t(given(bn_weight) ? bn_weight->scalar_type() : acc), int64_t(given(bn_bias) ? bn_bias->scalar_type() : acc)};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "clfast's fused conv-BN has no double backward (create_graph=True): "
                "unfuse the model (clfast.fuse.unfuse_conv_bn) for higher-order gradients");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &b = saved[2], &params = saved[4], &out = saved[5];
    const int64_t flags = ctx->saved_data["flags"].toInt();
    const auto gv = ctx->saved_data["geom"].toIntVector();
    const auto bn_dtypes = ctx->saved_data["bn_dtypes"].toIntVector();
    const Geometry geom{{gv[0], gv[1]}, {gv[2], gv[3]}, {gv[4], gv[5]}, gv[6]};
    const Tensor y = saved[3].defined() ? saved[3] : channels_last(conv(x, weight, b, geom));  // memory mode: recompute
    const int64_t c = y.size(1);
    Tensor g = grads[0];
    if (g.scalar_type() != y.scalar_type()) g = g.to(y.scalar_type());
    g = channels_last(g);
    const bool mask_from_out = out.defined(), has_res = flags & kResidual;
    const char* pp = static_cast<const char*>(params.const_data_ptr());
    const size_t row = size_t(c) * params.element_size();
    clfast_cpu::BwdArgs a{pp, pp + row, pp + 2 * row, pp + 3 * row};
    a.mask = !(flags & kRelu) ? clfast_cpu::Mask::none
             : mask_from_out  ? clfast_cpu::Mask::from_out : clfast_cpu::Mask::recompute;
    a.out = mask_from_out ? &out : nullptr;
    a.training = flags & kBatchStats;
    Tensor dres, dbn_w, dbn_b;
    if (has_res) dres = mask_from_out ? at::empty_like(y) : grads[0];  // without the ReLU mask dres is dout itself
    if (has_res && mask_from_out) a.dres = &dres;
    const auto acc = params.scalar_type();
    if (flags & kNeedBnW) { dbn_w = at::empty({c}, params.options()); a.sum_dzx = dbn_w.data_ptr(); }
    if (flags & kNeedBnB) { dbn_b = at::empty({c}, params.options()); a.sum_dz = dbn_b.data_ptr(); }
    Tensor dy = at::empty_like(y);
    clfast_cpu::backward(g, y, c, a, dy);
    Tensor dx, dw, db;
    const bool nx = flags & kNeedX, nw = flags & kNeedW, nb = (flags & kNeedB) && b.defined();
    if (nx || nw || nb) {
      std::vector<int64_t> bias_sizes{weight.size(0)};
      std::tie(dx, dw, db) = at::convolution_backward(
          dy, x, weight, b.defined() ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(), geom.stride,
          geom.padding, geom.dilation, false, {0, 0}, geom.groups, {nx, nw, nb});
    }
    if (dbn_w.defined() && bn_dtypes[0] != int64_t(acc)) dbn_w = dbn_w.to(at::ScalarType(bn_dtypes[0]));
    if (dbn_b.defined() && bn_dtypes[1] != int64_t(acc)) dbn_b = dbn_b.to(at::ScalarType(bn_dtypes[1]));
    // one gradient per forward argument: x, weight, bias, bn_weight, bn_bias, residual, bn, geom, relu, memory
    return {dx, dw, db, dbn_w, dbn_b, dres, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor conv_bn_act(const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
                   const OptTensor& bn_bias, const OptTensor& residual, const OptTensor& running_mean,
                   const OptTensor& running_var, const OptTensor& num_batches_tracked, at::IntArrayRef stride,
                   at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double eps,
                   std::optional<double> momentum, bool training, bool relu, bool memory) {
  TORCH_CHECK_VALUE(x.dim() == 4, "expected 4D input (got ", x.dim(), "D input)");
  BnState bn{running_mean, running_var, num_batches_tracked, eps, momentum, training};
  Geometry geom{stride.vec(), padding.vec(), dilation.vec(), groups};
  return ConvBNAct::apply(x, weight, bias, bn_weight, bn_bias, residual, bn, geom, relu, memory);
}

}  // namespace

TORCH_LIBRARY(clfast_cpu, m) {
  m.def("stats(Tensor x) -> (Tensor, Tensor)", &clfast_cpu::stats_op);
  m.def("fwd(Tensor x, Tensor scale, Tensor shift, Tensor? res, bool relu) -> Tensor", &clfast_cpu::fwd_op);
  m.def("bwd(Tensor dout, Tensor x, Tensor mean, Tensor invstd, Tensor scale, Tensor shift, Tensor? res, "
        "bool relu, bool training, bool want_dres) -> (Tensor, Tensor, Tensor, Tensor)", &clfast_cpu::bwd_op);
  m.def("conv_bn_act(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, Tensor? residual, "
        "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, int[] stride, "
        "int[] padding, int[] dilation, int groups, float eps, float? momentum, bool training, bool relu, "
        "bool memory) -> Tensor", &conv_bn_act);
}
