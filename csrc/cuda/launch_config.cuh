// Grid sizing for the grid-stride kernels: capped, so the loops (not the grid)
// cover element counts above 2^31 and above one grid dimension.
#pragma once

#include "torchstash/common.h"

namespace torchstash {
namespace cuda {

constexpr int kThreads = 256;
constexpr index_t kMaxBlocks = 4096;  // enough to fill any current GPU several times over

inline unsigned int grid_for(index_t work) {
  const index_t blocks = ceil_div(work, kThreads);
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// First index and stride of a grid-stride loop, in 64 bits.
__device__ __forceinline__ index_t grid_start() {
  return static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ index_t grid_stride() {
  return static_cast<index_t>(blockDim.x) * gridDim.x;
}

}  // namespace cuda
}  // namespace torchstash
