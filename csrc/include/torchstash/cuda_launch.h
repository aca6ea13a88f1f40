// Launchers for the CUDA kernels in csrc/cuda/*.cu, called by csrc/bindings/ops_cuda.cpp.
//
// Raw pointers and a stream only, no torch headers: `nvcc -c` compiles the .cu
// files on machines without a CUDA build of torch. Each launcher returns the
// launch status (cudaGetLastError) for the caller to check; n == 0 launches nothing.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

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

// Fused per-group quantization of x[0, n) (float32, __half or __nv_bfloat16, per `kind`):
// packed[0, ceil(n * bits / 8)) <- the codes, lo/step[0, ceil(n / group_size)) <- the
// bfloat16 bit patterns of each group's lo and signed step; see groupquant.h.
cudaError_t launch_group_quantize(const void* x, groupquant::FloatKind kind, index_t n, int bits,
                                  index_t group_size, std::uint64_t seed, bool stochastic, std::uint8_t* packed,
                                  std::uint16_t* lo, std::uint16_t* step, cudaStream_t stream);

// out[0, n) (float32, __half or __nv_bfloat16 per `kind`) <- the values group_quantize encoded.
cudaError_t launch_group_dequantize(const std::uint8_t* packed, const std::uint16_t* lo, const std::uint16_t* step,
                                    int bits, index_t group_size, index_t n, groupquant::FloatKind kind, void* out,
                                    cudaStream_t stream);

}  // namespace cuda
}  // namespace torchstash
