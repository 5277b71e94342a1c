// CPU kernels for the elementwise/statistics half of fused conv-BN(-ReLU)(+add).
// Every tensor is a row-major [M, C] matrix: the channels-last view of an N,C,H,W (or N,C,D,H,W) tensor.
// Loops run over rows in parallel (at::parallel_for) and over C innermost, where the compiler vectorizes them.
// fp16/bf16 accumulate in fp32 blocks of rows that are summed in fp64; fp64 input accumulates in fp64.
// Registered as torch ops (namespace `clfast_cpu`) in conv_bn_act.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>
#include "bn_act.h"

using at::Tensor;

namespace {

constexpr int64_t kBlockRows = 64;      // rows summed in opmath before spilling into the fp64 totals
constexpr int64_t kMaxChunks = 256;     // fixed row partition: results do not depend on the thread count

int64_t num_chunks(int64_t m, int64_t c) {
  // about 64K elements per chunk, at least one chunk
  int64_t per = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(c, 1));
  return std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, (m + per - 1) / per));
}

void check_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "clfast_cpu: ", name, " must be a contiguous [M, C] matrix");
  TORCH_CHECK(t.device().is_cpu(), "clfast_cpu: ", name, " must be on the CPU");
}

void check_vec(const Tensor& t, int64_t c, at::ScalarType acc, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == c && t.is_contiguous() && t.scalar_type() == acc,
              "clfast_cpu: ", name, " must be a contiguous [C] vector of the accumulation dtype");
}

at::ScalarType acc_type(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

// Per-chunk column sums of f(row) over a row range, blocked: opmath inside a block, fp64 across blocks.
// `body(r, a, b)` adds row r's contributions to the opmath block accumulators a[C], b[C].
template <typename opmath_t, typename Body>
void chunked_sums(int64_t m, int64_t c, std::vector<double>& s1, std::vector<double>& s2, const Body& body) {
  const int64_t nch = num_chunks(m, c), per = (m + nch - 1) / nch;
  std::vector<double> part1(nch * c, 0.0), part2(nch * c, 0.0);
  at::parallel_for(0, nch, 1, [&](int64_t cb, int64_t ce) {
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

}  // namespace

namespace clfast_cpu {

// Per-channel mean and biased variance. Sums are shifted by the first row, so a large mean does not cancel.
std::tuple<Tensor, Tensor> stats(const Tensor& x) {
  check_rows(x, "x");
  const int64_t m = x.size(0), c = x.size(1);
  TORCH_CHECK(m > 0, "clfast_cpu.stats needs at least one value per channel");
  const auto acc = acc_type(x.scalar_type());
  Tensor mean = at::empty({c}, x.options().dtype(acc)), var = at::empty({c}, x.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_stats", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
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
    opmath_t* mp = mean.data_ptr<opmath_t>();
    opmath_t* vp = var.data_ptr<opmath_t>();
    for (int64_t j = 0; j < c; ++j) {
      const double md = s1[j] / double(m);
      mp[j] = opmath_t(double(sh[j]) + md);
      vp[j] = opmath_t(std::max(0.0, s2[j] / double(m) - md * md));
    }
  });
  return {mean, var};
}

// out = act(x*scale + shift [+ res])
Tensor fwd(const Tensor& x, const Tensor& scale, const Tensor& shift, const std::optional<Tensor>& res, bool relu) {
  check_rows(x, "x");
  const int64_t m = x.size(0), c = x.size(1);
  const auto acc = acc_type(x.scalar_type());
  check_vec(scale, c, acc, "scale"); check_vec(shift, c, acc, "shift");
  const bool has_res = res.has_value() && res->defined();
  if (has_res) {
    check_rows(*res, "res");
    TORCH_CHECK(res->sizes() == x.sizes() && res->scalar_type() == x.scalar_type(), "clfast_cpu: res must match x");
  }
  Tensor out = at::empty({m, c}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_fwd", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = has_res ? res->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const opmath_t* __restrict__ sc = scale.const_data_ptr<opmath_t>();
    const opmath_t* __restrict__ sh = shift.const_data_ptr<opmath_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(c, 1));
    at::parallel_for(0, m, grain, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const scalar_t* __restrict__ xr = xp + r * c;
        scalar_t* __restrict__ o = op + r * c;
        if (has_res) {
          const scalar_t* __restrict__ rr = rp + r * c;
          if (relu) for (int64_t j = 0; j < c; ++j) {
            const opmath_t z = opmath_t(xr[j]) * sc[j] + sh[j] + opmath_t(rr[j]);
            o[j] = scalar_t(z > opmath_t(0) ? z : opmath_t(0));
          } else for (int64_t j = 0; j < c; ++j) o[j] = scalar_t(opmath_t(xr[j]) * sc[j] + sh[j] + opmath_t(rr[j]));
        } else {
          if (relu) for (int64_t j = 0; j < c; ++j) {
            const opmath_t z = opmath_t(xr[j]) * sc[j] + sh[j];
            o[j] = scalar_t(z > opmath_t(0) ? z : opmath_t(0));
          } else for (int64_t j = 0; j < c; ++j) o[j] = scalar_t(opmath_t(xr[j]) * sc[j] + sh[j]);
        }
      }
    });
  });
  return out;
}

