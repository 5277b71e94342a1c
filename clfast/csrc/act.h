// The activations of a fused layer: the ONE place in C++ where their formulas live. Codes are those of
// `clfast.act.ACTS` (clfast/act.py). Every function is a template on the code, so a kernel picks the activation once,
// outside its loops (`dispatch`), and the loops over C stay branch-free and vectorizable (the piecewise activations
// are selects; silu and the gelus call exp/erf/tanh, which the compiler does not vectorize without -ffast-math).
// `T` is the opmath type (float; double for double tensors); `p` the activation's parameter (leaky_relu's slope).
// Backward conventions are PyTorch's: the `grad` functions compute what its backward kernels compute from `g`
// (including which side of a boundary gets the gradient and what a NaN input does).
#pragma once
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

// Forward: act(z)
template <int A, typename T> inline T f(T z, T p) {
  if constexpr (A == kNone) return z;
  else if constexpr (A == kRelu) return z < T(0) ? T(0) : z;                      // NaN passes, as torch.relu
  else if constexpr (A == kRelu6) return z < T(0) ? T(0) : (z > T(6) ? T(6) : z);  // hardtanh(0, 6)
  else if constexpr (A == kLeaky) return z > T(0) ? z : z * p;
  else if constexpr (A == kSilu) return z / (T(1) + std::exp(-z));
  else if constexpr (A == kHardswish) return z * std::min(std::max(z + T(3), T(0)), T(6)) / T(6);
  else if constexpr (A == kGelu) return z * T(0.5) * (T(1) + std::erf(z * T(kSqrt1_2)));
  else if constexpr (A == kGeluTanh) {
    const T inner = T(kTanhBeta) * (z + T(kTanhKappa) * z * z * z);
    return T(0.5) * z * (T(1) + std::tanh(inner));
  } else static_assert(A < 0, "unknown activation code");
}

// Derivative act'(z)
template <int A, typename T> inline T df(T z, T p) {
  if constexpr (A == kNone) return T(1);
  else if constexpr (A == kRelu) return z > T(0) ? T(1) : T(0);
  else if constexpr (A == kRelu6) return (z > T(0) && z < T(6)) ? T(1) : T(0);
  else if constexpr (A == kLeaky) return z > T(0) ? T(1) : p;
  else if constexpr (A == kSilu) {
    const T s = T(1) / (T(1) + std::exp(-z));
    return s * (T(1) + z * (T(1) - s));
  } else if constexpr (A == kHardswish) {
    // 0 at z == -3 and 1 at z == 3 exactly, as stock's hardswish_backward
    return z <= T(-3) ? T(0) : (z >= T(3) ? T(1) : z / T(3) + T(0.5));
  } else if constexpr (A == kGelu) {
    const T cdf = T(0.5) * (T(1) + std::erf(z * T(kSqrt1_2)));
    const T pdf = T(kErfPdf) * std::exp(T(-0.5) * z * z);
    return cdf + z * pdf;
  } else if constexpr (A == kGeluTanh) {
    const T z2 = z * z;
    const T t = std::tanh(T(kTanhBeta) * (z + T(kTanhKappa) * z2 * z));
    return T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * T(kTanhBeta) * (T(1) + T(3 * kTanhKappa) * z2);
  } else static_assert(A < 0, "unknown activation code");
}

// The gradient dz = g * act'(z), as PyTorch's (vectorized) CPU backward kernels compute it: the piecewise
// activations select, so a zero derivative gives 0 even for an infinite g, and a NaN z gives what stock gives:
// relu g (threshold_backward), relu6 0 (hardtanh_backward), leaky_relu g*slope, hardswish NaN.
template <int A, typename T> inline T grad(T g, T z, T p) {
  if constexpr (A == kNone) return g;
  else if constexpr (A == kRelu) return z <= T(0) ? T(0) : g;
  else if constexpr (A == kRelu6) return (z > T(0) && z < T(6)) ? g : T(0);
  else if constexpr (A == kLeaky) return z > T(0) ? g : g * p;
  else if constexpr (A == kHardswish) return z <= T(-3) ? T(0) : (z >= T(3) ? g : g * (z / T(3) + T(0.5)));
  else return g * df<A>(z, p);
}

// Whether act'(z) can be read exactly from out = act(z) (clfast.act's `grad_from_out`): for these the sign (and
// the 0..6 range) of out is that of z. leaky_relu only with a slope >= 0 (checked at run time: `grad_from_out`).
template <int A> constexpr bool has_grad_from_out() { return A == kNone || A == kRelu || A == kRelu6 || A == kLeaky; }
inline bool grad_from_out(int64_t code, double p) {
  return code == kNone || code == kRelu || code == kRelu6 || (code == kLeaky && p >= 0);
}

// act'(z) and dz read from out = act(z), for the activations where that is exact
template <int A, typename T> inline T df_out(T out, T p) {
  static_assert(has_grad_from_out<A>(), "this activation's derivative cannot be read from its output");
  if constexpr (A == kNone) return T(1);
  else if constexpr (A == kRelu) return out > T(0) ? T(1) : T(0);
  else if constexpr (A == kRelu6) return (out > T(0) && out < T(6)) ? T(1) : T(0);
  else return out > T(0) ? T(1) : p;                                               // leaky, slope >= 0
}
template <int A, typename T> inline T grad_out(T g, T out, T p) {
  static_assert(has_grad_from_out<A>(), "this activation's derivative cannot be read from its output");
  if constexpr (A == kNone) return g;
  else if constexpr (A == kRelu) return out <= T(0) ? T(0) : g;   // PyTorch's relu backward reads its result too
  else if constexpr (A == kRelu6) return (out > T(0) && out < T(6)) ? g : T(0);
  else return out > T(0) ? g : g * p;
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
