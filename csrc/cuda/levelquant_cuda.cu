// CUDA kernel for level_quantize (levelquant_cpu.cpp has the definition): one thread per Philox
// block of 4 elements, which it codes and packs into its 4 * bits / 8 bytes (so no byte is
// shared between threads), 64-bit indices, a grid-stride loop with a capped grid.
//
// The float32 steps are the reference's, each rounded once: (high - low), u * that, v - low,
// then a comparison (nothing for a fused multiply-add to contract).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_io.cuh"
#include "launch_config.cuh"
#include "torchstash/bitpack.h"
#include "torchstash/cuda_launch.h"
#include "torchstash/groupquant.h"
#include "torchstash/philox.h"

namespace torchstash {
namespace cuda {
namespace {

// clamp(#levels below v, 1, L - 1), as torch.bucketize counts them (levels ascending): a walk
// over a short table, a binary search over a long one. NaN compares below nothing (its code
// is replaced anyway).
__device__ __forceinline__ int upper_level(float v, const float* __restrict__ levels, int nlevels) {
  int below = 0;
  if (nlevels <= 16) {
    for (int k = 0; k < nlevels; ++k) below += levels[k] < v ? 1 : 0;
  } else {
    int lo = 0, hi = nlevels;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (levels[mid] < v) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    below = lo;
  }
  return below < 1 ? 1 : (below > nlevels - 1 ? nlevels - 1 : below);
}

template <typename T>
__global__ void level_kernel(const T* __restrict__ x, index_t n, const float* __restrict__ levels, int nlevels,
                             int bits, std::uint64_t seed, std::uint8_t* __restrict__ out) {
  const unsigned top = (1u << bits) - 1u;
  const int per = bitpack::codes_per_byte(bits);
  const index_t bytes = bitpack::packed_size(n, bits);
  for (index_t block = grid_start(); block * 4 < n; block += grid_stride()) {
    const philox::Words w = philox::block_words(seed, 0, static_cast<std::uint64_t>(block));
    const std::uint32_t words[4] = {w.x0, w.x1, w.x2, w.x3};
    unsigned codes[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const index_t i = block * 4 + k;
      if (i >= n) break;
      const float v = load_float(x, i);
      const int up = upper_level(v, levels, nlevels);
      const float low = levels[up - 1];
      const float high = levels[up];
      const float u = philox::to_uniform(words[k]);
      const bool down = __fmul_rn(u, __fsub_rn(high, low)) >= __fsub_rn(v, low);
      codes[k] = v != v ? top : static_cast<unsigned>(up - (down ? 1 : 0));
    }
    // the block's elements fill bytes [block * 4 / per, (block + 1) * 4 / per)
    const index_t first_byte = block * 4 / per;
    for (int b = 0; b < 4 / per; ++b) {
      const index_t j = first_byte + b;
      if (j >= bytes) break;
      unsigned packed = 0;
      for (int k = 0; k < per; ++k) packed |= (codes[b * per + k] & top) << (k * bits);
      out[j] = static_cast<std::uint8_t>(packed);
    }
  }
}

template <typename T>
cudaError_t launch(const void* x, index_t n, const float* levels, int nlevels, int bits, std::uint64_t seed,
                   std::uint8_t* out, cudaStream_t stream) {
  level_kernel<T><<<grid_for(ceil_div(n, 4)), kThreads, 0, stream>>>(static_cast<const T*>(x), n, levels, nlevels,
                                                                     bits, seed, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_level_quantize(const void* x, groupquant::FloatKind kind, index_t n, const float* levels,
                                  int nlevels, int bits, std::uint64_t seed, std::uint8_t* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (bits != 2 && bits != 4 && bits != 8) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32: return launch<float>(x, n, levels, nlevels, bits, seed, out, stream);
    case groupquant::FloatKind::kFloat16: return launch<__half>(x, n, levels, nlevels, bits, seed, out, stream);
    case groupquant::FloatKind::kBFloat16:
      return launch<__nv_bfloat16>(x, n, levels, nlevels, bits, seed, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace torchstash
