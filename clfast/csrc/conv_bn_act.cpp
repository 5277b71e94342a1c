// The CPU backend of the fused layer act(bn(conv(x)) [+ residual]) (the contract: clfast/KERNELS.md): `layer_fwd` and
// `layer_bwd`, each a whole layer in one op: the conv (oneDNN through ATen) and the bn_act.cpp kernels. Per layer and
// direction they make two to four tensor-op calls (the conv, the allocations) where Python glue made a dozen: right
// after a conv every such call is slow (cold caches), and on a CPU ResNet-50 step they cost about what the kernels
// saved. Per-channel values are computed in plain loops, not with [C] tensor ops. They are the CPU kernels of the
// `clfast::layer_fwd`, `clfast::layer_bwd` and `clfast::batch_stats` ops (declared in clfast/ops.py); no autograd
// here: the `clfast::conv_bn_act` op (layer_op.cpp) owns the graph and BatchNorm's running statistics, and calls these
// below autograd and autocast (it has cast the dtypes). Also registers the CPU-only `clfast_cpu` utility ops.
#include "act.h"  // first: simd.h picks the CPU capability of ATen's vec headers
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>
#include "bn_act.h"

using at::Tensor;
using OptTensor = std::optional<Tensor>;

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

struct Geometry { at::IntArrayRef stride, padding, dilation; int64_t groups; };

// The layer's conv; a layer without one (no weight: BatchNorm alone) passes x on
Tensor conv(const Tensor& x, const OptTensor& w, const OptTensor& b, const Geometry& g) {
  if (!given(w)) return x;
  const std::vector<int64_t> out_pad(g.stride.size(), 0);
  return at::convolution(x, *w, given(b) ? b : std::nullopt, g.stride, g.padding, g.dilation, false, out_pad, g.groups);
}

Tensor channels_last(const Tensor& t) {
  if (clfast_cpu::is_rows(t)) return t;
  return t.contiguous(t.dim() == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast);
}

// `g` laid out as `like`: channels-last when `like` is (and is not also contiguous), else contiguous. ATen's CPU conv
// backward may return a channels-last weight gradient for a contiguous weight; the kernels' rule (KERNELS.md, and the
// fakes) is the inputs' layouts.
Tensor layout_like(const Tensor& g, const Tensor& like) {
  if (!g.defined() || g.numel() == 0) return g;
  const bool cl = like.dim() == 4 && like.is_contiguous(at::MemoryFormat::ChannelsLast) && !like.is_contiguous();
  return g.contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

// Per-channel values of an optional [C] tensor as doubles (`dflt` where absent), without tensor-op calls
std::vector<double> doubles(const OptTensor& t, int64_t c, double dflt, const char* name) {
  std::vector<double> v(c, dflt);
  if (!given(t)) return v;
  const Tensor tc = t->contiguous();  // no dispatcher call when already contiguous
  TORCH_CHECK_VALUE(tc.numel() == c, "clfast_cpu: ", name, " has ", tc.numel(), " values, expected ", c);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tc.scalar_type(), "clfast_doubles", [&] {
    const scalar_t* p = tc.const_data_ptr<scalar_t>();
    for (int64_t j = 0; j < c; ++j) v[j] = double(p[j]);
  });
  return v;
}

at::ScalarType acc_type(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

void check_dtype(const OptTensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(!given(t) || t->scalar_type() == x.scalar_type(), "clfast_cpu: ", name, " is ",
                    t->scalar_type(), " but x is ", x.scalar_type(), " (the caller casts them to one dtype)");
}

// What both directions run under: the caller has set dtypes (no autocast) and owns the autograd graph
struct Guards {
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
  at::AutoDispatchBelowADInplaceOrView below_autograd;
};

}  // namespace

