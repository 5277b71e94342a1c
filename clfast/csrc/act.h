// The activations of a fused layer: the ONE place in C++ where their formulas live. Codes are those of
// `clfast.act.ACTS` (clfast/act.py). Every function is a template on the code, so a kernel picks the activation once,
// outside its loops (`dispatch`), and the loops over C stay branch-free.
// Each formula is written once, as a template on `V`: ATen's `Vectorized<T>` of the opmath type `T` (float; double
// for double tensors), every element of a row included (its last step is a partial vector). The operations are
// simd.h's: exp/erf/tanh (ATen's vectorized ones, as stock PyTorch's vectorized silu/gelu kernels), neg, min/max, and
// the selects `sel(cond, a, b)` (cond ? a : b) and `both(c, d)` (c && d) that the piecewise activations are written
// with; `k<V>(x)` is a constant.
// `p` is the activation's parameter (leaky_relu's slope), of type V too.
// Backward conventions are PyTorch's: the `grad` functions compute what its backward kernels compute from `g`
// (including which side of a boundary gets the gradient and what a NaN input does).
#pragma once
#include "simd.h"  // first: it picks the CPU capability of ATen's vec headers
#include <c10/util/Exception.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace clfast_cpu {
namespace act {

enum Code : int { kNone = 0, kRelu = 1, kRelu6 = 2, kLeaky = 3, kSilu = 4, kHardswish = 5, kGelu = 6, kGeluTanh = 7 };

constexpr double kSqrt1_2 = 0.70710678118654752440;                 // 1/sqrt(2)            (gelu's erf argument)
constexpr double kErfPdf = 0.39894228040143267794;                  // 1/sqrt(2*pi)         (gelu's pdf)
constexpr double kTanhBeta = 0.79788456080286535588;                // sqrt(2/pi)           (gelu_tanh)
constexpr double kTanhKappa = 0.044715;
// |z| from which gelu_tanh' is 1 (or 0) to fp64's precision: tanh's argument is past 35000 there, 1 - tanh^2 = 0
constexpr double kTanhFlat = 100.0;

// `formula` but at z = +-inf, where the smooth activations' formulas meet inf * 0 (NaN): there the mathematical limits
// `at_pos` / `at_neg` (act(+inf) = +inf, act(-inf) = 0, act'(+inf) = 1, act'(-inf) = 0). Stock PyTorch gives NaN at
// one or both ends, differently in its scalar and vectorized paths (gelu(+inf): NaN on a [1,C,1,1] tensor, +inf on a
// [2,C,2,2] one), so it is no oracle there.
template <typename V> inline V limits(V z, V formula, V at_pos, V at_neg) {
  using namespace simd;
  return sel(z == k<V>(INFINITY), at_pos, sel(z == k<V>(-INFINITY), at_neg, formula));
}

// Forward: act(z)
template <int A, typename V> inline V f(V z, V p) {
  using namespace simd;
  if constexpr (A == kNone) return z;
  else if constexpr (A == kRelu) return sel(z < k<V>(0), k<V>(0), z);              // NaN passes, as torch.relu
  else if constexpr (A == kRelu6) return sel(z < k<V>(0), k<V>(0), sel(z > k<V>(6), k<V>(6), z));  // hardtanh(0, 6)
  else if constexpr (A == kLeaky) return sel(z > k<V>(0), z, z * p);
  else if constexpr (A == kSilu) return limits(z, z / (k<V>(1) + simd::exp(neg(z))), z, k<V>(0));
  else if constexpr (A == kHardswish)
    // z itself from 3 up (the formula's z * 6 overflows to inf above FLT_MAX / 6), 0 from -3 down (-inf * 0: NaN)
    return sel(z >= k<V>(3), z,
               sel(z <= k<V>(-3), k<V>(0), z * simd::min(simd::max(z + k<V>(3), k<V>(0)), k<V>(6)) / k<V>(6)));
  else if constexpr (A == kGelu) return limits(z, z * k<V>(0.5) * (k<V>(1) + simd::erf(z * k<V>(kSqrt1_2))), z, k<V>(0));
  else if constexpr (A == kGeluTanh) {
    const V inner = k<V>(kTanhBeta) * (z + k<V>(kTanhKappa) * z * z * z);
    return limits(z, k<V>(0.5) * z * (k<V>(1) + simd::tanh(inner)), z, k<V>(0));
  } else static_assert(A < 0, "unknown activation code");
}

// Derivative act'(z)
template <int A, typename V> inline V df(V z, V p) {
  using namespace simd;
  if constexpr (A == kNone) return k<V>(1);
  else if constexpr (A == kRelu) return sel(z > k<V>(0), k<V>(1), k<V>(0));
  else if constexpr (A == kRelu6) return sel(both(z > k<V>(0), z < k<V>(6)), k<V>(1), k<V>(0));
  else if constexpr (A == kLeaky) return sel(z > k<V>(0), k<V>(1), p);
  else if constexpr (A == kSilu) {
    const V s = k<V>(1) / (k<V>(1) + simd::exp(neg(z)));
    return limits(z, s * (k<V>(1) + z * (k<V>(1) - s)), k<V>(1), k<V>(0));
  } else if constexpr (A == kHardswish) {
    // 0 at z == -3 and 1 at z == 3 exactly, as stock's hardswish_backward
    return sel(z <= k<V>(-3), k<V>(0), sel(z >= k<V>(3), k<V>(1), z / k<V>(3) + k<V>(0.5)));
  } else if constexpr (A == kGelu) {
    const V cdf = k<V>(0.5) * (k<V>(1) + simd::erf(z * k<V>(kSqrt1_2)));
    const V pdf = k<V>(kErfPdf) * simd::exp(k<V>(-0.5) * z * z);
    return limits(z, cdf + z * pdf, k<V>(1), k<V>(0));
  } else if constexpr (A == kGeluTanh) {
    const V z2 = z * z;
    const V t = simd::tanh(k<V>(kTanhBeta) * (z + k<V>(kTanhKappa) * z2 * z));
    const V formula = k<V>(0.5) * (k<V>(1) + t) +
                      k<V>(0.5) * z * (k<V>(1) - t * t) * k<V>(kTanhBeta) * (k<V>(1) + k<V>(3 * kTanhKappa) * z2);
    // 1 and 0 from |z| = kTanhFlat on (1 - t*t is 0 there; far out z2 overflows and 0 * inf would be NaN: fp32 from
    // |z| = 1.8e19)
    return sel(z >= k<V>(kTanhFlat), k<V>(1), sel(z <= k<V>(-kTanhFlat), k<V>(0), formula));
  } else static_assert(A < 0, "unknown activation code");
}

// The gradient dz = g * act'(z), as PyTorch's (vectorized) CPU backward kernels compute it: the piecewise
// activations select, so a zero derivative gives 0 even for an infinite g, and a NaN z gives what stock gives:
// relu g (threshold_backward), relu6 0 (hardtanh_backward), leaky_relu g*slope, hardswish NaN.
template <int A, typename V> inline V grad(V g, V z, V p) {
  using namespace simd;
  if constexpr (A == kNone) return g;
  else if constexpr (A == kRelu) return sel(z <= k<V>(0), k<V>(0), g);
  else if constexpr (A == kRelu6) return sel(both(z > k<V>(0), z < k<V>(6)), g, k<V>(0));
  else if constexpr (A == kLeaky) return sel(z > k<V>(0), g, g * p);
  else if constexpr (A == kHardswish)
    return sel(z <= k<V>(-3), k<V>(0), sel(z >= k<V>(3), g, g * (z / k<V>(3) + k<V>(0.5))));
  else return g * df<A>(z, p);
}

// Whether act'(z) can be read exactly from out = act(z) (clfast.act's `grad_from_out`): for these the sign (and
// the 0..6 range) of out is that of z. leaky_relu only with a slope >= 0 (checked at run time: `grad_from_out`).
template <int A> constexpr bool has_grad_from_out() { return A == kNone || A == kRelu || A == kRelu6 || A == kLeaky; }
inline bool grad_from_out(int64_t code, double p) {
  return code == kNone || code == kRelu || code == kRelu6 || (code == kLeaky && p >= 0);
}

// act'(z) and dz read from out = act(z), for the activations where that is exact
// For these activations act'(act(z)) == act'(z) (that is what `grad_from_out` means), so the derivative read from
// out is the derivative's own formula evaluated at out
template <int A, typename V> inline V df_out(V out, V p) {
  static_assert(has_grad_from_out<A>(), "this activation's derivative cannot be read from its output");
  return df<A>(out, p);
}
template <int A, typename V> inline V grad_out(V g, V out, V p) {
  static_assert(has_grad_from_out<A>(), "this activation's derivative cannot be read from its output");
  return grad<A>(g, out, p);
}

// Calls fn(std::integral_constant<int, A>{}) for the activation `code`: the one switch, outside the loops
template <typename F> inline void dispatch(int64_t code, F&& fn) {
  switch (code) {
    case kNone: fn(std::integral_constant<int, kNone>{}); break;
    case kRelu: fn(std::integral_constant<int, kRelu>{}); break;
    case kRelu6: fn(std::integral_constant<int, kRelu6>{}); break;
    case kLeaky: fn(std::integral_constant<int, kLeaky>{}); break;
    case kSilu: fn(std::integral_constant<int, kSilu>{}); break;
    case kHardswish: fn(std::integral_constant<int, kHardswish>{}); break;
    case kGelu: fn(std::integral_constant<int, kGelu>{}); break;
    case kGeluTanh: fn(std::integral_constant<int, kGeluTanh>{}); break;
    default: TORCH_CHECK_VALUE(false, "clfast_cpu: unknown activation code ", code, " (see clfast.act.ACTS)");
  }
}

}  // namespace act
}  // namespace clfast_cpu
