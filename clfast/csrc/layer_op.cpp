// The fused layer's op, `clfast::conv_bn_act` (its schema, with every other clfast op's: clfast/ops.py): one
// training or inference step of act(bn(conv(x)) [+ residual]) with BatchNorm2d's semantics, on every device. It is
// CompositeImplicitAutograd: what runs is the C++ autograd node below around the three kernel ops, `clfast::layer_fwd`,
// `clfast::layer_bwd` and `clfast::batch_stats` (clfast/KERNELS.md), each registered per dispatch key (CPU:
// conv_bn_act.cpp; CUDA: Triton, Meta: fakes, any other device: the pure-PyTorch reference, from ops.py); the node
// also updates BatchNorm's running statistics (`clfast::update_running`). Whatever traces (torch.compile, export)
// sees the kernel ops.
// Synchronized statistics (a process group's name in `group`) call three Python ops, `clfast::synced_stats`,
// `clfast::synced_running_rows` and `clfast::synced_grad_means` (clfast/syncstats.py: the collectives).
// Why C++: between a module's forward and the kernels there is no Python, in either direction. The Python autograd
// formula this replaced cost about 110 us per layer forward + backward: more than the BatchNorm kernels at
// efficientnet_b0's late shapes, and 2-15% of a whole resnet50/efficientnet_b0 step (BENCHMARKS.md).
// CUDA's eager step does not come here: its kernels are Python (Triton), which this node would reach through the
// dispatcher three times a step, so ops.py's Python twin of this node calls them directly (`_direct`).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <array>
#include <optional>
#include <string>
#include <vector>
#include "act.h"

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }
// Whether `t` has no elements (an absent result or the 'memory' mode's y). Sizes may be symbolic (torch.compile with
// dynamic shapes): the comparison then guards, always on a literal 0 or a batch's size
bool no_elements(const Tensor& t) { return t.sym_numel() == 0; }
OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }
// A tensor whose values this file may read and write through a pointer: a plain contiguous CPU tensor of `dtype` (not
// a fake, functional or other Python-backed one, which torch.compile traces with; nothing autograd tracks)
bool plain_cpu(const OptTensor& t, at::ScalarType dtype) {
  return given(t) && t->is_cpu() && t->layout() == at::kStrided && t->scalar_type() == dtype && t->is_contiguous() &&
         !t->requires_grad() && !t->unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
         !t->key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// The conv's geometry, as `aten.convolution` takes it (ConvGeometry in Python)
struct Geometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups;
};

// The ops this one is made of, called through the dispatcher (so each device's kernel runs, and tracing sees them)
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
using Tensors3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensors6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Tensors3 layer_fwd(const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
                   const OptTensor& bn_bias, const OptTensor& residual, const OptTensor& mean, const OptTensor& var,
                   const Geometry& g, double eps, int64_t act, double act_param, bool keep_y, const OptTensor& y) {
  static const auto k = op<Tensors3(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                    const OptTensor&, const OptTensor&, const OptTensor&, at::IntArrayRef, at::IntArrayRef,
                                    at::IntArrayRef, int64_t, double, int64_t, double, bool, const OptTensor&)>(
      "clfast::layer_fwd");
  return k.call(x, weight, bias, bn_weight, bn_bias, residual, mean, var, g.stride, g.padding, g.dilation, g.groups, eps,
                act, act_param, keep_y, y);
}

Tensors6 layer_bwd(const Tensor& dout, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const Tensor& y,
                   const Tensor& params, const OptTensor& residual, const Tensor& out, const Geometry& g, bool training,
                   int64_t act, double act_param, std::array<bool, 6> needs, const OptTensor& grad_means) {
  static const auto k = op<Tensors6(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&,
                                    const Tensor&, const OptTensor&, const Tensor&, at::IntArrayRef, at::IntArrayRef,
                                    at::IntArrayRef, int64_t, bool, int64_t, double, std::array<bool, 6>,
                                    const OptTensor&)>("clfast::layer_bwd");
  return k.call(dout, x, weight, bias, y, params, residual, out, g.stride, g.padding, g.dilation, g.groups, training, act,
                act_param, needs, grad_means);
}