namespace clfast_cpu {

std::tuple<Tensor, Tensor, Tensor> layer_fwd(
    const Tensor& x, const OptTensor& weight, const OptTensor& bias, const OptTensor& bn_weight, const OptTensor& bn_bias,
    const OptTensor& residual, const OptTensor& mean, const OptTensor& var, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, double eps, int64_t act, double act_param,
    bool keep_y, const OptTensor& y_given) {
  Guards guards;
  TORCH_CHECK_VALUE(x.dim() == 4 || x.dim() == 5, "clfast::layer_fwd (CPU): expected 4D (or 5D) input, got ", x.dim(), "D");
  TORCH_CHECK_VALUE(given(mean) == given(var), "clfast::layer_fwd (CPU): give both mean and var, or neither");
  check_dtype(weight, x, "weight"); check_dtype(bias, x, "bias"); check_dtype(residual, x, "residual");
  check_dtype(y_given, x, "y");
  // the caller may have run the conv already (synchronized statistics need it before normalising)
  const Tensor y = given(y_given) ? channels_last(*y_given)
                                  : channels_last(conv(x, weight, bias, {stride, padding, dilation, groups}));
  const int64_t c = y.size(1), m = y.numel() / c;
  TORCH_CHECK_VALUE(!given(residual) || residual->sizes() == y.sizes(), "clfast::layer_fwd (CPU): residual shape ",
                    residual->sizes(), " must equal the conv output's ", y.sizes());
  std::vector<double> mu(c), va(c);
  if (given(mean)) {
    mu = doubles(mean, c, 0.0, "mean");
    va = doubles(var, c, 1.0, "var");
  } else {
    TORCH_CHECK_VALUE(m > 0, "clfast::layer_fwd (CPU): batch statistics need at least one value per channel");
    clfast_cpu::stats(y, c, mu.data(), va.data());
  }
  const std::vector<double> w = doubles(bn_weight, c, 1.0, "bn_weight"), bb = doubles(bn_bias, c, 0.0, "bn_bias");
  Tensor params = at::empty({5, c}, y.options().dtype(acc_type(y.scalar_type())));  // mean, invstd, scale, shift, var
  AT_DISPATCH_FLOATING_TYPES(params.scalar_type(), "clfast_params", [&] {
    scalar_t* p = params.data_ptr<scalar_t>();
    for (int64_t j = 0; j < c; ++j) {
      const double invstd = 1.0 / std::sqrt(va[j] + eps), scale = invstd * w[j];
      p[j] = scalar_t(mu[j]); p[c + j] = scalar_t(invstd); p[2 * c + j] = scalar_t(scale);
      p[3 * c + j] = scalar_t(bb[j] - mu[j] * scale); p[4 * c + j] = scalar_t(va[j]);
    }
  });
  const Tensor res = given(residual) ? channels_last(*residual) : Tensor();
  Tensor out = at::empty_like(y);
  const char* pp = static_cast<const char*>(params.const_data_ptr());
  const size_t row = size_t(c) * params.element_size();
  clfast_cpu::normalize(y, c, pp + 2 * row, pp + 3 * row, res.defined() ? &res : nullptr, act, act_param, out);
  return {out, keep_y ? y : at::empty({0}, y.options()), params};
}

// A layer's output again (no residual) from its conv output and the params its forward returned: the forward's
// normalize over the same scale and shift rows, bit for bit (clfast.recompute's recipes)
Tensor layer_out(const Tensor& y_in, const Tensor& params, int64_t act, double act_param) {
  Guards guards;
  TORCH_CHECK_VALUE(y_in.dim() == 4 || y_in.dim() == 5, "clfast::layer_out (CPU): expected 4D (or 5D) y, got ",
                    y_in.dim(), "D");
  const Tensor y = channels_last(y_in);
  const int64_t c = y.size(1);
  TORCH_CHECK_VALUE(params.dim() == 2 && params.size(0) == 5 && params.size(1) == c && params.is_contiguous() &&
                    params.scalar_type() == acc_type(y.scalar_type()),
                    "clfast::layer_out (CPU): params must be the layer forward's contiguous [5, ", c, "] ",
                    acc_type(y.scalar_type()), " tensor, got ", params.sizes(), " ", params.scalar_type());
  Tensor out = at::empty_like(y);
  const char* pp = static_cast<const char*>(params.const_data_ptr());
  const size_t row = size_t(c) * params.element_size();
  clfast_cpu::normalize(y, c, pp + 2 * row, pp + 3 * row, nullptr, act, act_param, out);
  return out;
}

}  // namespace clfast_cpu

