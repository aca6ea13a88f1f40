// Grid-stride CUDA kernels over the inline bitpack.h functions: one thread per
// packed byte (both directions), 64-bit indices.
#include "launch_config.cuh"
#include "torchstash/bitpack.h"
#include "torchstash/cuda_launch.h"

namespace torchstash {
namespace cuda {
namespace {

template <int BITS>
__global__ void pack_kernel(const std::uint8_t* __restrict__ codes, index_t n, std::uint8_t* __restrict__ out) {
  constexpr int per = 8 / BITS;
  const index_t bytes = ceil_div(n, per);
  const index_t full = n / per;
  for (index_t j = grid_start(); j < bytes; j += grid_stride()) {
    out[j] = j < full ? bitpack::pack_full<BITS>(codes + j * per) : bitpack::pack_byte(codes, n, j, BITS);
  }
}

template <int BITS>
__global__ void unpack_kernel(const std::uint8_t* __restrict__ packed, index_t n, std::uint8_t* __restrict__ out) {
  constexpr int per = 8 / BITS;
  const index_t bytes = ceil_div(n, per);
  const index_t full = n / per;
  for (index_t j = grid_start(); j < bytes; j += grid_stride()) {
    if (j < full) {
      bitpack::unpack_full<BITS>(packed[j], out + j * per);
    } else {
      for (index_t i = j * per; i < n; ++i) out[i] = bitpack::unpack_code(packed, i, BITS);
    }
  }
}

template <int BITS>
cudaError_t launch_pack(const std::uint8_t* codes, index_t n, std::uint8_t* out, cudaStream_t stream) {
  pack_kernel<BITS><<<grid_for(ceil_div(n, 8 / BITS)), kThreads, 0, stream>>>(codes, n, out);
  return cudaGetLastError();
}

template <int BITS>
cudaError_t launch_unpack(const std::uint8_t* packed, index_t n, std::uint8_t* out, cudaStream_t stream) {
  unpack_kernel<BITS><<<grid_for(ceil_div(n, 8 / BITS)), kThreads, 0, stream>>>(packed, n, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (bits) {
    case 1: return launch_pack<1>(codes, n, out, stream);
    case 2: return launch_pack<2>(codes, n, out, stream);
    case 4: return launch_pack<4>(codes, n, out, stream);
    case 8: return launch_pack<8>(codes, n, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (bits) {
    case 1: return launch_unpack<1>(packed, n, out, stream);
    case 2: return launch_unpack<2>(packed, n, out, stream);
    case 4: return launch_unpack<4>(packed, n, out, stream);
    case 8: return launch_unpack<8>(packed, n, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace torchstash
