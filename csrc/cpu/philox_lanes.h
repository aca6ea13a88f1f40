// kPhiloxLanes consecutive Philox blocks advanced through the rounds together (structure of
// arrays), so the compiler vectorizes the 32x32->64-bit products across blocks. Shared by
// philox_cpu.cpp and the quantization spans (float_spans.h); always inlined, so each
// TS_CPU_CLONES caller gets it compiled for its own instruction set. philox_blocks picks
// philox_avx2.cpp's intrinsics instead where the leaf loops run 8 lanes wide (AVX2 without
// AVX-512, simd.h's lanes()): GCC's own AVX2 code for these products was the slowest of all.
#pragma once

#include <cstdint>

#include "simd.h"
#include "torchstash/common.h"
#include "torchstash/philox.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define TS_PHILOX_AVX2 1
#else
#define TS_PHILOX_AVX2 0
#endif

namespace torchstash {
namespace cpu {

constexpr int kPhiloxLanes = 8;

// out[0, 4 * kPhiloxLanes) <- the uniforms of blocks b0 .. b0 + kPhiloxLanes - 1.
__attribute__((always_inline)) inline void philox_lanes(float* out, std::uint64_t b0, std::uint64_t seed,
                                                        std::uint64_t offset) {
  std::uint32_t c0[kPhiloxLanes], c1[kPhiloxLanes], c2[kPhiloxLanes], c3[kPhiloxLanes];
  for (int l = 0; l < kPhiloxLanes; ++l) {
    const std::uint64_t b = b0 + static_cast<std::uint64_t>(l);
    c0[l] = static_cast<std::uint32_t>(b);
    c1[l] = static_cast<std::uint32_t>(b >> 32);
    c2[l] = static_cast<std::uint32_t>(offset);
    c3[l] = static_cast<std::uint32_t>(offset >> 32);
  }
  auto k0 = static_cast<std::uint32_t>(seed);
  auto k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int r = 0; r < philox::kRounds; ++r) {
    if (r > 0) {
      k0 += philox::kW0;
      k1 += philox::kW1;
    }
    for (int l = 0; l < kPhiloxLanes; ++l) {
      const philox::Words w = philox::round(philox::Words{c0[l], c1[l], c2[l], c3[l]}, k0, k1);
      c0[l] = w.x0;
      c1[l] = w.x1;
      c2[l] = w.x2;
      c3[l] = w.x3;
    }
  }
  for (int l = 0; l < kPhiloxLanes; ++l) {
    out[4 * l + 0] = philox::to_uniform(c0[l]);
    out[4 * l + 1] = philox::to_uniform(c1[l]);
    out[4 * l + 2] = philox::to_uniform(c2[l]);
    out[4 * l + 3] = philox::to_uniform(c3[l]);
  }
}

#if TS_PHILOX_AVX2
// out[0, 32 * groups) <- the uniforms of blocks b0 .. b0 + 8 * groups - 1 (philox_avx2.cpp).
void philox_blocks_avx2(float* out, std::uint64_t b0, index_t groups, std::uint64_t seed, std::uint64_t offset);

inline bool philox_avx2() {
  static const bool found = lanes() == 8 && __builtin_cpu_supports("avx2");
  return found;
}

// The same with 16 blocks a vector (philox_avx512.cpp), where the leaf loops run 16 lanes wide.
void philox_blocks_avx512(float* out, std::uint64_t b0, index_t groups, std::uint64_t seed, std::uint64_t offset);

inline bool philox_avx512() {
  static const bool found = lanes() == 16 && __builtin_cpu_supports("avx512f");
  return found;
}
#endif

// out[0, 4 * kPhiloxLanes * groups) <- the uniforms of kPhiloxLanes * groups blocks from b0.
__attribute__((always_inline)) inline void philox_blocks(float* out, std::uint64_t b0, index_t groups,
                                                         std::uint64_t seed, std::uint64_t offset) {
  static_assert(kPhiloxLanes == 8, "philox_avx2.cpp advances blocks 8 at a time");
#if TS_PHILOX_AVX2
  if (philox_avx2()) {
    philox_blocks_avx2(out, b0, groups, seed, offset);
    return;
  }
  if (philox_avx512()) {
    philox_blocks_avx512(out, b0, groups, seed, offset);
    return;
  }
#endif
  for (index_t g = 0; g < groups; ++g) {
    philox_lanes(out + g * 4 * kPhiloxLanes, b0 + static_cast<std::uint64_t>(g) * kPhiloxLanes, seed, offset);
  }
}

}  // namespace cpu
}  // namespace torchstash