namespace {

// A conv's weight gradient is a matrix product: dW = dy^T cols(x), where cols(x) holds, for each output position, the
// input values each tap of the kernel reads (im2col; for a 1x1 conv at stride 1 it is x's own rows, no copy). Over
// channels-last tensors both are row-major matrices and dW comes out in a channels-last weight's memory order. For a 1x1
// conv without padding dx is a matrix product too: dx = dy W (with a stride, on the rows the conv reads, 0 elsewhere).
// Where the maps are small this "GEMM way" beats ATen's channels-last conv backward, whose weight gradient is slow there
// (ResNet-50 at 160 px on an AVX2 EPYC: 1.2-1.46x on the deep and strided 1x1 convs, 1.1-1.6x on the deep 3x3 weight
// gradients); on large maps ATen wins. A third way is ATen's in fp32 for a bf16 or fp16 conv (inputs widened exactly,
// gradients rounded back once): oneDNN's bf16 channels-last depthwise backward took 3-33x fp32's on a Zen 4 EPYC with
// AVX512-BF16 (strided and 5x5 ones; efficientnet_b0's bf16 step ran at half its fp32 speed), while elsewhere bf16 is
// the faster. Where each crossover lies depends on the CPU, so the first time a shape is met each way that applies is
// timed against ATen's and the fastest kept (as cudnn.benchmark does), by the one rule clfast times every choice with
// (clfast.timing: paired ratios, one margin, a sign test), once per machine: this library asks Python's
// `clfast_timing::choose_backward` through the dispatcher. Not with torch.use_deterministic_algorithms(True): there,
// which way runs must not depend on a timing, so ATen always runs; nor without that op (no Python): ATen too.
enum class GemmWay : int64_t { never = 0, always = 1, timed = 2 };
std::atomic<int64_t> gemm_way{int64_t(GemmWay::timed)};
// The ways one conv backward can run ('timed' picks one per shape); their names in `gemm_backward_choices`
enum class BackwardWay : int64_t { aten = 0, gemm = 1, aten_fp32 = 2 };
// x's N, C, H, W; the weight's shape (out channels, in channels per group, kernel height, width); stride, padding,
// dilation (h, w each); dtype; needs (bits dx 1, dweight 2, dbias 4); threads; rows (1 where x and dy are dense
// channels-last, `is_rows`: only there can the GEMM way read them, so a strided call of a shape whose dense calls
// chose it chooses apart, among the ways that apply to it)  ->  the way that won
using ShapeKey = std::array<int64_t, 18>;
std::mutex gemm_mutex;
std::map<ShapeKey, BackwardWay> gemm_won;
// cols(x) larger than this is not built: a temporary that big costs more in page faults than ATen's way
constexpr int64_t kMaxColumnsBytes = int64_t(64) << 20;
// rows of dy and cols(x) one fp32 GEMM of the weight gradient sums before the sum goes on in fp64
constexpr int64_t kGemmBlockRows = 1024;
// cols(x) at most this wide (input channels x taps) is multiplied in fp64, kThinBlockRows rows at a time
constexpr int64_t kThinColumns = 16;
constexpr int64_t kThinBlockRows = 8192;

Tensor rows(const Tensor& t) { return t.as_strided({t.numel() / t.size(1), t.size(1)}, {t.size(1), 1}); }

bool is_1x1_unpadded(const Tensor& w, const Geometry& g) {
  return w.size(2) == 1 && w.size(3) == 1 && g.padding[0] == 0 && g.padding[1] == 0;
}
// a 1x1 conv at stride 1 without padding: cols(x) is x's own rows
bool reads_rows(const Tensor& w, const Geometry& g) {
  return is_1x1_unpadded(w, g) && g.stride[0] == 1 && g.stride[1] == 1;
}

bool gemm_way_fits(const Tensor& x, const Tensor& w, const Tensor& dy, const Geometry& g, bool nw) {
  if (!(x.dim() == 4 && g.groups == 1 && clfast_cpu::is_rows(x) && clfast_cpu::is_rows(dy))) return false;
  if (reads_rows(w, g)) return true;
  if (!nw && !is_1x1_unpadded(w, g)) return false;  // nothing for the GEMMs to do: dx is ATen's
  return dy.numel() / dy.size(1) * w.numel() / w.size(0) * x.element_size() <= kMaxColumnsBytes;
}

// cols(x): a row-major [N*Ho*Wo, kh*kw*C] matrix, row (n, ho, wo) holding tap after tap the C values that output reads
Tensor columns(const Tensor& x, const Tensor& w, const Tensor& dy, const Geometry& g) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3), kh = w.size(2), kw = w.size(3);
  const int64_t ho = dy.size(2), wo = dy.size(3);
  if (reads_rows(w, g)) return rows(x);
  const Tensor xn = x.permute({0, 2, 3, 1});  // channels-last memory seen as NHWC
  Tensor cols = at::empty({n, ho, wo, kh, kw, c}, x.options());
  // the output positions [lo, hi) whose tap at offset `off` reads inside an input of `size` (the others read padding)
  auto inside = [](int64_t off, int64_t stride, int64_t size, int64_t out) {
    const int64_t lo = off >= 0 ? 0 : std::min(out, (-off + stride - 1) / stride);  // all padding: lo = hi = out
    const int64_t hi = size - 1 - off < 0 ? 0 : std::min(out, (size - 1 - off) / stride + 1);
    return std::pair<int64_t, int64_t>{lo, std::max(lo, hi)};
  };
  for (int64_t i = 0; i < kh; ++i) {
    const int64_t oh = i * g.dilation[0] - g.padding[0];
    const auto [h0, h1] = inside(oh, g.stride[0], h, ho);
    for (int64_t j = 0; j < kw; ++j) {
      const int64_t ow = j * g.dilation[1] - g.padding[1];
      const auto [w0, w1] = inside(ow, g.stride[1], wd, wo);
      Tensor tap = cols.select(3, i).select(3, j);  // [n, ho, wo, c]
      if (h0 > 0) tap.narrow(1, 0, h0).zero_();
      if (h1 < ho) tap.narrow(1, h1, ho - h1).zero_();
      if (h1 > h0) {
        Tensor mid = tap.narrow(1, h0, h1 - h0);
        if (w0 > 0) mid.narrow(2, 0, w0).zero_();
        if (w1 < wo) mid.narrow(2, w1, wo - w1).zero_();
        if (w1 > w0)
          mid.narrow(2, w0, w1 - w0).copy_(xn.slice(1, h0 * g.stride[0] + oh, (h1 - 1) * g.stride[0] + oh + 1, g.stride[0])
                                             .slice(2, w0 * g.stride[1] + ow, (w1 - 1) * g.stride[1] + ow + 1, g.stride[1]));
      }
    }
  }
  return cols.view({n * ho * wo, kh * kw * c});
}

