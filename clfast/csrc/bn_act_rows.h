// What both halves of the BN+act kernels share (bn_act.cpp: statistics and normalize; bn_act_backward.h: the
// backward, the bulk of the template instances, made in files of their own so that they compile side by side): the
// row partitions, the blocked column sums and the argument check. Included by those only.
#pragma once
#include "act.h"  // first: simd.h picks the CPU capability of ATen's vec headers
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#include "bn_act.h"

namespace clfast_cpu::rows {
using at::Tensor;
// a*b + c written as one fused multiply-add: the compiler may contract a*b + c into one or not, differently in each
// template instance and file, and z must round the same in forward and backward (a derivative read from out = act(z)
// is exactly the recomputed one)
using at::vec::fmadd;
using clfast_cpu::simd::IO;

constexpr int64_t kBlockRows = 64;      // rows summed in opmath before spilling into the fp64 totals
constexpr int64_t kMaxChunks = 256;     // fixed row partition: results do not depend on the thread count
constexpr int64_t kChunkAlign = 16;     // chunk counts are multiples of this (when rows allow): balanced over 2-16 threads

inline int64_t num_chunks(int64_t m, int64_t c) {
  // about 64K elements per chunk, at least one chunk
  int64_t per = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(c, 1));
  int64_t n = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, (m + per - 1) / per));
  return std::min(m, (n + kChunkAlign - 1) / kChunkAlign * kChunkAlign);
}

// Rows handed to one parallel_for task of an elementwise pass: about 32K elements
inline int64_t row_grain(int64_t c) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(c, 1)); }

// Per-chunk column sums of f(row) over a row range, blocked: opmath inside a block, fp64 across blocks.
// `body(r, a, b)` adds row r's contributions to the opmath block accumulators a[C], b[C].
template <typename opmath_t, typename Body>
void chunked_sums(int64_t m, int64_t c, std::vector<double>& s1, std::vector<double>& s2, const Body& body) {
  const int64_t nch = num_chunks(m, c), per = nch ? (m + nch - 1) / nch : 0;   // no rows (a rank's empty batch): no chunk
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

inline void check_rows(const Tensor& t, const Tensor& like, int64_t c, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "clfast_cpu: ", name, " must be on the CPU");
  TORCH_CHECK(is_rows(t) && t.numel() == like.numel() && t.size(1) == c &&
              t.scalar_type() == like.scalar_type(), "clfast_cpu: ", name, " must be a row-major [M, C] matrix "
              "(contiguous 2D or channels-last) of x's size and dtype");
}

}  // namespace clfast_cpu::rows
