// The float64 lane sums of rows (rowcenter.h), shared by the row loops of rowcenter_cpu.cpp
// and the fused row-centered group codes of groupquant_cpu.cpp. Internal linkage: each unit
// gets its own copy, the leaf loops compiled per instruction set (clones.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "clones.h"
#include "float_spans.h"
#include "torchstash/common.h"
#include "torchstash/rowcenter.h"

namespace torchstash {
namespace cpu {
namespace {

using rowcenter::kSumLanes;
static_assert(kSpan % kSumLanes == 0, "spans must keep elements in their lanes");

typedef double RowD8 __attribute__((vector_size(64)));
typedef float RowF8 __attribute__((vector_size(32)));
typedef std::int32_t RowI8 __attribute__((vector_size(32)));

// lanes[l] += x[k] (times `scale` first, rounded to float32, when `scaled`) for
// k = l, l + 16, ... in order, over x[0, count) (x[0] in lane 0); returns whether every
// x[k] equals `first`. The 16 floats of a step are taken as two 8-float halves: a 16-float
// compare ran lane by lane on AVX2 (simd.h), an 8-float one is a register there.
__attribute__((always_inline)) inline bool sum_lanes(const float* x, index_t count, bool scaled, float scale,
                                                     float first, double* lanes) {
  RowD8 lo, hi;
  std::memcpy(&lo, lanes, sizeof(lo));
  std::memcpy(&hi, lanes + 8, sizeof(hi));
  RowI8 diff = {};
  index_t k = 0;
  for (; k + kSumLanes <= count; k += kSumLanes) {
    RowF8 a, b;
    std::memcpy(&a, x + k, sizeof(a));
    std::memcpy(&b, x + k + 8, sizeof(b));
    diff |= (a != first) | (b != first);
    if (scaled) {
      a = a * scale;
      b = b * scale;
    }
    lo += __builtin_convertvector(a, RowD8);
    hi += __builtin_convertvector(b, RowD8);
  }
  std::memcpy(lanes, &lo, sizeof(lo));
  std::memcpy(lanes + 8, &hi, sizeof(hi));
  bool same = true;
  for (int l = 0; l < 8; ++l) same = same && diff[l] == 0;
  for (int l = 0; k + l < count; ++l) {
    const float v = x[k + l];
    same = same && v == first;
    lanes[l] += static_cast<double>(scaled ? v * scale : v);
  }
  return same;
}

// Lane sums of x[0, count) and whether all of it equals `first` (centering's first pass).
[[maybe_unused]] TS_CPU_CLONES bool add_lanes(const float* x, index_t count, float first, double* lanes) {
  return sum_lanes(x, count, false, 1.0f, first, lanes);
}

// Lane sums of x[k] * scale (restoring a scaled row).
[[maybe_unused]] TS_CPU_CLONES void add_scaled_lanes(const float* x, index_t count, float scale, double* lanes) {
  sum_lanes(x, count, true, scale, 0.0f, lanes);
}

// A row's drift (the mean its restored values are corrected by) from its lane sums.
[[maybe_unused]] inline float lanes_drift(double* lanes, index_t run) {
  return rowcenter::drift_of(rowcenter::mean_of(rowcenter::fold_lanes(lanes), run));
}

}  // namespace
}  // namespace cpu
}  // namespace torchstash