std::tuple<Tensor, Tensor, Tensor> aten_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                      const OptTensor& bias, const Geometry& g, bool nx, bool nw,
                                                      bool nb) {
  const std::vector<int64_t> bias_sizes{w.size(0)}, out_pad(g.stride.size(), 0);
  return at::convolution_backward(dy, x, w, given(bias) ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(),
                                  g.stride, g.padding, g.dilation, false, out_pad, g.groups, {nx, nw, nb});
}

std::tuple<Tensor, Tensor, Tensor> gemm_way_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                     const OptTensor& bias, const Geometry& g, bool nx, bool nw,
                                                     bool nb) {
  const Tensor dyr = rows(dy);
  Tensor dx, dw, db;
  if (nx && is_1x1_unpadded(w, g)) {
    const Tensor w2 = w.reshape({w.size(0), w.size(1)});
    if (reads_rows(w, g)) {
      dx = at::empty_like(x);
      Tensor dx_rows = rows(dx);
      at::mm_out(dx_rows, dyr, w2);
    } else {
      dx = at::zeros_like(x);
      const Tensor hit = at::mm(dyr, w2).view({dy.size(0), dy.size(2), dy.size(3), x.size(1)}).permute({0, 3, 1, 2});
      dx.slice(2, 0, x.size(2), g.stride[0]).slice(3, 0, x.size(3), g.stride[1]).copy_(hit);
    }
  } else if (nx) {
    std::tie(dx, std::ignore, db) = aten_conv_backward(dy, x, w, bias, g, true, false, nb);
  }
  if (nw) {
    dw = at::empty(w.sizes(), w.options().memory_format(at::MemoryFormat::ChannelsLast));
    Tensor dw2 = dw.as_strided({w.size(0), w.numel() / w.size(0)}, {w.numel() / w.size(0), 1});
    const Tensor cols = columns(x, w, dy, g);
    const int64_t m = dyr.size(0);
    // A reduction over every output position in one fp32 GEMM loses what a conv before a training BN needs: its true
    // weight gradient nearly cancels (BN makes the layer almost scale-invariant), and a 1-channel stem's came out 0.04
    // of the model's gradient scale from fp64 against contiguous ATen's 5e-4. So the sum over rows goes on in fp64:
    // a thin input (few columns: the GEMM is cheap, the cancellation worst) is multiplied in fp64 block by block;
    // otherwise fp32 GEMMs over blocks of rows are summed in fp64, as the BN kernels sum (bn_act.cpp)
    const bool thin = cols.size(1) <= kThinColumns;
    const int64_t block = thin ? kThinBlockRows : kGemmBlockRows;
    if (x.scalar_type() == at::kDouble || (m <= block && !thin)) {
      at::mm_out(dw2, dyr.t(), cols);
    } else {
      Tensor total = at::zeros(dw2.sizes(), dw2.options().dtype(at::kDouble));
      Tensor part = thin ? Tensor() : at::empty(dw2.sizes(), dw2.options());
      for (int64_t r = 0; r < m; r += block) {
        const int64_t len = std::min(block, m - r);
        const Tensor dyb = dyr.narrow(0, r, len).t(), colsb = cols.narrow(0, r, len);
        if (thin) {
          total.addmm_(dyb.to(at::kDouble), colsb.to(at::kDouble));
        } else {
          at::mm_out(part, dyb, colsb);
          total.add_(part);
        }
      }
      dw2.copy_(total);
    }
  }
  if (nb && !db.defined()) db = dyr.sum(0);
  return {dx, dw, db};
}

