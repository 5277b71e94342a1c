// The fused layer's training step on the CPU with its autograd in C++: `clfast_cpu::conv_bn_act_step`, what an eager
// fused layer or precise BatchNorm calls. Between the module's forward and the kernels (layer.h) there is no Python,
// in either direction: the Python autograd.Function this replaces cost about 110 us per layer forward + backward, more
// than the BN kernels themselves at efficientnet_b0's late shapes and 2-10% of a whole resnet50/efficientnet_b0 step.
// The formulas are the `clfast::conv_bn_act` op's (clfast/ops.py: its autograd and `_update_running`), which
// torch.compile and synchronized BatchNorm run.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <optional>
#include <vector>
#include "act.h"
#include "layer.h"

using at::Tensor;
using clfast_cpu::OptTensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// `g` laid out as `like`: channels-last when `like` is (and is not also contiguous), else contiguous. ATen's CPU conv
// backward may return a channels-last weight gradient for a contiguous weight; the op's rule is its inputs' layouts.
Tensor layout_like(const Tensor& g, const Tensor& like) {
  if (!g.defined() || g.numel() == 0) return g;
  const bool cl = like.dim() == 4 && like.is_contiguous(at::MemoryFormat::ChannelsLast) && !like.is_contiguous();
  return g.contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

}  // namespace

namespace clfast_cpu {
// act(bn(conv(x)) [+ residual]): out, with y and params as non-differentiable outputs (the op's `_setup_context` and
// `_backward`). A profiler shows its two directions and the running-statistics update under the op's names.
struct ConvBnAct : public torch::autograd::Function<ConvBnAct> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& residual,
                               const OptTensor& mean, const OptTensor& var, std::vector<int64_t> stride,
                               std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups, double eps,
                               int64_t act, double act_param, bool keep_y) {
    RECORD_FUNCTION("clfast::conv_bn_act", std::vector<c10::IValue>());
    auto [out, y, params] = clfast_cpu::layer_fwd(x, weight, bias, bn_weight, bn_bias, residual, mean, var, stride,
                                                  padding, dilation, groups, eps, act, act_param, keep_y, std::nullopt);
    const bool training = !given(mean);
    if (training) {  // the batch variance the running average takes: unbiased (backward reads rows 0-3 only)
      const int64_t n = out.numel() / out.size(1);
      params.select(0, 4).mul_(double(n) / double(std::max<int64_t>(n - 1, 1)));
    }
    const bool has_act = act != clfast_cpu::act::kNone, has_res = given(residual);
    const bool from_out = has_res && has_act && clfast_cpu::act::grad_from_out(act, act_param);
    const bool keep_res = has_res && has_act && !from_out;
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), y, params,
                            keep_res ? *residual : Tensor(), from_out ? out : Tensor()});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["training"] = training;
    ctx->saved_data["act"] = act;
    ctx->saved_data["act_param"] = act_param;
    // autograd's edges are the given tensors only: which of x, weight, bias, bn_weight, bn_bias, residual were
    ctx->saved_data["given"] = std::vector<bool>{true, given(weight), given(bias), given(bn_weight), given(bn_bias),
                                                 has_res};
    // BN's parameter gradients come out in the accumulation dtype; they go back in their parameters' dtypes
    ctx->saved_data["bn_weight_dtype"] = given(bn_weight) ? int64_t(bn_weight->scalar_type()) : int64_t(-1);
    ctx->saved_data["bn_bias_dtype"] = given(bn_bias) ? int64_t(bn_bias->scalar_type()) : int64_t(-1);
    ctx->mark_non_differentiable({y, params});
    ctx->set_materialize_grads(false);  // y and params never get gradients: no zero-filled activation-sized tensors
    return {out, y, params};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("clfast::conv_bn_act_backward", std::vector<c10::IValue>());
    TORCH_CHECK(!at::GradMode::is_enabled(), "clfast's fused conv-BN has no double backward (create_graph=True): "
                "unfuse the model (clfast.fuse.unfuse_conv_bn) for higher-order gradients");
    variable_list result(16);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &y = saved[3], &params = saved[4];
    const Tensor &residual = saved[5], &out = saved[6];
    auto& d = ctx->saved_data;
    const int64_t act = d["act"].toInt();
    std::array<bool, 6> needs{};
    const auto was_given = d["given"].toBoolList();
    for (size_t i = 0, edge = 0; i < 6; ++i)
      if (was_given[i]) needs[i] = ctx->needs_input_grad(edge++);
    const bool res_through_act = needs[5] && act != clfast_cpu::act::kNone;
    const Tensor dout = grads[0].to(x.scalar_type());
    auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); };
    auto [dx, dw, db, dbw, dbb, dres] = clfast_cpu::layer_bwd(
        dout, x, opt(weight), opt(bias), y.defined() ? y : x.new_empty({0}), params, opt(residual),
        out.defined() ? out : x.new_empty({0}), d["stride"].toIntVector(), d["padding"].toIntVector(),
        d["dilation"].toIntVector(), d["groups"].toInt(), d["training"].toBool(), act, d["act_param"].toDouble(),
        {needs[0], needs[1], needs[2], needs[3], needs[4], res_through_act}, std::nullopt);
    if (needs[5] && !res_through_act) dres = dout;  // no activation: dresidual is dout
    const Tensor got[6] = {layout_like(dx, x), layout_like(dw, weight), db, dbw, dbb, dres};
    for (size_t i = 0; i < 6; ++i)
      if (needs[i] && got[i].defined() && got[i].numel()) result[i] = got[i];
    for (auto [i, key] : {std::pair<size_t, const char*>{3, "bn_weight_dtype"}, {4, "bn_bias_dtype"}})
      if (result[i].defined()) result[i] = result[i].to(at::ScalarType(d[key].toInt()));
    return result;
  }
};
}  // namespace clfast_cpu

