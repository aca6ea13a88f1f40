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

typedef double RowD4 __attribute__((vector_size(32)));
typedef float RowF4 __attribute__((vector_size(16)));
typedef std::int32_t RowI4 __attribute__((vector_size(16)));

// acc += x[0, 4) (times `scale` first, rounded to float32, when `scaled`) as doubles; diff
// marks the lanes not equal to `first`.
__attribute__((always_inline)) inline void sum_four(const float* x, bool scaled, float scale, float first,
                                                    RowD4& acc, RowI4& diff) {
  RowF4 a;
  std::memcpy(&a, x, sizeof(a));
  diff |= a != first;
  if (scaled) a = a * scale;
  acc += __builtin_convertvector(a, RowD4);
}

// lanes[l] += x[k] (times `scale` first, rounded to float32, when `scaled`) for
// k = l, l + 16, ... in order, over x[0, count) (x[0] in lane 0); returns whether every
// x[k] equals `first`. The 16 lanes are four named vectors of 4 doubles, each from 4
// floats: registers on AVX2 and AVX-512 (8-double vectors, and an array of vectors, went
// through the stack on AVX2: 1 ns an element).
__attribute__((always_inline)) inline bool sum_lanes(const float* x, index_t count, bool scaled, float scale,
                                                     float first, double* lanes) {
  RowD4 a0, a1, a2, a3;
  std::memcpy(&a0, lanes, sizeof(a0));
  std::memcpy(&a1, lanes + 4, sizeof(a1));
  std::memcpy(&a2, lanes + 8, sizeof(a2));
  std::memcpy(&a3, lanes + 12, sizeof(a3));
  RowI4 diff = {};
  index_t k = 0;
  for (; k + kSumLanes <= count; k += kSumLanes) {
    sum_four(x + k, scaled, scale, first, a0, diff);
    sum_four(x + k + 4, scaled, scale, first, a1, diff);
    sum_four(x + k + 8, scaled, scale, first, a2, diff);
    sum_four(x + k + 12, scaled, scale, first, a3, diff);
  }
  std::memcpy(lanes, &a0, sizeof(a0));
  std::memcpy(lanes + 4, &a1, sizeof(a1));
  std::memcpy(lanes + 8, &a2, sizeof(a2));
  std::memcpy(lanes + 12, &a3, sizeof(a3));
  bool same = true;
  for (int l = 0; l < 4; ++l) same = same && diff[l] == 0;
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