// ATen's conv backward on fp32 copies of a bf16 / fp16 conv's tensors, its gradients rounded back to their dtypes
std::tuple<Tensor, Tensor, Tensor> aten_fp32_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                           const OptTensor& bias, const Geometry& g, bool nx, bool nw,
                                                           bool nb) {
  const auto wide = [](const Tensor& t) { return t.to(at::kFloat); };  // keeps the memory format
  auto [dx, dw, db] = aten_conv_backward(wide(dy), wide(x), wide(w), bias, g, nx, nw, nb);
  const auto back = [](const Tensor& t, at::ScalarType dt) { return t.defined() ? t.to(dt) : t; };
  return {back(dx, x.scalar_type()), back(dw, w.scalar_type()), back(db, given(bias) ? bias->scalar_type() : dy.scalar_type())};
}

struct ConvGrads {
  std::tuple<Tensor, Tensor, Tensor> grads;  // dx, dweight, dbias (undefined where not needed)
  BackwardWay way;
  bool timed = false;  // the way 'timed' chose for this shape (not forced, nor the only one that applies)
};

ConvGrads run_backward_way(BackwardWay w, const Tensor& dy, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                           const Geometry& g, bool nx, bool nw, bool nb) {
  switch (w) {
    case BackwardWay::gemm: return {gemm_way_backward(dy, x, weight, bias, g, nx, nw, nb), w};
    case BackwardWay::aten_fp32: return {aten_fp32_conv_backward(dy, x, weight, bias, g, nx, nw, nb), w};
    default: return {aten_conv_backward(dy, x, weight, bias, g, nx, nw, nb), BackwardWay::aten};
  }
}

