// The backward of bn_act.cpp's normalize, act(x*scale + shift [+ residual]), for batch statistics or given ones (see
// that file for the layout, the vectorization and the accumulation): the templates. Their instances (per dtype,
// activation, mask kind and residual, and the sweeps' choices) are most of the kernels' compile time, so each dtype's
// are made in one of two files that compile side by side: bn_act_backward.cpp (float, double, and `backward`, which
// checks the arguments and dispatches) and bn_act_backward_half.cpp (bfloat16, half).
#pragma once
#include "bn_act_rows.h"  // first: it includes act.h, whose simd.h picks the CPU capability of ATen's vec headers
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <memory>
#include <type_traits>

namespace clfast_cpu::bwd {
using namespace clfast_cpu::rows;

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

// `backward` for x of dtype scalar_t, its arguments checked
template <typename scalar_t>
void backward_typed(const Tensor& dout, const Tensor& x, int64_t c, const BwdArgs& a) {
  const Mask mask = a.act == act::kNone ? Mask::none : a.mask;
  const bool with_res = mask == Mask::recompute && a.res;
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
}

// made in bn_act_backward.cpp (float, double) and bn_act_backward_half.cpp (bfloat16, half), not where included
#define CLFAST_BACKWARD_TYPED(T) void backward_typed<T>(const Tensor&, const Tensor&, int64_t, const BwdArgs&)
extern template CLFAST_BACKWARD_TYPED(float);
extern template CLFAST_BACKWARD_TYPED(double);
extern template CLFAST_BACKWARD_TYPED(c10::BFloat16);
extern template CLFAST_BACKWARD_TYPED(c10::Half);

}  // namespace clfast_cpu::bwd
