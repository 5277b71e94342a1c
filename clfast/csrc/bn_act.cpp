// CPU kernels for the elementwise/statistics half of a fused layer, act(bn(y) [+ residual]) (act: act.h).
// Every tensor is read as a row-major [M, C] matrix: a contiguous [M, C] tensor, or the memory of a channels-last
// N,C,H,W (or N,C,D,H,W) tensor. Loops run over rows in parallel (at::parallel_for) and over C innermost: the
// normalize and backward loops explicitly vectorized (ATen's Vectorized, simd.h; act.h's formulas on vectors), a row's
// last step a partial vector (so every element takes the same formula), the statistics loop by the compiler.
// fp16/bf16 accumulate in fp32 blocks of rows that are summed in fp64; fp64 input
// accumulates in fp64. Per-channel arrays are in opmath (float; double for double tensors).
// The kernels make no tensor-op calls (no dispatcher round trips): conv_bn_act.cpp runs a whole layer around them.
// Each loop is instantiated per dtype, activation, mask kind and residual (the switches sit outside the loops).
#include "act.h"  // first: simd.h picks the CPU capability of ATen's vec headers
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>
#include "bn_act.h"

using at::Tensor;
using clfast_cpu::BwdArgs;
using clfast_cpu::Mask;
using clfast_cpu::is_rows;
namespace act = clfast_cpu::act;
using clfast_cpu::simd::IO;
// a*b + c written as one fused multiply-add: the compiler may contract a*b + c into one or not, differently in each
// template instance, and z must round the same in forward and backward (a derivative read from out = act(z) is
// exactly the recomputed one)
using at::vec::fmadd;

namespace {

constexpr int64_t kBlockRows = 64;      // rows summed in opmath before spilling into the fp64 totals
constexpr int64_t kMaxChunks = 256;     // fixed row partition: results do not depend on the thread count
constexpr int64_t kChunkAlign = 16;     // chunk counts are multiples of this (when rows allow): balanced over 2-16 threads

int64_t num_chunks(int64_t m, int64_t c) {
  // about 64K elements per chunk, at least one chunk
  int64_t per = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(c, 1));
  int64_t n = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, (m + per - 1) / per));
  return std::min(m, (n + kChunkAlign - 1) / kChunkAlign * kChunkAlign);
}

// Rows handed to one parallel_for task of an elementwise pass: about 32K elements
int64_t row_grain(int64_t c) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(c, 1)); }

// Per-chunk column sums of f(row) over a row range, blocked: opmath inside a block, fp64 across blocks.
// `body(r, a, b)` adds row r's contributions to the opmath block accumulators a[C], b[C].
template <typename opmath_t, typename Body>
void chunked_sums(int64_t m, int64_t c, std::vector<double>& s1, std::vector<double>& s2, const Body& body) {
  const int64_t nch = num_chunks(m, c), per = (m + nch - 1) / nch;
  std::vector<double> part1(nch * c, 0.0), part2(nch * c, 0.0);
  // small inputs sum inline: waking the thread pool costs more than the work (the partition stays the same)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(per * c, 1));
  at::parallel_for(0, nch, grain, [&](int64_t cb, int64_t ce) {
    std::vector<opmath_t> a(c), b(c);
    for (int64_t ch = cb; ch < ce; ++ch) {
      double* __restrict__ p1 = part1.data() + ch * c;
      double* __restrict__ p2 = part2.data() + ch * c;
      const int64_t r1 = std::min(m, (ch + 1) * per);
      for (int64_t r0 = ch * per; r0 < r1; r0 += kBlockRows) {
        std::fill(a.begin(), a.end(), opmath_t(0));
        std::fill(b.begin(), b.end(), opmath_t(0));
        const int64_t re = std::min(r1, r0 + kBlockRows);
        for (int64_t r = r0; r < re; ++r) body(r, a.data(), b.data());
        for (int64_t j = 0; j < c; ++j) { p1[j] += double(a[j]); p2[j] += double(b[j]); }
      }
    }
  });
  s1.assign(c, 0.0); s2.assign(c, 0.0);
  for (int64_t ch = 0; ch < nch; ++ch)
    for (int64_t j = 0; j < c; ++j) { s1[j] += part1[ch * c + j]; s2[j] += part2[ch * c + j]; }
}

