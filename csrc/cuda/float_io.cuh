// Element loads and stores of float32, __half and __nv_bfloat16 as float32, shared by the
// quantization kernels. The narrow stores round like torch's CPU casts (groupquant.h), NaN
// patterns included (not __float2half_rn, whose NaN is 0x7FFF), so CUDA and CPU agree.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "torchstash/common.h"
#include "torchstash/groupquant.h"

namespace torchstash {
namespace cuda {

__device__ __forceinline__ float load_float(const float* x, index_t i) { return x[i]; }
__device__ __forceinline__ float load_float(const __half* x, index_t i) { return __half2float(x[i]); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* x, index_t i) { return __bfloat162float(x[i]); }

__device__ __forceinline__ void store_float(float* out, index_t i, float v) { out[i] = v; }
__device__ __forceinline__ void store_float(__half* out, index_t i, float v) {
  out[i] = __ushort_as_half(groupquant::float_to_half_bits(v));
}
__device__ __forceinline__ void store_float(__nv_bfloat16* out, index_t i, float v) {
  out[i] = __ushort_as_bfloat16(groupquant::float_to_bf16_bits(v));
}

}  // namespace cuda
}  // namespace torchstash