// Backward. dz = dout * [z > 0] (z recomputed exactly as in fwd). Pass 1: per-channel sum(dz), sum(dz*x_hat).
// Pass 2: dy = scale*(dz - sum_dz/M - x_hat*sum_dzx/M) (training) or dz*scale (running stats); dres = dz.
std::tuple<Tensor, Tensor, Tensor, Tensor> bwd(const Tensor& dout, const Tensor& x, const Tensor& mean,
                                               const Tensor& invstd, const Tensor& scale, const Tensor& shift,
                                               const std::optional<Tensor>& res, bool relu, bool training,
                                               bool want_dres) {
  check_rows(x, "x"); check_rows(dout, "dout");
  const int64_t m = x.size(0), c = x.size(1);
  TORCH_CHECK(dout.sizes() == x.sizes() && dout.scalar_type() == x.scalar_type(), "clfast_cpu: dout must match x");
  const auto acc = acc_type(x.scalar_type());
  check_vec(mean, c, acc, "mean"); check_vec(invstd, c, acc, "invstd");
  check_vec(scale, c, acc, "scale"); check_vec(shift, c, acc, "shift");
  const bool has_res = res.has_value() && res->defined();
  if (has_res) {
    check_rows(*res, "res");
    TORCH_CHECK(res->sizes() == x.sizes() && res->scalar_type() == x.scalar_type(), "clfast_cpu: res must match x");
  }
  TORCH_CHECK(!want_dres || has_res, "clfast_cpu: want_dres needs res");
  Tensor dy = at::empty({m, c}, x.options());
  Tensor dres = want_dres ? at::empty({m, c}, x.options()) : at::empty({0}, x.options());
  Tensor sum_dz = at::empty({c}, x.options().dtype(acc)), sum_dzx = at::empty({c}, x.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clfast_cpu_bwd", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = dout.const_data_ptr<scalar_t>();
    const scalar_t* rp = has_res ? res->const_data_ptr<scalar_t>() : nullptr;
    const opmath_t* __restrict__ mu = mean.const_data_ptr<opmath_t>();
    const opmath_t* __restrict__ is = invstd.const_data_ptr<opmath_t>();
    const opmath_t* __restrict__ sc = scale.const_data_ptr<opmath_t>();
    const opmath_t* __restrict__ sh = shift.const_data_ptr<opmath_t>();
    // pass 1
    std::vector<double> s1, s2;
    chunked_sums<opmath_t>(m, c, s1, s2, [&](int64_t r, opmath_t* __restrict__ a, opmath_t* __restrict__ b) {
      const scalar_t* __restrict__ xr = xp + r * c;
      const scalar_t* __restrict__ gr = gp + r * c;
      if (relu && has_res) {
        const scalar_t* __restrict__ rr = rp + r * c;
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t xv = opmath_t(xr[j]);
          const opmath_t z = xv * sc[j] + sh[j] + opmath_t(rr[j]);
          const opmath_t g = z > opmath_t(0) ? opmath_t(gr[j]) : opmath_t(0);
          a[j] += g; b[j] += g * (xv - mu[j]);
        }
      } else if (relu) {
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t xv = opmath_t(xr[j]);
          const opmath_t z = xv * sc[j] + sh[j];
          const opmath_t g = z > opmath_t(0) ? opmath_t(gr[j]) : opmath_t(0);
          a[j] += g; b[j] += g * (xv - mu[j]);
        }
      } else {
        for (int64_t j = 0; j < c; ++j) {
          const opmath_t g = opmath_t(gr[j]);
          a[j] += g; b[j] += g * (opmath_t(xr[j]) - mu[j]);
        }
      }
    });
    opmath_t* sdz = sum_dz.data_ptr<opmath_t>();
    opmath_t* sdx = sum_dzx.data_ptr<opmath_t>();
    // dy = dz*A + (x - mean)*B + D
    std::vector<opmath_t> A(c), B(c), D(c);
    for (int64_t j = 0; j < c; ++j) {
      sdz[j] = opmath_t(s1[j]);
      sdx[j] = opmath_t(s2[j] * double(is[j]));
      A[j] = sc[j];
      B[j] = training ? opmath_t(-double(sc[j]) * double(is[j]) * double(sdx[j]) / double(m)) : opmath_t(0);
      D[j] = training ? opmath_t(-double(sc[j]) * s1[j] / double(m)) : opmath_t(0);
    }
    const opmath_t* __restrict__ Ap = A.data();
    const opmath_t* __restrict__ Bp = B.data();
    const opmath_t* __restrict__ Dp = D.data();
    scalar_t* dyp = dy.data_ptr<scalar_t>();
    scalar_t* drp = want_dres ? dres.data_ptr<scalar_t>() : nullptr;
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(c, 1));
    // pass 2
    at::parallel_for(0, m, grain, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const scalar_t* __restrict__ xr = xp + r * c;
        const scalar_t* __restrict__ gr = gp + r * c;
        scalar_t* __restrict__ o = dyp + r * c;
        if (relu && has_res) {
          const scalar_t* __restrict__ rr = rp + r * c;
          for (int64_t j = 0; j < c; ++j) {
            const opmath_t xv = opmath_t(xr[j]);
            const opmath_t z = xv * sc[j] + sh[j] + opmath_t(rr[j]);
            const opmath_t g = z > opmath_t(0) ? opmath_t(gr[j]) : opmath_t(0);
            o[j] = scalar_t(g * Ap[j] + (xv - mu[j]) * Bp[j] + Dp[j]);
          }
          if (drp) {  // a second sweep over the row (in L1) keeps both loops vectorized
            scalar_t* __restrict__ d = drp + r * c;
            for (int64_t j = 0; j < c; ++j) {
              const opmath_t z = opmath_t(xr[j]) * sc[j] + sh[j] + opmath_t(rr[j]);
              d[j] = scalar_t(z > opmath_t(0) ? opmath_t(gr[j]) : opmath_t(0));  // exact: dout or 0
            }
          }
        } else if (relu) {
          for (int64_t j = 0; j < c; ++j) {
            const opmath_t xv = opmath_t(xr[j]);
            const opmath_t z = xv * sc[j] + sh[j];
            const opmath_t g = z > opmath_t(0) ? opmath_t(gr[j]) : opmath_t(0);
            o[j] = scalar_t(g * Ap[j] + (xv - mu[j]) * Bp[j] + Dp[j]);
          }
        } else {
          for (int64_t j = 0; j < c; ++j)
            o[j] = scalar_t(opmath_t(gr[j]) * Ap[j] + (opmath_t(xr[j]) - mu[j]) * Bp[j] + Dp[j]);
          if (drp) std::copy(gr, gr + c, drp + r * c);
        }
      }
    });
  });
  return {dy, sum_dz, sum_dzx, dres};
}

}  // namespace clfast_cpu