Tensors3 synced_stats(const Tensor& y, const std::string& group) {
  static const auto k = op<Tensors3(const Tensor&, c10::string_view)>("clfast::synced_stats");
  return k.call(y, group);
}

void synced_running_rows(const Tensor& params, const Tensor& count, const OptTensor& mean, const OptTensor& var) {
  static const auto k = op<void(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&)>(
      "clfast::synced_running_rows");
  k.call(params, count, mean, var);
}

Tensor synced_grad_means(const Tensor& sum_dz, const Tensor& sum_dzx, const Tensor& y, const std::string& group) {
  static const auto k = op<Tensor(const Tensor&, const Tensor&, const Tensor&, c10::string_view)>(
      "clfast::synced_grad_means");
  return k.call(sum_dz, sum_dzx, y, group);
}

Tensor conv(const Tensor& x, const OptTensor& w, const OptTensor& b, const Geometry& g) {
  if (!given(w)) return x;  // a layer without a conv (a BatchNorm alone): y is x
  return at::convolution(x, *w, b, g.stride, g.padding, g.dilation, false, std::vector<int64_t>(g.stride.size(), 0),
                         g.groups)
      .contiguous(at::MemoryFormat::ChannelsLast);
}

// ATen's lerp on the CPU (its vector formula): start + weight * (end - start), from the nearer end
template <typename T> T lerp(T start, T end, T weight) {
  const bool small = std::abs(weight) < T(0.5);
  return std::fma(small ? weight : weight - T(1), end - start, small ? start : end);
}

// `clfast::update_running`'s CPU kernel, BatchNorm's bookkeeping after a batch-statistics step: bump
// num_batches_tracked, then running = lerp(running, batch value, momentum, or 1/num_batches_tracked where momentum is
// None: a cumulative average), the batch's variance times Bessel's correction count / (count - 1).
// A loop over the C values: the tensor ops it replaces (add_, mul_, select, to, lerp_ twice) cost ~13 us a layer
// forward in a loop and more right after a conv, with the caches cold
void update_running(const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& num_batches_tracked,
                    const Tensor& params, std::optional<double> momentum, c10::SymInt sym_count) {
  at::NoGradGuard no_grad;
  const auto acc = params.scalar_type();
  const double n = double(sym_count.guard_int(__FILE__, __LINE__)), correction = n / std::max(n - 1, 1.0);
  const bool stats = given(running_mean) && given(running_var);
  if ((!given(num_batches_tracked) || plain_cpu(num_batches_tracked, at::kLong)) &&
      (!stats || (plain_cpu(params, acc) && plain_cpu(running_mean, acc) && plain_cpu(running_var, acc))) &&
      (acc == at::kFloat || acc == at::kDouble)) {
    int64_t count = 0;
    if (given(num_batches_tracked)) {
      count = ++*num_batches_tracked->data_ptr<int64_t>();
      num_batches_tracked->unsafeGetTensorImpl()->bump_version();
    }
    if (!stats) return;
    AT_DISPATCH_FLOATING_TYPES(acc, "clfast_update_running", [&] {
      // as ATen's: a Scalar momentum, and the reciprocal of the count, each rounded to the running dtype first
      const scalar_t weight = momentum ? scalar_t(*momentum) : scalar_t(1) / scalar_t(count);
      const int64_t c = params.size(1);
      const scalar_t* batch = params.const_data_ptr<scalar_t>();
      const scalar_t unbias = scalar_t(correction);
      scalar_t* r = running_mean->data_ptr<scalar_t>();
      for (int64_t j = 0; j < c; ++j) r[j] = lerp(r[j], batch[j], weight);
      r = running_var->data_ptr<scalar_t>();
      for (int64_t j = 0; j < c; ++j) r[j] = lerp(r[j], batch[4 * c + j] * unbias, weight);
      running_mean->unsafeGetTensorImpl()->bump_version();
      running_var->unsafeGetTensorImpl()->bump_version();
    });
    return;
  }
  std::optional<Tensor> cumulative;
  if (given(num_batches_tracked)) {
    num_batches_tracked->add_(1);
    if (!momentum) cumulative = at::reciprocal(num_batches_tracked->to(params.scalar_type()));
  }
  if (!stats) return;
  for (auto [running, value] : {std::pair<const Tensor*, Tensor>{&*running_mean, params.select(0, 0)},
                                 {&*running_var, params.select(0, 4) * correction}}) {
    const Tensor v = value.to(running->scalar_type());
    if (cumulative) running->lerp_(v, cumulative->to(running->scalar_type()));
    else running->lerp_(v, momentum.value_or(0.0));
  }
}