ConvGrads conv_backward_way(const Tensor& dy, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                            const Geometry& g, bool nx, bool nw, bool nb) {
  auto run = [&](BackwardWay w) { return run_backward_way(w, dy, x, weight, bias, g, nx, nw, nb); };
  const auto way = GemmWay(gemm_way.load());
  const bool gemm_fits = way != GemmWay::never && gemm_way_fits(x, weight, dy, g, nw);
  if (way == GemmWay::always && gemm_fits) return run(BackwardWay::gemm);
  if (way != GemmWay::timed || at::globalContext().deterministicAlgorithms()) return run(BackwardWay::aten);
  std::vector<BackwardWay> ways{BackwardWay::aten};
  if (gemm_fits) ways.push_back(BackwardWay::gemm);
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) ways.push_back(BackwardWay::aten_fp32);
  if (ways.size() == 1) return run(BackwardWay::aten);
  const bool rows = clfast_cpu::is_rows(x) && clfast_cpu::is_rows(dy);
  const int64_t needs = int64_t(nx) | int64_t(nw) << 1 | int64_t(nb) << 2;
  const ShapeKey key{x.size(0), x.size(1), x.size(2), x.size(3), weight.size(0), weight.size(1), weight.size(2), weight.size(3),
                     g.stride[0], g.stride[1], g.padding[0], g.padding[1], g.dilation[0], g.dilation[1],
                     int64_t(x.scalar_type()), needs, int64_t(at::get_num_threads()), int64_t(rows)};
  {
    std::lock_guard<std::mutex> lock(gemm_mutex);
    const auto it = gemm_won.find(key);
    if (it != gemm_won.end()) {
      ConvGrads r = run(it->second);
      r.timed = true;
      return r;
    }
  }
  // first meeting: clfast.timing chooses (timed once per machine, cached; the lock is not held meanwhile: the choice
  // runs this shape's backward itself, through `conv_backward_as`)
  const auto chooser = c10::Dispatcher::singleton().findSchema({"clfast_timing::choose_backward", ""});
  if (!chooser.has_value()) return run(BackwardWay::aten);
  std::vector<int64_t> candidates;
  for (const auto w : ways) candidates.push_back(int64_t(w));
  const auto chosen = BackwardWay(
      chooser->typed<int64_t(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, at::IntArrayRef,
                             at::IntArrayRef, at::IntArrayRef, int64_t, int64_t, bool, at::IntArrayRef)>()
          .call(dy, x, weight, bias, g.stride, g.padding, g.dilation, g.groups, needs, rows, candidates));
  {
    std::lock_guard<std::mutex> lock(gemm_mutex);
    gemm_won[key] = chosen;
  }
  ConvGrads r = run(chosen);
  r.timed = true;
  return r;
}

// One way of a conv backward, forced (what `clfast_timing::choose_backward` times); empty tensors where not needed
std::tuple<Tensor, Tensor, Tensor> conv_backward_as(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                    const OptTensor& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                                                    at::IntArrayRef dilation, int64_t groups, int64_t needs, int64_t way) {
  TORCH_CHECK_VALUE(way >= 0 && way <= 2, "clfast_cpu.conv_backward_as: way 0 (aten), 1 (gemm) or 2 (aten_fp32), got ", way);
  TORCH_CHECK_VALUE(way != 1 || gemm_way_fits(x, weight, dy, Geometry{stride, padding, dilation, groups}, needs & 2),
                    "clfast_cpu.conv_backward_as: the GEMM way does not fit this conv");
  const auto [dx, dw, db] = run_backward_way(BackwardWay(way), dy, x, weight, bias,
                                             Geometry{stride, padding, dilation, groups}, needs & 1, needs & 2, needs & 4).grads;
  auto or_empty = [&](const Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  return {or_empty(dx), or_empty(dw), or_empty(db)};
}

std::tuple<Tensor, Tensor, Tensor> conv_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                 const OptTensor& bias, const Geometry& g, bool nx, bool nw, bool nb) {
  return conv_backward_way(dy, x, weight, bias, g, nx, nw, nb).grads;
}

// A stock conv's backward run as a fused layer's is (`conv_backward_way`: timed per shape), for the convs clfast.guard
// routes (a bf16 / fp16 conv where the stock backward measured slow); empty tensors where not needed, and the way
// 'timed' chose for this shape (a BackwardWay), or -1 where none was (forced, deterministic, or one way only)
std::tuple<Tensor, Tensor, Tensor, int64_t> stock_conv_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                                                const OptTensor& bias, at::IntArrayRef stride,
                                                                at::IntArrayRef padding, at::IntArrayRef dilation,
                                                                int64_t groups, std::array<bool, 3> needs) {
  const auto [grads, way, timed] = conv_backward_way(dy, x, weight, bias, Geometry{stride, padding, dilation, groups},
                                                     needs[0], needs[1], needs[2]);
  auto or_empty = [&](const Tensor& t) { return t.defined() ? t : at::empty({0}, x.options()); };
  return {or_empty(std::get<0>(grads)), or_empty(std::get<1>(grads)), or_empty(std::get<2>(grads)),
          timed ? int64_t(way) : int64_t(-1)};
}

