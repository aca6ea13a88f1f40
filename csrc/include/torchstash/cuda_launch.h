// Launchers for the CUDA kernels in csrc/cuda/*.cu, called by csrc/bindings/ops_cuda.cpp.
//
// Raw pointers and a stream only, no torch headers: `nvcc -c` compiles the .cu
// files on machines without a CUDA build of torch. Each launcher returns the
// launch status (cudaGetLastError) for the caller to check; n == 0 launches nothing.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "torchstash/common.h"

namespace torchstash {
namespace cuda {

// out[0, ceil(n * bits / 8)) <- codes[0, n) packed at `bits` bits (1, 2, 4 or 8).
cudaError_t launch_pack_bits(const std::uint8_t* codes, index_t n, int bits, std::uint8_t* out,
                             cudaStream_t stream);

// out[0, n) <- the first n codes of `packed` at `bits` bits.
cudaError_t launch_unpack_bits(const std::uint8_t* packed, index_t n, int bits, std::uint8_t* out,
                               cudaStream_t stream);

// out[0, n) <- Philox4x32-10 uniforms in [0, 1) for (seed, offset); see philox.h.
cudaError_t launch_philox_uniform(float* out, index_t n, std::uint64_t seed, std::uint64_t offset,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace torchstash