// The layer's six gradients as stock ops that autograd records (clfast/ops.py's `_layer_grads_graph`): backward under
// create_graph=True, where the kernels' gradients would be constants to a second differentiation
std::vector<Tensor> layer_grads_graph(const Tensor& dout, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                      const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& residual,
                                      const OptTensor& out, const Tensor& params, const Geometry& g, double eps,
                                      bool training, int64_t act, double act_param, std::array<bool, 6> needs,
                                      bool synced) {
  static const auto k =
      op<std::vector<Tensor>(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                             const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&, at::IntArrayRef,
                             at::IntArrayRef, at::IntArrayRef, int64_t, double, bool, int64_t, double,
                             std::array<bool, 6>, bool)>("clfast::layer_grads_graph");
  return k.call(dout, x, weight, bias, bn_weight, bn_bias, residual, out, params, g.stride, g.padding, g.dilation,
                g.groups, eps, training, act, act_param, needs, synced);
}

void update_running_op(const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& num_batches_tracked,
                       const Tensor& params, std::optional<double> momentum, c10::SymInt count) {
  static const auto k = op<void(const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&,
                                std::optional<double>, c10::SymInt)>("clfast::update_running");
  k.call(running_mean, running_var, num_batches_tracked, params, momentum, std::move(count));
}

}  // namespace