// How conv backward runs from now on: 0 ATen's way, 1 the GEMM way where it fits, 2 timed per shape (the default,
// keeping the timings made so far); returns the previous setting
int64_t set_gemm_backward(int64_t how) {
  TORCH_CHECK_VALUE(how >= 0 && how <= 2, "clfast_cpu.set_gemm_backward: 0 (conv), 1 (gemm) or 2 (timed), got ", how);
  return gemm_way.exchange(how);
}

// The timed choices so far: per shape a row (ShapeKey's values, then the way that won: a BackwardWay) and the dtype's name
std::tuple<Tensor, std::vector<std::string>> gemm_backward_choices() {
  constexpr int64_t n = std::tuple_size_v<ShapeKey> + 1;
  std::lock_guard<std::mutex> lock(gemm_mutex);
  Tensor t = at::empty({int64_t(gemm_won.size()), n}, at::kLong);
  std::vector<std::string> dtypes;
  int64_t* p = t.data_ptr<int64_t>();
  for (const auto& [k, won] : gemm_won) {
    std::copy(k.begin(), k.end(), p);
    p[n - 1] = int64_t(won);
    p += n;
    dtypes.emplace_back(c10::toString(at::ScalarType(k[14])));
  }
  return {t, dtypes};
}

}  // namespace

namespace clfast_cpu {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layer_bwd(
    const Tensor& dout, const Tensor& x, const OptTensor& weight, const OptTensor& bias, const Tensor& y_saved,
    const Tensor& params, const OptTensor& residual, const Tensor& out, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups, bool training, int64_t act, double act_param, std::array<bool, 6> needs,
    const OptTensor& grad_means) {
  Guards guards;
  check_dtype(weight, x, "weight"); check_dtype(bias, x, "bias"); check_dtype(residual, x, "residual");
  check_dtype(dout, x, "dout");
  const Geometry geom{stride, padding, dilation, groups};
  const bool recompute_y = !y_saved.defined() || y_saved.numel() == 0;  // the 'memory' mode
  const Tensor y = recompute_y ? channels_last(conv(x, weight, bias, geom)) : channels_last(y_saved);
  const int64_t c = y.size(1);
  const auto acc = acc_type(y.scalar_type());
  TORCH_CHECK_VALUE(params.dim() == 2 && params.size(0) == 5 && params.size(1) == c && params.is_contiguous() &&
                    params.scalar_type() == acc, "clfast::layer_bwd (CPU): params must be layer_fwd's contiguous [5, C] ",
                    acc, " tensor");
  const Tensor g = channels_last(dout);
  const bool from_out = out.defined() && out.numel() > 0;
  const Tensor o = from_out ? channels_last(out) : Tensor();
  // the residual only enters the recomputed z of an activation
  const Tensor res = !from_out && act != clfast_cpu::act::kNone && given(residual) ? channels_last(*residual) : Tensor();
  const char* pp = static_cast<const char*>(params.const_data_ptr());
  const size_t row = size_t(c) * params.element_size();
  clfast_cpu::BwdArgs a{pp, pp + row, pp + 2 * row, pp + 3 * row};
  a.act = act; a.act_param = act_param;
  a.mask = from_out ? clfast_cpu::Mask::from_out : clfast_cpu::Mask::recompute;
  a.out = from_out ? &o : nullptr;
  a.res = res.defined() ? &res : nullptr;
  a.training = training;
  if (given(grad_means)) {
    TORCH_CHECK_VALUE(grad_means->dim() == 2 && grad_means->size(0) == 2 && grad_means->size(1) == c &&
                      grad_means->is_contiguous() && grad_means->scalar_type() == acc,
                      "clfast::layer_bwd (CPU): grad_means must be a contiguous [2, C] ", acc, " tensor");
    const char* gm = static_cast<const char*>(grad_means->const_data_ptr());
    a.mean_dz = gm; a.mean_dzx = gm + row;
  }
  const bool nx = needs[0], nw = needs[1], nb = needs[2] && given(bias);
  Tensor dy, dres, dbn_w, dbn_b;
  if (nx || nw || nb) { dy = at::empty_like(y); a.dy = &dy; }
  if (needs[5]) { dres = at::empty_like(y); a.dres = &dres; }
  if (needs[3]) { dbn_w = at::empty({c}, params.options()); a.sum_dzx = dbn_w.data_ptr(); }
  if (needs[4]) { dbn_b = at::empty({c}, params.options()); a.sum_dz = dbn_b.data_ptr(); }
  if (a.dy || a.dres || a.sum_dz || a.sum_dzx) clfast_cpu::backward(g, y, c, a);
  Tensor dx, dw, db;
  if (dy.defined() && !given(weight)) dx = dy;  // no conv: y is x
  else if (dy.defined()) std::tie(dx, dw, db) = conv_backward(dy, x, *weight, bias, geom, nx, nw, nb);
  auto or_empty = [&](const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); };
  return {or_empty(layout_like(dx, x), x), or_empty(given(weight) ? layout_like(dw, *weight) : dw, x), or_empty(db, x), or_empty(dbn_w, params), or_empty(dbn_b, params),
          or_empty(dres, x)};
}

}  // namespace clfast_cpu