template <typename scalar_t>
void stats_impl(const scalar_t* xp, int64_t m, int64_t c, double* mean, double* var) {
  using opmath_t = at::opmath_type<scalar_t>;
  // sums are shifted by the first row, so a large mean does not cancel
  std::vector<opmath_t> shift(c);
  for (int64_t j = 0; j < c; ++j) shift[j] = opmath_t(xp[j]);
  const opmath_t* __restrict__ sh = shift.data();
  std::vector<double> s1, s2;
  chunked_sums<opmath_t>(m, c, s1, s2, [&](int64_t r, opmath_t* __restrict__ a, opmath_t* __restrict__ b) {
    const scalar_t* __restrict__ row = xp + r * c;
    for (int64_t j = 0; j < c; ++j) {
      const opmath_t d = opmath_t(row[j]) - sh[j];
      a[j] += d; b[j] += d * d;
    }
  });
  for (int64_t j = 0; j < c; ++j) {
    const double md = s1[j] / double(m);
    mean[j] = double(sh[j]) + md;
    const double v = s2[j] / double(m) - md * md;
    var[j] = v < 0.0 ? 0.0 : v;  // rounding below 0 clamped; a NaN (a NaN or inf in x) kept, as ATen's (std::max drops it)
  }
}

template <typename scalar_t, int A, bool R>
void normalize_impl(const scalar_t* xp, int64_t m, int64_t c, const at::opmath_type<scalar_t>* sc,
                    const at::opmath_type<scalar_t>* sh, const scalar_t* rp, double act_param, scalar_t* op) {
  using opmath_t = at::opmath_type<scalar_t>;
  using io = IO<scalar_t>;
  using Vo = typename io::Vo;
  const Vo pv{opmath_t(act_param)};
  at::parallel_for(0, m, row_grain(c), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      const scalar_t* __restrict__ xr = xp + r * c;
      const scalar_t* __restrict__ rr = R ? rp + r * c : nullptr;
      scalar_t* __restrict__ o = op + r * c;
      for (int64_t j = 0; j < c; j += io::kStep) {
        const int64_t n = c - j;
        typename io::Vs z = io::load(xr + j, n);
        typename io::Vs rv;
        if constexpr (R) rv = io::load(rr + j, n);
        for (int i = 0; i < io::kParts; ++i) {
          z[i] = fmadd(z[i], io::chan(sc, j, i, n), io::chan(sh, j, i, n));
          if constexpr (R) z[i] = z[i] + rv[i];
          z[i] = act::f<A>(z[i], pv);
        }
        io::store(o + j, z, n);
      }
    }
  });
}

// The gradient dz at the vector step starting at element j of a row, `n` elements left in the row (`dzv`), the mask
// kind and activation fixed at compile time
template <typename scalar_t, Mask M, int A, bool R>
struct Rows {
  using opmath_t = at::opmath_type<scalar_t>;
  using io = IO<scalar_t>;
  using Vo = typename io::Vo;
  const scalar_t *g, *x, *res, *out;
  const opmath_t *sc, *sh;
  Vo pv;
  inline typename io::Vs dzv(int64_t j, int64_t n) const {
    typename io::Vs gv = io::load(g + j, n);
    if constexpr (M == Mask::from_out) {
      const typename io::Vs ov = io::load(out + j, n);
      for (int i = 0; i < io::kParts; ++i) gv[i] = act::grad_out<A>(gv[i], ov[i], pv);
    } else if constexpr (M == Mask::recompute) {
      const typename io::Vs xv = io::load(x + j, n);
      typename io::Vs rv;
      if constexpr (R) rv = io::load(res + j, n);
      for (int i = 0; i < io::kParts; ++i) {
        Vo z = fmadd(xv[i], io::chan(sc, j, i, n), io::chan(sh, j, i, n));
        if constexpr (R) z = z + rv[i];
        gv[i] = act::grad<A>(gv[i], z, pv);
      }
    }
    return gv;
  }
};