namespace clfast {
// BatchNorm's running statistics and count, and whether this step updates them from its batch's (a training step)
struct Running {
  OptTensor mean, var, num_batches_tracked;
  std::optional<double> momentum;
  bool update;
};

// act(bn(conv(x)) [+ residual]): out, with y and params as non-differentiable outputs. `training`: normalise with the
// batch's statistics (over every rank of `group` when one is named), else with the given `mean` and `var`; then the
// running statistics are updated, here, before autograd saves this node's tensors: a non-reentrant gradient
// checkpoint stops its recomputation at the block's last saved tensor, and BatchNorm's own kernel, which updates them
// before it saves, updates them again in that recomputation (a fused layer must keep the statistics stock keeps)
struct ConvBnAct : public torch::autograd::Function<ConvBnAct> {
  static constexpr size_t kArgs = 16;  // forward's arguments after ctx: backward returns one gradient (or none) each
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& weight, const OptTensor& bias,
                               const OptTensor& bn_weight, const OptTensor& bn_bias, const OptTensor& residual,
                               const OptTensor& mean, const OptTensor& var, Geometry g, double eps, int64_t act,
                               double act_param, bool keep_y, bool training, std::string group, Running running) {
    Tensor out, y, params;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels have no autograd of their own: this node is it
      if (training && !group.empty()) {  // this rank's conv, its statistics joined with the other ranks', then the layer
        const Tensor y_here = conv(x, weight, bias, g);
        auto [mean_all, var_all, count] = synced_stats(y_here, group);
        std::tie(out, y, params) = layer_fwd(x, weight, bias, bn_weight, bn_bias, residual, mean_all, var_all, g, eps,
                                             act, act_param, keep_y, y_here);
        // rows 0 and 4 as the running update takes them (row 4 unbiased with every rank's count; every batch empty:
        // the running statistics themselves): one rule, the Python node's too
        synced_running_rows(params, count, running.update ? running.mean : OptTensor(),
                            running.update ? running.var : OptTensor());
      } else {
        std::tie(out, y, params) = layer_fwd(x, weight, bias, bn_weight, bn_bias, residual, mean, var, g, eps, act,
                                             act_param, keep_y, std::nullopt);
      }
    }
    if (running.update) {  // outside the guard: ATen's in-place fallback bumps the statistics' versions
      // the variance's count for Bessel's correction; 1 (none) where the synchronized step applied every rank's
      c10::SymInt count = group.empty() ? out.sym_numel() / out.sym_size(1) : c10::SymInt(1);
      update_running_op(running.mean, running.var, running.num_batches_tracked, params, running.momentum,
                        std::move(count));
    }
    const bool has_act = act != clfast_cpu::act::kNone, has_res = given(residual);
    const bool from_out = has_res && has_act && clfast_cpu::act::grad_from_out(act, act_param);
    const bool keep_res = has_res && has_act && !from_out;
    // (BN's weight and bias for a backward under create_graph=True alone: `layer_grads_graph`)
    ctx->save_for_backward({x, weight.value_or(Tensor()), bias.value_or(Tensor()), y, params,
                            keep_res ? *residual : Tensor(), from_out ? out : Tensor(),
                            bn_weight.value_or(Tensor()), bn_bias.value_or(Tensor())});
    ctx->saved_data["stride"] = g.stride;
    ctx->saved_data["padding"] = g.padding;
    ctx->saved_data["dilation"] = g.dilation;
    ctx->saved_data["groups"] = g.groups;
    ctx->saved_data["training"] = training;
    ctx->saved_data["act"] = act;
    ctx->saved_data["act_param"] = act_param;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["group"] = group;
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
    variable_list result(kArgs);
    auto& d = ctx->saved_data;
    const bool training = d["training"].toBool();
    const std::string group = d["group"].toStringRef();
    const bool synced = training && !group.empty();
    // no gradient (autograd's undefined one: zeros) and nothing to exchange: none. A synchronized layer's ranks all
    // join its exchange below, whatever gradient reached each: a rank whose batch was empty gets none from the layer
    // above (its input's had no elements), and skipping the exchange would leave the others waiting in it
    if (!grads[0].defined() && !synced) return result;
    // unpacked before autograd's keys are excluded: a non-reentrant gradient checkpoint recomputes its block inside
    // this call, and the block's other ops must record their autograd (and save their tensors) as in the forward
    const auto saved = ctx->get_saved_variables();
    std::array<bool, 6> needs{};
    const auto was_given = d["given"].toBoolList();
    for (size_t i = 0, edge = 0; i < 6; ++i)
      if (was_given[i]) needs[i] = ctx->needs_input_grad(edge++);
    const Geometry g{d["stride"].toIntVector(), d["padding"].toIntVector(), d["dilation"].toIntVector(),
                     d["groups"].toInt()};
    const int64_t act = d["act"].toInt();
    const double act_param = d["act_param"].toDouble();
    if (at::GradMode::is_enabled()) {  // create_graph=True: the gradients as a graph autograd differentiates again
      // (a synchronized layer's refused there, with the reason: one message, Python's)
      const auto got = layer_grads_graph(grads[0], saved[0], opt(saved[1]), opt(saved[2]), opt(saved[7]),
                                         opt(saved[8]), opt(saved[5]), opt(saved[6]), saved[4], g,
                                         d["eps"].toDouble(), training, act, act_param, needs, synced);
      for (size_t i = 0; i < 6; ++i)
        if (needs[i]) result[i] = got[i];
      return result;
    }
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Tensor &x = saved[0], &params = saved[4];
    const OptTensor weight = opt(saved[1]), bias = opt(saved[2]), residual = opt(saved[5]);
    const Tensor empty = x.new_empty({0});
    const Tensor out = saved[6].defined() ? saved[6] : empty;
    Tensor y = saved[3].defined() ? saved[3] : empty;  // empty: the 'memory' mode, recomputed by the kernel
    const bool res_through_act = needs[5] && act != clfast_cpu::act::kNone;
    Tensor dout = grads[0].defined() ? grads[0].to(x.scalar_type()) : Tensor();
    Tensor dx, dw, db, dbw, dbb, dres;
    if (synced) {  // this rank's two per-channel sums, summed over the ranks, then dy from their means
      if (no_elements(y)) y = conv(x, weight, bias, g);  // once, for both passes
      // no gradient reached this rank's output: zeros, as SyncBatchNorm's autograd materializes them (no elements for
      // an empty batch; a full batch's input gradient is not zero: the other ranks' gradient means reach it)
      if (!dout.defined()) dout = at::zeros_like(y, y.options().dtype(x.scalar_type()));
      auto [_x, _w, _b, sum_dzx, sum_dz, _r] = layer_bwd(dout, x, weight, bias, y, params, residual, out, g, training, act,
                                                         act_param, {false, false, false, true, true, false}, std::nullopt);
      const Tensor means = synced_grad_means(sum_dz, sum_dzx, y, group);
      std::tie(dx, dw, db, std::ignore, std::ignore, dres) =
          layer_bwd(dout, x, weight, bias, y, params, residual, out, g, training, act, act_param,
                    {needs[0], needs[1], needs[2], false, false, res_through_act}, means);
      // BN's own parameter gradients stay this rank's, as SyncBatchNorm's: DDP averages them with the others
      dbw = sum_dzx; dbb = sum_dz;
    } else {
      std::tie(dx, dw, db, dbw, dbb, dres) =
          layer_bwd(dout, x, weight, bias, y, params, residual, out, g, training, act, act_param,
                    {needs[0], needs[1], needs[2], needs[3], needs[4], res_through_act}, std::nullopt);
    }
    if (needs[5] && !res_through_act) dres = dout;  // no activation: dresidual is dout
    const Tensor got[6] = {dx, dw, db, dbw, dbb, dres};
    for (size_t i = 0; i < 6; ++i)
      if (needs[i] && got[i].defined() && !no_elements(got[i])) result[i] = got[i];
    // an empty batch's input gradients have no elements, but are there: the layers above run their backward on them
    if (needs[0] && !result[0].defined() && no_elements(x)) result[0] = at::zeros_like(x);
    if (needs[5] && !result[5].defined() && no_elements(dout)) result[5] = dout;  // (the residual has out's shape)
    for (auto [i, key] : {std::pair<size_t, const char*>{3, "bn_weight_dtype"}, {4, "bn_bias_dtype"}})
      if (result[i].defined()) result[i] = result[i].to(at::ScalarType(d[key].toInt()));
    return result;
  }
};

}  // namespace clfast