namespace {

// Per-channel (mean, biased variance) of a conv output, in the accumulation dtype: the statistics a synchronized
// layer gathers from every rank before normalising (clfast/KERNELS.md)
std::tuple<Tensor, Tensor> batch_stats(const Tensor& y_in) {
  Guards guards;
  TORCH_CHECK_VALUE(y_in.dim() >= 2, "clfast::batch_stats (CPU): expected an N,C,... tensor, got ", y_in.dim(), "D");
  const Tensor y = channels_last(y_in);
  const int64_t c = y.size(1), m = y.numel() / std::max<int64_t>(c, 1);
  TORCH_CHECK_VALUE(m > 0, "clfast::batch_stats (CPU): needs at least one value per channel");
  std::vector<double> mu(c), va(c);
  clfast_cpu::stats(y, c, mu.data(), va.data());
  const auto opts = y.options().dtype(acc_type(y.scalar_type()));
  Tensor mean = at::empty({c}, opts), var = at::empty({c}, opts);
  AT_DISPATCH_FLOATING_TYPES(mean.scalar_type(), "clfast_batch_stats", [&] {
    scalar_t* mp = mean.data_ptr<scalar_t>();
    scalar_t* vp = var.data_ptr<scalar_t>();
    for (int64_t j = 0; j < c; ++j) { mp[j] = scalar_t(mu[j]); vp[j] = scalar_t(va[j]); }
  });
  return {mean, var};
}

// What the kernels' vector loops were compiled for (simd.h): "avx512", "avx2" or "generic", and the floats per vector
std::tuple<std::string, int64_t> simd_info() {
  return {clfast_cpu::simd::kCapability, int64_t(at::vec::Vectorized<float>::size())};
}

}  // namespace

TORCH_LIBRARY(clfast_cpu, m) {
  m.def("simd_info() -> (str capability, int float_lanes)", &simd_info);
  m.def("set_gemm_backward(int how) -> int", &set_gemm_backward);
  m.def("gemm_backward_choices() -> (Tensor rows, str[] dtypes)", &gemm_backward_choices);
  m.def("stock_conv_backward(Tensor dy, Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
        "int[] dilation, int groups, bool[3] needs) -> (Tensor dx, Tensor dweight, Tensor dbias, int way)",
        &stock_conv_backward);
  m.def("conv_backward_as(Tensor dy, Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
        "int groups, int needs, int way) -> (Tensor dx, Tensor dweight, Tensor dbias)", &conv_backward_as);
}

TORCH_LIBRARY_IMPL(clfast, CPU, m) {  // the schemas: clfast/ops.py
  m.impl("layer_fwd", &clfast_cpu::layer_fwd);
  m.impl("layer_out", &clfast_cpu::layer_out);
  m.impl("layer_bwd", &clfast_cpu::layer_bwd);
  m.impl("batch_stats", &batch_stats);
}
