// Philox4x32-10 blocks written with AVX-512F intrinsics, for CPUs whose leaf loops run 16
// lanes wide (simd.h's lanes()).
//
// GCC 12 lowers philox_lanes.h's 32x32->64-bit products for the x86-64-v4 clone as widened
// 64-bit multiplies (`vpmovzxdq`, `vpmullq`: three micro-ops each on Intel cores) with
// permutes and stack spills: 205 us per 256K uniforms on one Xeon core. Here, as in
// philox_avx2.cpp, two chains of 16 blocks (one 32-bit lane each) go through the rounds
// interleaved, each product as two `vpmuludq` (even and odd lanes) and two masked blends.
// The words and uniforms are philox.h's, bit for bit (tests/test_kernel_lanes.py runs each
// lane width against the reference).
#include "philox_lanes.h"

#if TS_PHILOX_AVX2
#include <immintrin.h>

namespace torchstash {
namespace cpu {
namespace {

#define TS_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// Lane-wise high and low 32 bits of m * a over 16 lanes.
TS_AVX512 void mulhilo16(__m512i m, __m512i a, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, m);                        // lanes 0, 2, ... as 64 bits
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);  // lanes 1, 3, ...
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

struct Block16 {
  __m512i x0, x1, x2, x3;  // word k of blocks b .. b + 15, one block a lane
};

// Counters of blocks b .. b + 15 at `offset` (philox.h's layout; the 64-bit block number
// may carry into its high word within the 16).
TS_AVX512 Block16 counters(std::uint64_t b, std::uint64_t offset) {
  alignas(64) std::uint32_t lo[16], hi[16];
  for (int l = 0; l < 16; ++l) {
    const std::uint64_t c = b + static_cast<std::uint64_t>(l);
    lo[l] = static_cast<std::uint32_t>(c);
    hi[l] = static_cast<std::uint32_t>(c >> 32);
  }
  return Block16{_mm512_load_si512(lo), _mm512_load_si512(hi),
                 _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(offset))),
                 _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(offset >> 32)))};
}

TS_AVX512 Block16 round16(const Block16& c, __m512i k0, __m512i k1) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(philox::kM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(philox::kM1));
  __m512i hi0, lo0, hi1, lo1;
  mulhilo16(m0, c.x0, &hi0, &lo0);
  mulhilo16(m1, c.x2, &hi1, &lo1);
  return Block16{_mm512_xor_si512(_mm512_xor_si512(hi1, c.x1), k0), lo1,
                 _mm512_xor_si512(_mm512_xor_si512(hi0, c.x3), k1), lo0};
}

TS_AVX512 __m512 uniforms16(__m512i w) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 8)), _mm512_set1_ps(5.9604644775390625e-08f));
}

// out[0, 64) <- the uniforms of the 16 blocks, block-major (element 4 * l + k is word k of
// block l): a 4x4 transpose within each 128-bit lane, then one of the 128-bit lanes.
TS_AVX512 void store16(float* out, const Block16& c) {
  const __m512 u0 = uniforms16(c.x0), u1 = uniforms16(c.x1), u2 = uniforms16(c.x2), u3 = uniforms16(c.x3);
  const __m512 t0 = _mm512_unpacklo_ps(u0, u1), t1 = _mm512_unpackhi_ps(u0, u1);
  const __m512 t2 = _mm512_unpacklo_ps(u2, u3), t3 = _mm512_unpackhi_ps(u2, u3);
  const __m512 v0 = _mm512_shuffle_ps(t0, t2, 0x44), v1 = _mm512_shuffle_ps(t0, t2, 0xEE);  // blocks 0|4|8|12, 1|5|9|13
  const __m512 v2 = _mm512_shuffle_ps(t1, t3, 0x44), v3 = _mm512_shuffle_ps(t1, t3, 0xEE);  // blocks 2|6|.., 3|7|..
  const __m512 a = _mm512_shuffle_f32x4(v0, v1, 0x44), b = _mm512_shuffle_f32x4(v2, v3, 0x44);
  const __m512 e = _mm512_shuffle_f32x4(v0, v1, 0xEE), f = _mm512_shuffle_f32x4(v2, v3, 0xEE);
  _mm512_storeu_ps(out + 0, _mm512_shuffle_f32x4(a, b, 0x88));   // blocks 0-3
  _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(a, b, 0xDD));  // blocks 4-7
  _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(e, f, 0x88));  // blocks 8-11
  _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(e, f, 0xDD));  // blocks 12-15
}

TS_AVX512 Block16 rounds(Block16 c, std::uint32_t k0, std::uint32_t k1) {
  for (int r = 0; r < philox::kRounds; ++r) {
    if (r > 0) {
      k0 += philox::kW0;
      k1 += philox::kW1;
    }
    c = round16(c, _mm512_set1_epi32(static_cast<int>(k0)), _mm512_set1_epi32(static_cast<int>(k1)));
  }
  return c;
}

}  // namespace

// out[0, 32 * groups) <- the uniforms of blocks b0 .. b0 + 8 * groups - 1 (philox_lanes.h's
// groups of 8 blocks; an odd last group computes 16 blocks and stores its 8).
__attribute__((target("avx512f"))) void philox_blocks_avx512(float* out, std::uint64_t b0, index_t groups,
                                                             std::uint64_t seed, std::uint64_t offset) {
  const auto s0 = static_cast<std::uint32_t>(seed);
  const auto s1 = static_cast<std::uint32_t>(seed >> 32);
  index_t g = 0;
  for (; g + 4 <= groups; g += 4) {  // two independent chains keep the multipliers busy
    const std::uint64_t b = b0 + static_cast<std::uint64_t>(g) * 8;
    Block16 c = counters(b, offset), d = counters(b + 16, offset);
    std::uint32_t k0 = s0, k1 = s1;
    for (int r = 0; r < philox::kRounds; ++r) {
      if (r > 0) {
        k0 += philox::kW0;
        k1 += philox::kW1;
      }
      const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
      c = round16(c, key0, key1);
      d = round16(d, key0, key1);
    }
    store16(out + g * 32, c);
    store16(out + g * 32 + 64, d);
  }
  for (; g < groups; g += 2) {
    const Block16 c = rounds(counters(b0 + static_cast<std::uint64_t>(g) * 8, offset), s0, s1);
    if (g + 2 <= groups) {
      store16(out + g * 32, c);
    } else {
      alignas(64) float tail[64];
      store16(tail, c);
      for (int k = 0; k < 32; ++k) out[g * 32 + k] = tail[k];
    }
  }
}

}  // namespace cpu
}  // namespace torchstash

#endif  // TS_PHILOX_AVX2
