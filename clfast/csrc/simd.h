// SIMD building blocks for the kernels: ATen's at::vec::Vectorized and the math the formulas of act.h are written
// with. Must be included before any other ATen vec header.
//
// Inside ATen the vec headers are compiled once per CPU capability (CPU_CAPABILITY_AVX2 / _AVX512 set per file by its
// build); in this extension nothing sets them, and without them Vectorized is the generic array-of-scalars version
// (its exp/erf/tanh are scalar std:: calls). So the capability follows what the compiler targets, which is clfast's
// CPU level (clfast/machine.py: the build adds exactly that level's -m flags):
//   avx512: AVX-512 F, BW, DQ and VL (what ATen's AVX-512 vectors use), with AVX2, FMA and F16C: 16 floats, 8 doubles
//   avx2:   AVX2, FMA and F16C: 8 floats, 4 doubles
//   generic (x86 baseline, or not x86): the generic version, still correct.
// exp/tanh come from Sleef, exported by libtorch_cpu for both widths (Sleef_expf8_u10, Sleef_expf16_u10, ...); erf is
// a polynomial. libtorch_cpu exports no at::vec symbol, so these inline functions cannot be resolved to ATen's own
// copies, which are compiled for another capability.
#pragma once
#if defined(VECTOR_WIDTH) && !defined(CLFAST_SIMD_CAPABILITY_SET)
#error "clfast simd.h must be included before ATen's vec headers (it picks their CPU capability)"
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CPU_CAPABILITY_AVX2) && \
    !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#else
#define CPU_CAPABILITY_AVX2
#endif
#endif
#define CLFAST_SIMD_CAPABILITY_SET
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace clfast_cpu {
namespace simd {
using at::vec::Vectorized;

#if defined(CPU_CAPABILITY_AVX512)
static_assert(Vectorized<float>::size() == 16 && Vectorized<double>::size() == 8, "AVX-512: 16 floats, 8 doubles");
constexpr const char* kCapability = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
static_assert(Vectorized<float>::size() == 8 && Vectorized<double>::size() == 4, "AVX2: 8 floats, 4 doubles");
constexpr const char* kCapability = "avx2";
#else
constexpr const char* kCapability = "generic";
#endif

// The element type of V (V itself for a scalar)
template <typename V> struct elem { using type = V; };
template <typename T> struct elem<Vectorized<T>> { using type = T; };
template <typename V> using elem_t = typename elem<V>::type;

// A constant of type V (a scalar, or broadcast to every lane)
template <typename V> inline V k(double x) { return V(elem_t<V>(x)); }

// Math on vectors: ATen's vectorized versions (the ones stock PyTorch's CPU kernels use). Every element takes them: a
// row's last step is a partial vector (IO below), so there is no scalar version to keep in step.
template <typename T> inline Vectorized<T> exp(const Vectorized<T>& x) { return x.exp(); }
template <typename T> inline Vectorized<T> erf(const Vectorized<T>& x) { return x.erf(); }
template <typename T> inline Vectorized<T> tanh(const Vectorized<T>& x) { return x.tanh(); }
template <typename T> inline Vectorized<T> neg(const Vectorized<T>& x) { return x.neg(); }
// min/max propagate NaN (at::vec's); the formulas use them as max(NaN-able, constant)
template <typename T> inline Vectorized<T> max(const Vectorized<T>& a, const Vectorized<T>& b) {
  return at::vec::maximum(a, b);
}
template <typename T> inline Vectorized<T> min(const Vectorized<T>& a, const Vectorized<T>& b) {
  return at::vec::minimum(a, b);
}

// Selects and their conditions: a comparison is a lane mask (Vectorized's operators <, >, <=, >= are ordered: false
// on NaN). sel(c, a, b) = c ? a : b; both(c, d) = c && d.
template <typename T> inline Vectorized<T> sel(const Vectorized<T>& c, const Vectorized<T>& a, const Vectorized<T>& b) {
  return Vectorized<T>::blendv(b, a, c);
}
template <typename T> inline Vectorized<T> both(const Vectorized<T>& c, const Vectorized<T>& d) { return c & d; }

// Loads and stores of a tensor's elements as opmath vectors. A step covers Vectorized<scalar_t>::size() elements:
// one opmath vector for float and double, two float vectors for bf16/fp16 (loaded and rounded as stock's kernels do:
// convert_to_float / convert_from_float).
template <typename scalar_t> struct IO {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vo = Vectorized<opmath_t>;
  static constexpr int64_t kW = Vo::size();                          // opmath lanes
  static constexpr int64_t kStep = Vectorized<scalar_t>::size();     // elements per step
  static constexpr int kParts = int(kStep / kW);
  static_assert(kParts * kW == kStep && (kParts == 1 || kParts == 2), "unexpected vector widths");
  using Vs = std::array<Vo, kParts>;
  static inline Vs load(const scalar_t* p) {
    if constexpr (kParts == 1) return {Vo::loadu(p)};
    else {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
      return {a, b};
    }
  }
  static inline void store(scalar_t* p, const Vs& v) {
    if constexpr (kParts == 1) v[0].store(p);
    else at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
  }
  // The same for a step of which only the first `n` elements exist (the row's last, when C is not a multiple of
  // kStep): the other lanes load as 0 and are not stored. Every element then takes the vector formula: a scalar tail
  // would cost a bf16 row of 144 channels (4 steps of 32 and 16 left) twice the time with exp-based activations.
  static inline Vs load(const scalar_t* p, int64_t n) {
    if (n >= kStep) return load(p);
    if constexpr (kParts == 1) return {Vo::loadu(p, n)};
    else {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p, n));
      return {a, b};
    }
  }
  static inline void store(scalar_t* p, const Vs& v, int64_t n) {
    if (n >= kStep) return store(p, v);
    if constexpr (kParts == 1) v[0].store(p, n);
    else at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p, n);
  }
  // Part `i` of the step at `j` of a per-channel opmath array with `n` elements left from j
  static inline Vo chan(const opmath_t* p, int64_t j, int i, int64_t n) {
    const int64_t left = n - i * kW;
    if (left >= kW) return Vo::loadu(p + j + i * kW);
    return left > 0 ? Vo::loadu(p + j + i * kW, left) : Vo(opmath_t(0));
  }
  static inline void chan_store(opmath_t* p, int64_t j, int i, int64_t n, const Vo& v) {
    const int64_t left = n - i * kW;
    if (left >= kW) v.store(p + j + i * kW);
    else if (left > 0) v.store(p + j + i * kW, left);
  }
};

}  // namespace simd
}  // namespace clfast_cpu
