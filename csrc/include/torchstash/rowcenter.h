// Rows coded relative to their own offset (a normalization's input, quant's `centered`
// module), host and device: the per-row arithmetic shared by the CPU loops
// (csrc/cpu/rowcenter_cpu.cpp) and the CUDA kernels (csrc/cuda/rowcenter_cuda.cu).
//
// The bit-exact definition is torchstash.kernels.rowcenter_reference (csrc/README.md
// repeats it). A row is `run` consecutive elements read as float32:
//   sum        kSumLanes float64 lanes, lane l adding x[l], x[l + 16], ... in order from +0.0;
//              then lanes folded by halves: s[l] += s[l + w] for w = 8, 4, 2, 1
//   mean       float32(sum / run) (the division in float64)
//   constant   every element equal to the first, and that one finite
//   offset     constant: first + 0.0 (a zero row's offset is +0.0); else the mean; 0 when
//              that is not finite
//   centered   x - offset (float32); with row scales, then / scale, scale the largest
//              finite |centered| of the row (1 when none is above 0)
//   restored   v = decoded (* scale); 0 for a constant row; drift = the mean of v (0 when not
//              finite); v + (offset - drift), cast to the output dtype
// The float64 lanes make the sum independent of how a row is split into chunks, threads
// or warps, so CPU, CUDA and the reference agree bit for bit.
#pragma once

#include <cstdint>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace rowcenter {

constexpr int kSumLanes = 16;

// s[0] <- the lanes folded by halves (s[l] + s[l + w], w = 8, 4, 2, 1); s is overwritten.
TS_HD double fold_lanes(double* s) {
  for (int w = kSumLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  }
  return s[0];
}

// The row's mean from its folded sum.
TS_HD float mean_of(double sum, index_t run) { return static_cast<float>(sum / static_cast<double>(run)); }

// The offset a row is centered on.
TS_HD float offset_of(bool constant, float first, float mean) {
  const float offset = constant ? groupquant::add_rn(first, 0.0f) : mean;
  return groupquant::is_finite(offset) ? offset : 0.0f;
}

// A row's scale from the largest finite |centered| (0 when there is none).
TS_HD float scale_of(float amax) { return amax > 0.0f ? amax : 1.0f; }

// What a restored row's mean is corrected by: its decoded mean where finite, else 0.
TS_HD float drift_of(float mean) { return groupquant::is_finite(mean) ? mean : 0.0f; }

}  // namespace rowcenter
}  // namespace torchstash