namespace {

// BatchNorm's bookkeeping after a batch-statistics step (the op's `_update_running`): bump num_batches_tracked, then
// running = lerp(running, batch value, momentum, or 1/num_batches_tracked where momentum is None: a cumulative average)
void update_running(const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& num_batches_tracked,
                    const Tensor& params, std::optional<double> momentum) {
  RECORD_FUNCTION("clfast::bn_update_running", std::vector<c10::IValue>());
  at::NoGradGuard no_grad;
  std::optional<Tensor> cumulative;
  if (given(num_batches_tracked)) {
    num_batches_tracked->add_(1);
    if (!momentum) cumulative = at::reciprocal(num_batches_tracked->to(params.scalar_type()));
  }
  if (!given(running_mean) || !given(running_var)) return;
  for (auto [running, row] : {std::pair<const Tensor*, int64_t>{&*running_mean, 0}, {&*running_var, 4}}) {
    const Tensor value = params.select(0, row).to(running->scalar_type());
    if (cumulative) running->lerp_(value, cumulative->to(running->scalar_type()));
    else running->lerp_(value, momentum.value_or(0.0));
  }
}

Tensor conv_bn_act_step(const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
                        const OptTensor& bn_bias, const OptTensor& residual, const OptTensor& running_mean,
                        const OptTensor& running_var, const OptTensor& num_batches_tracked, bool training,
                        std::optional<double> momentum, double eps, at::IntArrayRef stride, at::IntArrayRef padding,
                        at::IntArrayRef dilation, int64_t groups, int64_t act, double act_param, bool keep_y) {
  const bool batch_stats = training || !(given(running_mean) && given(running_var));
  OptTensor mean, var;
  if (!batch_stats) { mean = running_mean->detach(); var = running_var->detach(); }
  auto outs = clfast_cpu::ConvBnAct::apply(x, weight, bias, bn_weight, bn_bias, residual, mean, var, stride.vec(), padding.vec(),
                           dilation.vec(), groups, eps, act, act_param, keep_y && given(weight));
  const Tensor& out = outs[0];
  TORCH_CHECK_VALUE(!batch_stats || out.numel() / out.size(1) > 1, "Expected more than 1 value per channel when "
                    "training, got input size ", out.sizes());
  if (training && (given(running_mean) || given(num_batches_tracked)))
    update_running(running_mean, running_var, num_batches_tracked, outs[2], momentum);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clfast_cpu, m) {
  // eager mode only (torch.compile traces the `clfast::conv_bn_act` op); one call per layer and step
  m.def("conv_bn_act_step(Tensor x, Tensor? weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, "
        "Tensor? residual, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
        "bool training, float? momentum, float eps, int[] stride, int[] padding, int[] dilation, int groups, int act, "
        "float act_param, bool keep_y) -> Tensor",
        &conv_bn_act_step);
}
