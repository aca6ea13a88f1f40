// CUDA kernels for sign bits (signs.h): one thread per packed byte (8 elements tested), and
// one thread per element back, 64-bit indices, grid-stride loops with a capped grid.
#include "launch_config.cuh"
#include "torchstash/bitpack.h"
#include "torchstash/cuda_launch.h"
#include "torchstash/signs.h"

namespace torchstash {
namespace cuda {
namespace {

__device__ __forceinline__ bool above(const void* x, SignKind kind, index_t i) {
  switch (kind) {
    case SignKind::kFloat32: return !(static_cast<const float*>(x)[i] <= 0.0f);
    case SignKind::kFloat64: return !(static_cast<const double*>(x)[i] <= 0.0);
    default: return signs::above_bits16(static_cast<const std::uint16_t*>(x)[i], signs::inf_bits16(kind));
  }
}

__global__ void pack_kernel(const void* __restrict__ x, SignKind kind, index_t n, std::uint8_t* __restrict__ out) {
  const index_t bytes = ceil_div(n, 8);
  for (index_t j = grid_start(); j < bytes; j += grid_stride()) {
    unsigned b = 0;
    for (int k = 0; k < 8 && 8 * j + k < n; ++k) b |= above(x, kind, 8 * j + k) ? 1u << k : 0u;
    out[j] = static_cast<std::uint8_t>(b);
  }
}

__global__ void unpack_kernel(const std::uint8_t* __restrict__ packed, index_t n, SignKind kind,
                              void* __restrict__ out) {
  for (index_t i = grid_start(); i < n; i += grid_stride()) {
    const bool on = bitpack::unpack_code(packed, i, 1) != 0;
    switch (kind) {
      case SignKind::kFloat32: static_cast<std::uint32_t*>(out)[i] = on ? signs::kOne32 : 0u; break;
      case SignKind::kFloat64: static_cast<std::uint64_t*>(out)[i] = on ? signs::kOne64 : 0u; break;
      default:
        static_cast<std::uint16_t*>(out)[i] = on ? signs::one_bits16(kind) : static_cast<std::uint16_t>(0);
        break;
    }
  }
}

}  // namespace

cudaError_t launch_sign_pack(const void* x, SignKind kind, index_t n, std::uint8_t* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  pack_kernel<<<grid_for(ceil_div(n, 8)), kThreads, 0, stream>>>(x, kind, n, out);
  return cudaGetLastError();
}

cudaError_t launch_sign_unpack(const std::uint8_t* packed, index_t n, SignKind kind, void* out,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  unpack_kernel<<<grid_for(n), kThreads, 0, stream>>>(packed, n, kind, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace torchstash
