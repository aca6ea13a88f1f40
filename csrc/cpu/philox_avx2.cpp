// Philox4x32-10 blocks written with AVX2 intrinsics, for CPUs with AVX2 but not AVX-512.
//
// GCC 12 lowers philox_lanes.h's 32x32->64-bit products poorly for AVX2 (the x86-64-v3
// clone took 764 us per 256K uniforms on an AVX2 EPYC, the baseline SSE2 clone 560 us);
// here two chains of 8 blocks (one 32-bit lane each) go through the rounds interleaved,
// each product as two `vpmuludq` (even and odd lanes) and two blends: 190 us on that CPU.
// The words and uniforms are philox.h's, bit for bit (tests/test_kernel_lanes.py runs
// each lane width against the reference).
#include "philox_lanes.h"

#if TS_PHILOX_AVX2
#include <immintrin.h>

namespace torchstash {
namespace cpu {
namespace {

#define TS_AVX2 __attribute__((target("avx2"), always_inline)) inline

// Lane-wise high and low 32 bits of m * a over 8 lanes.
TS_AVX2 void mulhilo8(__m256i m, __m256i a, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                        // lanes 0, 2, 4, 6 as 64 bits
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, 5, 7
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

struct Block8 {
  __m256i x0, x1, x2, x3;  // word k of blocks b .. b + 7, one block a lane
};

// Counters of blocks b .. b + 7 at `offset` (philox.h's layout; the 64-bit block number
// may carry into its high word within the 8).
TS_AVX2 Block8 counters(std::uint64_t b, std::uint64_t offset) {
  alignas(32) std::uint32_t lo[8], hi[8];
  for (int l = 0; l < 8; ++l) {
    const std::uint64_t c = b + static_cast<std::uint64_t>(l);
    lo[l] = static_cast<std::uint32_t>(c);
    hi[l] = static_cast<std::uint32_t>(c >> 32);
  }
  return Block8{_mm256_load_si256(reinterpret_cast<const __m256i*>(lo)),
                _mm256_load_si256(reinterpret_cast<const __m256i*>(hi)),
                _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(offset))),
                _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(offset >> 32)))};
}

TS_AVX2 Block8 round8(const Block8& c, __m256i k0, __m256i k1) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(philox::kM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(philox::kM1));
  __m256i hi0, lo0, hi1, lo1;
  mulhilo8(m0, c.x0, &hi0, &lo0);
  mulhilo8(m1, c.x2, &hi1, &lo1);
  return Block8{_mm256_xor_si256(_mm256_xor_si256(hi1, c.x1), k0), lo1,
                _mm256_xor_si256(_mm256_xor_si256(hi0, c.x3), k1), lo0};
}

TS_AVX2 __m256 uniforms8(__m256i w) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
}

// out[0, 32) <- the uniforms of the 8 blocks, block-major (element 4 * l + k is word k of
// block l): a 4x8 transpose.
TS_AVX2 void store8(float* out, const Block8& c) {
  const __m256 u0 = uniforms8(c.x0), u1 = uniforms8(c.x1), u2 = uniforms8(c.x2), u3 = uniforms8(c.x3);
  const __m256 t0 = _mm256_unpacklo_ps(u0, u1), t1 = _mm256_unpackhi_ps(u0, u1);
  const __m256 t2 = _mm256_unpacklo_ps(u2, u3), t3 = _mm256_unpackhi_ps(u2, u3);
  const __m256 v0 = _mm256_shuffle_ps(t0, t2, 0x44), v1 = _mm256_shuffle_ps(t0, t2, 0xEE);  // blocks 0|4, 1|5
  const __m256 v2 = _mm256_shuffle_ps(t1, t3, 0x44), v3 = _mm256_shuffle_ps(t1, t3, 0xEE);  // blocks 2|6, 3|7
  _mm256_storeu_ps(out + 0, _mm256_permute2f128_ps(v0, v1, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(v2, v3, 0x20));
  _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(v0, v1, 0x31));
  _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(v2, v3, 0x31));
}

}  // namespace

__attribute__((target("avx2"))) void philox_blocks_avx2(float* out, std::uint64_t b0, index_t groups,
                                                        std::uint64_t seed, std::uint64_t offset) {
  const auto s0 = static_cast<std::uint32_t>(seed);
  const auto s1 = static_cast<std::uint32_t>(seed >> 32);
  index_t g = 0;
  for (; g + 2 <= groups; g += 2) {  // two independent chains keep the multipliers busy
    const std::uint64_t b = b0 + static_cast<std::uint64_t>(g) * 8;
    Block8 c = counters(b, offset), d = counters(b + 8, offset);
    std::uint32_t k0 = s0, k1 = s1;
    for (int r = 0; r < philox::kRounds; ++r) {
      if (r > 0) {
        k0 += philox::kW0;
        k1 += philox::kW1;
      }
      const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
      c = round8(c, key0, key1);
      d = round8(d, key0, key1);
    }
    store8(out + g * 32, c);
    store8(out + g * 32 + 32, d);
  }
  if (g < groups) {
    Block8 c = counters(b0 + static_cast<std::uint64_t>(g) * 8, offset);
    std::uint32_t k0 = s0, k1 = s1;
    for (int r = 0; r < philox::kRounds; ++r) {
      if (r > 0) {
        k0 += philox::kW0;
        k1 += philox::kW1;
      }
      c = round8(c, _mm256_set1_epi32(static_cast<int>(k0)), _mm256_set1_epi32(static_cast<int>(k1)));
    }
    store8(out + g * 32, c);
  }
}

}  // namespace cpu
}  // namespace torchstash

#endif  // TS_PHILOX_AVX2
