// Grid-stride CUDA kernel over the inline philox.h functions: one thread per
// 4-word block, 64-bit indices; a full block is one 16-byte store when aligned.
#include "launch_config.cuh"
#include "torchstash/cuda_launch.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cuda {
namespace {

__global__ void philox_kernel(float* __restrict__ out, index_t n, std::uint64_t seed, std::uint64_t offset) {
  const index_t blocks = ceil_div(n, 4);
  // torch allocations are 16-byte aligned, but `out` may be a view with an offset.
  const bool aligned = (reinterpret_cast<std::uintptr_t>(out) % sizeof(float4)) == 0;
  for (index_t b = grid_start(); b < blocks; b += grid_stride()) {
    const philox::Words w = philox::block_words(seed, offset, static_cast<std::uint64_t>(b));
    const index_t i = b * 4;
    if (aligned && i + 4 <= n) {
      reinterpret_cast<float4*>(out)[b] = make_float4(philox::to_uniform(w.x0), philox::to_uniform(w.x1),
                                                      philox::to_uniform(w.x2), philox::to_uniform(w.x3));
    } else {
      const std::uint32_t words[4] = {w.x0, w.x1, w.x2, w.x3};
      for (int k = 0; k < 4 && i + k < n; ++k) out[i + k] = philox::to_uniform(words[k]);
    }
  }
}

}  // namespace

cudaError_t launch_philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset,
                                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  philox_kernel<<<grid_for(ceil_div(n, 4)), kThreads, 0, stream>>>(out, n, seed, offset);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace torchstash
