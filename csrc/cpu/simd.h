// Vectors of N lanes (GCC vector extensions) and the lane count the running CPU takes in one
// register. A 16-float vector is one register on AVX-512, but on AVX2 GCC lowers its
// compare-and-select (`a < b ? a : b`) and its narrowing conversions lane by lane: the group
// code's min/max and codes loops, written on 16-float vectors, ran as scalar code on an AVX2
// CPU (4 ns an element, against 0.8 at 8 lanes). A TS_CPU_CLONES function therefore runs its
// loop at lanes() lanes, compiled for each width in each clone; the width never changes a
// result (lane-wise operations and exact min/max only), only how it is computed.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace torchstash {
namespace cpu {

template <class T, int N>
struct VecOf {
  typedef T type __attribute__((vector_size(sizeof(T) * N)));
};
template <int N>
using FloatV = typename VecOf<float, N>::type;
template <int N>
using UintV = typename VecOf<std::uint32_t, N>::type;
template <int N>
using IntV = typename VecOf<std::int32_t, N>::type;
template <int N>
using ByteV = typename VecOf<std::uint8_t, N>::type;

// Each 32-bit lane's low byte, as __builtin_convertvector(v, ByteV<N>) truncates. GCC lowers
// that conversion lane by lane where the clone has no narrowing store (AVX2: 8 extracts,
// shifts and ors per 8 codes, half of a channel code's time); a byte shuffle of the same
// vector is a vpshufb and a permute there. At 16 lanes (AVX-512's vpmovdb) and where the
// shuffle builtin is missing, the conversion itself.
template <int N, class V>
__attribute__((always_inline)) inline ByteV<N> low_bytes(V v) {
  static_assert(sizeof(V) == 4 * N, "lanes of 32 bits");
#if defined(__has_builtin) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#if __has_builtin(__builtin_shufflevector)
  if constexpr (N == 8) {
    const ByteV<32> b = (ByteV<32>)v;
    return __builtin_shufflevector(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
  } else if constexpr (N == 4) {
    const ByteV<16> b = (ByteV<16>)v;
    return __builtin_shufflevector(b, b, 0, 4, 8, 12);
  }
#endif
#endif
  return __builtin_convertvector(v, ByteV<N>);
}

// N bytes from c widened to 32-bit lanes, as __builtin_convertvector(bytes, UintV<N>) does.
// AVX2 has vpmovzxbd, but GCC lowers that conversion lane by lane (half of an fp8 decode's
// time); at 8 lanes the two words are broadcast, blended and shifted instead (byte k of a
// word its bits 8k..8k+7: little-endian only).
template <int N>
__attribute__((always_inline)) inline UintV<N> widen_bytes(const std::uint8_t* c) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  constexpr bool kLittle = true;
#else
  constexpr bool kLittle = false;
#endif
  if constexpr (N == 8 && kLittle) {
    std::uint32_t w[2];
    std::memcpy(w, c, sizeof(w));
    const UintV<8> lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const UintV<8> word = lane < 4u ? UintV<8>{} + w[0] : UintV<8>{} + w[1];
    return (word >> ((lane & 3u) * 8u)) & 0xFFu;
  }
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
  else if constexpr (N == 16 && kLittle) {
    // GCC 12 lowers the conversion lane by lane at 16 lanes too, even where AVX-512 has
    // vpmovzxbd (fp8_dequantize took twice its 8-lane time): two 8-lane halves, joined
    const UintV<8> lo = widen_bytes<8>(c), hi = widen_bytes<8>(c + 8);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
#endif
#endif
  else {
    ByteV<N> bytes;
    std::memcpy(&bytes, c, sizeof(bytes));
    return __builtin_convertvector(bytes, UintV<N>);
  }
}

// 16 where the CPU has AVX-512 (the x86-64-v4 clone runs), 8 with AVX2, 4 below; 16 off x86
// (GCC splits a vector into the target's registers, with no lane-wise fallback on NEON).
// TORCHSTASH_CPU_LANES=4, 8 or 16 overrides it, read once: the tests run every width on one
// machine (tests/test_kernel_lanes.py), since a result must not depend on it.
inline int detect_lanes() {
  if (const char* told = std::getenv("TORCHSTASH_CPU_LANES")) {
    const int n = std::atoi(told);
    if (n == 4 || n == 8 || n == 16) return n;
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 16;
  return __builtin_cpu_supports("avx2") ? 8 : 4;
#else
  return 16;
#endif
}

inline int lanes() {
  static const int found = detect_lanes();
  return found;
}

// A lambda given to at_lanes is written `[&](auto n) TS_LANES { ... }`: a lambda does not
// inherit its TS_CPU_CLONES caller's target, so one GCC leaves out of line is compiled for
// baseline x86-64 and every clone calls that one copy. At 16 lanes baseline code takes
// AVX-512's vector operations lane by lane (a group code's statistics ran at 2 ns an element
// on an AVX-512 CPU, six times the 8-lane time); inlined, the lambda is compiled in each
// clone, for its target.
#define TS_LANES __attribute__((always_inline))

// f(std::integral_constant<int, N>{}) at the running CPU's lane count N (see lanes()): a
// generic lambda reads N as decltype(n)::value.
template <class F>
__attribute__((always_inline)) inline auto at_lanes(F&& f) {
  switch (lanes()) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

}  // namespace cpu
}  // namespace torchstash
