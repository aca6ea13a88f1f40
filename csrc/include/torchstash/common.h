// Shared definitions for torchstash's CPU (g++) and CUDA (nvcc) kernels.
//
// Everything here is header-only and free of torch headers, so the same inline
// functions compile into the OpenMP loops, the CUDA kernels and the tests.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

namespace torchstash {

// Element and byte indices are always 64-bit: tensors above 2^31 elements must work.
using index_t = std::int64_t;

// ceil(a / b) for non-negative a and positive b, without overflow for a near INT64_MAX.
TS_HD index_t ceil_div(index_t a, index_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace torchstash
