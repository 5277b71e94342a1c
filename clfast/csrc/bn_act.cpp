// CPU kernels for the elementwise/statistics half of a fused layer, act(bn(y) [+ residual]) (act: act.h).
// Every tensor is read as a row-major [M, C] matrix: a contiguous [M, C] tensor, or the memory of a channels-last
// N,C,H,W (or N,C,D,H,W) tensor. Loops run over rows in parallel (at::parallel_for) and over C innermost: the
// normalize and backward loops explicitly vectorized (ATen's Vectorized, simd.h; act.h's formulas on vectors), a row's
// last step a partial vector (so every element takes the same formula), the statistics loop by the compiler.
// fp16/bf16 accumulate in fp32 blocks of rows that are summed in fp64; fp64 input
// accumulates in fp64. Per-channel arrays are in opmath (float; double for double tensors).
// The kernels make no tensor-op calls (no dispatcher round trips): conv_bn_act.cpp runs a whole layer around them.
// Each loop is instantiated per dtype, activation, mask kind and residual (the switches sit outside the loops).
// This file: the statistics and normalize; the backward is bn_act_backward.h's, their shared helpers bn_act_rows.h's.
#include "bn_act_rows.h"  // first: it includes act.h, whose simd.h picks the CPU capability of ATen's vec headers
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

using at::Tensor;
namespace act = clfast_cpu::act;
using namespace clfast_cpu::rows;

namespace {

// Per channel, the shift the statistics' sums are taken from: the median of 5 rows spread over x (the first, the last
// and three between), or 0 where that median is not finite. The variance is s2/m - (s1/m)^2 of the shifted values,
// whose rounding grows with (shift - mean)^2: a shift near the mean keeps a large mean from cancelling. The first row
// alone was the shift before: an outlier there (a value 100 standard deviations off) cost the fp32 statistics and
// gradients 1e-4 of fp64 against stock's 1e-7, and an infinity there made the mean NaN where it is +-inf (stock's, and
// the limit). A median of 5 is no outlier while 3 of its rows are none; it depends on x alone, not on the threads. Min
// and max over whole rows, no sort: a median of 64 rows sorted per channel made the BN 5x slower at [8, 2048, 4, 4]
// (128 rows), where the sums themselves are short.
template <typename opmath_t> inline opmath_t med3(opmath_t x, opmath_t y, opmath_t z) {
  return std::max(std::min(x, y), std::min(std::max(x, y), z));
}

template <typename scalar_t, typename opmath_t>
std::vector<opmath_t> stats_shift(const scalar_t* xp, int64_t m, int64_t c) {
  const scalar_t* __restrict__ r[5];
  for (int64_t i = 0; i < 5; ++i) r[i] = xp + (i * (m - 1) / 4) * c;   // (rows repeat where m < 5)
  std::vector<opmath_t> shift(c);
  for (int64_t j = 0; j < c; ++j) {
    const opmath_t a = opmath_t(r[0][j]), b = opmath_t(r[1][j]), p = opmath_t(r[2][j]), d = opmath_t(r[3][j]);
    // of the sorted pairs (a, b), (p, d): the larger minimum and the smaller maximum are the 2nd and 3rd of the four
    const opmath_t v = med3(opmath_t(r[4][j]), std::max(std::min(a, b), std::min(p, d)), std::min(std::max(a, b), std::max(p, d)));
    shift[j] = v - v == opmath_t(0) ? v : opmath_t(0);   // finite (inf - inf and NaN - NaN are NaN); an element of x
  }
  return shift;
}

template <typename scalar_t>
void stats_impl(const scalar_t* xp, int64_t m, int64_t c, double* mean, double* var) {
  using opmath_t = at::opmath_type<scalar_t>;
  // sums are shifted by a value near each channel's mean (`stats_shift`), so a large mean does not cancel
  const std::vector<opmath_t> shift = stats_shift<scalar_t, opmath_t>(xp, m, c);
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

}  // namespace clfast_cpu