// Pass 1 (training, or sums asked for): s1 = sum(dz), s2 = sum(dz*(x-mean)). Pass 2 (dy or dres asked for):
// dy = dz*A + (x-mean)*B + D with A = scale and, in training, B = -scale*invstd^2*s2/M, D = -scale*s1/M; dres = dz.
// Given all ranks' means of dz and dz*x_hat (synchronized BN), pass 2 uses them and pass 1 runs only for the sums.
template <typename scalar_t, Mask M, int A, bool R>
void backward_impl(const scalar_t* gp, const scalar_t* xp, const scalar_t* rp, const scalar_t* op, int64_t m,
                   int64_t c, const BwdArgs& a, scalar_t* dyp, scalar_t* drp) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t* __restrict__ mu = static_cast<const opmath_t*>(a.mean);
  const opmath_t* __restrict__ is = static_cast<const opmath_t*>(a.invstd);
  const opmath_t* __restrict__ sc = static_cast<const opmath_t*>(a.scale);
  const opmath_t* __restrict__ sh = static_cast<const opmath_t*>(a.shift);
  using io = IO<scalar_t>;
  using Vo = typename io::Vo;
  const Vo pv{opmath_t(a.act_param)};
  auto row = [&](int64_t r) {
    const int64_t o = r * c;
    return Rows<scalar_t, M, A, R>{gp + o, xp + o, rp ? rp + o : nullptr, op ? op + o : nullptr, sc, sh, pv};
  };
  const bool given_means = a.mean_dz && a.mean_dzx;
  const bool sums = (a.training && dyp && !given_means) || a.sum_dz || a.sum_dzx;
  // With these activations dz costs an exp (erf, tanh) per element: pass 1 keeps it, in opmath, for pass 2 to read
  // rather than compute again (the same values; 0.7-0.8x a bf16 BN+SiLU backward). For float, in dy's own memory.
  constexpr bool kKeepDz = M == Mask::recompute && (A == act::kSilu || A == act::kGelu || A == act::kGeluTanh);
  std::unique_ptr<opmath_t[]> kept_own;
  opmath_t* kept = nullptr;
  if (kKeepDz && sums && (dyp || drp)) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) kept = dyp ? dyp : drp;
    else { kept_own.reset(new opmath_t[m * c]); kept = kept_own.get(); }
  }
  std::vector<double> s1(c, 0.0), s2(c, 0.0);
  if (sums)
    chunked_sums<opmath_t>(m, c, s1, s2, [&](int64_t r, opmath_t* __restrict__ ac, opmath_t* __restrict__ bc) {
      const auto rw = row(r);
      for (int64_t j = 0; j < c; j += io::kStep) {
        const int64_t n = c - j;
        const typename io::Vs g = rw.dzv(j, n), xv = io::load(rw.x + j, n);
        if constexpr (kKeepDz)
          if (kept)
            for (int i = 0; i < io::kParts; ++i) io::chan_store(kept + r * c, j, i, n, g[i]);
        for (int i = 0; i < io::kParts; ++i) {
          io::chan_store(ac, j, i, n, io::chan(ac, j, i, n) + g[i]);
          io::chan_store(bc, j, i, n, fmadd(g[i], xv[i] - io::chan(mu, j, i, n), io::chan(bc, j, i, n)));
        }
      }
    });
  std::vector<opmath_t> B(c, opmath_t(0)), D(c, opmath_t(0));
  for (int64_t j = 0; j < c; ++j) {
    if (a.sum_dz) static_cast<opmath_t*>(a.sum_dz)[j] = opmath_t(s1[j]);
    if (a.sum_dzx) static_cast<opmath_t*>(a.sum_dzx)[j] = opmath_t(s2[j] * double(is[j]));
    if (a.training && given_means) {
      B[j] = opmath_t(-double(sc[j]) * double(is[j]) * double(static_cast<const opmath_t*>(a.mean_dzx)[j]));
      D[j] = opmath_t(-double(sc[j]) * double(static_cast<const opmath_t*>(a.mean_dz)[j]));
    } else if (a.training) {
      B[j] = opmath_t(-double(sc[j]) * double(is[j]) * double(is[j]) * s2[j] / double(m));
      D[j] = opmath_t(-double(sc[j]) * s1[j] / double(m));
    }
  }
  if (!dyp && !drp) return;
  const opmath_t* __restrict__ Bp = B.data();
  const opmath_t* __restrict__ Dp = D.data();
  // dy = dz*scale + (x-mean)*B + D in training, dz*scale alone with given statistics (so an infinite x does not
  // turn dy into inf*0); dres = dz. The choices are template arguments: the loops over C stay branch-free.
  auto sweep = [&](auto has_dy, auto has_dr, auto train) {
    constexpr bool Y = decltype(has_dy)::value, Dr = decltype(has_dr)::value, T = decltype(train)::value;
    at::parallel_for(0, m, row_grain(c), [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const auto rw = row(r);
        scalar_t* __restrict__ o = Y ? dyp + r * c : nullptr;
        scalar_t* __restrict__ d = Dr ? drp + r * c : nullptr;
        for (int64_t j = 0; j < c; j += io::kStep) {
          const int64_t n = c - j;
          typename io::Vs g;  // dz once per element
          if constexpr (kKeepDz) {
            if (kept)
              for (int i = 0; i < io::kParts; ++i) g[i] = io::chan(kept + r * c, j, i, n);
            else g = rw.dzv(j, n);
          } else {
            g = rw.dzv(j, n);
          }
          if constexpr (Dr) io::store(d + j, g, n);
          if constexpr (Y) {
            typename io::Vs v;
            if constexpr (T) {
              const typename io::Vs xv = io::load(rw.x + j, n);
              for (int i = 0; i < io::kParts; ++i)
                v[i] = fmadd(g[i], io::chan(sc, j, i, n),
                             fmadd(xv[i] - io::chan(mu, j, i, n), io::chan(Bp, j, i, n), io::chan(Dp, j, i, n)));
            } else {
              for (int i = 0; i < io::kParts; ++i) v[i] = g[i] * io::chan(sc, j, i, n);
            }
            io::store(o + j, v, n);
          }
        }
      }
    });
  };
  using std::true_type, std::false_type;
  if (dyp && drp) {
    if (a.training) sweep(true_type{}, true_type{}, true_type{}); else sweep(true_type{}, true_type{}, false_type{});
  } else if (dyp) {
    if (a.training) sweep(true_type{}, false_type{}, true_type{}); else sweep(true_type{}, false_type{}, false_type{});
  } else {
    sweep(false_type{}, true_type{}, false_type{});
  }
}