namespace {

Tensor conv_bn_act(const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
                   const OptTensor& bn_bias, const OptTensor& residual, const OptTensor& running_mean,
                   const OptTensor& running_var, const OptTensor& num_batches_tracked, bool training,
                   std::optional<double> momentum, double eps, at::IntArrayRef stride, at::IntArrayRef padding,
                   at::IntArrayRef dilation, int64_t groups, int64_t act, double act_param, bool keep_y,
                   c10::string_view group) {
  const bool batch_stats = training || !(given(running_mean) && given(running_var));
  OptTensor mean, var;
  if (!batch_stats) {  // copies: a later in-place update of the running statistics must not change what backward saved
    mean = running_mean->detach().clone();
    var = running_var->detach().clone();
  }
  const std::string synced = batch_stats ? std::string(group) : std::string();
  const Geometry g{stride.vec(), padding.vec(), dilation.vec(), groups};
  const clfast::Running running{running_mean, running_var, num_batches_tracked, momentum,
                                training && (given(running_mean) || given(num_batches_tracked))};
  return clfast::ConvBnAct::apply(x, weight, bias, bn_weight, bn_bias, residual, mean, var, g, eps, act, act_param,
                                  keep_y && given(weight), batch_stats, synced, running)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(clfast, CompositeImplicitAutograd, m) { m.impl("conv_bn_act", &conv_bn_act); }
TORCH_LIBRARY_IMPL(clfast, CPU, m) { m.impl("update_running", &update_running); }
