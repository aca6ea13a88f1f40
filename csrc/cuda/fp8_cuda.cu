// CUDA kernels over the inline fp8.h functions: e4m3 codes with a per-group scale and their
// inverse, 64-bit indices, grid-stride loops with a capped grid.
//
// Quantize: one warp per group; the lanes stride over it for the largest finite magnitude
// (as bits: finite magnitudes order like them, so the shuffle reduction is exact) and whether
// anything is not finite, then code it (the last group's padding as 0). Dequantize: one
// thread per element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_io.cuh"
#include "launch_config.cuh"
#include "torchstash/cuda_launch.h"
#include "torchstash/fp8.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kAll = 0xFFFFFFFFu;

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ x, index_t n, index_t group_size,
                                std::uint8_t* __restrict__ codes, std::uint16_t* __restrict__ scale) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const index_t groups = ceil_div(n, group_size);
  for (index_t g = grid_start() / kWarp; g < groups; g += grid_stride() / kWarp) {  // warp-uniform
    const index_t begin = g * group_size;
    const index_t end = n - begin < group_size ? n : begin + group_size;
    std::uint32_t big = 0;
    bool bad = false;
    for (index_t i = begin + lane; i < end; i += kWarp) {
      const std::uint32_t b = groupquant::float_bits(load_float(x, i)) & 0x7FFFFFFFu;
      if (b < 0x7F800000u) {
        big = b > big ? b : big;
      } else {
        bad = true;
      }
    }
#pragma unroll
    for (int d = kWarp / 2; d > 0; d /= 2) {
      const std::uint32_t o = __shfl_xor_sync(kAll, big, d);
      big = o > big ? o : big;
    }
    const bool special = __any_sync(kAll, bad) != 0;
    const float s = fp8::group_scale(groupquant::bits_float(big), special);
    if (lane == 0) scale[g] = fp8::stored_scale(s, special);
    for (index_t i = begin + lane; i < begin + group_size; i += kWarp) {
      codes[i] = i < end ? fp8::code_of(load_float(x, i), s) : 0;
    }
  }
}

template <typename T>
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ codes, const std::uint16_t* __restrict__ scale,
                                  index_t n, index_t group_size, T* __restrict__ out) {
  for (index_t i = grid_start(); i < n; i += grid_stride()) {
    const std::uint16_t stored = scale[i / group_size];
    const float magnitude = groupquant::bf16_bits_to_float(static_cast<std::uint16_t>(stored & 0x7FFFu));
    store_float(out, i, fp8::value_of(codes[i], magnitude, (stored & 0x8000u) != 0));
  }
}

template <typename T>
cudaError_t quantize(const void* x, index_t n, index_t group_size, std::uint8_t* codes, std::uint16_t* scale,
                     cudaStream_t stream) {
  quantize_kernel<T><<<grid_for(ceil_div(n, group_size) * kWarp), kThreads, 0, stream>>>(static_cast<const T*>(x), n,
                                                                                         group_size, codes, scale);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dequantize(const std::uint8_t* codes, const std::uint16_t* scale, index_t n, index_t group_size,
                       void* out, cudaStream_t stream) {
  dequantize_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(codes, scale, n, group_size, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_quantize(const void* x, groupquant::FloatKind kind, index_t n, index_t group_size,
                                std::uint8_t* codes, std::uint16_t* scale, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (group_size <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32: return quantize<float>(x, n, group_size, codes, scale, stream);
    case groupquant::FloatKind::kFloat16: return quantize<__half>(x, n, group_size, codes, scale, stream);
    case groupquant::FloatKind::kBFloat16: return quantize<__nv_bfloat16>(x, n, group_size, codes, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_fp8_dequantize(const std::uint8_t* codes, const std::uint16_t* scale, index_t n,
                                  index_t group_size, groupquant::FloatKind kind, void* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (group_size <= 0) return cudaErrorInvalidValue;
  switch (kind) {
    case groupquant::FloatKind::kFloat32: return dequantize<float>(codes, scale, n, group_size, out, stream);
    case groupquant::FloatKind::kFloat16: return dequantize<__half>(codes, scale, n, group_size, out, stream);
    case groupquant::FloatKind::kBFloat16:
      return dequantize<__nv_bfloat16>(codes, scale, n, group_size, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace torchstash