void check_rows(const Tensor& t, const Tensor& like, int64_t c, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "clfast_cpu: ", name, " must be on the CPU");
  TORCH_CHECK(is_rows(t) && t.numel() == like.numel() && t.size(1) == c &&
              t.scalar_type() == like.scalar_type(), "clfast_cpu: ", name, " must be a row-major [M, C] matrix "
              "(contiguous 2D or channels-last) of x's size and dtype");
}

}  // namespace

namespace clfast_cpu {

bool is_rows(const Tensor& t) {
  switch (t.dim()) {
    case 2: return t.is_contiguous();
    case 4: return t.is_contiguous(at::MemoryFormat::ChannelsLast);
    case 5: return t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
    default: return false;
  }
}

void stats(const Tensor& x, int64_t c, double* mean, double* var) {
  check_rows(x, x, c, "x");
  const int64_t m = x.numel() / c;
  TORCH_CHECK(m > 0, "clfast_cpu.stats needs at least one value per channel");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_stats", [&] {
    stats_impl(x.const_data_ptr<scalar_t>(), m, c, mean, var);
  });
}

void normalize(const Tensor& x, int64_t c, const void* scale, const void* shift, const Tensor* res, int64_t act_code,
               double act_param, Tensor& out) {
  check_rows(x, x, c, "x");
  check_rows(out, x, c, "out");
  if (res) check_rows(*res, x, c, "res");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_normalize", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = res ? res->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const auto* sc = static_cast<const opmath_t*>(scale);
    const auto* sh = static_cast<const opmath_t*>(shift);
    const int64_t m = x.numel() / c;
    act::dispatch(act_code, [&](auto a) {
      constexpr int A = decltype(a)::value;
      if (rp) normalize_impl<scalar_t, A, true>(xp, m, c, sc, sh, rp, act_param, op);
      else normalize_impl<scalar_t, A, false>(xp, m, c, sc, sh, rp, act_param, op);
    });
  });
}

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
  const Mask mask = a.act == act::kNone ? Mask::none : a.mask;
  const bool with_res = mask == Mask::recompute && a.res;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_backward", [&] {
    const scalar_t* gp = dout.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = with_res ? a.res->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* op = mask == Mask::from_out ? a.out->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dyp = a.dy ? a.dy->data_ptr<scalar_t>() : nullptr;
    scalar_t* drp = a.dres ? a.dres->data_ptr<scalar_t>() : nullptr;
    const int64_t m = x.numel() / c;
    if (mask == Mask::none) {
      backward_impl<scalar_t, Mask::none, act::kNone, false>(gp, xp, rp, op, m, c, a, dyp, drp);
      return;
    }
    act::dispatch(a.act, [&](auto ac) {
      constexpr int A = decltype(ac)::value;
      if (mask == Mask::from_out) {
        if constexpr (act::has_grad_from_out<A>())
          backward_impl<scalar_t, Mask::from_out, A, false>(gp, xp, rp, op, m, c, a, dyp, drp);
      } else if (with_res) backward_impl<scalar_t, Mask::recompute, A, true>(gp, xp, rp, op, m, c, a, dyp, drp);
      else backward_impl<scalar_t, Mask::recompute, A, false>(gp, xp, rp, op, m, c, a, dyp, drp);
    });
  });
}

}  // namespace clfast_cpu
